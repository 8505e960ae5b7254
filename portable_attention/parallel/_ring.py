"""What a ring step computes, array-API only: blocks of ``attend`` merged by lse, and
their gradients from ``attend_backward``.

The framework modules (:mod:`._jax`, :mod:`._torch`) move K/V shards around the ring and
choose each shard's blocks from the :class:`~._schedule.Schedule`; the arithmetic of a
step is here, once, in the namespace of the arrays.

Forward: each block is what ``attend(q[rows], k[cols], v[cols], causal=..., window=...,
return_lse=True)`` computes on the local query rows and the visiting K/V shard, merged
into the running ``(out, lse)`` of the local rows with the guarded merge of
:mod:`._merge`. Not the public ``attend``: the ring's call was validated once, so each
block runs the internal entry (:func:`portable_attention._attention.run_call`) on the
ring's :class:`~portable_attention._options.Options` with the block's band.

Backward (FlashAttention-2's, which decomposes exactly over key blocks given the global
``out`` and ``lse`` of the query rows): each block is what ``attend_backward(dout[rows],
q[rows], k[cols], v[cols], out[rows], lse[rows], ...)`` computes
(:func:`~portable_attention._attention.run_backward`); ``dq`` accumulates locally and
``dk``/``dv`` accumulate into buffers that travel the ring with their K/V shard.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import array_api_compat

from portable_attention._attention import run_backward, run_call
from portable_attention._block_plan import BlockPlan, check_plan_for
from portable_attention._mods import Mods
from portable_attention._options import Options
from portable_attention._spec import Call, describe
from portable_attention.backends import adapter
from portable_attention.parallel._merge import add_rows, merge_rows
from portable_attention.parallel._schedule import Block, Schedule, pruned, schedule


@dataclass(frozen=True)
class UserMods:
    """The ring's ``score_mod`` and ``mask_mod`` (a block plan's function), which see
    global positions."""

    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None


#: What a ring step knows of the user's mods: them, the global positions of the local
#: query rows and those of the visiting keys (int32, ``[L/P]`` each).
Positioned = tuple[UserMods, Any, Any]


def step_positions(tables: tuple[Any, Any], shard: Any, shift: int, size: int) -> tuple[Any, Any]:
    """The global positions of shard ``shard``'s query rows and of the keys it holds at a
    step of ``shift``, from the layout's ``[P, L/P]`` tables of queries and keys
    (:func:`~._layout.position_table`, built once per call); ``shard`` may be traced."""
    q_table, k_table = tables
    return q_table[shard], k_table[(shard - shift) % size]


def _block_call(options: Options, block: Block, q: Any, k: Any, v: Any, mods: Mods | None) -> Call:
    """The call of one block: the ring's options with the block's band and ``lse``, on
    slices of the arrays the ring's call validated (nothing checked again). With segment
    ids, ``mods`` holds the ids of the block's rows and of its columns, cut from the one
    array of the packed sequence ("slices"): the block's band is the global band, which
    is exact for one array of ids, and a row may find no key of its id in the block."""
    causal = "lower_right" if block.causal else None
    changes = dataclasses.replace(options, causal=causal, window=block.window, return_lse=True)
    segments = None if mods is None or mods.q_ids is None else "slices"
    scored = mods is not None and mods.score_mod is not None
    masked = mods is not None and mods.mask_mod is not None
    return describe(changes, q, k, v, segments=segments, score_mod=scored, mask_mod=masked)


def _block_mods(
    ids: tuple[Any, Any] | None, positioned: Positioned | None, block: Block
) -> Mods | None:
    """The segment ids of a block's rows and of its columns, and the ring's mods seeing
    the global positions of both (None where there is none of them)."""
    score_mod = mask_mod = None
    if positioned is not None:
        user, q_pos, kv_pos = positioned
        rows, cols = _last(q_pos, block.rows), _last(kv_pos, block.cols)
        if user.score_mod is not None:
            score_mod = _score_at_global(user.score_mod, rows, cols)
        if user.mask_mod is not None and block.masked:
            mask_mod = _mask_at_global(user.mask_mod, rows, cols)
    if ids is None and score_mod is None and mask_mod is None:
        return None
    q_ids = kv_ids = None
    if ids is not None:
        q_ids, kv_ids = _last(ids[0], block.rows), _last(ids[1], block.cols)
    return Mods(q_ids=q_ids, kv_ids=kv_ids, score_mod=score_mod, mask_mod=mask_mod)


def _global(positions: Any, index: Any) -> Any:
    """A block's own index array (``q_idx`` or ``kv_idx``) as the global positions of
    those rows or columns."""
    xp = array_api_compat.array_namespace(index)
    return xp.reshape(xp.take(positions, xp.reshape(index, (-1,))), tuple(index.shape))


def _mask_at_global(mask_mod: Callable[..., Any], rows: Any, cols: Any) -> Callable[..., Any]:
    def global_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b, h, _global(rows, q_idx), _global(cols, kv_idx))

    return global_mask_mod


def _score_at_global(score_mod: Callable[..., Any], rows: Any, cols: Any) -> Callable[..., Any]:
    def global_score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score_mod(score, b, h, _global(rows, q_idx), _global(cols, kv_idx))

    return global_score_mod


#: ``when(keep, compute, state)``: ``compute(state)`` where the 0-d boolean array ``keep``
#: holds, else ``state``, decided on the device (JAX: ``lax.cond``). None: decided on
#: the host where ``keep`` can be read (eager torch), computed where it cannot.
When = Callable[[Any, Callable[[Any], Any], Any], Any]


def _guarded(
    xp: Any, call: Call, mods: Mods | None, when: When | None, compute: Any, state: Any
) -> Any:
    """``compute(state)``, skipped where no query of the block shares a segment id with
    any of its keys (the block adds nothing): by ``when`` on the device, or by one host
    read of the block's ids where they are not traced."""
    if mods is None or mods.q_ids is None:
        return compute(state)
    backend = adapter(call.backend)
    if when is None and (backend.traced(mods.q_ids) or backend.traced(mods.kv_ids)):
        return compute(state)
    pair = xp.expand_dims(mods.q_ids, axis=-1) == xp.expand_dims(mods.kv_ids, axis=-2)
    keep = xp.any(pair)
    if when is not None:
        return when(keep, compute, state)
    return state if backend.host_bool(keep) is False else compute(state)


