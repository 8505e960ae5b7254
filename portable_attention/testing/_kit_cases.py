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

    def describe(self) -> str:
        on = self.backend + (f" ({self.device})" if self.device is not None else "")
        mask = "no mask"
        if self.mask:
            meaning = "may attend" if self.mask_polarity == "keep" else "masked out"
            mask = f"mask={self.mask!r} (True = {meaning})"
        causal = f"causal={self.causal!r} ({self.causal_alignment})" if self.causal else "no causal"
        returns = "out" if self.returns is None else repr(self.returns)
        extra = f", options {dict(self.options)!r}" if self.options else ""
        return (
            f"{on} {self.dtype}, layout {self.layout}, {mask}, {causal}, returns {returns}{extra}"
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
    mask: np.ndarray | None = None  # True = may attend, [B, 1, Lq, Lk]
    causal: bool = False


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype``, held in that NumPy dtype (bfloat16 through ml_dtypes)."""
    return np.asarray(a).astype(numpy_dtype(dtype))


def _to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a if layout == "bhld" else np.swapaxes(a, -3, -2))


def _from_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout == "bhld" else np.swapaxes(a, -3, -2)


def _call(fn: Callable[..., Any], conv: Conventions, inputs: _Inputs) -> dict[str, Any]:
    """Call ``fn`` on ``inputs`` as its conventions say; its outputs by name, unconverted."""
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
    q, k, v = (
        to_backend(_to_layout(a, conv.layout), conv.backend, conv.device)
        for a in (inputs.q, inputs.k, inputs.v)
    )
    result = fn(q, k, v, **kwargs)
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


def _single(
    inputs: _Inputs,
    fn: Callable[..., Any],
    conv: Conventions,
    dtype: str,
    alternatives: Sequence[tuple[str, Reference]] = (),
) -> tuple[list[str], list[str], dict[str, Any]]:
    """Call ``fn`` on ``inputs`` and judge it: ``(departures, notes, its outputs)``."""
    causal = conv.causal_alignment if inputs.causal else False
    ref = reference_attention(inputs.q, inputs.k, inputs.v, mask=inputs.mask, causal=causal)
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
}
