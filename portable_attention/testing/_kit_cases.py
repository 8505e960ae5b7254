"""The cases of :func:`~portable_attention.testing.check_attention` and how each is judged.

Each case builds inputs in the canonical layout ``[B, H, L, D]`` (rounded to the dtype
under test), calls the function under test through its declared conventions
(:class:`Conventions`: layout, mask polarity, causal alignment, what it returns), and
compares what came back with :func:`~portable_attention.testing.reference_attention`:
``(departures, notes)``, the departures with the likely cause where one fits. The
report around them is :mod:`._check`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_attention.testing._autodiff import differentiable, vjp
from portable_attention.testing._backend import numpy_dtype
from portable_attention.testing._convert import dtype_name, source_framework, to_backend, to_numpy
from portable_attention.testing._reference import Reference, reference_attention
from portable_attention.testing._tolerance import Tolerance, tolerance

SEED = 0

Verdict = tuple[list[str], list[str]]  # a case's (departures, notes)

# -- the conventions of the function under test ------------------------------------------------


@dataclass(frozen=True)
class Conventions:
    backend: str
    device: Any
    dtype: str
    layout: str
    mask: str | None
    mask_polarity: str
    causal: str | None
    causal_alignment: str
    returns: tuple[str | None, ...] | None  # None: the output alone
    options: Mapping[str, Any]
    window: str | None = None  # the keyword of a (left, right) window
    sinks: str | None = None  # the keyword of per-head sink logits [Hq]

    def describe(self) -> str:
        on = self.backend + (f" ({self.device})" if self.device is not None else "")
        mask = "no mask"
        if self.mask:
            meaning = "may attend" if self.mask_polarity == "keep" else "masked out"
            mask = f"mask={self.mask!r} (True = {meaning})"
        causal = f"causal={self.causal!r} ({self.causal_alignment})" if self.causal else "no causal"
        returns = "out" if self.returns is None else repr(self.returns)
        more = "".join(
            f", {what}={kw!r}"
            for what, kw in (("window", self.window), ("sinks", self.sinks))
            if kw is not None
        )
        extra = f", options {dict(self.options)!r}" if self.options else ""
        return (
            f"{on} {self.dtype}, layout {self.layout}, {mask}, {causal}{more}, "
            f"returns {returns}{extra}"
        )


class Skip(Exception):
    """The case needs what the function does not take."""


class Returned(Exception):
    """The function returned something other than what ``returns`` declares."""


@dataclass
class _Inputs:
    """One call's inputs in the canonical layout ``[B, H, L, D]``, rounded to the dtype."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None = None  # True = may attend, [B, 1, Lq, Lk] (or [B, 1, 1, Lk])
    causal: bool = False
    window: tuple[int, int] | None = None  # (left, right), passed as the kernel's keyword
    sinks: np.ndarray | None = None  # [Hq] logits


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype``, held in that NumPy dtype (bfloat16 through ml_dtypes)."""
    return np.asarray(a).astype(numpy_dtype(dtype))


def _to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a if layout == "bhld" else np.swapaxes(a, -3, -2))


def _from_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout == "bhld" else np.swapaxes(a, -3, -2)


def _arguments(conv: Conventions, inputs: _Inputs) -> tuple[list[Any], dict[str, Any]]:
    """``fn``'s arguments for ``inputs`` as its conventions say: ``[q, k, v]`` and keywords
    (the sinks under the ``sinks`` keyword)."""
    kwargs = dict(conv.options)
    if inputs.mask is not None:
        if conv.mask is None:
            msg = "the function takes no mask (mask=None)"
            raise Skip(msg)
        mask = inputs.mask if conv.mask_polarity == "keep" else ~inputs.mask
        kwargs[conv.mask] = to_backend(np.ascontiguousarray(mask), conv.backend, conv.device)
    if inputs.causal:
        if conv.causal is None:
            msg = "the function takes no causal flag (causal=None)"
            raise Skip(msg)
        kwargs[conv.causal] = True
    if inputs.window is not None:
        if conv.window is None:
            msg = "the function takes no window (window=None)"
            raise Skip(msg)
        kwargs[conv.window] = inputs.window
    if inputs.sinks is not None:
        if conv.sinks is None:
            msg = "the function takes no sinks (sinks=None)"
            raise Skip(msg)
        kwargs[conv.sinks] = to_backend(inputs.sinks, conv.backend, conv.device)
    qkv = [
        to_backend(_to_layout(a, conv.layout), conv.backend, conv.device)
        for a in (inputs.q, inputs.k, inputs.v)
    ]
    return qkv, kwargs


def _outputs(conv: Conventions, result: Any) -> dict[str, Any]:
    """``fn``'s result by name, as ``returns`` declares it."""
    if conv.returns is None:
        return {"out": result}
    if not isinstance(result, (tuple, list)) or len(result) != len(conv.returns):
        msg = (
            f"returned {type(result).__name__}"
            + (f" of {len(result)} items" if isinstance(result, (tuple, list)) else "")
            + f", not the {len(conv.returns)} items of returns={conv.returns!r}"
        )
        raise Returned(msg)
    return {name: x for name, x in zip(conv.returns, result, strict=True) if name is not None}


