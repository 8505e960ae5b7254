"""What a ring step computes, array-API only: blocks of ``attend`` merged by lse, and
their gradients from ``attend_backward``.

The framework modules (:mod:`._jax`, :mod:`._torch`) move K/V shards around the ring and
choose each shard's blocks from the :class:`~._schedule.Schedule`; the arithmetic of a
step is here, once, in the namespace of the arrays.

Forward: each block is ``attend(q[rows], k[cols], v[cols], causal=..., window=...,
return_lse=True)`` on the local query rows and the visiting K/V shard, merged into the
running ``(out, lse)`` of the local rows with the guarded merge of :mod:`._merge`.

Backward (FlashAttention-2's, which decomposes exactly over key blocks given the global
``out`` and ``lse`` of the query rows): each block is ``attend_backward(dout[rows], q[rows],
k[cols], v[cols], out[rows], lse[rows], ...)``; ``dq`` accumulates locally and ``dk``/``dv``
accumulate into buffers that travel the ring with their K/V shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from portable_attention._spec import Call
from portable_attention.parallel._merge import add_rows, merge_rows
from portable_attention.parallel._schedule import Block


@dataclass(frozen=True)
class Options:
    """The options of a ring call that reach every block (hashable: part of the JAX
    custom-gradient function's cache key)."""

    scale: float
    softcap: float | None
    chunk_size: int | None
    return_lse: bool

    @classmethod
    def of(cls, call: Call) -> Options:
        return cls(
            scale=call.scale,
            softcap=call.softcap,
            chunk_size=call.chunk_size,
            return_lse=call.return_lse,
        )

    def block(self, block: Block) -> dict[str, Any]:
        """attend's keyword arguments for one block."""
        return {
            "causal": block.causal,
            "window": block.window,
            "scale": self.scale,
            "softcap": self.softcap,
            "chunk_size": self.chunk_size,
        }


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
    from portable_attention import attend

    for block in blocks:
        part, part_lse = attend(
            _rows(q, block.rows),
            _rows(k, block.cols),
            _rows(v, block.cols),
            return_lse=True,
            **options.block(block),
        )
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
    from portable_attention import attend_backward

    dq, dk, dv = grads
    dout, q, out, lse, dlse = saved
    for block in blocks:
        g = attend_backward(
            _rows(dout, block.rows),
            _rows(q, block.rows),
            _rows(k, block.cols),
            _rows(v, block.cols),
            _rows(out, block.rows),
            _lse_rows(lse, block.rows),
            dlse=None if dlse is None else _lse_rows(dlse, block.rows),
            **options.block(block),
        )
        dq = add_rows(xp, dq, block.rows, g.dq)
        dk = add_rows(xp, dk, block.cols, g.dk)
        dv = add_rows(xp, dv, block.cols, g.dv)
    return dq, dk, dv
