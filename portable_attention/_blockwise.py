"""The blockwise path: FlashAttention-2's forward and backward over query and key blocks
(the forward here, the backward in :mod:`portable_attention._blockwise_backward`).

Array-API only, as :mod:`portable_attention._core` (no framework code, no boolean
indexing, Python branching on static shapes only). Each block's elementwise steps go through
a :class:`~portable_attention._block_math.BlockMath` that the adapter gives: functional by
default, in place where the framework can (torch outside autograd). Both passes walk the same
static grid of ``size x size`` blocks and skip the blocks that ``causal``/``window`` mask
entirely (:mod:`portable_attention._block_grid`); where a loop asks for it
(``BlockLoop.key_span``: a span budget, NumPy's), the forward takes a run of consecutive
key blocks that need no mask in one step (:func:`~portable_attention._block_grid.merged`):

- :func:`forward`: the online softmax (running max and sum) of every query block over its
  key blocks; returns ``(out, lse)``. Peak memory ``O(Lq * Dv + size**2)`` per head
  (a step over a run of key blocks: up to the loop's ``key_span`` keys instead of
  ``size``; NumPy's, 4M scores over batch and heads, on each of its threads).
- :func:`~portable_attention._blockwise_backward.backward`: gradients from ``q, k, v,
  out, lse, dout`` alone, the probabilities of
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
are those of the whole call restricted to it, so sequence parallelism can call the
backward per shard and sum the ``dq``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from portable_attention import _core
from portable_attention._block_grid import (
    HostBool,
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
from portable_attention._core import Scores
from portable_attention._mods import Mods
from portable_attention._spec import Call
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
    adapter's primitives where not given (:func:`primitives`).
    """
    if call.k_shape[-2] == 0 or call.q_shape[-2] == 0:
        out, _, lse = _core.empty_keys(call, q, k, v)
        return out, lse
    xp, ct = call.xp, call.compute_dtype
    scores, host_bool, math, loop = primitives(
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


def primitives(
    call: Call,
    arrays: tuple[Any, ...],
    scores: Scores | None,
    host_bool: HostBool | None,
    math: BlockMath | None,
    loop: BlockLoop | None,
) -> tuple[Scores | None, HostBool, BlockMath, BlockLoop]:
    """The primitives a pass runs on: those given, else the adapter's (``Adapter.scores``,
    ``host_bool``, :func:`block_math` of the pass's ``arrays``, ``block_loop``)."""
    backend = adapter(call.backend)
    return (
        backend.scores(call.xp) if scores is None else scores,
        backend.host_bool if host_bool is None else host_bool,
        block_math(call, arrays) if math is None or call.score_mod else math,
        backend.block_loop(call) if loop is None else loop,
    )


def block_math(call: Call, arrays: tuple[Any, ...]) -> BlockMath:
    """The elementwise steps of a pass (or of the dense weights call) on ``arrays``: the
    adapter's (``Adapter.block_math``), the functional ones for a call with a
    ``score_mod``, whose result may be any array of the block's shape, which an in-place
    step must not overwrite."""
    if call.score_mod:
        return BlockMath(call.xp)
    return adapter(call.backend).block_math(call.xp, arrays)


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
