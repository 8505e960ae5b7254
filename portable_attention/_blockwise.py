"""The blockwise path: FlashAttention-2's forward and backward over query and key blocks.

Array-API only, as :mod:`portable_attention._core` (no framework code, no boolean
indexing, Python branching on static shapes only). Each block's elementwise steps go through
a :class:`~portable_attention._block_math.BlockMath` that the adapter gives: functional by
default, in place where the framework can (torch outside autograd). Both passes walk the same
static grid of ``size x size`` blocks (:func:`block_size`) and skip the blocks that
``causal``/``window`` mask entirely (:func:`pairs`):

- :func:`forward`: the online softmax (running max and sum) of every query block over its
  key blocks; returns ``(out, lse)``. Peak memory ``O(Lq * Dv + size**2)`` per head.
- :func:`backward`: gradients from ``q, k, v, out, lse, dout`` alone, the probabilities of
  each block recomputed as ``exp(s - lse)``: ``delta = rowsum(dout * out)``,
  ``dv += p^T dout``, ``dp = dout v^T``, ``ds = p * (dp - delta)``, softcap's derivative,
  ``dq += scale * ds k``, ``dk += scale * ds^T q`` (and ``dbias``, ``ds`` summed to the
  bias's shape). Peak memory ``O((Lq + Lk) * D + size**2)`` per head (plus ``dbias``,
  the size of the bias). Grouped-query heads are summed over their group without copying
  K/V; rows with no key get zero, finite gradients.

Dropout draws one keep mask per block from a :data:`BlockKeep`, a deterministic function
of the user's ``rng`` and the block's number (``qi * n_key_blocks + ki``) that each
framework's adapter makes (``Adapter.block_keep``): the backward draws the same masks as
the forward, block by block, and never stores them.

The decomposition is exact for key shards: with the *global* ``out`` and ``lse`` of the
query rows, the gradients of each shard of K/V (and the shard's contribution to ``dq``)
are those of the whole call restricted to it, so sequence parallelism can call
:func:`backward` per shard and sum the ``dq``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from portable_attention import _core, _mods
from portable_attention._block_math import BlockMath
from portable_attention._checks import is_kind, shape_of
from portable_attention._core import Scores, allowed, block_of, operands
from portable_attention._mods import Mods
from portable_attention._spec import Call, check_arrays

#: ``keep(block, shape) -> bool array``: block ``block``'s dropout keep mask for a block of
#: scores of ``shape``, the same array for the same block every time it is asked (the
#: forward and the backward draw it alike). ``block`` is a Python int, or a traced integer
#: scalar inside a compiled loop (JAX's ``lax.scan``).
BlockKeep = Callable[[Any, tuple[int, ...]], Any]

#: ``concrete(x) -> bool or None``: a 0-d boolean array as a Python bool where the
#: framework runs eagerly (None while a compiler traces): blocks that segment ids or a
#: ``mask_mod`` mask entirely are then skipped (``Adapter.concrete``).
Concrete = Callable[[Any], "bool | None"]


class Grads(NamedTuple):
    """Gradients of a loss with respect to the inputs of ``attend``.

    Attributes
    ----------
    dq, dk, dv : array
        Shaped and typed as ``q``, ``k`` and ``v``.
    dbias : array or None
        Shaped and typed as ``bias`` (the gradient summed over the axes the bias
        broadcasts along); None where no bias was given.
    dsinks : array or None
        Shaped and typed as ``sinks``; None where no sinks were given.
    """

    dq: Any
    dk: Any
    dv: Any
    dbias: Any
    dsinks: Any = None


def block_size(call: Call) -> int:
    """The block length of both passes: a block plan's, ``chunk_size``, else
    :func:`_core.auto_chunk`."""
    if call.blocks is not None:
        size: int = call.blocks.block_size
        return size
    return call.chunk_size or _core.auto_chunk(call)


def grid(call: Call, size: int) -> tuple[int, int]:
    """Numbers of query and key blocks of ``size`` (the last ones may be shorter)."""
    return -(-call.q_shape[-2] // size), -(-call.k_shape[-2] // size)


def span(length: int, size: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of block ``index`` of ``size`` on an axis of ``length``."""
    return index * size, min((index + 1) * size, length)


