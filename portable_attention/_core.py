"""The array-API implementation of the contract: the spec in code.

Only array-API calls on the namespace of the inputs: no framework code, no in-place
writes, no boolean indexing, no Python branching on data (only on static shapes).
Grouped-query heads are computed by splitting the query heads into ``[Hk, G]`` and
broadcasting K/V over ``G``, so K/V are never copied per head.

:func:`dense` materialises the ``[..., Lq, Lk]`` scores; the blockwise path
(:mod:`portable_attention._blockwise`) walks query and key blocks with an online softmax
(running max and sum) and has a backward of its own, so its peak memory is
``O((Lq + Lk) * D + block**2)`` per head instead of ``O(Lq * Lk)``. Its blocks reuse this
module's operands, masks and score pipeline (:func:`block_scores`, of which the dense
path's block is the whole matrix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from portable_attention import _band, _checks, _mods
from portable_attention import masks as _masks
from portable_attention._block_math import BlockMath
from portable_attention._mods import Mods
from portable_attention._spec import Call

#: ``keep_mask(shape) -> bool array``: the dropout keep mask, from the framework's RNG.
KeepMask = Callable[[tuple[int, ...]], Any]

#: Score-block budget of the blockwise path, in elements over all batch and head dims
#: (4 MiB of float32): 256-key blocks for 8 heads. At ``[1, 8, L, 64]`` float32, L=1024
#: and 2048, causal, forward + backward, blocks of 256 measured fastest on torch and JAX
#: (JAX jit(grad) at L=1024: 88 ms at 256, 106 ms at 512, 304 ms at 1024).
CHUNK_BUDGET = 1 << 20

#: ``scores(q, k) -> q @ k^T``: an adapter's faster formulation of the scores' matmul
#: (JAX: an einsum), passed to :func:`block_scores`; None for the standard
#: ``matmul(q, matrix_transpose(k))``.
Scores = Callable[[Any, Any], Any]

#: Above this many bytes of dense scores, ``auto`` takes the blockwise path.
DENSE_LIMIT_BYTES = 256 << 20

#: On a framework with autodiff (torch, JAX), above this many bytes of dense scores
#: ``auto`` takes the blockwise path: the dense path's autodiff would save the
#: probabilities (and more of the scores' size) for backward. See
#: :mod:`portable_attention._plan` for the measurement.
SAVED_LIMIT_BYTES = 16 << 20


def score_count(call: Call) -> int:
    """Scores of the whole score matrix, over batch and heads."""
    return math.prod(call.q_shape[:-1]) * call.k_shape[-2]


def dense_bytes(call: Call) -> int:
    """Bytes of the whole score matrix in the compute dtype (NumPy's longdouble: 16)."""
    return score_count(call) * (call.xp.finfo(call.compute_dtype).bits // 8)


@dataclass(frozen=True)
class Operands:
    """q, k, v, mask and bias in the compute dtype, heads split as ``[..., Hk, G, L, D]``.

    q is already multiplied by the scale (``Lq*Dk`` products instead of ``Lq*Lk``).
    With no grouping (``G == 1``) the head axis is left as it is.
    """

    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any


def known(shape: tuple[Any, ...]) -> bool:
    """Whether every dimension of ``shape`` can be written in a ``reshape``: ints, or an
    export's symbolic sizes (torch's SymInts, JAX's symbolic dims). The array API lets a
    lazy library leave a dimension it cannot know as None (ndonnx's symbolic dims); a
    call's q, k and v are decided once (``Call.unknown_dims``), this serves arrays made
    later (``mha``'s projections)."""
    return all(d is not None for d in shape)


def _split_heads(xp: Any, x: Any, hk: int, group: int, fixed: bool) -> Any:
    """``[..., Hk*G, A, B] -> [..., Hk, G, A, B]``: a reshape (a view where the framework
    has views), or where a dimension is unknown (``fixed`` False), the ``Hk`` slices of
    ``G`` heads stacked on a new axis (a copy of this operand: q, a mask or a bias, never
    K/V)."""
    if fixed:
        *lead, _, a, b = x.shape
        return xp.reshape(x, (*lead, hk, group, a, b))
    heads = [x[..., h * group : (h + 1) * group, :, :] for h in range(hk)]
    return xp.stack(heads, axis=-4)


def _group_heads(xp: Any, x: Any, hk: int, group: int, *, kv: bool, fixed: bool) -> Any:
    """``[..., Hq, L, D] -> [..., Hk, G, L, D]`` (q) or ``[..., Hk, 1, L, D]`` (k, v)."""
    if group == 1:
        return x
    if not kv:
        return _split_heads(xp, x, hk, group, fixed)
    if not fixed:
        return xp.expand_dims(x, axis=-3)
    *lead, h, length, d = x.shape
    return xp.reshape(x, (*lead, h, 1, length, d))


def _group_scores_operand(xp: Any, x: Any, ndim: int, hk: int, group: int, fixed: bool) -> Any:
    """Left-pad a mask or bias to ``ndim`` dims and split its head axis like q's."""
    if not fixed:
        while x.ndim < ndim:
            x = xp.expand_dims(x, axis=0)
        if group == 1:
            return x
        if x.shape[-3] == 1:
            return xp.expand_dims(x, axis=-3)
        return _split_heads(xp, x, hk, group, fixed)
    shape = (1,) * (ndim - x.ndim) + tuple(x.shape)
    if shape != tuple(x.shape):
        x = xp.reshape(x, shape)
    if group == 1:
        return x
    *lead, h, lq, lk = shape
    if h == 1:
        return xp.reshape(x, (*lead, 1, 1, lq, lk))
    return _split_heads(xp, x, hk, group, fixed)


def operands(
    call: Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, *, q_factor: float | None = None
) -> Operands:
    """q, k, v, mask and bias as the kernels take them: in the compute dtype, q times
    ``q_factor`` (default: the call's scale), heads grouped, mask and bias padded."""
    xp, ct = call.xp, call.compute_dtype
    fixed = not call.unknown_dims
    if len(call.q_shape) == 2:  # one implicit head
        q, k, v = (
            xp.reshape(x, (1, *x.shape)) if fixed else xp.expand_dims(x, axis=0) for x in (q, k, v)
        )
    hk = k.shape[-3]
    group = q.shape[-3] // hk
    ndim = q.ndim
    if q.dtype != ct:  # half precision: computed in float32 (the check saves a call)
        q, k, v = (xp.astype(x, ct) for x in (q, k, v))
    qc = q * (call.scale if q_factor is None else q_factor)
    if bias is not None:
        bias = xp.astype(_group_scores_operand(xp, bias, ndim, hk, group, fixed), ct, copy=False)
    if mask is not None:
        mask = _group_scores_operand(xp, mask, ndim, hk, group, fixed)
    return Operands(
        q=_group_heads(xp, qc, hk, group, kv=False, fixed=fixed),
        k=_group_heads(xp, k, hk, group, kv=True, fixed=fixed),
        v=_group_heads(xp, v, hk, group, kv=True, fixed=fixed),
        mask=mask,
        bias=bias,
    )


def window_sides(call: Call) -> tuple[int | None, int | None]:
    """``(left, right)`` of the band of ``causal`` and ``window`` (None: unbounded)."""
    return call.band_sides


def band_keeps_all(call: Call) -> bool:
    """Whether ``causal`` and ``window`` keep every score: neither is given, or the band
    is wide enough for every row. Lower-right causal with one query (the KV-cache decode
    step) is one: the query's aligned position is the last key. A mask of all True would
    cost the fused kernels their mask-free path (torch decode: 62-115 us against 32-37).
    """
    if not call.global_band:  # (q_ids, kv_ids) pairs align causal/window per segment
        return True
    if call.symbolic:  # only neither option keeps every score for every length
        return call.causal is None and call.window is None
    grid = (0, call.q_shape[-2]), (0, call.k_shape[-2])
    return _band.block_full(*grid, call.band_offset, *window_sides(call))


def key_span(call: Call, rows: tuple[int, int]) -> tuple[int, int]:
    """The keys ``(start, stop)`` that ``causal``/``window`` leave to the query rows
    ``rows``: every key outside is masked for each of them (``start >= stop``: none is
    left). Kernels compute only these columns of the block."""
    lk = call.k_shape[-2]
    if not call.global_band:
        return 0, lk
    left, right = window_sides(call)
    offset = call.band_offset
    start = 0 if left is None else max(0, rows[0] + offset - left)
    stop = lk if right is None else min(lk, rows[1] - 1 + offset + right + 1)
    return start, max(start, stop)


def full_columns(call: Call, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[int, int]:
    """The keys ``(start, stop)`` within ``cols`` that ``causal``/``window`` keep for every
    query of ``rows`` (``start >= stop``: none; ``cols`` itself without a band): a kernel
    masks only the columns outside them."""
    if not call.global_band or band_keeps_all(call):
        return cols
    left, right = window_sides(call)
    offset = call.band_offset
    start = cols[0] if left is None else max(cols[0], rows[1] - 1 + offset - left)
    stop = cols[1] if right is None else min(cols[1], rows[0] + offset + right + 1)
    return start, max(start, stop)


def band_mask(
    call: Call,
    *,
    device: Any = None,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> Any:
    """The mask of ``causal`` and ``window`` on ``[Lq, Lk]`` (or a block); None where
    they keep every score (:func:`band_keeps_all`). The blockwise path's blocks take
    theirs from ``_block_grid.Pass.band``."""
    if band_keeps_all(call):
        return None
    left, right = window_sides(call)
    return _masks.band(
        call.xp,
        call.q_shape[-2],
        call.k_shape[-2],
        left=left,
        right=right,
        align=call.align,
        device=device,
        rows=rows,
        cols=cols,
    )


def fused_mask(call: Call, mask: Any, bias: Any) -> tuple[Any, bool]:
    """``(allow, is_causal)`` for fused kernels whose causal flag is upper-left (SDPA,
    jax.nn): the boolean mask of ``mask``, ``causal`` and ``window`` together, or
    ``(None, True)`` where the kernel's own flag is exact and alone: causal with no mask,
    bias or window, and ``Lq == Lk`` or upper-left alignment (no row is then empty).
    """
    exact = call.align == "upper_left" or _checks.same_length(call.q_shape[-2], call.k_shape[-2])
    alone = call.causal is not None and call.window is None and mask is None and bias is None
    if alone and exact:
        return None, True
    return allow_mask(call, mask), False


def fused_operand(call: Call, mask: Any, bias: Any) -> tuple[Any, bool]:
    """``(attn_mask, is_causal)`` for kernels that take one mask operand, boolean or
    additive (torch SDPA): :func:`fused_mask`, with ``bias`` where given (``-inf`` where
    the boolean mask drops a score)."""
    allow, is_causal = fused_mask(call, mask, bias)
    if bias is None or allow is None:
        return (allow if bias is None else bias), is_causal
    return call.xp.where(allow, bias, -call.xp.inf), False


def allow_mask(
    call: Call,
    mask: Any,
    *,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> Any:
    """The user's ``mask`` (already cut to the block) and the band of ``causal`` and
    ``window`` on ``rows x cols`` together: True = may attend; None where nothing masks."""
    band = band_mask(call, device=call.device, rows=rows, cols=cols)
    if mask is None:
        return band
    return mask if band is None else (mask & band)


def _unknown_lengths_band(call: Call, q: Any, k: Any) -> Any:
    """The band of ``causal`` and ``window`` where ``Lq`` or ``Lk`` is unknown (None in
    the shape: ndonnx's symbolic dims), from positions read off ``q`` and ``k`` (the
    traced lengths, never Python ints); None where the band keeps every score. Shaped
    ``[1, ..., 1, Lq, Lk]`` like ``q``'s dims, to broadcast against the scores."""
    if band_keeps_all(call):
        return None
    xp = call.xp

    def positions(x: Any) -> tuple[Any, Any]:  # ([1, ..., 1, L, 1] positions, [1, ..., 1, 1, 1] L)
        column = x[(slice(0, 1),) * (x.ndim - 2) + (slice(None), slice(0, 1))]
        ones = xp.ones_like(column, dtype=xp.int64)
        return xp.cumulative_sum(ones, axis=-2) - 1, xp.sum(ones, axis=-2, keepdims=True)

    i, lq = positions(q)
    j, lk = positions(k)
    left, right = window_sides(call)
    return _band.keep_at(
        i, xp.matrix_transpose(j), lq, lk, left=left, right=right, align=call.align
    )


def block_is_full(call: Call, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
    """Whether ``causal``/``window`` keep every score of the block (a static decision;
    never for symbolic lengths, where the mask is built for every value, nor for a band
    within segments, which depends on the ids)."""
    if call.symbolic or (not call.global_band and call.band_sides != (None, None)):
        return False
    return _band.block_full(rows, cols, call.band_offset, *window_sides(call))


def block_of(x: Any, rows: tuple[int, int], cols: tuple[int, int]) -> Any:
    """The ``rows x cols`` block of a broadcastable mask/bias (size-1 axes kept)."""
    if x is None:
        return None
    r = slice(*rows) if x.shape[-2] != 1 else slice(None)
    c = slice(*cols) if x.shape[-1] != 1 else slice(None)
    return x[..., r, c]


def q_factor(call: Call) -> float:
    """What q is multiplied by before the scores of the portable paths: the scale, over
    ``softcap`` where one is given (``tanh`` then takes the product as it is: one pass
    less)."""
    return call.scale / call.softcap if call.softcap is not None else call.scale


def block_scores(
    call: Call,
    qb: Any,
    kb: Any,
    rows: tuple[Any, int],
    cols: tuple[Any, int],
    *,
    bias: Any,
    mods: Mods | None,
    allow: Any,
    math: BlockMath,
    scores: Scores | None = None,
    need_t: bool = False,
    zero_after: bool = False,
    score_fn: Callable[[Any, Any, Any], Any] | None = None,
    slot: str | None = "scores",
) -> tuple[Any, Any]:
    """The score pipeline, written once: ``(s, t)`` of one block of the portable paths
    (the dense path's block is the whole matrix). ``s``: ``q @ k^T`` from operands whose
    q carries :func:`q_factor`, then softcap, ``+ bias`` (the block's), ``score_mod``,
    and ``-inf`` where ``allow`` (the block's mask; None: nothing masks) is False;
    ``t = tanh(q k^T * scale / softcap)`` where ``need_t`` (None without softcap).
    ``rows`` / ``cols``: the block's ``(start, length)``, for the ``score_mod``'s
    indices. ``score_fn(s, rows, cols)`` applies the ``score_mod`` instead (the
    blockwise backward's records its vector-Jacobian product). ``math``: the elementwise
    steps (an adapter's, maybe in place); ``slot``: the product's (see
    :meth:`BlockMath.product`; None: an array of its own).

    ``zero_after``: leave the mask out; the caller zeroes the masked probabilities after
    ``exp`` instead (where the scores are bounded): ``exp(-inf)`` takes about 5x the
    time of ``exp`` of a finite number on torch's CPU kernels."""
    xp = call.xp
    if scores is not None:
        s = scores(qb, kb)
    else:
        s = math.product(qb, xp.matrix_transpose(kb), slot=slot)
    t = None
    if call.softcap is not None:
        if need_t:
            t = math.tanh(s)
            s = math.scaled_copy(t, call.softcap)
        else:
            s = math.scaled(math.tanh(s), call.softcap)
    if bias is not None:
        s = math.add(s, bias)
    if score_fn is not None:
        s = score_fn(s, rows, cols)
    elif mods is not None and mods.score_mod is not None:
        s = _mods.apply_score_mod(call, mods, s, rows, cols)
    if allow is not None and not zero_after:
        s = math.masked(s, allow)
    return s, t


def empty_keys(call: Call, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """Lk == 0 (every row is fully masked) or Lq == 0: static shapes, decided without data.

    ``out = (q @ k^T) @ v`` sums over an empty axis: exact zeros that autograd connects to
    q, k and v (zero gradients, as on the fused paths), not a constant without a grad_fn.
    """
    xp, lead_q, dev = call.xp, call.q_shape[:-1], call.device
    ops = operands(call, q, k, v, None, None)
    out = xp.matmul(xp.matmul(ops.q, xp.matrix_transpose(ops.k)), ops.v)
    weights = xp.zeros((*lead_q, call.k_shape[-2]), dtype=call.dtype, device=dev)
    lse = xp.full(lead_q, -xp.inf, dtype=call.compute_dtype, device=dev)
    out, lse = ungrouped(call, out, lse)
    return out, weights, lse


def group_rows(call: Call, x: Any) -> Any:
    """An array of the output's rows (``dout``, ``out`` ``[..., Hq, Lq, Dv]``; ``lse``
    with a trailing axis of 1) with its heads split as :func:`operands` splits q's,
    without a reshape where a dimension is unknown."""
    xp = call.xp
    if len(call.q_shape) == 2:
        return xp.expand_dims(x, axis=0)
    hk = call.k_shape[-3]
    group = call.q_shape[-3] // hk
    return _group_heads(xp, x, hk, group, kv=False, fixed=not call.unknown_dims)


def ungrouped(call: Call, out: Any, lse: Any, lq: int | None = None) -> tuple[Any, Any]:
    """Grouped ``[..., Hk, G, Lq, Dv]`` results back to the caller's shapes and dtype
    (``lq``: the rows computed, where they are a block of the call's queries)."""
    xp = call.xp
    lead = (*call.q_shape[:-2], call.q_shape[-2] if lq is None else lq)
    if not call.unknown_dims:
        out = xp.astype(xp.reshape(out, (*lead, call.v_shape[-1])), call.dtype, copy=False)
        return out, xp.reshape(lse, lead)
    out = xp.astype(caller_heads(call, out, (*lead, call.v_shape[-1])), call.dtype, copy=False)
    return out, caller_heads(call, lse, lead)


def caller_heads(call: Call, x: Any, shape: tuple[Any, ...]) -> Any:
    """A result with the kernels' heads (``[..., Hk, G, *tail]``, or ``[1, *tail]`` for
    2-D q) in the caller's ``shape`` (``[..., Hq, *tail]``, or ``tail``): a reshape, or
    where a dimension is unknown, the 2-D case's one head taken and the ``Hk`` groups
    concatenated along the heads."""
    if not call.unknown_dims:
        return call.xp.reshape(x, shape)
    if len(call.q_shape) == 2:
        return x[0, ...]
    if not call.grouped:
        return x
    tail = len(shape) - len(call.q_shape) + 2  # the dims after the heads
    rest = (slice(None),) * (tail + 1)
    groups = [x[(..., h, *rest)] for h in range(call.k_shape[-3])]
    return call.xp.concat(groups, axis=-tail - 1)


def dense(
    call: Call,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    bias: Any = None,
    keep_mask: KeepMask | None = None,
    *,
    scores: Scores | None = None,
    guarded: bool | None = None,
    band: bool = True,
    mods: Mods | None = None,
    math: BlockMath | None = None,
) -> tuple[Any, Any, Any]:
    """Attention with the full ``[..., Lq, Lk]`` score matrix.

    Returns ``(out, weights, lse)``: ``out [..., Hq, Lq, Dv]`` and ``weights`` (before
    dropout; None unless ``call.return_weights``) in the input dtype, ``lse [..., Hq, Lq]``
    in the compute dtype. The softmax division is applied to ``out`` (``Lq*Dv``
    divisions) rather than to the scores (``Lq*Lk``) unless the weights are wanted.
    ``guarded``: the softmax's empty-row guards; None: where :func:`rows_may_be_empty`.
    ``mods``: the call's segment ids and score/mask mods (sinks are added by the caller:
    :func:`add_sinks`).
    An adapter may ask for them where they measure faster. ``band=False``: ``q`` may be
    a block of the call's query rows, and ``mask`` (cut to those rows) already holds
    ``causal`` and ``window`` (JAX's query blocks, whose offset is traced). ``math``: the
    elementwise steps (:func:`portable_attention._blockwise.block_math`, which may write
    in place: the whole matrix is the one block; functional where None).
    """
    if call.k_shape[-2] == 0:
        return empty_keys(call, q, k, v)
    xp = call.xp
    ops = operands(call, q, k, v, mask, bias, q_factor=q_factor(call))
    lq, lk = q.shape[-2], call.k_shape[-2]
    allow = dense_allow(call, ops, mods, band=band)
    math = BlockMath(xp) if math is None else math
    # The weights come from the scores' own array: never from a product buffer that the
    # next call writes again.
    slot = None if call.return_weights else "scores"
    s, _ = block_scores(
        call, ops.q, ops.k, (0, lq), (0, lk), bias=ops.bias, mods=mods, allow=allow,
        math=math, scores=scores, slot=slot,
    )  # fmt: skip
    if guarded is None:
        guarded = rows_may_be_empty(call)
    e, denom, lse = _softmax_parts(xp, math, s, guarded=guarded)
    p = e
    if keep_mask is not None:
        p = inverted_dropout(xp, p, keep_mask, call.dropout)
    out, lse = ungrouped(call, xp.matmul(p, ops.v) / denom, lse, lq)
    weights = None
    if call.return_weights:  # (e is read no more: the weights may take its memory)
        weights = xp.astype(
            caller_heads(call, math.divided(e, denom), (*call.q_shape[:-2], lq, lk)),
            call.dtype,
            copy=False,
        )
    return out, weights, lse


def dense_allow(call: Call, ops: Operands, mods: Mods | None, *, band: bool = True) -> Any:
    """The dense path's mask of the whole score matrix (True = may attend; None where
    nothing masks): ``mask``, the band of ``causal``/``window`` (built from the arrays'
    positions where a length is unknown; left out with ``band=False``), segment ids and
    ``mask_mod``."""
    lq, lk = ops.q.shape[-2], call.k_shape[-2]
    if not band:
        allow = ops.mask
    elif lq is not None and lk is not None:
        allow = allow_mask(call, ops.mask, rows=(0, lq), cols=(0, lk))
    else:
        allow = _unknown_lengths_band(call, ops.q, ops.k)
        allow = ops.mask if allow is None else (allow if ops.mask is None else ops.mask & allow)
    if mods is not None:
        extra = _mods.block_mask(call, mods, (0, lq), (0, lk), (*ops.q.shape[:-1], lk))
        if extra is not None:
            allow = extra if allow is None else allow & extra
    return allow


def inverted_dropout(xp: Any, x: Any, keep_mask: KeepMask, p: float) -> Any:
    """``x`` where a keep-mask drawn for its shape is True, scaled by ``1 / (1 - p)``;
    0 elsewhere."""
    return apply_keep(xp, x, keep_mask(tuple(x.shape)), p)


def apply_keep(xp: Any, x: Any, keep: Any, p: float) -> Any:
    """``x`` where ``keep`` is True, scaled by ``1 / (1 - p)``; 0 elsewhere."""
    return xp.where(keep, x / (1.0 - p), 0.0)


def rows_may_be_empty(call: Call) -> bool:
    """Whether a query row can have no key: only through ``mask``, ``bias`` (-inf), or
    a ``causal``/``window`` band that drops scores (``Lk == 0`` is handled before any
    scores exist).

    Without them every row attends to all ``Lk >= 1`` keys, and the softmax needs no
    guard for empty rows. The guards are not free: on XLA's CPU backend a ``where`` on
    the row max stops the scores' matmul, max, ``exp`` and sum from fusing; the plain
    call took 0.48 ms instead of 0.57 ms without it (jax 0.10, ``[1, 8, 128, 64]``).
    Non-finite inputs then give NaN rows, as in the seed's formula.
    """
    if call.segments in ("pair", "slices") or call.score_mod or call.mask_mod:
        return True
    return not (call.mask_shape is None and call.bias_shape is None and band_keeps_all(call))


def _softmax_parts(xp: Any, math: BlockMath, s: Any, *, guarded: bool) -> tuple[Any, Any, Any]:
    """``(exp(s - max), row sums, lse)``: softmax = the first over the second.

    ``math``'s steps may take ``s``'s memory for the exps. ``guarded``: rows whose
    scores are all ``-inf`` give exps 0, a row sum replaced by 1
    (so weights and outputs are 0) and lse ``-inf``, with zero (finite) gradients: every
    division and log sees a safe operand selected by ``where``. Unguarded is the plain
    formula, for calls where no row can be empty (:func:`rows_may_be_empty`).
    """
    m = xp.max(s, axis=-1, keepdims=True)
    if not guarded:
        e = math.exp_shifted(s, m)
        denom = xp.sum(e, axis=-1, keepdims=True)
        return e, denom, (xp.log(denom) + m)[..., 0]
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    e = math.exp_shifted(s, m_safe)
    denom_safe, lse = row_denominators(xp, xp.sum(e, axis=-1, keepdims=True), m_safe)
    return e, denom_safe, lse[..., 0]


def row_denominators(xp: Any, total: Any, shift: Any) -> tuple[Any, Any]:
    """``(denominator, lse)`` of rows from their sums ``total`` of ``exp(s - shift)``
    (``shift`` an array, a number, or None for 0), as every kernel finishes them: a row
    with no key (sum 0) gets denominator 1, so its weights and output are 0, and lse
    ``-inf``; NaN rows keep NaN (lse too). Each ``log`` and division sees a safe operand
    selected by ``where``, so gradients through it are finite."""
    has_key = total != 0
    total_safe = xp.where(has_key, total, 1.0)
    lse = xp.log(total_safe)
    if shift is not None:
        lse = lse + shift
    return total_safe, xp.where(has_key, lse, -xp.inf)


def merge_lse(xp: Any, lse_a: Any, lse_b: Any) -> tuple[Any, Any, Any]:
    """The guarded log-sum-exp merge of two partial results over disjoint key sets (the
    ring's shards, the keys and a sink): ``(lse, w_a, w_b)`` with ``lse = log(exp(lse_a) +
    exp(lse_b))`` and ``w_x = exp(lse_x - lse)``, the factor of each part's output in the
    union's (``out = w_a * out_a + w_b * out_b``). Computed around the larger lse and
    finished by :func:`row_denominators`: a row with no key in either (both ``-inf``) gets
    ``lse = -inf`` and factors 0, NaN rows keep NaN, and no exponent sees ``-inf - -inf``
    (each subtracts a finite shift, so an empty part's exponent is 0), so no gradient
    through it is NaN. In the operands' dtype."""
    m = xp.maximum(lse_a, lse_b)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    e_a, e_b = xp.exp(lse_a - m_safe), xp.exp(lse_b - m_safe)
    total_safe, lse = row_denominators(xp, e_a + e_b, m_safe)
    return lse, e_a / total_safe, e_b / total_safe


# -- sinks: one more logit in the softmax's denominator, merged like a partial result ---


def add_sinks(call: Call, sinks: Any, out: Any, weights: Any, lse: Any) -> tuple[Any, Any, Any]:
    """``(out, weights, lse)`` with one more logit per query head in the softmax's
    denominator: the merge of the keys' result with a sink of value 0 (so
    ``lse = logaddexp(lse, sink)`` and ``out``, ``weights`` scaled by ``exp(lse_keys -
    lse)``). Rows with no key: out 0, weights 0, lse = sink; a sink of ``-inf`` changes
    nothing. Every exponent and log sees a safe operand selected by ``where``, so no
    gradient through it is NaN."""
    xp, ct = call.xp, call.compute_dtype
    sink = sink_rows(call, sinks)
    lse_new, factor, _ = merge_lse(xp, lse, sink)  # the sink's output is 0
    factor = factor[..., None]
    out = xp.astype(xp.astype(out, ct, copy=False) * factor, call.dtype, copy=False)
    if weights is not None:
        weights = xp.astype(xp.astype(weights, ct, copy=False) * factor, call.dtype, copy=False)
    return out, weights, lse_new


def sink_rows(call: Call, sinks: Any) -> Any:
    """``sinks`` in the compute dtype, shaped to broadcast against lse ``[..., Hq, Lq]``."""
    xp = call.xp
    heads = call.q_shape[:-2]
    shape = (1,) * (len(heads) - sinks.ndim) + tuple(sinks.shape)
    if not heads:  # 2-D q: one implicit head, sinks () or (1,)
        shape = ()
    x = xp.reshape(xp.astype(sinks, call.compute_dtype, copy=False), (*shape, 1))
    return x


def sinks_grad(call: Call, sinks: Any, lse: Any, delta: Any) -> Any:
    """d loss / d sinks from the rows' ``lse`` (with the sink) and ``delta`` (``rowsum(dout
    * out) - dlse``): each row contributes ``-exp(sink - lse) * delta``, summed over the
    rows and the axes ``sinks`` broadcasts along; in ``sinks``' shape and dtype."""
    xp = call.xp
    sink = sink_rows(call, sinks)
    lse_safe = xp.where(lse == -xp.inf, xp.inf, lse)  # empty rows with a -inf sink: p = 0
    g = -xp.exp(sink - lse_safe) * delta
    g = xp.sum(g, axis=-1)  # over the query rows
    target = tuple(sinks.shape)
    lead = g.ndim - len(target)
    if lead > 0:
        g = xp.sum(g, axis=tuple(range(lead)))
    elif lead < 0:
        g = xp.reshape(g, (1,) * -lead + tuple(g.shape))
    axes = tuple(i for i, (a, b) in enumerate(zip(g.shape, target, strict=True)) if b == 1 != a)
    if axes:
        g = xp.sum(g, axis=axes, keepdims=True)
    g = xp.reshape(xp.asarray(g), target)  # NumPy's full sum is a scalar: an array again
    return xp.astype(g, sinks.dtype, copy=False)


def sinks_grad_from(call: Call, sinks: Any, dout: Any, out: Any, lse: Any, dlse: Any) -> Any:
    """:func:`sinks_grad` from the backward's arrays: ``delta = rowsum(dout * out) -
    dlse`` (rows with no key: ``out = 0``, so ``dsinks = dlse`` there)."""
    xp, ct = call.xp, call.compute_dtype
    delta = xp.sum(xp.astype(dout, ct, copy=False) * xp.astype(out, ct, copy=False), axis=-1)
    if dlse is not None:
        delta = delta - xp.astype(dlse, ct, copy=False)
    return sinks_grad(call, sinks, lse, delta)


def auto_chunk(call: Call, budget: int = CHUNK_BUDGET) -> int:
    """Block length for the blockwise path: blocks of ``budget`` scores in all."""
    heads_and_batch = math.prod(call.q_shape[:-2])
    side = math.isqrt(max(budget // max(heads_and_batch, 1), 1))
    return max(64, min(1024, 1 << max(side.bit_length() - 1, 0)))
