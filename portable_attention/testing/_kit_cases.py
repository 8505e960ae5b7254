"""The cases of :func:`~portable_attention.testing.check_attention`: each builds inputs in the
canonical layout ``[B, H, L, D]``, calls the function under test and judges what it returns
(:mod:`._kit_judge`), giving ``(departures, notes)``. :data:`CASES` says what each checks;
the report around them is :mod:`._check`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from portable_attention.testing._autodiff import differentiable, vjp
from portable_attention.testing._convert import to_backend, to_numpy
from portable_attention.testing._kit_judge import (
    SEED,
    Conventions,
    Inputs,
    Skip,
    Verdict,
    call_arguments,
    call_under_test,
    from_layout,
    judged_call,
    max_abs,
    named_outputs,
    random_qkv,
    reference_of,
    rounded,
    rows_text,
    to_layout,
    within_tolerance,
)
from portable_attention.testing._reference import Reference, reference_attention
from portable_attention.testing._tolerance import Tolerance, tolerance


def _case_plain(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    q, k, v = random_qkv(np.random.default_rng([SEED, 1]), conv.dtype, 2, 2, 8, 8)
    inputs = Inputs(q, k, v)
    other = "bhld" if conv.layout == "blhd" else "blhd"
    # The arrays read in the other layout: heads and positions swapped.
    swapped = reference_attention(*(np.swapaxes(a, -3, -2) for a in (q, k, v)))
    wrong = Reference(np.swapaxes(swapped.out, -3, -2), swapped.weights, swapped.lse)
    return judged_call(inputs, fn, conv, conv.dtype, [(f"layout={other!r}", wrong)])[:2]


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
    q, k, v = random_qkv(rng, conv.dtype, 2, 2, 8, 10)
    mask = _mask_case(rng, 2, 8, 10)
    inputs = Inputs(q, k, v, mask=mask)
    inverted = reference_attention(q, k, v, mask=~mask)
    other = "drop" if conv.mask_polarity == "keep" else "keep"
    hint = f"the inverted mask (mask_polarity={other!r})"
    return judged_call(inputs, fn, conv, conv.dtype, [(hint, inverted)])[:2]


def _case_empty_rows(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    rng = np.random.default_rng([SEED, 3])
    q, k, v = random_qkv(rng, conv.dtype, 2, 2, 8, 10)
    inputs = Inputs(q, k, v, mask=_mask_case(rng, 2, 8, 10, empty_rows=(2, 5)))
    return judged_call(inputs, fn, conv, conv.dtype)[:2]


def _causal_case(lq: int, lk: int) -> Callable[..., Verdict]:
    def run(fn: Callable[..., Any], conv: Conventions) -> Verdict:
        q, k, v = random_qkv(np.random.default_rng([SEED, 4, lq, lk]), conv.dtype, 2, 2, lq, lk)
        inputs = Inputs(q, k, v, causal=True)
        other = "upper_left" if conv.causal_alignment == "lower_right" else "lower_right"
        wrong = reference_attention(q, k, v, causal=other)
        alternatives = [] if lq == lk else [(f"causal_alignment={other!r}", wrong)]
        return judged_call(inputs, fn, conv, conv.dtype, alternatives)[:2]

    return run


def _case_heads(hq: int, hk: int) -> Callable[..., Verdict]:
    def run(fn: Callable[..., Any], conv: Conventions) -> Verdict:
        q, k, v = random_qkv(np.random.default_rng([SEED, 5, hk]), conv.dtype, hq, hk, 8, 8)
        inputs = Inputs(q, k, v)
        # Query head h reading key/value head h % Hk (tiled, not repeated): a common slip.
        reps = (1, hq // hk, 1, 1)
        tiled = reference_attention(q, np.tile(k, reps), np.tile(v, reps))
        alternatives = [] if hk == 1 else [("query head h reading key/value head h % Hk", tiled)]
        return judged_call(inputs, fn, conv, conv.dtype, alternatives)[:2]

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
    inputs = Inputs(rounded(q, "float16"), rounded(k, "float16"), rounded(v, "float16"))
    return judged_call(inputs, fn, conv, "float16")[:2]


def _case_decode(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """One query (a decode step) against the last row of the same call with Lq = Lk."""
    q, k, v = random_qkv(np.random.default_rng([SEED, 7]), conv.dtype, 2, 2, 8, 8)
    causal = conv.causal is not None and conv.causal_alignment == "lower_right"
    full = Inputs(q, k, v, causal=causal)
    one = Inputs(np.ascontiguousarray(q[..., -1:, :]), k, v, causal=causal)
    # With the upper-left alignment the one query would see key 0 only.
    upper_left = reference_attention(one.q, k, v, causal="upper_left")
    wrong = [("causal_alignment='upper_left'", upper_left)]
    departures, notes, got_full = judged_call(full, fn, conv, conv.dtype)
    more, more_notes, got_one = judged_call(one, fn, conv, conv.dtype, wrong if causal else [])
    departures += [f"Lq=1: {d}" for d in more]
    notes += [f"Lq=1 {n}" for n in more_notes]
    if not departures:  # both agree with the reference; and with each other?
        a = from_layout(to_numpy(got_full["out"], dtype="float64"), conv.layout)[..., -1:, :]
        b = from_layout(to_numpy(got_one["out"], dtype="float64"), conv.layout)
        if not np.all(within_tolerance(b, a, tolerance(conv.dtype, "out"))):
            departures.append(
                f"the Lq=1 call differs from the last row of the Lq=8 call by {max_abs(b, a):.3g}"
            )
    return departures, notes


def _case_padding(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """Key padding as a broadcast ``[B, 1, 1, Lk]`` mask, one sequence all padding."""
    rng = np.random.default_rng([SEED, 8])
    q, k, v = random_qkv(rng, conv.dtype, 2, 2, 8, 10, b=3)
    lengths = np.array([10, 6, 0])  # the third sequence is all padding: no key for any row
    mask = (np.arange(10)[None, :] < lengths[:, None])[:, None, None, :]
    return judged_call(Inputs(q, k, v, mask=mask), fn, conv, conv.dtype)[:2]


def _case_window(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """``window=(3, 1)`` with ``Lq = 6 < Lk = 10``: counts, inclusive bounds, alignment."""
    window = (3, 1)
    q, k, v = random_qkv(np.random.default_rng([SEED, 9]), conv.dtype, 2, 2, 6, 10)
    inputs = Inputs(q, k, v, window=window)
    other = "upper_left" if conv.causal_alignment == "lower_right" else "lower_right"
    alternatives = [
        (
            f"the window aligned {other} (causal_alignment={other!r})",
            reference_of(inputs, conv, alignment=other),
        ),
        ("left and right swapped: window=(1, 3)", reference_of(inputs, conv, window=(1, 3))),
        (
            "bounds exclusive (each side one key narrower: (2, 0))",
            reference_of(inputs, conv, window=(2, 0)),
        ),
        ("each side one key wider: (4, 2)", reference_of(inputs, conv, window=(4, 2))),
    ]
    return judged_call(inputs, fn, conv, conv.dtype, alternatives)[:2]


def _case_window_causal(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """``causal`` with ``window=(3, 2)``, ``Lq = 6 < Lk = 10``: both at once, causal caps
    the window's right side at 0 (3 keys left and the aligned one)."""
    q, k, v = random_qkv(np.random.default_rng([SEED, 13]), conv.dtype, 2, 2, 6, 10)
    inputs = Inputs(q, k, v, causal=True, window=(3, 2))
    other = "upper_left" if conv.causal_alignment == "lower_right" else "lower_right"
    alternatives = [
        (
            "causal ignored where a window is given (window=(3, 2) alone)",
            reference_of(Inputs(q, k, v, window=(3, 2)), conv),
        ),
        (
            "the window ignored where causal is given",
            reference_of(Inputs(q, k, v, causal=True), conv),
        ),
        (f"both aligned {other} (causal_alignment={other!r})", reference_of(inputs, conv, other)),
    ]
    return judged_call(inputs, fn, conv, conv.dtype, alternatives)[:2]


