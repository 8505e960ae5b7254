"""How :func:`~portable_attention.testing.check_attention` calls the function under test and
judges what it returns.

A case's inputs are in the canonical layout ``[B, H, L, D]`` (rounded to the dtype under
test); the function is called through its declared conventions (:class:`Conventions`:
layout, mask polarity, causal alignment, what it returns), and what came back is compared
with :func:`~portable_attention.testing.reference_attention`: ``(departures, notes)``, the
departures with the likely cause where one fits. The cases themselves are
:mod:`._kit_cases`'.
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
class Inputs:
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


def to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a if layout == "bhld" else np.swapaxes(a, -3, -2))


def from_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout == "bhld" else np.swapaxes(a, -3, -2)


def call_arguments(conv: Conventions, inputs: Inputs) -> tuple[list[Any], dict[str, Any]]:
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
        to_backend(to_layout(a, conv.layout), conv.backend, conv.device)
        for a in (inputs.q, inputs.k, inputs.v)
    ]
    return qkv, kwargs


def named_outputs(conv: Conventions, result: Any) -> dict[str, Any]:
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


def call_under_test(fn: Callable[..., Any], conv: Conventions, inputs: Inputs) -> dict[str, Any]:
    """Call ``fn`` on ``inputs`` as its conventions say; its outputs by name, unconverted."""
    (q, k, v), kwargs = call_arguments(conv, inputs)
    return named_outputs(conv, fn(q, k, v, **kwargs))


# -- judging one result --------------------------------------------------------------------------


def max_abs(x: np.ndarray, r: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        d = np.abs(x - r)
    return float(np.max(np.where(np.isnan(d), np.inf, d))) if d.size else 0.0


def within_tolerance(x: np.ndarray, r: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Elementwise ``|x - r| <= atol + rtol * |r|`` (NaN never; an infinity only itself)."""
    with np.errstate(invalid="ignore", over="ignore"):
        near = np.isfinite(r) & (np.abs(x - r) <= tol.atol + tol.rtol * np.abs(r))
        return (x == r) | near


def rows_text(n: int) -> str:
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
    return (from_layout(a, conv.layout) if what == "out" else a), problems


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
            found.append(f"lse is NaN on rows with no key ({rows_text(n)}); the contract: -inf")
        elif np.isposinf(got_empty).any():
            found.append(f"lse is +inf on rows with no key ({rows_text(n)}); the contract: -inf")
        elif not np.isneginf(got_empty).all():
            worst = float(np.max(got_empty[~np.isneginf(got_empty)]))
            found.append(
                f"lse is finite (up to {worst:.3g}) on rows with no key ({rows_text(n)}); "
                "the contract: -inf"
            )
    elif n:
        nonzero = np.any(got_empty != 0, axis=-1)
        means = np.broadcast_to(v_mean, (*expected.shape[:-1], v_mean.shape[-1]))[empty]
        if np.isnan(got_empty).any():
            found.append(f"{what} is NaN on rows with no key ({rows_text(n)}); the contract: 0")
        elif what == "out" and nonzero.all() and np.all(within_tolerance(got_empty, means, tol)):
            found.append(
                f"out is mean(V) on rows with no key ({rows_text(n)}), as a softmax over a large "
                "negative fill gives; the contract: 0"
            )
        elif nonzero.any():
            worst = float(np.max(np.abs(got_empty)))
            found.append(
                f"{what} is not 0 on {rows_text(int(nonzero.sum()))} of the {n} with no key "
                f"(max |{what}| {worst:.3g}); the contract: 0"
            )
    err = max_abs(got_full, ref_full)
    if np.isnan(got_full).any():
        found.append(f"{what} has NaN on rows that have keys")
    elif not np.all(within_tolerance(got_full, ref_full, tol)):
        off = int(np.sum(~within_tolerance(got_full, ref_full, tol)))
        found.append(
            f"{what}: {off} of {got_full.size} values differ beyond rtol={tol.rtol:g}, "
            f"atol={tol.atol:g} (max abs err {err:.3g})"
        )
    return found, err


def _judge(
    outputs: Mapping[str, Any],
    ref: Reference,
    inputs: Inputs,
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
                if np.all(within_tolerance(a, other.out, tolerance(dtype, "out"))):
                    departures.append(f"it matches {hint}")
                    break
    return departures, notes


# -- the cases -----------------------------------------------------------------------------------


def random_qkv(
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


def reference_of(
    inputs: Inputs, conv: Conventions, alignment: str | None = None, window: Any = None
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


def judged_call(
    inputs: Inputs,
    fn: Callable[..., Any],
    conv: Conventions,
    dtype: str,
    alternatives: Sequence[tuple[str, Reference]] = (),
) -> tuple[list[str], list[str], dict[str, Any]]:
    """Call ``fn`` on ``inputs`` and judge it: ``(departures, notes, its outputs)``."""
    ref = reference_of(inputs, conv)
    outputs = call_under_test(fn, conv, inputs)
    departures, notes = _judge(outputs, ref, inputs, conv, dtype, alternatives)
    return departures, notes, outputs