def pairs(call: Call, size: int) -> list[tuple[int, int]]:
    """The ``(query block, key block)`` pairs that ``causal``/``window`` (and a block
    plan) leave, query block by query block (a static list: it depends on shapes and
    options only)."""
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    nq, nk = grid(call, size)
    kept = None if call.blocks is None else set(call.blocks.kept)
    return [
        (qi, ki)
        for qi in range(nq)
        for ki in range(nk)
        if not _core._block_is_empty(call, span(lq, size, qi), span(lk, size, ki))
        and (kept is None or (qi, ki) in kept)
    ]


def block_allow(
    call: Call,
    ops: Any,
    mods: Mods | None,
    rows: tuple[int, int],
    cols: tuple[int, int],
    pair: tuple[int, int],
    bands: dict[tuple[int, int, int], Any] | None = None,
) -> Any:
    """The block's mask (True = may attend): the user's ``mask``, ``causal``/``window``,
    segment ids and ``mask_mod`` together; None where nothing masks. A block plan's full
    blocks skip the ``mask_mod``. ``bands``: a pass's blocks of ``causal``/``window``
    alone, by their offset and shape (the band of a block depends on nothing else)."""
    if ops.mask is None and bands is not None:
        key = (rows[0] - cols[0], rows[1] - rows[0], cols[1] - cols[0])
        if key not in bands:
            bands[key] = allowed(call, None, rows=rows, cols=cols)
        allow = bands[key]
    else:
        allow = allowed(call, block_of(ops.mask, rows, cols), rows=rows, cols=cols)
    if mods is None or (mods.q_ids is None and mods.mask_mod is None):
        return allow
    if mods.mask_mod is not None and call.blocks is not None and pair in call.blocks.full:
        mods = Mods(mods.q_ids, mods.kv_ids, mods.q_pos, mods.kv_pos, None, None)
    layout = (*ops.q.shape[:-2], rows[1] - rows[0], cols[1] - cols[0])
    spans = ((rows[0], rows[1] - rows[0]), (cols[0], cols[1] - cols[0]))
    extra = _mods.block_mask(call, mods, *spans, layout)
    if extra is None:
        return allow
    return extra if allow is None else allow & extra


def masked_out(call: Call, allow: Any, concrete: Concrete | None, mods: Mods | None) -> bool:
    """Whether a block's mask from segment ids or a ``mask_mod`` keeps nothing, where
    that can be read (eagerly: one host read per block; none without ids or a mask_mod)."""
    if concrete is None or allow is None or mods is None:
        return False
    if mods.q_ids is None and mods.mask_mod is None:
        return False
    return concrete(call.xp.any(allow)) is False


def _by_first(todo: list[tuple[int, int]]) -> dict[int, list[int]]:
    """``{a: [b, ...]}`` of the pairs ``(a, b)``, in their order: each block's partners
    in one pass (scanning the list per block was ``O(blocks * pairs)`` Python steps)."""
    grouped: dict[int, list[int]] = {}
    for a, b in todo:
        grouped.setdefault(a, []).append(b)
    return grouped


def block_number(qi: Any, ki: Any, n_key_blocks: int) -> Any:
    """The number of block ``(qi, ki)`` that dropout's keep masks are drawn for."""
    return qi * n_key_blocks + ki


