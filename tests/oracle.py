"""A plain float64 NumPy reference for attention, written independently of the package.

It does not import ``portable_attention``. It follows DESIGN.md / docs/api-decisions.md
literally and favours the obvious formulation over speed:

* grouped-query heads by repeating K/V heads (``np.repeat``), query head h uses KV head
  ``h // (Hq // Hk)``;
* causal and window masks from explicit index comparisons;
* a max-subtracted softmax that explicitly writes 0 for rows with no key left;
* lse = log-sum-exp of the masked scores, exactly ``-inf`` for those rows;
* attention sinks as one more score column (never masked) that the softmax sees and the
  weights drop: lse includes the sink, an empty row has lse = sink;
* segment ids by walking each row of ids for the start and end of every position's run,
  then the causal/window comparisons on the positions within the runs;
* ``score_mod``/``mask_mod`` (FlexAttention's signatures) called once on the whole score
  matrix with int32 index arrays that broadcast to it.

Also a central finite-difference gradient of a scalar loss of the oracle (for grad tests),
and the analytic gradient of that loss with respect to the sinks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


def allowed_positions(
    lq: int,
    lk: int,
    *,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """Boolean [lq, lk]: True where query i may see key j because of causal/window options."""
    if causal is True or causal == "lower_right":
        offset = lk - lq
        is_causal = True
    elif causal == "upper_left":
        offset = 0
        is_causal = True
    elif causal is False:
        offset = lk - lq  # window alignment without causal: lower-right
        is_causal = False
    else:
        msg = f"oracle: bad causal {causal!r}"
        raise ValueError(msg)

    if isinstance(window, int):
        left, right = window, window
    elif window is None:
        left, right = None, None
    else:
        left, right = window

    i = np.arange(lq)[:, None]  # query index
    j = np.arange(lk)[None, :]  # key index
    p = i + offset  # each query's aligned key position
    keep = np.ones((lq, lk), dtype=bool)
    if is_causal:
        keep &= j <= p
    if left is not None:
        keep &= j >= p - left
    if right is not None:
        keep &= j <= p + right
    return keep


def _window_sides(
    window: int | tuple[int | None, int | None] | None,
) -> tuple[int | None, int | None]:
    if isinstance(window, int):
        return window, window
    if window is None:
        return None, None
    return window[0], window[1]


def id_bounds(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` of the segment each position is in: the first position of its id
    and one past the last (in its row, last axis), by a walk over each row."""
    ids = np.asarray(ids)
    start = np.zeros(ids.shape, dtype=np.int64)
    end = np.zeros(ids.shape, dtype=np.int64)
    for row in np.ndindex(*ids.shape[:-1]):
        values = [int(x) for x in ids[row]]
        for p, x in enumerate(values):
            where = [i for i, y in enumerate(values) if y == x]
            start[(*row, p)] = where[0]
            end[(*row, p)] = where[-1] + 1
    return start, end