def _head_dims(dk: int, dv: int) -> Callable[..., Verdict]:
    def run(fn: Callable[..., Any], conv: Conventions) -> Verdict:
        rng = np.random.default_rng([SEED, 10, dk, dv])
        q, k = (rounded(rng.standard_normal((1, 2, n, dk)), conv.dtype) for n in (8, 8))
        v = rounded(rng.standard_normal((1, 2, 8, dv)), conv.dtype)
        return judged_call(Inputs(q, k, v), fn, conv, conv.dtype)[:2]

    return run


def _empty_rows_inputs(
    conv: Conventions, rng: np.random.Generator, hq: int, lq: int, lk: int, rows: Sequence[int]
) -> Inputs:
    """``q, k, v`` with query rows that have no key: ``rows`` masked out by a mask; where
    ``fn`` takes no mask but a lower-right causal flag, causal with ``Lq = Lk + 4`` (its
    first 4 rows see no key); else neither (no row without a key)."""
    if conv.mask is None and conv.causal is not None and conv.causal_alignment == "lower_right":
        q, k, v = random_qkv(rng, conv.dtype, hq, hq, lk + 4, lk)
        return Inputs(q, k, v, causal=True)
    q, k, v = random_qkv(rng, conv.dtype, hq, hq, lq, lk)
    if conv.mask is None:
        return Inputs(q, k, v)
    return Inputs(q, k, v, mask=_mask_case(rng, 2, lq, lk, empty_rows=rows))


def _sink_inputs(conv: Conventions) -> Inputs:
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
    no_sinks = Inputs(inputs.q, inputs.k, inputs.v, mask=inputs.mask)
    alternatives = [("no sinks at all (the sinks ignored)", reference_of(no_sinks, conv))]
    return judged_call(inputs, fn, conv, conv.dtype, alternatives)[:2]


