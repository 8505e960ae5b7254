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
from typing import Any

from portable_attention._attention import run_backward, run_call
from portable_attention._options import Options
from portable_attention._spec import Call, describe
from portable_attention.parallel._merge import add_rows, merge_rows
from portable_attention.parallel._schedule import Block


def _block_call(options: Options, block: Block, q: Any, k: Any, v: Any) -> Call:
    """The call of one block: the ring's options with the block's band and ``lse``, on
    slices of the arrays the ring's call validated (nothing checked again)."""
    causal = "lower_right" if block.causal else None
    changes = dataclasses.replace(options, causal=causal, window=block.window, return_lse=True)
    return describe(changes, q, k, v)


def _rows(x: Any, span: tuple[int, int]) -> Any:
    """Rows ``span`` along axis -2 (``x`` itself where that is all of them)."""
    if span == (0, x.shape[-2]):
        return x
    return x[..., span[0] : span[1], :]


def _lse_rows(x: Any, span: tuple[int, int]) -> Any:
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
) -> tuple[Any, Any]:
    """The running ``(out, lse)`` of the local query rows after ``blocks`` against the
    visiting ``k``, ``v`` (all in the compute dtype)."""
    for block in blocks:
        qb, kb, vb = _rows(q, block.rows), _rows(k, block.cols), _rows(v, block.cols)
        part, part_lse = run_call(_block_call(options, block, qb, kb, vb), qb, kb, vb)
        out, lse = merge_rows(xp, out, lse, block.rows, part, part_lse)
    return out, lse


def backward_blocks(
    xp: Any,
    blocks: tuple[Block, ...],
    options: Options,
    grads: tuple[Any, Any, Any],
    saved: tuple[Any, Any, Any, Any, Any],
    k: Any,
    v: Any,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` after the gradients of ``blocks`` are added: ``dq`` of the local
    rows, ``dk``/``dv`` of the visiting shard (all in the compute dtype). ``saved``:
    ``(dout, q, out, lse, dlse)`` of the local rows, ``out`` and ``lse`` the global ones
    (every shard's keys merged); ``dlse`` the cotangent of the returned lse, or None.
    """
    dq, dk, dv = grads
    dout, q, out, lse, dlse = saved
    for block in blocks:
        qb, kb, vb = _rows(q, block.rows), _rows(k, block.cols), _rows(v, block.cols)
        g = run_backward(
            _block_call(options, block, qb, kb, vb),
            _rows(dout, block.rows),
            qb,
            kb,
            vb,
            _rows(out, block.rows),
            _lse_rows(lse, block.rows),
            dlse=None if dlse is None else _lse_rows(dlse, block.rows),
        )
        dq = add_rows(xp, dq, block.rows, g.dq)
        dk = add_rows(xp, dk, block.cols, g.dk)
        dv = add_rows(xp, dv, block.cols, g.dv)
    return dq, dk, dv
