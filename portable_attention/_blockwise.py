"""The blockwise path: FlashAttention-2's forward and backward over query and key blocks.

Array-API only, as :mod:`portable_attention._core` (no framework code, no boolean
indexing, Python branching on static shapes only). Each block's elementwise steps go through
a :class:`~portable_attention._block_math.BlockMath` that the adapter gives: functional by
default, in place where the framework can (torch outside autograd). Both passes walk the same
static grid of ``size x size`` blocks and skip the blocks that ``causal``/``window`` mask
entirely (:mod:`portable_attention._block_grid`); where a loop asks for it
(``BlockLoop.key_span``: NumPy's), the forward takes a run of consecutive key blocks that
need no mask in one step (:func:`~portable_attention._block_grid.merged`):

- :func:`forward`: the online softmax (running max and sum) of every query block over its
  key blocks; returns ``(out, lse)``. Peak memory ``O(Lq * Dv + size**2)`` per head
  (a step over a run of key blocks: up to the loop's ``key_span`` keys instead of
  ``size``; NumPy's, 4M scores over batch and heads, on each of its threads).
- :func:`backward`: gradients from ``q, k, v, out, lse, dout`` alone, the probabilities of
  each block recomputed as ``exp(s - lse)``: ``delta = rowsum(dout * out)``,
  ``dv += p^T dout``, ``dp = dout v^T``, ``ds = p * (dp - delta)``, softcap's derivative,
  ``dq += scale * ds k``, ``dk += scale * ds^T q`` (and ``dbias``, ``ds`` summed to the
  bias's shape). Peak memory ``O((Lq + Lk) * D + size**2)`` per head (plus ``dbias``,
  the size of the bias). Grouped-query heads are summed over their group without copying
  K/V; rows with no key get zero, finite gradients.

The loops themselves, the slices of blocks and the sums into arrays of blocks go through a
:class:`~portable_attention._block_loop.BlockLoop` that the adapter gives
(``Adapter.block_loop``): Python loops over static offsets by default, JAX's compiled ones
(``lax.scan``, ``lax.fori_loop``, traced offsets, padded blocks) on JAX. Every framework
runs this one kernel.

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

import functools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from portable_attention import _core
from portable_attention._block_grid import (
    HostBool,
    Span,
    block_number,
    masked_out,
    merged,
    pairs,
    partners,
    prepared,
    trimmed,
)
from portable_attention._block_loop import BlockLoop
from portable_attention._block_math import BlockMath
from portable_attention._checks import is_kind, shape_of
from portable_attention._core import Scores
from portable_attention._mods import Mods
from portable_attention._spec import Call, check_arrays
from portable_attention.backends import adapter

_INF = float("inf")  # (a pass's ``math`` argument shadows the math module)
_LOG2E, _LN2 = 1.0 / math.log(2.0), math.log(2.0)

#: ``keep(block, shape) -> bool array``: block ``block``'s dropout keep mask for a block of
#: scores of ``shape``, the same array for the same block and shape every time it is asked
#: (the forward and the backward draw it alike; a padded loop's last blocks have another
#: shape than a static loop's, so their masks differ between loops, not between passes).
#: ``block`` is a Python int, or a traced integer scalar inside a compiled loop (JAX's).
BlockKeep = Callable[[Any, tuple[int, ...]], Any]


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


#: ``score_grad(s, rows, cols) -> (s_modded, pullback)``: a ``score_mod`` applied to one
#: block with its vector-Jacobian product, where the framework differentiates it (JAX);
#: ``pullback(ds) -> (ds before the mod, *d consts)``, ``consts`` being the arrays the mod
#: captures (:attr:`ScoreGrad.consts`), whose gradients the backward sums over blocks.
class ScoreGrad(Protocol):
    consts: tuple[Any, ...]

    def __call__(
        self, s: Any, rows: tuple[Any, int], cols: tuple[Any, int]
    ) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]: ...


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
    host_bool: HostBool | None = None,
    query_blocks: tuple[int, int] | None = None,
    math: BlockMath | None = None,
    loop: BlockLoop | None = None,
) -> tuple[Any, Any]:
    """Online-softmax attention over the blocks of ``_block_grid.pairs``; returns
    ``(out, lse)``.

    ``out [..., Hq, Lq, Dv]`` in the input dtype, ``lse [..., Hq, Lq]`` in the compute
    dtype, as :func:`_core.dense`. ``keep``: dropout's keep masks, one per block.
    ``mods``: segment ids and score/mask mods; with ``host_bool`` (eager frameworks),
    blocks that they mask entirely are skipped. ``query_blocks=(start, stop)``: only the
    rows of those query blocks (their ``out`` and ``lse``). ``scores``, ``host_bool``,
    ``math`` (the blocks' elementwise steps), ``loop`` (how the blocks are walked): the
    adapter's primitives where not given (:func:`_primitives`).
    """
    if call.k_shape[-2] == 0 or call.q_shape[-2] == 0:
        out, _, lse = _core.empty_keys(call, q, k, v)
        return out, lse
    xp, ct = call.xp, call.compute_dtype
    scores, host_bool, math, loop = _primitives(
        call, (q, k, v, mask, bias), scores, host_bool, math, loop
    )
    base2 = base2_scores(call, math)
    run = prepared(call, loop, q, k, v, mask, bias, mods, _LOG2E if base2 else 1.0)
    ops, mods = run.ops, run.mods
    keys_of = partners(pairs(call, run.size), run.nq, by_keys=False)
    if _merges_runs(call, keep, mods, loop):
        keys_of = merged(call, run, keys_of, loop.key_span(call, run.size) // run.size)
    bounded = bounded_scores(call)
    like = run.like()

    unshifted = not bounded and _tries_unshifted(call, keep, loop)
    # A kept buffer for the sums, unless a mask_mod (which may call attend) runs between.
    acc_slot = "acc" if mods is None or mods.mask_mod is None else None

    # (Not the row sums as a column of ones in v: on torch's CPU kernels, accumulating
    # e @ [v, 1] into [8, 256, 65] took 410 us against 205 us for e @ v and 19 for a sum.)
    def query_block(carry: Any, qi: Any) -> tuple[Any, tuple[Any, Any]]:
        rows = run.rows(qi)
        lead = (*ops.q.shape[:-2], rows[1])

        def init() -> tuple[Any, Any, Any]:  # (the sums: None on a static loop until the first)
            return (
                loop.full((*lead, 1), ct, -_INF, like),
                loop.accumulator((*lead, 1), ct, like),
                loop.accumulator((*lead, call.v_shape[-1]), ct, like),
            )

        qb = loop.take(ops.q, *rows, -2)

        def step(state: Any, ki: Any, *, shifted: bool) -> Any:
            m, total, acc = state
            cols = run.cols(ki)
            allow = run.allow(rows, cols, (qi, ki))
            if loop.static and masked_out(call, allow, host_bool, mods):
                return state
            kb = loop.take(ops.k, *cols, -2)
            s, _ = _core.block_scores(
                call, qb, kb, rows, cols, bias=run.block(ops.bias, rows, cols), mods=mods,
                allow=allow, math=math, scores=scores, zero_after=bounded,
            )  # fmt: skip
            if not shifted:  # exp(s) without a running max, no rescaling (see below)
                e = math.exp(s, base2=base2)
                if bounded and allow is not None:
                    e = math.zeroed(e, allow)
                total = _summed(math, total, math.row_sum(e))
            else:
                m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))
                m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)
                e = math.exp_shifted(s, m_safe, base2=base2)
                if total is not None:
                    # 0 while the row has seen no key (m = -inf)
                    rescale = xp.exp((m - m_safe) * (_LN2 if base2 else 1.0))
                    total, acc = math.mul(total, rescale), math.mul(acc, rescale)
                total = _summed(math, total, math.row_sum(e))
                m = m_new
            if keep is not None:
                kept = keep(block_number(qi, ki, run.nk), tuple(e.shape))
                e = _core.apply_keep(xp, e, kept, call.dropout)
            acc = math.matmul_add(acc, e, loop.take(ops.v, *cols, -2), slot=acc_slot)
            return m, total, acc

        def walk(shifted: bool) -> tuple[Any, Any, Any]:
            state = loop.inner(functools.partial(step, shifted=shifted), init(), keys_of, qi)
            m, total, acc = state
            if total is None:  # no key block was computed: every row is empty
                total, acc = xp.zeros_like(m), loop.full((*lead, call.v_shape[-1]), ct, 0.0, like)
            return m, total, acc

        shifted = not (bounded or unshifted)
        m, total, acc = walk(shifted)
        if unshifted and not host_bool(_unshifted_held(xp, total, acc)):
            shifted = True  # an exp overflowed or a row's sum lost digits: with the max
            m, total, acc = walk(shifted)
        shift = xp.where(xp.isfinite(m), m * (_LN2 if base2 else 1.0), 0.0) if shifted else None
        total_safe, block_lse = _core.row_denominators(xp, total, shift)
        return carry, (acc / total_safe, block_lse[..., 0])

    first, stop = query_blocks if query_blocks is not None else (0, run.nq)
    out, lse = loop.each(query_block, range(first, stop), (-2, -1))
    length = min(stop * run.size, call.q_shape[-2]) - first * run.size
    out, lse = trimmed(out, length, -2), trimmed(lse, length, -1)
    if query_blocks is not None:
        return _core.ungrouped(call, out, lse, length)
    return _core.ungrouped(call, out, lse)


def _summed(math: BlockMath, total: Any, x: Any) -> Any:
    """``total + x``, ``x`` where nothing was summed yet (None)."""
    return x if total is None else math.add(total, x)


def base2_scores(call: Call, math: BlockMath) -> bool:
    """Whether the forward takes its scores in units of log2 (``log2(e)`` folded into q
    with the scale, ``exp`` as ``exp2``): where the steps say ``exp2`` is faster
    (:attr:`BlockMath.base2`), in float32, and without a softcap, a bias or a score_mod,
    which take scores in natural units. Not in float64: there the factor would cost exact
    inputs their exactness (at ``scale=1e6``, keys whose scores tie exactly got weights
    1.6e-10 apart). A score beyond float32's max over ``log2(e)`` (2.4e38) overflows in
    base 2 where it would not in natural units (its row is NaN): such scores are no
    softmax's in practice."""
    if not math.base2 or call.softcap is not None or call.bias_shape is not None:
        return False
    if call.score_mod or call.compute_dtype != call.xp.float32:
        return False
    # (a scale near float32's max would become inf with the factor: every score NaN)
    return abs(_core.q_factor(call)) * _LOG2E < float(call.xp.finfo(call.compute_dtype).max)


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
    # (NumPy's longdouble: its smallest normal is 0 as a Python float; float64's is safe)
    tiny = max(float(info.smallest_normal), sys.float_info.min)
    high, low = math.log(float(info.max)), math.log(tiny)
    return call.softcap + math.log(max(call.k_shape[-2], 1)) < high - 1 and call.softcap < -low - 1


def _merges_runs(call: Call, keep: BlockKeep | None, mods: Mods | None, loop: BlockLoop) -> bool:
    """Whether the forward joins runs of key blocks (:func:`_block_grid.merged`): on a
    static loop, without dropout (whose masks are drawn per block), a block plan (its
    blocks are its own), ``chunk_size`` (the user's bound on a block's memory), a
    ``score_mod`` (its functional steps over a run's scores: ALiBi at L=4096 took 443 ms
    against 371 in blocks of 128, same run) or masks that segment ids or a ``mask_mod``
    make (a block they mask entirely is skipped)."""
    if not loop.static or keep is not None or call.blocks is not None or call.chunk_size:
        return False
    if call.score_mod:
        return False
    return mods is None or (mods.q_ids is None and mods.mask_mod is None)


def _tries_unshifted(call: Call, keep: BlockKeep | None, loop: BlockLoop) -> bool:
    """Whether the forward first takes ``exp(s)`` without the running max and checks
    after each query block that it held (:func:`_unshifted_held`; one host read per query
    block, the block computed again with the max where it did not, as for a block with a
    row that has no key, whose sum 0 fails the check): where the adapter asks for it
    (``Adapter.unshifted_exp``: NumPy and torch's CPU, where each pass over the scores
    costs), the blocks are walked eagerly, without dropout, and without a ``score_mod``
    (its scores are any array, and it runs on the functional steps: NumPy would warn of
    the first try's overflow; torch's ``torch.func`` transforms could not read the check
    on the host)."""
    if not loop.static or keep is not None or call.score_mod:
        return False
    return adapter(call.backend).unshifted_exp(call)


def _unshifted_held(xp: Any, total: Any, acc: Any) -> Any:
    """Whether ``exp(s)`` without the max gave the softmax to the dtype's resolution: every
    row sum finite (no ``exp`` overflowed, no NaN) and at least the square root of the
    smallest normal number, so the row's largest term is at least that over ``Lk`` and the
    terms that ``exp`` rounded to subnormals or zero weigh less than ``Lk * sqrt(tiny)``
    relative to it (1e-19 in float32), below the dtype's resolution as with the max
    subtracted; and the unnormalised output finite (it overflows where the sums are large
    and V is). NaN fails every comparison. The bound is on the weights: where ``|v|`` is
    tiny too (below about 1e-17 in float32 with sums near 1e-19), ``exp(s) @ v`` may fall
    among subnormals and keep fewer digits than with the max subtracted. A 0-d boolean
    array. The bound stays in the dtype's own scalar (NumPy's longdouble: its smallest
    normal is 0 as a Python float)."""
    low = xp.finfo(total.dtype).smallest_normal ** 0.5
    in_range = xp.all((total >= low) & xp.isfinite(total))
    return in_range & xp.all(xp.isfinite(acc))


def _primitives(
    call: Call,
    arrays: tuple[Any, ...],
    scores: Scores | None,
    host_bool: HostBool | None,
    math: BlockMath | None,
    loop: BlockLoop | None,
) -> tuple[Scores | None, HostBool, BlockMath, BlockLoop]:
    """The primitives a pass runs on: those given, else the adapter's (``Adapter.scores``,
    ``host_bool``, ``block_math`` of the pass's ``arrays``, ``block_loop``). The steps are
    the functional ones for a call with a ``score_mod``, whose result may be any array of
    the block's shape, which an in-place step must not overwrite."""
    backend = adapter(call.backend)
    if math is None and not call.score_mod:
        math = backend.block_math(call.xp, arrays)
    return (
        backend.scores(call.xp) if scores is None else scores,
        backend.host_bool if host_bool is None else host_bool,
        BlockMath(call.xp) if call.score_mod or math is None else math,
        backend.block_loop(call) if loop is None else loop,
    )


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
    host_bool: HostBool | None = None,
    sinks: Any = None,
    math: BlockMath | None = None,
    loop: BlockLoop | None = None,
) -> Grads:
    """FlashAttention-2's backward over the blocks of ``_block_grid.pairs`` (see the
    module).

    ``out`` and ``lse`` are the forward's (or, for a shard of K/V, those of the whole
    call); ``dlse`` the loss's gradient with respect to ``lse`` where it uses it. ``keep``
    must draw the forward's masks. ``want_dbias=False`` skips ``dbias`` (None then).
    ``mods``: segment ids and a ``mask_mod`` (a ``score_mod`` needs autodiff: torch
    differentiates it on its own path, JAX through :func:`backward_and_consts`).
    ``sinks``: with the ``lse`` that includes them, every block's ``exp(s - lse)`` is
    already the probability with the sink in the denominator; ``dsinks`` comes from the
    rows' ``delta`` (:func:`_core.sinks_grad`). The primitives as :func:`forward`'s.
    Returns :class:`Grads` in the inputs' dtypes and shapes.
    """
    assert not call.score_mod, "the array-API backward cannot differentiate a score_mod"
    return backward_and_consts(
        call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, want_dbias=want_dbias,
        scores=scores, mods=mods, host_bool=host_bool, sinks=sinks, math=math, loop=loop,
    )[0]  # fmt: skip