def _reference_grads(inputs: Inputs, ref: Reference, dout: np.ndarray) -> dict[str, np.ndarray]:
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


def _gradient_case(inputs: Inputs, fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """``fn``'s gradients (its framework's autodiff) against :func:`_reference_grads`:
    finite everywhere, ``dq`` exactly 0 on rows with no key."""
    if not differentiable(conv.backend):
        msg = f"{conv.backend} arrays have no autodiff here (differentiable: torch, jax)"
        raise Skip(msg)
    (q, k, v), kwargs = call_arguments(conv, inputs)
    ref = reference_of(inputs, conv)
    dout = rounded(np.random.default_rng([SEED, 12]).standard_normal(ref.out.shape), conv.dtype)
    primals = {"q": q, "k": k, "v": v}
    sinks_keyword = conv.sinks or "sinks"  # call_arguments has skipped a case with no keyword
    if inputs.sinks is not None:
        primals["sinks"] = kwargs.pop(sinks_keyword)

    def call(**arrays: Any) -> Any:
        more = {sinks_keyword: arrays["sinks"]} if "sinks" in arrays else {}
        result = fn(arrays["q"], arrays["k"], arrays["v"], **kwargs, **more)
        return named_outputs(conv, result)["out"]

    got = vjp(call, primals, to_layout(dout, conv.layout), conv.backend, conv.device)
    want = _reference_grads(inputs, ref, dout.astype(np.float64))
    empty = np.isneginf(ref.lse) if inputs.sinks is None else ref.weights.sum(-1) == 0
    base = tolerance(conv.dtype, "out")
    tol = Tolerance(base.rtol, 10 * base.atol)  # a gradient sums over a row or a column
    departures: list[str] = []
    notes: list[str] = []
    for name, ref_grad in want.items():
        g = got[name] if name == "sinks" else from_layout(got[name], conv.layout)
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
                f"dq is not 0 on rows with no key ({rows_text(int(empty.sum()))}, "
                f"max |dq| {worst:.3g}); the contract: 0"
            )
        err = max_abs(g, ref_grad)
        close = within_tolerance(g, ref_grad, tol)
        if not np.all(close):
            departures.append(
                f"{what}: {int(np.sum(~close))} of {g.size} values differ "
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


def _out_of(fn: Callable[..., Any], conv: Conventions, inputs: Inputs) -> np.ndarray:
    out = call_under_test(fn, conv, inputs)["out"]
    return from_layout(to_numpy(out, dtype="float64"), conv.layout)


def _bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def _case_batch_invariance(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """Sequence 2 alone against the same sequence inside a batch of 4 (causal if taken):
    the two outputs against each other, not against the reference."""
    q, k, v = random_qkv(np.random.default_rng([SEED, 13]), conv.dtype, 2, 2, 1024, 1024, b=4, d=64)
    causal = conv.causal is not None
    in_batch = _out_of(fn, conv, Inputs(q, k, v, causal=causal))[2:3]
    q1, k1, v1 = (np.ascontiguousarray(a[2:3]) for a in (q, k, v))
    one = _out_of(fn, conv, Inputs(q1, k1, v1, causal=causal))
    if one.shape != in_batch.shape:
        return [f"out has shape {one.shape} alone, {in_batch.shape} in the batch"], []
    if _bitwise(one, in_batch):
        return [], ["alone vs in a batch of 4: bitwise equal"]
    diff = max_abs(one, in_batch)
    if not np.all(within_tolerance(one, in_batch, tolerance(conv.dtype, "out"))):
        return [f"alone vs in a batch of 4: differs by {diff:.3g}, beyond tolerance"], []
    return [], [f"alone vs in a batch of 4: not bitwise, max diff {diff:.2g}"]


def _case_determinism(fn: Callable[..., Any], conv: Conventions) -> Verdict:
    """The same call three times: bitwise the same output (not judged against the
    reference: the other cases do that)."""
    rng = np.random.default_rng([SEED, 14])
    q, k, v = random_qkv(rng, conv.dtype, 2, 2, 64, 64, d=32)
    mask = _mask_case(rng, 2, 64, 64) if conv.mask is not None else None
    inputs = Inputs(q, k, v, mask=mask, causal=mask is None and conv.causal is not None)
    first = _out_of(fn, conv, inputs)
    for _ in range(2):
        again = _out_of(fn, conv, inputs)
        if not _bitwise(first, again):
            diff = max_abs(first, again)
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
    "window_causal": "causal with window=(3, 2), Lq = 6 < Lk = 10: the window's right side "
    "capped at 0 by causal (skipped without both `causal=` and `window=`)",
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
    "window_causal": _case_window_causal,
    "head_dim_256": _head_dims(256, 256),
    "head_dim_512": _head_dims(512, 512),
    "dv_ne_dk": _head_dims(192, 128),
    "sinks": _case_sinks,
    "grad_empty_rows": _case_grad_empty_rows,
    "grad_sinks": _case_grad_sinks,
    "batch_invariance": _case_batch_invariance,
    "determinism": _case_determinism,
}