def forward(
    call: Call,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    bias: Any = None,
    keep: BlockKeep | None = None,
    *,
    scores: Scores | None = None,
    mods: Mods | None = None,
    concrete: Concrete | None = None,
    query_blocks: tuple[int, int] | None = None,
    math: BlockMath | None = None,
) -> tuple[Any, Any]:
    """Online-softmax attention over the blocks of :func:`pairs`; returns ``(out, lse)``.

    ``out [..., Hq, Lq, Dv]`` in the input dtype, ``lse [..., Hq, Lq]`` in the compute
    dtype, as :func:`_core.dense`. ``keep``: dropout's keep masks, one per block.
    ``mods``: segment ids and score/mask mods; with ``concrete`` (eager frameworks),
    blocks that they mask entirely are skipped. ``query_blocks=(start, stop)``: only the
    rows of those query blocks (their ``out`` and ``lse``). ``math``: the blocks'
    elementwise steps (:func:`block_math`).
    """
    if call.k_shape[-2] == 0 or call.q_shape[-2] == 0:
        out, _, lse = _core._empty_keys(call, q, k, v)
        return out, lse
    xp, ct, dev = call.xp, call.compute_dtype, call.device
    math = block_math(call, math)
    ops = operands(call, q, k, v, mask, bias, q_factor=q_factor(call))
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    size = block_size(call)
    nk = grid(call, size)[1]
    keys_of = _by_first(pairs(call, size))  # query block -> its key blocks, in order
    bounded = bounded_scores(call)
    bands: dict[tuple[int, int, int], Any] = {}
    # (Not the row sums as a column of ones in v: on torch's CPU kernels, accumulating
    # e @ [v, 1] into [8, 256, 65] took 410 us against 205 us for e @ v and 19 for a sum.)
    out_blocks, lse_blocks = [], []
    first, stop = query_blocks if query_blocks is not None else (0, grid(call, size)[0])
    for qi in range(first, stop):
        rows = span(lq, size, qi)
        lead = (*ops.q.shape[:-2], rows[1] - rows[0])
        m = xp.full((*lead, 1), -xp.inf, dtype=ct, device=dev)
        total = xp.zeros((*lead, 1), dtype=ct, device=dev)
        acc = xp.zeros((*lead, call.v_shape[-1]), dtype=ct, device=dev)
        for ki in keys_of.get(qi, ()):
            cols = span(lk, size, ki)
            allow = block_allow(call, ops, mods, rows, cols, (qi, ki), bands)
            if masked_out(call, allow, concrete, mods):
                continue
            qb = ops.q[..., rows[0] : rows[1], :]
            kb = ops.k[..., cols[0] : cols[1], :]
            s, _ = block_scores(
                call, ops, qb, kb, rows, cols, scores, allow=allow, mods=mods, math=math,
                zero_after=bounded,
            )  # fmt: skip
            if bounded:  # exp(s) <= e**softcap: no running max, no rescaling
                e = math.exp(s)
                if allow is not None:
                    e = math.zeroed(e, allow)
                total = math.add(total, xp.sum(e, axis=-1, keepdims=True))
            else:
                m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))
                m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)
                e = math.exp_shifted(s, m_safe)
                rescale = xp.exp(m - m_safe)  # 0 while the row has seen no key (m = -inf)
                total = math.add(math.mul(total, rescale), xp.sum(e, axis=-1, keepdims=True))
                acc = math.mul(acc, rescale)
                m = m_new
            if keep is not None:
                kept = keep(block_number(qi, ki, nk), tuple(e.shape))
                e = _core.apply_keep(xp, e, kept, call.dropout)
            acc = math.matmul_add(acc, e, ops.v[..., cols[0] : cols[1], :])
        shift = None if bounded else xp.where(xp.isfinite(m), m, 0.0)
        total_safe, block_lse = _core.finish_rows(xp, total, shift)
        out_blocks.append(acc / total_safe)
        lse_blocks.append(block_lse[..., 0])
    out = out_blocks[0] if len(out_blocks) == 1 else xp.concat(out_blocks, axis=-2)
    lse = lse_blocks[0] if len(lse_blocks) == 1 else xp.concat(lse_blocks, axis=-1)
    if query_blocks is not None:
        return _core._finish(call, out, lse, out.shape[-2])
    return _core._finish(call, out, lse)


def bounded_scores(call: Call) -> bool:
    """Whether the forward may take ``exp(s)`` without subtracting a running max: with
    ``softcap`` and no bias every score is within ``[-softcap, softcap]``, so no ``exp``
    overflows, no row sum of ``Lk`` of them does, and none underflows below the compute
    dtype's smallest normal number (the same relative precision as with the max
    subtracted: softmax does not depend on the shift). Two passes over each block fewer
    (the max and the subtraction) and no rescaling."""
    if call.softcap is None or call.bias_shape is not None or call.score_mod:
        return False
    info = call.xp.finfo(call.compute_dtype)
    high, low = math.log(float(info.max)), math.log(float(info.smallest_normal))
    return call.softcap + math.log(max(call.k_shape[-2], 1)) < high - 1 and call.softcap < -low - 1