def backward_and_consts(
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
    host_bool: HostBool | None = None,
    sinks: Any = None,
    math: BlockMath | None = None,
    loop: BlockLoop | None = None,
    score_grad: ScoreGrad | None = None,
) -> tuple[Grads, tuple[Any, ...]]:
    """:func:`backward`, with a ``score_mod`` differentiated by ``score_grad``: returns
    ``(grads, gradients of score_grad.consts)`` (``()`` without one)."""
    xp = call.xp
    scores, host_bool, math, loop = _primitives(
        call, (dout, q, k, v, out, lse, bias, dlse, sinks), scores, host_bool, math, loop
    )
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    consts = () if score_grad is None else tuple(score_grad.consts)
    dbias_wanted = bias is not None and want_dbias
    dsinks = None
    if sinks is not None:
        dsinks = _core.sinks_grad_from(call, sinks, dout, out, lse, dlse)
    if lq == 0 or lk == 0:
        grads = Grads(
            xp.zeros_like(q),
            xp.zeros_like(k),
            xp.zeros_like(v),
            xp.zeros_like(bias) if dbias_wanted else None,
            dsinks,
        )
        return grads, tuple(xp.zeros_like(c) for c in consts)
    run = prepared(call, loop, q, k, v, mask, bias, mods)
    ops, size = run.ops, run.size
    lqp = run.nq * size
    dv_size = call.v_shape[-1]
    do = loop.pad(grouped(call, dout, last=dv_size), lqp, -2, 0.0)
    delta = xp.sum(do * loop.pad(grouped(call, out, last=dv_size), lqp, -2, 0.0), axis=-1)
    if dlse is not None:  # d lse / d s = p: ds = p * (dp - (delta - dlse))
        delta = delta - loop.pad(grouped(call, dlse, last=None), lqp, -1, 0.0)
    # Rows with no key (lse = -inf): +inf makes every p = exp(s - inf) = 0 (NaN stays NaN).
    lse_g = grouped(call, lse, last=None)
    lse_g = loop.pad(xp.where(lse_g == -xp.inf, xp.inf, lse_g), lqp, -1, _INF)
    queries_of = partners(pairs(call, size), run.nk, by_keys=True)
    bias_shape = tuple(ops.bias.shape) if dbias_wanted else ()
    # One column more in a matmul instead of a pass over each block: [dout, delta] @
    # [v, -1]^T = dp - delta (not with dropout, whose mask applies to dp alone), and
    # without softcap [q, -lse] @ [k, 1]^T = s - lse (softcap's tanh, or a score_mod,
    # comes in between); where the loop's compiler fuses those passes itself, the
    # augmented copies of q and dout only cost memory (BlockLoop.fold_columns).
    fold_delta = keep is None and loop.fold_columns
    fold_lse = call.softcap is None and not call.score_mod and loop.fold_columns
    # With softcap bounding the scores (no bias), p = exp(s) * exp(-lse): the row factor
    # goes into dout and delta (rows with no key: exp(-inf) = 0), a pass less per block.
    bounded = bounded_scores(call)
    if bounded:
        factor = xp.exp(-lse_g)
        do = do * factor[..., None]
        delta = delta * factor
    do_aug = xp.concat([do, delta[..., None]], axis=-1) if fold_delta else do
    q_aug = xp.concat([ops.q, -lse_g[..., None]], axis=-1) if fold_lse else ops.q
    ct = call.compute_dtype
    like = run.like(do, delta, lse_g, *consts)
    dq0 = loop.blocks(tuple(ops.q.shape), ct, like)
    db0 = loop.blocks(bias_shape, ct, like) if dbias_wanted else None
    dc0 = tuple(loop.full(tuple(c.shape), c.dtype, 0.0, like) for c in consts)

    def key_block(carry: Any, ki: Any) -> tuple[Any, tuple[Any, Any]]:
        cols = run.cols(ki)
        kb = loop.take(ops.k, *cols, -2)
        vb = loop.take(ops.v, *cols, -2)
        column = (*kb.shape[:-1], 1)
        if fold_lse:
            kb_aug = xp.concat([kb, xp.ones(column, dtype=kb.dtype, device=call.device)], axis=-1)
        if fold_delta:
            vb_aug = xp.concat([vb, -xp.ones(column, dtype=vb.dtype, device=call.device)], axis=-1)
        init = (
            loop.accumulator(tuple(kb.shape), ct, like),
            loop.accumulator(tuple(vb.shape), ct, like),
            *carry,
        )

        def step(state: Any, qi: Any) -> Any:
            dk_b, dv_b, dq, db_store, dconsts = state
            rows = run.rows(qi)
            allow = run.allow(rows, cols, (qi, ki))
            if loop.static and masked_out(call, allow, host_bool, run.mods):
                return state
            qb = loop.take(ops.q, *rows, -2)
            dob = loop.take(do, *rows, -2)
            pullback: list[Any] = []
            score_fn = None
            if score_grad is not None:

                def score_fn(s: Any, rows: Span, cols: Span) -> Any:
                    s_mod, pull = score_grad(s, rows, cols)
                    pullback.append(pull)
                    return s_mod

            if fold_lse:
                s_lse, t = _core.block_scores(
                    call, loop.take(q_aug, *rows, -2), kb_aug, rows, cols,
                    bias=run.block(ops.bias, rows, cols), mods=run.mods, allow=allow,
                    math=math, scores=scores,
                )  # fmt: skip
                p = math.exp(s_lse)
            else:
                s, t = _core.block_scores(
                    call, qb, kb, rows, cols, bias=run.block(ops.bias, rows, cols),
                    mods=run.mods, allow=allow, math=math, scores=scores, need_t=True,
                    zero_after=bounded, score_fn=score_fn,
                )  # fmt: skip
                if bounded:
                    p = math.exp(s)
                    if allow is not None:
                        p = math.zeroed(p, allow)
                else:
                    p = math.exp_shifted(s, loop.take(lse_g, *rows, -1)[..., None])
            p_used = p
            if fold_delta:  # (no buffer where dbias may keep ds, made from it)
                dp_delta = math.product(
                    loop.take(do_aug, *rows, -2),
                    xp.matrix_transpose(vb_aug),
                    slot=None if dbias_wanted or pullback else "dp",
                )
            else:
                dp = xp.matmul(dob, xp.matrix_transpose(vb))
                if keep is not None:
                    kept = keep(block_number(qi, ki, run.nk), tuple(p.shape))
                    p_used = _core.apply_keep(xp, p, kept, call.dropout)
                    dp = _core.apply_keep(xp, dp, kept, call.dropout)
                dp_delta = dp - loop.take(delta, *rows, -1)[..., None]
            dv_b = _add_product(call, math, dv_b, xp.matrix_transpose(p_used), dob)
            ds = math.mul(dp_delta, p)
            if pullback:  # d score_mod: back to the scores before it, and to its consts
                ds, *dcs = pullback[0](ds)
                dconsts = tuple(a + b for a, b in zip(dconsts, dcs, strict=True))
            if dbias_wanted:
                key, starts, sizes, axes = _bias_block(bias_shape, (qi, ki), rows, cols)
                target = (*bias_shape[:-2], *sizes_of(bias_shape, rows, cols))
                db = _reduce_to(xp, ds, target)

                def add_db(old: Any, db: Any = db) -> Any:
                    return db if old is None else old + db

                db_store = loop.add_block(db_store, key, starts, sizes, axes, add_db)
            if t is not None:  # (functionally where dbias may hold ds itself)
                ds = (BlockMath(xp) if dbias_wanted else math).softcap_grad(ds, t)

            def add_dq(old: Any, ds: Any = ds) -> Any:
                return math.matmul_add(old, ds, kb)

            dq = loop.add_block(dq, (qi,), (rows[0],), (rows[1],), (-2,), add_dq)
            dk_b = _add_product(call, math, dk_b, xp.matrix_transpose(ds), qb)
            return dk_b, dv_b, dq, db_store, dconsts

        dk_b, dv_b, *carry = loop.inner(step, init, queries_of, ki)
        if dk_b is None:  # no pair touched this key block
            dk_b = _zeros(call, ops.k, cols[1])
            dv_b = _zeros(call, ops.v, cols[1])
        return tuple(carry), (dk_b, dv_b)

    (dq_store, db_store, dconsts), (dk, dv) = loop.outer(
        key_block, (dq0, db0, dc0), range(run.nk), (-2, -2)
    )
    nq, nk = run.nq, run.nk

    def dq_zeros(key: tuple[Any, ...]) -> Any:
        return _zeros(call, ops.q, run.rows(key[0])[1])

    dq = loop.assembled(dq_store, [range(nq)], (-2,), dq_zeros)
    # ds was taken with respect to s; with q times q_factor, the scores' factor comes back
    # as the scale (dq) and as softcap (dk: its q blocks carry scale / softcap).
    dq = trimmed(dq, lq, -2) * call.scale
    dk, dv = trimmed(dk, lk, -2), trimmed(dv, lk, -2)
    if call.softcap is not None:
        dk = dk * call.softcap
    dbias = None
    if dbias_wanted:

        def db_zeros(key: tuple[Any, ...]) -> Any:
            rows, cols = run.rows(key[0]), run.cols(key[1])
            shape = (*bias_shape[:-2], *sizes_of(bias_shape, rows, cols))
            return xp.zeros(shape, dtype=ct, device=call.device)

        keys = [
            range(nq) if bias_shape[-2] != 1 else range(1),
            range(nk) if bias_shape[-1] != 1 else range(1),
        ]
        dbias = loop.assembled(db_store, keys, (-2, -1), db_zeros)
        if bias_shape[-2] != 1:
            dbias = trimmed(dbias, lq, -2)
        if bias_shape[-1] != 1:
            dbias = trimmed(dbias, lk, -1)
        dbias = xp.astype(xp.reshape(dbias, shape_of(bias)), bias.dtype, copy=False)
    grads = Grads(
        _as_input(call, dq, q), _as_input(call, dk, k), _as_input(call, dv, v), dbias, dsinks
    )
    return grads, tuple(dconsts)