def segment_positions(
    q_ids: np.ndarray,
    kv_ids: np.ndarray,
    *,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """Boolean ``[*batch, 1, Lq, Lk]``: query i may see key j (same id, and inside the
    causal/window band with both positions counted within their own segment: from the
    first (upper-left) or last (lower-right) position of their id)."""
    if causal not in (False, True, "lower_right", "upper_left"):
        msg = f"oracle: bad causal {causal!r}"
        raise ValueError(msg)
    left, right = _window_sides(window)
    q_start, q_end = id_bounds(q_ids)
    k_start, k_end = id_bounds(kv_ids)
    iq = np.arange(q_ids.shape[-1])
    jk = np.arange(kv_ids.shape[-1])
    if causal == "upper_left":
        pos_q, pos_k = iq - q_start, jk - k_start
    else:  # lower-right: the last query of an id is aligned with its last key
        pos_q, pos_k = iq - q_end, jk - k_end
    d = pos_k[..., None, :] - pos_q[..., :, None]  # [*batch, Lq, Lk]
    keep = q_ids[..., :, None] == kv_ids[..., None, :]
    if causal is not False:
        keep &= d <= 0
    if left is not None:
        keep &= d >= -left
    if right is not None:
        keep &= d <= right
    return keep[..., None, :, :]


def mod_indices(q_shape: tuple[int, ...], lk: int) -> tuple[np.ndarray, ...]:
    """The ``(b, h, q_idx, kv_idx)`` int32 arrays FlexAttention's mods receive, for a
    query of shape ``q_shape`` and ``lk`` keys."""
    lq = q_shape[-2]
    q_idx = np.arange(lq, dtype=np.int32)[:, None]
    kv_idx = np.arange(lk, dtype=np.int32)[None, :]
    if len(q_shape) == 2:
        return np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), q_idx, kv_idx
    batch, hq = q_shape[:-3], q_shape[-3]
    n = math.prod(batch)
    b = np.arange(n, dtype=np.int32).reshape((*batch, 1, 1, 1))
    h = np.arange(hq, dtype=np.int32).reshape((*(1 for _ in batch), hq, 1, 1))
    return b, h, q_idx, kv_idx


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(out, weights, lse)`` in float64 for the given (float64-convertible) inputs.

    ``sinks`` broadcast to ``q.shape[:-2]``; ``segment_ids`` is one int array
    ``[*batch, L]`` (``Lq == Lk``) or a pair ``(q_ids, kv_ids)``, ``*batch`` broadcasting
    to ``q.shape[:-3]``; ``score_mod(score, b, h, q_idx, kv_idx)`` and
    ``mask_mod(b, h, q_idx, kv_idx)`` get NumPy arrays (see :func:`mod_indices`).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    q_shape = q.shape
    two_d = q.ndim == 2
    if two_d:
        q, k, v = q[None], k[None], v[None]

    hq, hk = q.shape[-3], k.shape[-3]
    assert hq % hk == 0, (hq, hk)
    group = hq // hk
    k = np.repeat(k, group, axis=-3)
    v = np.repeat(v, group, axis=-3)

    lq, dk = q.shape[-2], q.shape[-1]
    lk = k.shape[-2]
    if scale is None:
        scale = 1.0 / np.sqrt(dk)

    scores = scale * np.einsum("...qd,...kd->...qk", q, k)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)

    keep = np.ones(scores.shape, dtype=bool)
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        scores = scores + bias
        keep = keep & (scores != -np.inf)
    indices = mod_indices(q_shape, lk)
    if score_mod is not None:
        new = np.asarray(score_mod(scores[0] if two_d else scores, *indices), dtype=np.float64)
        scores = np.broadcast_to(new, scores.shape[-2:] if two_d else scores.shape)
        scores = np.array(scores.reshape((1, lq, lk)) if two_d else scores)
        keep = keep & (scores != -np.inf)
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        keep = keep & mask
    if segment_ids is None:
        keep = keep & allowed_positions(lq, lk, causal=causal, window=window)
    else:
        if isinstance(segment_ids, (tuple, list)):
            q_ids, kv_ids = (np.asarray(a).astype(np.int64) for a in segment_ids)
        else:
            assert lq == lk, (lq, lk)
            q_ids = kv_ids = np.asarray(segment_ids).astype(np.int64)
        batch = q_shape[:-3]
        q_ids = np.broadcast_to(q_ids, (*batch, lq))
        kv_ids = np.broadcast_to(kv_ids, (*batch, lk))
        keep = keep & segment_positions(q_ids, kv_ids, causal=causal, window=window)
    if mask_mod is not None:
        allowed = np.asarray(mask_mod(*indices))
        assert allowed.dtype == np.bool_, allowed.dtype
        keep = keep & (allowed[None] if two_d else allowed)

    if sinks is not None:  # one more column per row, always kept unless -inf
        shape = np.broadcast_shapes(keep.shape, scores.shape)
        keep, scores = np.broadcast_to(keep, shape), np.broadcast_to(scores, shape)
        sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64), q.shape[:-2])
        sink_column = np.broadcast_to(sink[..., None, None], (*scores.shape[:-1], 1))
        scores = np.concatenate([scores, sink_column], axis=-1)
        keep = np.concatenate([keep, sink_column != -np.inf], axis=-1)

    # Stable softmax, row by row over the last axis; rows with no key are written as 0 / -inf.
    any_key = keep.any(axis=-1, keepdims=True)
    masked_scores = np.where(keep, scores, -np.inf)
    row_max = np.where(any_key, masked_scores.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    exp = np.where(keep, np.exp(np.where(keep, scores, 0.0) - row_max), 0.0)
    denom = exp.sum(axis=-1, keepdims=True)
    weights = np.where(any_key, exp / np.where(any_key, denom, 1.0), 0.0)
    lse = np.where(
        any_key[..., 0], row_max[..., 0] + np.log(np.where(any_key, denom, 1.0)[..., 0]), -np.inf
    )
    if sinks is not None:
        weights = weights[..., :lk]
    out = np.einsum("...qk,...kd->...qd", weights, v)
    out = np.where(any_key, out, 0.0)

    if two_d:
        out, weights, lse = out[0], weights[0], lse[0]
    return out, weights, lse


def numerical_grad(f: Callable[[], float], x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar ``f()`` with respect to ``x`` (modified in place,
    restored afterwards)."""
    g = np.zeros_like(x, dtype=np.float64)
    flat = x.reshape(-1)
    gflat = g.reshape(-1)
    for idx in range(flat.size):
        old = flat[idx]
        flat[idx] = old + h
        fp = f()
        flat[idx] = old - h
        fm = f()
        flat[idx] = old
        gflat[idx] = (fp - fm) / (2 * h)
    return g


def loss_grads(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    w_out: np.ndarray,
    w_lse: np.ndarray | None = None,
    **kwargs: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Finite-difference gradients wrt q, k, v of
    ``sum(out * w_out) + sum(where(isfinite(lse), lse, 0) * w_lse)``."""
    q, k, v = (np.array(a, dtype=np.float64, copy=True) for a in (q, k, v))

    def f() -> float:
        out, _, lse = attention(q, k, v, **kwargs)
        total = float(np.sum(out * w_out))
        if w_lse is not None:
            total += float(np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse))
        return total

    return numerical_grad(f, q), numerical_grad(f, k), numerical_grad(f, v)


def loss_grads_with_bias(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    w_out: np.ndarray,
    w_lse: np.ndarray | None = None,
    *,
    bias: np.ndarray | None = None,
    sinks: np.ndarray | None = None,
    **kwargs: Any,
) -> dict[str, np.ndarray]:
    """Finite-difference gradients of the loss of :func:`loss_grads` with respect to q, k,
    v and (where given) the bias and the sinks, each in its own (broadcast) shape:
    ``{"q": ..., "bias": ..., "sinks": ...}``. A ``-inf`` bias entry (or sink) stays
    ``-inf`` when nudged, so its gradient is 0."""
    arrays = {
        n: np.array(a, dtype=np.float64, copy=True) for n, a in zip("qkv", (q, k, v), strict=True)
    }
    if bias is not None:
        arrays["bias"] = np.array(bias, dtype=np.float64, copy=True)
    if sinks is not None:
        arrays["sinks"] = np.array(sinks, dtype=np.float64, copy=True)

    def f() -> float:
        out, _, lse = attention(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            bias=arrays.get("bias"),
            sinks=arrays.get("sinks"),
            **kwargs,
        )
        total = float(np.sum(out * w_out))
        if w_lse is not None:
            total += float(np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse))
        return total

    return {name: numerical_grad(f, a) for name, a in arrays.items()}