def q_factor(call: Call) -> float:
    """What q is multiplied by before its blocks' scores: the scale, over ``softcap``
    where one is given (``tanh`` then takes the product as it is: one pass less)."""
    return call.scale / call.softcap if call.softcap is not None else call.scale


def block_math(call: Call, math: BlockMath | None) -> BlockMath:
    """The steps a pass takes: the adapter's ``math``, but the functional ones for a call
    with a ``score_mod`` (whose result may be any array of the block's shape, which an
    in-place step must not overwrite) or where none is given."""
    if math is None or call.score_mod:
        return BlockMath(call.xp)
    return math


def block_scores(
    call: Call,
    ops: Any,
    qb: Any,
    kb: Any,
    rows: tuple[int, int],
    cols: tuple[int, int],
    scores: Scores | None,
    *,
    allow: Any,
    mods: Mods | None = None,
    math: BlockMath,
    need_t: bool = False,
    zero_after: bool = False,
) -> tuple[Any, Any]:
    """``(s, t)`` of one block: the scores after softcap, bias, ``score_mod`` and the
    block's mask ``allow`` (:func:`block_allow`; ``-inf`` where masked), and, where
    ``need_t``, ``t = tanh(q k^T * scale / softcap)`` (None without softcap), from operands
    whose q carries :func:`q_factor`.

    ``zero_after``: leave the mask out; the caller zeroes the masked probabilities after
    ``exp`` instead (where the scores are bounded, :func:`bounded_scores`): ``exp(-inf)``
    takes about 5x the time of ``exp`` of a finite number on torch's CPU kernels."""
    xp = call.xp
    if scores is not None:
        s = scores(qb, kb)
    else:
        s = math.product(qb, xp.matrix_transpose(kb), slot="scores")
    t = None
    if call.softcap is not None:
        if need_t:
            t = math.tanh(s)
            s = math.scaled_copy(t, call.softcap)
        else:
            s = math.scaled(math.tanh(s), call.softcap)
    if ops.bias is not None:
        s = math.add(s, block_of(ops.bias, rows, cols))
    if mods is not None and mods.score_mod is not None:
        spans = ((rows[0], rows[1] - rows[0]), (cols[0], cols[1] - cols[0]))
        s = _mods.apply_score_mod(call, mods, s, *spans)
    if allow is not None and not zero_after:
        s = math.masked(s, allow)
    return s, t