def user_mods(score_mod: Any, mask_mod: Any) -> UserMods | None:
    """The ring's :class:`UserMods` (a block plan's function for ``mask_mod``), or None
    where neither is given."""
    if score_mod is None and mask_mod is None:
        return None
    return UserMods(score_mod=score_mod, mask_mod=getattr(mask_mod, "mask_mod", mask_mod))


def ring_schedule(
    call: Call, size: int, layout: str, lq: int, lk: int, mask_mod: Any = None
) -> Schedule:
    """The ring's schedule for global lengths ``lq``/``lk``; with a block plan as
    ``mask_mod`` (built for the global lengths), the blocks and steps it leaves empty
    dropped and those it keeps whole unmasked (:func:`~._schedule.pruned`)."""
    plan = schedule(size, layout, lq, lk, call.causal, call.window)
    if isinstance(mask_mod, BlockPlan):
        q_shape, k_shape = (*call.q_shape[:-2], lq, 1), (*call.k_shape[:-2], lk, 1)
        check_plan_for(mask_mod, q_shape, k_shape, None)
        plan = pruned(plan, mask_mod.layout)
    return plan


def _rows(x: Any, span: tuple[int, int]) -> Any:
    """Rows ``span`` along axis -2 (``x`` itself where that is all of them)."""
    if span == (0, x.shape[-2]):
        return x
    return x[..., span[0] : span[1], :]