def sink_grads(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    w_out: np.ndarray,
    w_lse: np.ndarray | None = None,
    *,
    sinks: np.ndarray,
    **kwargs: Any,
) -> np.ndarray:
    """The analytic gradient, in ``sinks``' own shape, of the loss of :func:`loss_grads`
    (``sum(out * w_out) + sum(lse * w_lse)``, non-finite lse counted as 0).

    With ``p = exp(sink - lse)`` the sink's share of a row: ``d lse / d sink = p`` and
    ``d out / d sink = -p * out``; summed over the rows (and heads, batch) each sink
    reaches. A row with lse ``-inf`` (a ``-inf`` sink and no key) has ``p = 0``."""
    sinks = np.asarray(sinks, dtype=np.float64)
    out, _, lse = attention(q, k, v, sinks=sinks, **kwargs)
    heads_shape = lse.shape[:-1]  # q.shape[:-2]
    # 2-D q: one implicit head, sinks () or (1,) (heads_shape is ()).
    sink = np.broadcast_to(sinks.reshape(()) if not heads_shape else sinks, heads_shape)[..., None]
    finite = np.isfinite(lse)
    logit = np.where(finite, sink, 0.0) - np.where(finite, lse, 0.0)
    share = np.where(finite, np.exp(logit), 0.0)  # [..., Hq, Lq]
    per_row = -share * np.sum(out * np.asarray(w_out, dtype=np.float64), axis=-1)
    if w_lse is not None:
        per_row = per_row + share * np.asarray(w_lse, dtype=np.float64)
    grad = per_row.sum(axis=-1)  # [..., Hq]
    if not heads_shape:
        return grad.reshape(sinks.shape)
    # Sum over the dims the sinks were broadcast along, back to their shape.
    extra = grad.ndim - sinks.ndim
    grad = grad.sum(axis=tuple(range(extra))) if extra else grad
    axes = tuple(i for i, n in enumerate(sinks.shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(sinks.shape) if axes else grad