def _call(fn: Callable[..., Any], conv: Conventions, inputs: _Inputs) -> dict[str, Any]:
    """Call ``fn`` on ``inputs`` as its conventions say; its outputs by name, unconverted."""
    (q, k, v), kwargs = _arguments(conv, inputs)
    return _outputs(conv, fn(q, k, v, **kwargs))


# -- judging one result --------------------------------------------------------------------------


def _max_abs(x: np.ndarray, r: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        d = np.abs(x - r)
    return float(np.max(np.where(np.isnan(d), np.inf, d))) if d.size else 0.0


def _close(x: np.ndarray, r: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Elementwise ``|x - r| <= atol + rtol * |r|`` (NaN never; an infinity only itself)."""
    with np.errstate(invalid="ignore", over="ignore"):
        near = np.isfinite(r) & (np.abs(x - r) <= tol.atol + tol.rtol * np.abs(r))
        return (x == r) | near


def _rows(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


def _shape_in(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """A canonical ``[B, H, L, D]`` shape in ``layout``."""
    if layout == "bhld" or len(shape) < 3:
        return tuple(shape)
    return (*shape[:-3], shape[-2], shape[-3], shape[-1])


def _check_array(
    what: str, x: Any, ref: np.ndarray, conv: Conventions, dtype: str
) -> tuple[np.ndarray | None, list[str]]:
    """``x`` as canonical float64 NumPy and what is wrong with its kind (framework, dtype,
    shape); None for the array where its values cannot be compared."""
    problems = []
    try:
        framework = source_framework(x)
    except TypeError:
        return None, [f"{what} is {type(x).__name__}, not an array"]
    if framework != conv.backend:
        problems.append(f"{what} is a {framework} array for {conv.backend} inputs")
    want = "float32" if what == "lse" and dtype in ("float16", "bfloat16") else dtype
    got = dtype_name(x.dtype)
    if got != want:
        problems.append(f"{what} has dtype {got}; the contract: {want} for {dtype} inputs")
    a = to_numpy(x, dtype="float64")
    expected = _shape_in(ref.shape, conv.layout) if what == "out" else ref.shape
    if a.shape != expected:
        problems.append(f"{what} has shape {a.shape}, expected {expected}")
        return None, problems
    return (_from_layout(a, conv.layout) if what == "out" else a), problems


def _judge_values(
    what: str, a: np.ndarray, ref: Reference, v_mean: np.ndarray, tol: Tolerance
) -> tuple[list[str], float]:
    """The departures of output ``what`` (canonical float64) from ``ref``, and its largest
    error on the rows that have keys."""
    expected = getattr(ref, what)
    empty = np.isneginf(ref.lse)  # [B, H, Lq]: the rows with no key
    got_empty, got_full, ref_full = a[empty], a[~empty], expected[~empty]
    found: list[str] = []
    n = int(empty.sum())
    if n and what == "lse":
        if np.isnan(got_empty).any():
            found.append(f"lse is NaN on rows with no key ({_rows(n)}); the contract: -inf")
        elif np.isposinf(got_empty).any():
            found.append(f"lse is +inf on rows with no key ({_rows(n)}); the contract: -inf")
        elif not np.isneginf(got_empty).all():
            worst = float(np.max(got_empty[~np.isneginf(got_empty)]))
            found.append(
                f"lse is finite (up to {worst:.3g}) on rows with no key ({_rows(n)}); "
                "the contract: -inf"
            )
    elif n:
        nonzero = np.any(got_empty != 0, axis=-1)
        means = np.broadcast_to(v_mean, (*expected.shape[:-1], v_mean.shape[-1]))[empty]
        if np.isnan(got_empty).any():
            found.append(f"{what} is NaN on rows with no key ({_rows(n)}); the contract: 0")
        elif what == "out" and nonzero.all() and np.all(_close(got_empty, means, tol)):
            found.append(
                f"out is mean(V) on rows with no key ({_rows(n)}), as a softmax over a large "
                "negative fill gives; the contract: 0"
            )
        elif nonzero.any():
            worst = float(np.max(np.abs(got_empty)))
            found.append(
                f"{what} is not 0 on {_rows(int(nonzero.sum()))} of the {n} with no key "
                f"(max |{what}| {worst:.3g}); the contract: 0"
            )
    err = _max_abs(got_full, ref_full)
    if np.isnan(got_full).any():
        found.append(f"{what} has NaN on rows that have keys")
    elif not np.all(_close(got_full, ref_full, tol)):
        off = int(np.sum(~_close(got_full, ref_full, tol)))
        found.append(
            f"{what}: {off} of {got_full.size} values differ beyond rtol={tol.rtol:g}, "
            f"atol={tol.atol:g} (max abs err {err:.3g})"
        )
    return found, err


def _judge(
    outputs: Mapping[str, Any],
    ref: Reference,
    inputs: _Inputs,
    conv: Conventions,
    dtype: str,
    alternatives: Sequence[tuple[str, Reference]] = (),
) -> Verdict:
    """``(departures, notes)`` of one call's outputs against ``ref``."""
    group = inputs.q.shape[-3] // inputs.k.shape[-3]
    v = np.repeat(inputs.v.astype(np.float64), group, axis=-3)
    v_mean = v.mean(axis=-2)[..., None, :]  # [B, H, 1, D]
    departures: list[str] = []
    notes: list[str] = []
    for what, x in outputs.items():
        expected = getattr(ref, what)
        a, problems = _check_array(what, x, expected, conv, dtype)
        departures += problems
        if a is None:
            continue
        found, err = _judge_values(what, a, ref, v_mean, tolerance(dtype, what))
        departures += found
        notes.append(f"{what} {err:.2g}")
        if found and what == "out":
            for hint, other in alternatives:
                if np.all(_close(a, other.out, tolerance(dtype, "out"))):
                    departures.append(f"it matches {hint}")
                    break
    return departures, notes


# -- the cases -----------------------------------------------------------------------------------


def _qkv(
    rng: np.random.Generator,
    dtype: str,
    hq: int,
    hk: int,
    lq: int,
    lk: int,
    b: int = 2,
    d: int = 16,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q, k, v = (rng.standard_normal((b, h, n, d)) for h, n in ((hq, lq), (hk, lk), (hk, lk)))
    return rounded(q, dtype), rounded(k, dtype), rounded(v, dtype)


def _window_band(lq: int, lk: int, window: tuple[int, int], alignment: str) -> np.ndarray:
    """``[Lq, Lk]``: key ``j`` within ``(left, right)`` of query ``i``'s aligned position,
    both bounds inclusive (``i + Lk - Lq`` lower-right, ``i`` upper-left)."""
    left, right = window
    i = np.arange(lq)[:, None] + (lk - lq if alignment == "lower_right" else 0)
    j = np.arange(lk)[None, :]
    return (j >= i - left) & (j <= i + right)


def _reference(
    inputs: _Inputs, conv: Conventions, alignment: str | None = None, window: Any = None
) -> Reference:
    """The reference for ``inputs`` under ``fn``'s declared alignment (or ``alignment``),
    the window given as ``inputs.window`` (or ``window``) applied as a band mask."""
    alignment = alignment or conv.causal_alignment
    window = inputs.window if window is None else window
    mask = inputs.mask
    if window is not None:
        band = _window_band(inputs.q.shape[-2], inputs.k.shape[-2], window, alignment)
        mask = band if mask is None else mask & band
    causal = alignment if inputs.causal else False
    return reference_attention(
        inputs.q, inputs.k, inputs.v, mask=mask, causal=causal, sinks=inputs.sinks
    )


def _single(
    inputs: _Inputs,
    fn: Callable[..., Any],
    conv: Conventions,
    dtype: str,
    alternatives: Sequence[tuple[str, Reference]] = (),
) -> tuple[list[str], list[str], dict[str, Any]]:
    """Call ``fn`` on ``inputs`` and judge it: ``(departures, notes, its outputs)``."""
    ref = _reference(inputs, conv)
    outputs = _call(fn, conv, inputs)
    departures, notes = _judge(outputs, ref, inputs, conv, dtype, alternatives)
    return departures, notes, outputs


def _case_plain(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    q, k, v = _qkv(np.random.default_rng([SEED, 1]), conv.dtype, 2, 2, 8, 8)
    inputs = _Inputs(q, k, v)
    other = "bhld" if conv.layout == "blhd" else "blhd"
    # The arrays read in the other layout: heads and positions swapped.
    swapped = reference_attention(*(np.swapaxes(a, -3, -2) for a in (q, k, v)))
    wrong = Reference(np.swapaxes(swapped.out, -3, -2), swapped.weights, swapped.lse)
    return _single(inputs, fn, conv, conv.dtype, [(f"layout={other!r}", wrong)])[:2]


def _mask_case(
    rng: np.random.Generator, b: int, lq: int, lk: int, empty_rows: Sequence[int] = ()
) -> np.ndarray:
    mask = rng.random((b, 1, lq, lk)) < 0.6
    mask[..., 0] = True  # every row keeps a key and drops one, in either polarity
    mask[..., 1] = False
    mask[0, :, list(empty_rows), :] = False
    return mask


def _case_mask(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    rng = np.random.default_rng([SEED, 2])
    q, k, v = _qkv(rng, conv.dtype, 2, 2, 8, 10)
    mask = _mask_case(rng, 2, 8, 10)
    inputs = _Inputs(q, k, v, mask=mask)
    inverted = reference_attention(q, k, v, mask=~mask)
    other = "drop" if conv.mask_polarity == "keep" else "keep"
    hint = f"the inverted mask (mask_polarity={other!r})"
    return _single(inputs, fn, conv, conv.dtype, [(hint, inverted)])[:2]


def _case_empty_rows(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    rng = np.random.default_rng([SEED, 3])
    q, k, v = _qkv(rng, conv.dtype, 2, 2, 8, 10)
    inputs = _Inputs(q, k, v, mask=_mask_case(rng, 2, 8, 10, empty_rows=(2, 5)))
    return _single(inputs, fn, conv, conv.dtype)[:2]


def _causal_case(lq: int, lk: int) -> Callable[..., Verdict]:
    def run(fn: Callable[..., Any], conv: Conventions) -> Verdict:
        q, k, v = _qkv(np.random.default_rng([SEED, 4, lq, lk]), conv.dtype, 2, 2, lq, lk)
        inputs = _Inputs(q, k, v, causal=True)
        other = "upper_left" if conv.causal_alignment == "lower_right" else "lower_right"
        wrong = reference_attention(q, k, v, causal=other)
        alternatives = [] if lq == lk else [(f"causal_alignment={other!r}", wrong)]
        return _single(inputs, fn, conv, conv.dtype, alternatives)[:2]

    return run


def _case_heads(hq: int, hk: int) -> Callable[..., Verdict]:
    def run(fn: Callable[..., Any], conv: Conventions) -> Verdict:
        q, k, v = _qkv(np.random.default_rng([SEED, 5, hk]), conv.dtype, hq, hk, 8, 8)
        inputs = _Inputs(q, k, v)
        # Query head h reading key/value head h % Hk (tiled, not repeated): a common slip.
        reps = (1, hq // hk, 1, 1)
        tiled = reference_attention(q, np.tile(k, reps), np.tile(v, reps))
        alternatives = [] if hk == 1 else [("query head h reading key/value head h % Hk", tiled)]
        return _single(inputs, fn, conv, conv.dtype, alternatives)[:2]

    return run


def _case_half(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """float16 inputs whose scores (scaled or not) pass float16's largest value, 65504."""
    try:
        to_backend(np.zeros(1, dtype=np.float16), conv.backend, conv.device)
    except TypeError:
        msg = f"{conv.backend} has no float16"
        raise Skip(msg) from None
    d = 16
    ones = np.ones(d)
    rng = np.random.default_rng([SEED, 6])
    # q . k = 16 * 128 * 128 = 262144 unscaled, 65536 at scale 1/4: past 65504 either way.
    q = np.stack([128 * ones, -128 * ones, np.round(8 * rng.standard_normal(d))])
    k = np.stack(
        [
            128 * ones,
            128 * ones,
            0 * ones,
            -128 * ones,
            120 * ones,
            np.round(4 * rng.standard_normal(d)),
        ]
    )
    q = np.broadcast_to(q, (1, 2, *q.shape))
    k = np.broadcast_to(k, (1, 2, *k.shape))
    v = rng.standard_normal((1, 2, 6, d))
    inputs = _Inputs(rounded(q, "float16"), rounded(k, "float16"), rounded(v, "float16"))
    return _single(inputs, fn, conv, "float16")[:2]


def _case_decode(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """One query (a decode step) against the last row of the same call with Lq = Lk."""
    q, k, v = _qkv(np.random.default_rng([SEED, 7]), conv.dtype, 2, 2, 8, 8)
    causal = conv.causal is not None and conv.causal_alignment == "lower_right"
    full = _Inputs(q, k, v, causal=causal)
    one = _Inputs(np.ascontiguousarray(q[..., -1:, :]), k, v, causal=causal)
    # With the upper-left alignment the one query would see key 0 only.
    upper_left = reference_attention(one.q, k, v, causal="upper_left")
    wrong = [("causal_alignment='upper_left'", upper_left)]
    departures, notes, got_full = _single(full, fn, conv, conv.dtype)
    more, more_notes, got_one = _single(one, fn, conv, conv.dtype, wrong if causal else [])
    departures += [f"Lq=1: {d}" for d in more]
    notes += [f"Lq=1 {n}" for n in more_notes]
    if not departures:  # both agree with the reference; and with each other?
        a = _from_layout(to_numpy(got_full["out"], dtype="float64"), conv.layout)[..., -1:, :]
        b = _from_layout(to_numpy(got_one["out"], dtype="float64"), conv.layout)
        if not np.all(_close(b, a, tolerance(conv.dtype, "out"))):
            departures.append(
                f"the Lq=1 call differs from the last row of the Lq=8 call by {_max_abs(b, a):.3g}"
            )
    return departures, notes


def _case_padding(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """Key padding as a broadcast ``[B, 1, 1, Lk]`` mask, one sequence all padding."""
    rng = np.random.default_rng([SEED, 8])
    q, k, v = _qkv(rng, conv.dtype, 2, 2, 8, 10, b=3)
    lengths = np.array([10, 6, 0])  # the third sequence is all padding: no key for any row
    mask = (np.arange(10)[None, :] < lengths[:, None])[:, None, None, :]
    return _single(_Inputs(q, k, v, mask=mask), fn, conv, conv.dtype)[:2]


def _case_window(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """``window=(3, 1)`` with ``Lq = 6 < Lk = 10``: counts, inclusive bounds, alignment."""
    window = (3, 1)
    q, k, v = _qkv(np.random.default_rng([SEED, 9]), conv.dtype, 2, 2, 6, 10)
    inputs = _Inputs(q, k, v, window=window)
    other = "upper_left" if conv.causal_alignment == "lower_right" else "lower_right"
    alternatives = [
        (
            f"the window aligned {other} (causal_alignment={other!r})",
            _reference(inputs, conv, alignment=other),
        ),
        ("left and right swapped: window=(1, 3)", _reference(inputs, conv, window=(1, 3))),
        (
            "bounds exclusive (each side one key narrower: (2, 0))",
            _reference(inputs, conv, window=(2, 0)),
        ),
        ("each side one key wider: (4, 2)", _reference(inputs, conv, window=(4, 2))),
    ]
    return _single(inputs, fn, conv, conv.dtype, alternatives)[:2]


def _head_dims(dk: int, dv: int) -> Callable[..., Verdict]:
    def run(fn: Callable[..., Any], conv: Conventions) -> Verdict:
        rng = np.random.default_rng([SEED, 10, dk, dv])
        q, k = (rounded(rng.standard_normal((1, 2, n, dk)), conv.dtype) for n in (8, 8))
        v = rounded(rng.standard_normal((1, 2, 8, dv)), conv.dtype)
        return _single(_Inputs(q, k, v), fn, conv, conv.dtype)[:2]

    return run


def _empty_rows_inputs(
    conv: Conventions, rng: np.random.Generator, hq: int, lq: int, lk: int, rows: Sequence[int]
) -> _Inputs:
    """``q, k, v`` with query rows that have no key: ``rows`` masked out by a mask; where
    ``fn`` takes no mask but a lower-right causal flag, causal with ``Lq = Lk + 4`` (its
    first 4 rows see no key); else neither (no row without a key)."""
    if conv.mask is None and conv.causal is not None and conv.causal_alignment == "lower_right":
        q, k, v = _qkv(rng, conv.dtype, hq, hq, lk + 4, lk)
        return _Inputs(q, k, v, causal=True)
    q, k, v = _qkv(rng, conv.dtype, hq, hq, lq, lk)
    if conv.mask is None:
        return _Inputs(q, k, v)
    return _Inputs(q, k, v, mask=_mask_case(rng, 2, lq, lk, empty_rows=rows))


def _sink_inputs(conv: Conventions) -> _Inputs:
    """Sinks [Hq] (one of them -inf: no sink) with rows with no key (a mask that leaves
    row 2 none, or as :func:`_empty_rows_inputs` says)."""
    inputs = _empty_rows_inputs(conv, np.random.default_rng([SEED, 11]), 4, 8, 10, (2,))
    inputs.sinks = rounded(np.array([0.5, -1.0, 2.0, -np.inf]), conv.dtype)
    return inputs


def _case_sinks(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    inputs = _sink_inputs(conv)
    if conv.sinks is None:
        msg = "the function takes no sinks (sinks=None)"
        raise Skip(msg)
    no_sinks = _Inputs(inputs.q, inputs.k, inputs.v, mask=inputs.mask)
    alternatives = [("no sinks at all (the sinks ignored)", _reference(no_sinks, conv))]
    return _single(inputs, fn, conv, conv.dtype, alternatives)[:2]


def _reference_grads(inputs: _Inputs, ref: Reference, dout: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 gradients of ``sum(out * dout)`` (``Hq == Hk``), from the reference's
    weights: ``dS = P * (dO V^T - rowsum(dO * O))``; a row with no key has ``P = 0``."""
    q, k, v = (a.astype(np.float64) for a in (inputs.q, inputs.k, inputs.v))
    scale = 1.0 / np.sqrt(q.shape[-1])
    p, o = ref.weights, ref.out
    rowsum = np.sum(dout * o, axis=-1, keepdims=True)  # [B, H, Lq, 1]
    ds = p * (dout @ np.swapaxes(v, -1, -2) - rowsum)
    grads = {
        "q": scale * ds @ k,
        "k": scale * np.swapaxes(ds, -1, -2) @ q,
        "v": np.swapaxes(p, -1, -2) @ dout,
    }
    if inputs.sinks is not None:
        sinks = inputs.sinks.astype(np.float64)[:, None]  # [H, 1]
        with np.errstate(invalid="ignore"):
            share = np.where(np.isneginf(sinks), 0.0, np.exp(sinks - ref.lse))  # [B, H, Lq]
        grads["sinks"] = -np.sum(share * rowsum[..., 0], axis=(0, 2))
    return grads


def _gradient_case(inputs: _Inputs, fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """``fn``'s gradients (its framework's autodiff) against :func:`_reference_grads`:
    finite everywhere, ``dq`` exactly 0 on rows with no key."""
    if not differentiable(conv.backend):
        msg = f"{conv.backend} arrays have no autodiff here (differentiable: torch, jax)"
        raise Skip(msg)
    (q, k, v), kwargs = _arguments(conv, inputs)
    ref = _reference(inputs, conv)
    dout = rounded(np.random.default_rng([SEED, 12]).standard_normal(ref.out.shape), conv.dtype)
    primals = {"q": q, "k": k, "v": v}
    sinks_keyword = conv.sinks or "sinks"  # _arguments has skipped a case with no keyword
    if inputs.sinks is not None:
        primals["sinks"] = kwargs.pop(sinks_keyword)

    def call(**arrays: Any) -> Any:
        more = {sinks_keyword: arrays["sinks"]} if "sinks" in arrays else {}
        result = fn(arrays["q"], arrays["k"], arrays["v"], **kwargs, **more)
        return _outputs(conv, result)["out"]

    got = vjp(call, primals, _to_layout(dout, conv.layout), conv.backend, conv.device)
    want = _reference_grads(inputs, ref, dout.astype(np.float64))
    empty = np.isneginf(ref.lse) if inputs.sinks is None else ref.weights.sum(-1) == 0
    base = tolerance(conv.dtype, "out")
    tol = Tolerance(base.rtol, 10 * base.atol)  # a gradient sums over a row or a column
    departures: list[str] = []
    notes: list[str] = []
    for name, ref_grad in want.items():
        g = got[name] if name == "sinks" else _from_layout(got[name], conv.layout)
        what = f"d{name}"
        if g.shape != ref_grad.shape:
            departures.append(f"{what} has shape {g.shape}, expected {ref_grad.shape}")
            continue
        if not np.isfinite(g).all():
            bad = "NaN" if np.isnan(g).any() else "inf"
            where = " on rows with no key" if name == "q" and np.isfinite(g[~empty]).all() else ""
            departures.append(f"{what} has {bad}{where}; the contract: finite (0 there)")
            continue
        if name == "q" and empty.any() and np.any(g[empty] != 0):
            worst = float(np.max(np.abs(g[empty])))
            departures.append(
                f"dq is not 0 on rows with no key ({_rows(int(empty.sum()))}, "
                f"max |dq| {worst:.3g}); the contract: 0"
            )
        err = _max_abs(g, ref_grad)
        if not np.all(_close(g, ref_grad, tol)):
            departures.append(
                f"{what}: {int(np.sum(~_close(g, ref_grad, tol)))} of {g.size} values differ "
                f"beyond rtol={tol.rtol:g}, atol={tol.atol:g} (max abs err {err:.3g})"
            )
        notes.append(f"{what} {err:.2g}")
    return departures, notes


def _case_grad_empty_rows(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    inputs = _empty_rows_inputs(conv, np.random.default_rng([SEED, 3]), 2, 8, 10, (2, 5))
    if inputs.mask is None and not inputs.causal:
        msg = "the function takes no mask and no lower-right causal flag: no row without a key"
        raise Skip(msg)
    return _gradient_case(inputs, fn, conv)


def _case_grad_sinks(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    inputs = _sink_inputs(conv)
    if conv.sinks is None:
        msg = "the function takes no sinks (sinks=None)"
        raise Skip(msg)
    return _gradient_case(inputs, fn, conv)


def _out_of(fn: Callable[..., Any], conv: Conventions, inputs: _Inputs) -> np.ndarray:
    out = _call(fn, conv, inputs)["out"]
    return _from_layout(to_numpy(out, dtype="float64"), conv.layout)


def _bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def _case_batch_invariance(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """Sequence 2 alone against the same sequence inside a batch of 4 (causal if taken):
    the two outputs against each other, not against the reference."""
    q, k, v = _qkv(np.random.default_rng([SEED, 13]), conv.dtype, 2, 2, 1024, 1024, b=4, d=64)
    causal = conv.causal is not None
    in_batch = _out_of(fn, conv, _Inputs(q, k, v, causal=causal))[2:3]
    q1, k1, v1 = (np.ascontiguousarray(a[2:3]) for a in (q, k, v))
    one = _out_of(fn, conv, _Inputs(q1, k1, v1, causal=causal))
    if one.shape != in_batch.shape:
        return [f"out has shape {one.shape} alone, {in_batch.shape} in the batch"], []
    if _bitwise(one, in_batch):
        return [], ["alone vs in a batch of 4: bitwise equal"]
    diff = _max_abs(one, in_batch)
    if not np.all(_close(one, in_batch, tolerance(conv.dtype, "out"))):
        return [f"alone vs in a batch of 4: differs by {diff:.3g}, beyond tolerance"], []
    return [], [f"alone vs in a batch of 4: not bitwise, max diff {diff:.2g}"]


def _case_determinism(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """The same call three times: bitwise the same output (not judged against the
    reference: the other cases do that)."""
    rng = np.random.default_rng([SEED, 14])
    q, k, v = _qkv(rng, conv.dtype, 2, 2, 64, 64, d=32)
    mask = _mask_case(rng, 2, 64, 64) if conv.mask is not None else None
    inputs = _Inputs(q, k, v, mask=mask, causal=mask is None and conv.causal is not None)
    first = _out_of(fn, conv, inputs)
    for _ in range(2):
        again = _out_of(fn, conv, inputs)
        if not _bitwise(first, again):
            diff = _max_abs(first, again)
            return [f"two calls on the same inputs differ by {diff:.3g}: not deterministic"], []
    return [], ["3 calls bitwise equal"]


CASES: Mapping[str, str] = {
    "plain": "no mask, Lq = Lk = 8, Hq = Hk = 2: the layout and the default scale 1/sqrt(D)",
    "mask": "a boolean mask [B, 1, Lq, Lk]: its polarity (True = may attend)",
    "empty_rows": "mask rows with no key at all: out 0 and lse -inf, never NaN or mean(V)",
    "causal": "causal with Lq = Lk = 8 (both alignments agree)",
    "causal_lq_gt_lk": "causal with Lq = 12 > Lk = 8: lower-right leaves rows 0-3 with no key",
    "causal_lq_lt_lk": "causal with Lq = 4 < Lk = 12: lower-right query i sees keys j <= i + 8",
    "gqa": "Hq = 4 query heads on Hk = 2 key/value heads: head h reads key/value head h // 2",
    "mqa": "Hq = 4 query heads on one key/value head",
    "half_overflow": "float16 scores past 65504 (q.k = 262144): computed in float32, no inf/NaN",
    "decode": "Lq = 1 (a decode step) against the last row of the Lq = 8 call",
    "padding": "key padding as a [B, 1, 1, Lk] mask, one sequence all padding: its rows "
    "have no key (out 0)",
    "window": "window=(3, 1) with Lq = 6 < Lk = 10: 3 keys left, 1 right, inclusive, aligned "
    "as causal is (skipped without `window=`)",
    "head_dim_256": "Dk = Dv = 256 (Gemma)",
    "head_dim_512": "Dk = Dv = 512",
    "dv_ne_dk": "Dk = 192, Dv = 128 (DeepSeek MLA): out [B, H, Lq, Dv], scale 1/sqrt(Dk)",
    "sinks": "a sink logit per head (one -inf), rows with no key (by the mask, else by "
    "lower-right causal Lq > Lk): out 0 there, lse the sink's (skipped without `sinks=`)",
    "grad_empty_rows": "gradients with rows with no key (by the mask, else by lower-right "
    "causal Lq > Lk): finite, dq 0 on them, dk and dv as the reference's (torch and jax "
    "autodiff)",
    "grad_sinks": "gradients of the sinks case, d(sinks) included (needs `sinks=` and autodiff)",
    "batch_invariance": "sequence 2 alone vs inside a batch of 4 ([4, 2, 1024, 64], causal "
    "where taken): within tolerance of each other; the notes say whether bitwise",
    "determinism": "the same call 3 times: bitwise equal outputs",
}
"""The cases of :func:`check_attention`, in order: name -> what it checks."""

RUNNERS: dict[str, Callable[..., Verdict]] = {
    "plain": _case_plain,
    "mask": _case_mask,
    "empty_rows": _case_empty_rows,
    "causal": _causal_case(8, 8),
    "causal_lq_gt_lk": _causal_case(12, 8),
    "causal_lq_lt_lk": _causal_case(4, 12),
    "gqa": _case_heads(4, 2),
    "mqa": _case_heads(4, 1),
    "half_overflow": _case_half,
    "decode": _case_decode,
    "padding": _case_padding,
    "window": _case_window,
    "head_dim_256": _head_dims(256, 256),
    "head_dim_512": _head_dims(512, 512),
    "dv_ne_dk": _head_dims(192, 128),
    "sinks": _case_sinks,
    "grad_empty_rows": _case_grad_empty_rows,
    "grad_sinks": _case_grad_sinks,
    "batch_invariance": _case_batch_invariance,
    "determinism": _case_determinism,
}
