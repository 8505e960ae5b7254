"""The array-API implementation of the contract: the spec in code.

Only array-API calls on the namespace of the inputs: no framework code, no in-place
writes, no boolean indexing, no Python branching on data. Grouped-query heads are
computed by splitting the query heads into ``[Hk, G]`` and broadcasting K/V over
``G``, so K/V are never copied per head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from portable_attention import masks as _masks
from portable_attention._validate import Call

#: ``keep_mask(shape) -> bool array``: the dropout keep mask, from the framework's RNG.
KeepMask = Callable[[tuple[int, ...]], Any]


def _group_heads(xp: Any, x: Any, hk: int, group: int, *, kv: bool) -> Any:
    """``[..., Hq, L, D] -> [..., Hk, G, L, D]`` (q) or ``[..., Hk, 1, L, D]`` (k, v)."""
    if group == 1:
        return x
    *lead, h, length, d = x.shape
    if kv:
        return xp.reshape(x, (*lead, h, 1, length, d))
    return xp.reshape(x, (*lead, hk, group, length, d))


def _group_scores_operand(xp: Any, x: Any, ndim: int, hk: int, group: int) -> Any:
    """Left-pad a mask or bias to ``ndim`` dims and split its head axis like q's."""
    shape = (1,) * (ndim - x.ndim) + tuple(x.shape)
    if shape != tuple(x.shape):
        x = xp.reshape(x, shape)
    if group == 1:
        return x
    *lead, h, lq, lk = shape
    heads = (1, 1) if h == 1 else (hk, group)
    return xp.reshape(x, (*lead, *heads, lq, lk))


def _empty_keys(xp: Any, call: Call) -> tuple[Any, Any, Any]:
    """Lk == 0: every row is fully masked (a static-shape case, decided without data)."""
    lead_q = call.q_shape[:-1]
    dev = call.device
    out = xp.zeros((*lead_q, call.v_shape[-1]), dtype=call.dtype, device=dev)
    weights = xp.zeros((*lead_q, 0), dtype=call.dtype, device=dev)
    lse = xp.full(lead_q, -xp.inf, dtype=call.compute_dtype, device=dev)
    return out, weights, lse


def dense(
    call: Call,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    bias: Any = None,
    keep_mask: KeepMask | None = None,
) -> tuple[Any, Any, Any]:
    """Attention with the full ``[..., Lq, Lk]`` score matrix.

    Returns ``(out, weights, lse)``: ``out [..., Hq, Lq, Dv]`` and ``weights`` (before
    dropout) in the input dtype, ``lse [..., Hq, Lq]`` in the compute dtype.
    """
    xp = call.xp
    if call.k_shape[-2] == 0:
        return _empty_keys(xp, call)
    ct = call.compute_dtype
    two_d = len(call.q_shape) == 2
    if two_d:  # one implicit head
        q, k, v = (xp.reshape(x, (1, *x.shape)) for x in (q, k, v))
    hq, hk = (q.shape[-3], k.shape[-3])
    group = hq // hk
    ndim = q.ndim

    # Scale q rather than the scores: Lq*Dk multiplies instead of Lq*Lk.
    qc = xp.astype(q, ct) * call.scale
    kc, vc = xp.astype(k, ct), xp.astype(v, ct)
    qg = _group_heads(xp, qc, hk, group, kv=False)
    kg = _group_heads(xp, kc, hk, group, kv=True)
    vg = _group_heads(xp, vc, hk, group, kv=True)

    s = xp.matmul(qg, xp.matrix_transpose(kg))  # [..., Hk, (G,) Lq, Lk]
    if call.softcap is not None:
        s = call.softcap * xp.tanh(s / call.softcap)
    if bias is not None:
        s = s + xp.astype(_group_scores_operand(xp, bias, ndim, hk, group), ct)

    allowed = structural_mask(call, device=call.device)
    if mask is not None:
        user = _group_scores_operand(xp, mask, ndim, hk, group)
        allowed = user if allowed is None else (user & allowed)
    if allowed is not None:
        s = xp.where(allowed, s, -xp.inf)

    weights, lse = _softmax_lse(xp, s)

    p = weights
    if keep_mask is not None:
        p = xp.where(keep_mask(tuple(s.shape)), p / (1.0 - call.dropout), 0.0)
    out = xp.matmul(p, vg)

    out_shape = (*call.q_shape[:-1], call.v_shape[-1])
    out = xp.astype(xp.reshape(out, out_shape), call.dtype)
    weights = xp.astype(xp.reshape(weights, (*call.q_shape[:-1], call.k_shape[-2])), call.dtype)
    lse = xp.reshape(lse, call.q_shape[:-1])
    return out, weights, lse


def _softmax_lse(xp: Any, s: Any) -> tuple[Any, Any]:
    """Softmax over the last axis and its natural-log logsumexp.

    Rows whose scores are all ``-inf`` give weights 0 and lse ``-inf`` with zero (finite)
    gradients: every division and log sees a safe operand selected by ``where``.
    """
    m = xp.max(s, axis=-1, keepdims=True)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(s - m_safe)
    denom = xp.sum(e, axis=-1, keepdims=True)
    has_key = denom > 0
    denom_safe = xp.where(has_key, denom, 1.0)
    weights = e / denom_safe
    lse = xp.where(has_key, xp.log(denom_safe) + m_safe, -xp.inf)
    return weights, lse[..., 0]


def structural_mask(call: Call, *, device: Any = None) -> Any:
    """The ``[Lq, Lk]`` mask of ``causal`` and ``window`` (None when neither is set)."""
    if call.causal is None and call.window is None:
        return None
    left, right = call.window if call.window is not None else (None, None)
    if call.causal is not None:
        right = 0  # causal never looks ahead of the aligned position, whatever the window
    return _masks.band(
        call.xp,
        call.q_shape[-2],
        call.k_shape[-2],
        left=left,
        right=right,
        align=call.align,
        device=device,
    )
