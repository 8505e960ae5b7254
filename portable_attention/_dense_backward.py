"""``attend_backward`` with the whole score matrix, for calls whose batch or lengths a lazy
library leaves unknown (None in the shape: ndonnx's symbolic dims), where the blockwise
backward cannot cut blocks. The same rule as the blockwise backward (FlashAttention-2's,
recomputed from ``lse``), written once over ``[..., Lq, Lk]``: ``p = exp(s - lse)``,
``ds = p * (dout @ v^T - delta)``; array-API calls only, every shape read off the arrays
(never a Python int of a length), so the graph a lazy library records holds for every
value of its symbolic dims. Dropout, a pair of segment ids and mods are refused on such
calls before this runs (``_spec``); one array of ids is a mask of the whole matrix.
"""

from __future__ import annotations

from typing import Any

from portable_attention import _core
from portable_attention._block_math import BlockMath
from portable_attention._blockwise import Grads
from portable_attention._mods import Mods
from portable_attention._spec import Call


def backward(
    call: Call,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    mask: Any = None,
    bias: Any = None,
    dlse: Any = None,
    sinks: Any = None,
    mods: Mods | None = None,
) -> Grads:
    """The gradients of ``attend``'s inputs from ``dout``, ``out`` and ``lse`` (and
    ``dlse``, ``sinks``; ``mods``: one array of segment ids), as
    :func:`portable_attention._blockwise_backward.backward` gives them."""
    xp, ct = call.xp, call.compute_dtype
    ops = _core.operands(call, q, k, v, mask, bias, q_factor=_core.q_factor(call))
    allow = _core.dense_allow(call, ops, mods)
    s, t = _core.block_scores(
        call, ops.q, ops.k, (0, ops.q.shape[-2]), (0, ops.k.shape[-2]), bias=ops.bias,
        mods=mods, allow=allow,
        math=BlockMath(xp), need_t=True,
    )  # fmt: skip

    def rows(x: Any) -> Any:
        return xp.astype(_core.group_rows(call, x), ct, copy=False)

    do = rows(dout)
    delta = xp.sum(do * rows(out), axis=-1, keepdims=True)
    if dlse is not None:  # d lse / d s = p: ds = p * (dp - (delta - dlse))
        delta = delta - rows(xp.expand_dims(dlse, axis=-1))
    lse_g = rows(xp.expand_dims(lse, axis=-1))
    # Rows with no key (lse = -inf): +inf makes every p = exp(s - inf) = 0.
    p = xp.exp(s - xp.where(lse_g == -xp.inf, xp.inf, lse_g))
    ds = p * (xp.matmul(do, xp.matrix_transpose(ops.v)) - delta)
    dbias = None if bias is None else _to_bias(call, ds, bias)
    if t is not None:  # s = softcap * tanh(x): ds/dx = softcap * (1 - t^2)
        ds = ds * (1.0 - t * t)
    # ops.q carries q_factor; the scores' derivative with respect to q k^T is the scale.
    dq = xp.matmul(ds, ops.k) * call.scale
    dk = xp.matmul(xp.matrix_transpose(ds), ops.q) * (call.scale / _core.q_factor(call))
    dv = xp.matmul(xp.matrix_transpose(p), do)
    dsinks = None
    if sinks is not None:
        dsinks = _core.sinks_grad_from(call, sinks, dout, out, lse, dlse)
    return Grads(
        xp.astype(_core.caller_heads(call, dq, call.q_shape), q.dtype, copy=False),
        xp.astype(_kv_heads(call, dk), k.dtype, copy=False),
        xp.astype(_kv_heads(call, dv), v.dtype, copy=False),
        dbias,
        dsinks,
    )


def _kv_heads(call: Call, x: Any) -> Any:
    """A gradient of K or V from the grouped heads: the ``G`` query heads of each K/V head
    summed, the 2-D case's one head taken."""
    if call.grouped:
        x = call.xp.sum(x, axis=-3)
    return x[0, ...] if len(call.k_shape) == 2 else x


def _to_bias(call: Call, ds: Any, bias: Any) -> Any:
    """``dbias``: the scores' gradient summed over the axes ``bias`` broadcasts along (its
    leading axes it lacks, and those where it has 1), in its shape and dtype."""
    xp = call.xp
    g = _core.caller_heads(call, ds, (*call.q_shape[:-1], call.k_shape[-2]))
    lead = g.ndim - bias.ndim
    if lead > 0:
        g = xp.sum(g, axis=tuple(range(lead)))
    axes = tuple(i for i, b in enumerate(bias.shape) if b == 1 and g.shape[i] != 1)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    return xp.astype(g, bias.dtype, copy=False)