def _last(x: Any, span: tuple[int, int]) -> Any:
    """Entries ``span`` along the last axis (lse's rows, ids' positions)."""
    if span == (0, x.shape[-1]):
        return x
    return x[..., span[0] : span[1]]


def forward_blocks(
    xp: Any,
    blocks: tuple[Block, ...],
    options: Options,
    out: Any,
    lse: Any,
    q: Any,
    k: Any,
    v: Any,
    ids: tuple[Any, Any] | None = None,
    mods: Positioned | None = None,
    when: When | None = None,
) -> tuple[Any, Any]:
    """The running ``(out, lse)`` of the local query rows after ``blocks`` against the
    visiting ``k``, ``v`` (all in the compute dtype); ``ids``: the segment ids of the
    local queries and of the visiting keys, or None; ``mods``: the ring's mods with the
    global positions of both, or None; ``when``: how a block that shares no
    segment id is skipped (:data:`When`)."""
    for block in blocks:
        qb, kb, vb = _rows(q, block.rows), _rows(k, block.cols), _rows(v, block.cols)
        block_mods = _block_mods(ids, mods, block)
        call = _block_call(options, block, qb, kb, vb, block_mods)
        add = functools.partial(_add_block, xp, call, block, block_mods, (qb, kb, vb))
        out, lse = _guarded(xp, call, block_mods, when, add, (out, lse))
    return out, lse


def _add_block(
    xp: Any, call: Call, block: Block, mods: Mods | None, qkv: tuple[Any, ...], state: Any
) -> tuple[Any, Any]:
    """``(out, lse)`` with one block's partial result merged into its rows."""
    q, k, v = qkv
    part, part_lse = run_call(call, q, k, v, mods=mods)
    return merge_rows(xp, state[0], state[1], block.rows, part, part_lse)


def backward_blocks(
    xp: Any,
    blocks: tuple[Block, ...],
    options: Options,
    grads: tuple[Any, Any, Any],
    saved: tuple[Any, Any, Any, Any, Any],
    k: Any,
    v: Any,
    ids: tuple[Any, Any] | None = None,
    mods: Positioned | None = None,
    when: When | None = None,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` after the gradients of ``blocks`` are added: ``dq`` of the local
    rows, ``dk``/``dv`` of the visiting shard (all in the compute dtype). ``saved``:
    ``(dout, q, out, lse, dlse)`` of the local rows, ``out`` and ``lse`` the global ones
    (every shard's keys merged); ``dlse`` the cotangent of the returned lse, or None.
    ``ids``, ``mods`` and ``when`` as :func:`forward_blocks`'.
    """
    dout, q, out, lse, dlse = saved
    for block in blocks:
        qb, kb, vb = _rows(q, block.rows), _rows(k, block.cols), _rows(v, block.cols)
        block_mods = _block_mods(ids, mods, block)
        call = _block_call(options, block, qb, kb, vb, block_mods)
        rows = (
            _rows(dout, block.rows),
            _rows(out, block.rows),
            _last(lse, block.rows),
            None if dlse is None else _last(dlse, block.rows),
        )
        add = functools.partial(_add_gradients, xp, call, block, block_mods, (qb, kb, vb), rows)
        grads = _guarded(xp, call, block_mods, when, add, grads)
    return grads


def _add_gradients(
    xp: Any,
    call: Call,
    block: Block,
    mods: Mods | None,
    qkv: tuple[Any, ...],
    rows: tuple[Any, ...],
    state: Any,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` with one block's gradients added: ``rows`` are the block's rows
    of ``dout``, ``out``, ``lse`` and ``dlse`` (or None)."""
    (q, k, v), (dout, out, lse, dlse) = qkv, rows
    g = run_backward(call, dout, q, k, v, out, lse, dlse=dlse, mods=mods)
    dq, dk, dv = state
    dq = add_rows(xp, dq, block.rows, g.dq)
    dk = add_rows(xp, dk, block.cols, g.dk)
    dv = add_rows(xp, dv, block.cols, g.dv)
    return dq, dk, dv