def grouped(call: Call, x: Any, *, last: int | None) -> Any:
    """An array of the output's rows, ``[..., Hq, Lq(, last)]``, in the compute dtype with
    its heads split as ``operands`` splits q's (``[..., Hk, G, Lq(, last)]``)."""
    xp = call.xp
    shape = (*call.q_shape[:-1], *(() if last is None else (last,)))
    if len(call.q_shape) == 2:
        shape = (1, *shape)
    if call.grouped:
        hq, hk = call.q_shape[-3], call.k_shape[-3]
        tail = shape[len(call.q_shape) - 2 :]
        shape = (*shape[: len(call.q_shape) - 3], hk, hq // hk, *tail)
    x = xp.reshape(x, shape)
    return x if x.dtype == call.compute_dtype else xp.astype(x, call.compute_dtype)


def _sum_group(call: Call, x: Any) -> Any:
    """``[..., Hk, G, L, D] -> [..., Hk, 1, L, D]``: the query heads of a K/V head summed."""
    return call.xp.sum(x, axis=-3, keepdims=True) if call.grouped else x


def _add_product(call: Call, math: BlockMath, acc: Any, a: Any, b: Any) -> Any:
    """``acc + a @ b`` with grouped-query heads summed over their group (``a @ b``
    where ``acc`` is None)."""
    if not call.grouped:
        return math.matmul_add(acc, a, b)
    product = _sum_group(call, call.xp.matmul(a, b))
    return product if acc is None else math.add(acc, product)


def _reduce_to(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` summed over the axes where ``shape`` has 1 and ``x`` does not (keepdims)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 != a)
    return xp.sum(x, axis=axes, keepdims=True) if axes else x


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
    keep: BlockKeep | None = None,
    *,
    dlse: Any = None,
    want_dbias: bool = True,
    scores: Scores | None = None,
    mods: Mods | None = None,
    concrete: Concrete | None = None,
    sinks: Any = None,
    math: BlockMath | None = None,
) -> Grads:
    """FlashAttention-2's backward over the blocks of :func:`pairs` (see the module).

    ``out`` and ``lse`` are the forward's (or, for a shard of K/V, those of the whole
    call); ``dlse`` the loss's gradient with respect to ``lse`` where it uses it. ``keep``
    must draw the forward's masks. ``want_dbias=False`` skips ``dbias`` (None then).
    ``mods``: segment ids and a ``mask_mod`` (a ``score_mod`` needs autodiff: torch and
    JAX differentiate it on their own paths). ``sinks``: with the ``lse`` that includes
    them, every block's ``exp(s - lse)`` is already the probability with the sink in the
    denominator; ``dsinks`` comes from the rows' ``delta`` (:func:`_core.sinks_grad`).
    ``math``: the blocks' elementwise steps (:func:`block_math`). Returns :class:`Grads`
    in the inputs' dtypes and shapes.
    """
    assert not call.score_mod, "the array-API backward cannot differentiate a score_mod"
    xp = call.xp
    math = block_math(call, math)
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    dbias_wanted = bias is not None and want_dbias
    if lq == 0 or lk == 0:
        dsinks = None
        if sinks is not None:
            dsinks = _core.sinks_grad_from(call, sinks, dout, out, lse, dlse)
        return Grads(
            xp.zeros_like(q),
            xp.zeros_like(k),
            xp.zeros_like(v),
            xp.zeros_like(bias) if dbias_wanted else None,
            dsinks,
        )
    ops = operands(call, q, k, v, mask, bias, q_factor=q_factor(call))
    do = grouped(call, dout, last=call.v_shape[-1])
    delta = xp.sum(do * grouped(call, out, last=call.v_shape[-1]), axis=-1)
    if dlse is not None:  # d lse / d s = p: ds = p * (dp - (delta - dlse))
        delta = delta - grouped(call, dlse, last=None)
    dsinks = None
    if sinks is not None:
        dsinks = _core.sinks_grad_from(call, sinks, dout, out, lse, dlse)
    # Rows with no key (lse = -inf): +inf makes every p = exp(s - inf) = 0 (NaN stays NaN).
    lse_g = grouped(call, lse, last=None)
    lse_g = xp.where(lse_g == -xp.inf, xp.inf, lse_g)
    size = block_size(call)
    nq, nk = grid(call, size)
    queries_of = _by_first([(ki, qi) for qi, ki in pairs(call, size)])  # key block -> queries
    bias_shape = tuple(ops.bias.shape) if dbias_wanted else ()
    # One column more in a matmul instead of a pass over each block: [dout, delta] @
    # [v, -1]^T = dp - delta (not with dropout, whose mask applies to dp alone), and
    # without softcap [q, -lse] @ [k, 1]^T = s - lse (softcap's tanh comes in between).
    fold_delta = keep is None
    fold_lse = call.softcap is None
    # With softcap bounding the scores (no bias), p = exp(s) * exp(-lse): the row factor
    # goes into dout and delta (rows with no key: exp(-inf) = 0), a pass less per block.
    bounded = bounded_scores(call)
    if bounded:
        factor = xp.exp(-lse_g)
        do = do * factor[..., None]
        delta = delta * factor
    do_aug = xp.concat([do, delta[..., None]], axis=-1) if fold_delta else do
    q_aug = xp.concat([ops.q, -lse_g[..., None]], axis=-1) if fold_lse else ops.q
    dq_blocks: dict[int, Any] = {}
    dk_blocks: list[Any] = []
    dv_blocks: list[Any] = []
    db_blocks: dict[tuple[int, int], Any] = {}
    bands: dict[tuple[int, int, int], Any] = {}
    for ki in range(nk):
        cols = span(lk, size, ki)
        kb = ops.k[..., cols[0] : cols[1], :]
        vb = ops.v[..., cols[0] : cols[1], :]
        column = (*kb.shape[:-1], 1)
        if fold_lse:
            kb_aug = xp.concat([kb, xp.ones(column, dtype=kb.dtype, device=call.device)], axis=-1)
        if fold_delta:
            vb_aug = xp.concat([vb, -xp.ones(column, dtype=vb.dtype, device=call.device)], axis=-1)
        dk_b = dv_b = None
        for qi in queries_of.get(ki, ()):
            rows = span(lq, size, qi)
            allow = block_allow(call, ops, mods, rows, cols, (qi, ki), bands)
            if masked_out(call, allow, concrete, mods):
                continue
            qb = ops.q[..., rows[0] : rows[1], :]
            dob = do[..., rows[0] : rows[1], :]
            if fold_lse:
                qb_aug = q_aug[..., rows[0] : rows[1], :]
                s_lse, t = block_scores(
                    call, ops, qb_aug, kb_aug, rows, cols, scores, allow=allow, math=math
                )
                p = math.exp(s_lse)
            else:
                s, t = block_scores(
                    call, ops, qb, kb, rows, cols, scores, allow=allow, math=math, need_t=True,
                    zero_after=bounded,
                )  # fmt: skip
                if bounded:
                    p = math.exp(s)
                    if allow is not None:
                        p = math.zeroed(p, allow)
                else:
                    p = math.exp_shifted(s, lse_g[..., rows[0] : rows[1], None])
            p_used = p
            if keep is None:  # fold_delta (no buffer where dbias may keep ds, made from it)
                dp_delta = math.product(
                    do_aug[..., rows[0] : rows[1], :],
                    xp.matrix_transpose(vb_aug),
                    slot=None if dbias_wanted else "dp",
                )
            else:
                dp = xp.matmul(dob, xp.matrix_transpose(vb))
                kept = keep(block_number(qi, ki, nk), tuple(p.shape))
                p_used = _core.apply_keep(xp, p, kept, call.dropout)
                dp_delta = (
                    _core.apply_keep(xp, dp, kept, call.dropout)
                    - delta[..., rows[0] : rows[1], None]
                )
            dv_b = _add_product(call, math, dv_b, xp.matrix_transpose(p_used), dob)
            ds = math.mul(dp_delta, p)
            if dbias_wanted:
                key = (qi if bias_shape[-2] != 1 else 0, ki if bias_shape[-1] != 1 else 0)
                target = (
                    *bias_shape[:-2],
                    rows[1] - rows[0] if bias_shape[-2] != 1 else 1,
                    cols[1] - cols[0] if bias_shape[-1] != 1 else 1,
                )
                db = _reduce_to(xp, ds, target)
                db_blocks[key] = db if key not in db_blocks else db_blocks[key] + db
            if t is not None:  # (functionally where dbias may hold ds itself)
                ds = (BlockMath(xp) if dbias_wanted else math).softcap_grad(ds, t)
            dq_blocks[qi] = math.matmul_add(dq_blocks.get(qi), ds, kb)
            dk_b = _add_product(call, math, dk_b, xp.matrix_transpose(ds), qb)
        width = cols[1] - cols[0]
        dk_blocks.append(dk_b if dk_b is not None else _zeros(call, ops.k, width))
        dv_blocks.append(dv_b if dv_b is not None else _zeros(call, ops.v, width))
    dq_list = [
        dq_blocks[qi] if qi in dq_blocks else _zeros(call, ops.q, span(lq, size, qi)[1] - qi * size)
        for qi in range(nq)
    ]
    # ds was taken with respect to s; with q times q_factor, the scores' factor comes back
    # as the scale (dq) and as softcap (dk: its q blocks carry scale / softcap).
    dq = _concat(xp, dq_list, axis=-2) * call.scale
    dk = _concat(xp, dk_blocks, axis=-2)
    if call.softcap is not None:
        dk = dk * call.softcap
    dv = _concat(xp, dv_blocks, axis=-2)
    dbias = None
    if dbias_wanted:
        dbias = _assemble_dbias(call, db_blocks, bias_shape, size)
        dbias = xp.astype(xp.reshape(dbias, shape_of(bias)), bias.dtype, copy=False)
    return Grads(
        _as_input(call, dq, q), _as_input(call, dk, k), _as_input(call, dv, v), dbias, dsinks
    )


def _zeros(call: Call, like: Any, length: int) -> Any:
    """Zeros of ``like``'s shape with ``length`` rows (a block no pair touched)."""
    shape = (*like.shape[:-2], length, like.shape[-1])
    return call.xp.zeros(shape, dtype=call.compute_dtype, device=call.device)


def _concat(xp: Any, blocks: list[Any], *, axis: int) -> Any:
    return blocks[0] if len(blocks) == 1 else xp.concat(blocks, axis=axis)


def _as_input(call: Call, grad: Any, x: Any) -> Any:
    """A gradient in the shape and dtype of the input ``x`` (heads merged again)."""
    xp = call.xp
    return xp.astype(xp.reshape(grad, shape_of(x)), x.dtype, copy=False)


def _assemble_dbias(
    call: Call, blocks: dict[tuple[int, int], Any], shape: tuple[int, ...], size: int
) -> Any:
    """The bias's gradient from its blocks (zeros where no pair touched one)."""
    xp = call.xp
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    nq = grid(call, size)[0] if shape[-2] != 1 else 1
    nk = grid(call, size)[1] if shape[-1] != 1 else 1
    rows_of = [span(lq, size, i) if shape[-2] != 1 else (0, 1) for i in range(nq)]
    cols_of = [span(lk, size, j) if shape[-1] != 1 else (0, 1) for j in range(nk)]
    row_blocks = []
    for i, (r0, r1) in enumerate(rows_of):
        parts = []
        for j, (c0, c1) in enumerate(cols_of):
            block = blocks.get((i, j))
            if block is None:
                block = xp.zeros(
                    (*shape[:-2], r1 - r0, c1 - c0), dtype=call.compute_dtype, device=call.device
                )
            parts.append(block)
        row_blocks.append(_concat(xp, parts, axis=-1))
    return _concat(xp, row_blocks, axis=-2)


def check_backward_arrays(call: Call, q: Any, *, dout: Any, out: Any, lse: Any, dlse: Any) -> None:
    """Check ``attend_backward``'s ``dout``, ``out``, ``lse`` (and ``dlse``) against the
    call: arrays of q's framework and device, the output's and lse's shapes, real
    floating dtypes of the inputs' dtype or the compute dtype."""
    check_arrays(q=q, dout=dout, out=out, lse=lse, dlse=dlse)
    out_shape = (*call.q_shape[:-1], call.v_shape[-1])
    lse_shape = call.q_shape[:-1]
    dtypes = (call.dtype, call.compute_dtype)
    for name, x, shape, what in (
        ("dout", dout, out_shape, "the output's shape [..., Hq, Lq, Dv]"),
        ("out", out, out_shape, "the output's shape [..., Hq, Lq, Dv]"),
        ("lse", lse, lse_shape, "lse's shape [..., Hq, Lq]"),
        ("dlse", dlse, lse_shape, "lse's shape [..., Hq, Lq]"),
    ):
        if x is None:
            continue
        if shape_of(x) != shape:
            msg = (
                f"`{name}` must have {what} = {shape} for q {call.q_shape}, k {call.k_shape}, "
                f"v {call.v_shape}, got {shape_of(x)}; pass the `out` and `lse` that "
                "`attend(..., return_lse=True)` returned and the gradient of the loss with "
                "respect to `out`."
            )
            raise ValueError(msg)
        if not is_kind(call.xp, x.dtype, "real floating") or x.dtype not in dtypes:
            allowed_text = " or ".join(dict.fromkeys(str(d) for d in dtypes))
            msg = (
                f"`{name}` must have the inputs' dtype or the compute dtype ({allowed_text}), "
                f"got {x.dtype}; cast it with `xp.astype({name}, ...)` first."
            )
            raise TypeError(msg)