def sizes_of(shape: tuple[int, ...], rows: Span, cols: Span) -> tuple[int, int]:
    """The block lengths of a bias of ``shape`` at ``rows x cols`` (1 on its size-1 axes)."""
    return (rows[1] if shape[-2] != 1 else 1, cols[1] if shape[-1] != 1 else 1)


def _bias_block(
    shape: tuple[int, ...], pair: tuple[Any, Any], rows: Span, cols: Span
) -> tuple[tuple[Any, Any], tuple[Any, ...], tuple[int, ...], tuple[int, ...]]:
    """``(key, starts, sizes, axes)`` of the dbias block of ``pair`` for a bias of
    ``shape``: its size-1 axes are one block, not sliced."""
    key = (pair[0] if shape[-2] != 1 else 0, pair[1] if shape[-1] != 1 else 0)
    starts: list[Any] = []
    sizes: list[int] = []
    axes: list[int] = []
    for axis, (start, length) in ((-2, rows), (-1, cols)):
        if shape[axis] != 1:
            starts.append(start)
            sizes.append(length)
            axes.append(axis)
    return key, tuple(starts), tuple(sizes), tuple(axes)


def _zeros(call: Call, like: Any, length: int) -> Any:
    """Zeros of ``like``'s shape with ``length`` rows (a block no pair touched)."""
    shape = (*like.shape[:-2], length, like.shape[-1])
    return call.xp.zeros(shape, dtype=call.compute_dtype, device=call.device)


def _as_input(call: Call, grad: Any, x: Any) -> Any:
    """A gradient in the shape and dtype of the input ``x`` (heads merged again)."""
    xp = call.xp
    return xp.astype(xp.reshape(grad, shape_of(x)), x.dtype, copy=False)


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
        if not _same_shape(shape_of(x), shape):
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


def _same_shape(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    """Whether shapes agree where both are known (None: a dimension a lazy library leaves
    unknown, such as ndonnx's symbolic dims, which its results may lose)."""
    return len(got) == len(want) and all(
        a is None or b is None or a == b for a, b in zip(got, want, strict=True)
    )
