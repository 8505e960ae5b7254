"""How the blockwise path walks its blocks, as one small interface of primitives.

:mod:`portable_attention._blockwise` writes FlashAttention-2's forward and backward once,
as two nested loops: over query blocks (the forward) or key blocks (the backward), and
within each over the blocks it pairs with. Every loop, slice of a block and accumulation
into an array of blocks goes through a :class:`BlockLoop`. This class is the array-API
default: Python loops over blocks whose offsets are Python ints, static slices, the last
block of an axis shorter where the length is not a multiple of the block's. The
decisions that need an offset known while the loop runs (a block inside the causal band
needs no mask; a block that segment ids mask entirely is skipped after one host read) are
taken only where :attr:`BlockLoop.static` is true.

An adapter whose framework compiles loops passes a subclass (``Adapter.block_loop``): JAX
runs the outer loop as one ``lax.scan`` and the inner one as a ``lax.fori_loop`` over a
table of the block's partners, so the program holds one block's code whatever L is. Its
offsets are traced integers, so it pads the operands to whole blocks (:meth:`pad`; the
padded keys are masked, the padded rows dropped) and every block has the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

#: ``step(state, index) -> state``: one block of an inner loop.
Step = Callable[[Any, Any], Any]
#: ``body(carry, index) -> (carry, outputs)``: one block of an outer loop; ``outputs`` a
#: tuple of arrays, each with its rows on the axis :meth:`BlockLoop.outer` is given.
Body = Callable[[Any, Any], tuple[Any, tuple[Any, ...]]]


class BlockLoop:
    """The array-API loops (Python, over static offsets); see the module docstring."""

    #: Block offsets are Python ints: decisions on them may be taken while looping.
    static = True
    #: The backward folds ``- delta`` and ``- lse`` into its matrix products as one more
    #: column of ``dout`` and ``q`` (a pass over each block fewer, for a copy of each):
    #: on torch's CPU kernels a block's subtraction costs a pass over memory.
    fold_columns = True

    def __init__(self, xp: Any, device: Any = None, *, span_scores: int = 0) -> None:
        self.xp = xp
        self.device = device
        self.span_scores = span_scores

    def budget(self, call: Any, default: int) -> int:
        """Scores per block over all batch and head dims, from the core's ``default``."""
        return default

    def key_span(self, call: Any, size: int) -> int:
        """The most keys one step of the forward takes at once, where consecutive key
        blocks of ``size`` need no mask (:func:`~portable_attention._block_grid.merged`;
        static loops only): as many whole blocks as keep the step's scores over all batch
        and head dims within ``span_scores`` (NumPy's: fewer Python steps), else
        ``size``, one block per step."""
        if not self.span_scores:
            return size
        rows = min(size, call.q_shape[-2]) * math.prod(call.q_shape[:-2])
        return max(size, self.span_scores // max(rows, 1))

    def length(self, total: int, size: int, index: Any) -> Any:
        """The length of block ``index`` of ``size`` on an axis of ``total``."""
        return min(size, total - index * size)

    def pad(self, x: Any, length: int, axis: int, value: float | bool) -> Any:
        """``x`` padded with ``value`` to ``length`` along ``axis`` (blocks here are cut
        to the axis: nothing is padded)."""
        return x

    def outer(
        self, body: Body, carry: Any, indices: Sequence[int], axes: tuple[int, ...]
    ) -> tuple[Any, tuple[Any, ...]]:
        """``body`` over ``indices``: the final carry and each output's blocks joined
        along its axis of ``axes``."""
        parts: list[tuple[Any, ...]] = []
        for index in indices:
            carry, outputs = body(carry, index)
            parts.append(outputs)
        return carry, joined(self.xp, parts, axes)

    def each(self, body: Body, indices: Sequence[int], axes: tuple[int, ...]) -> tuple[Any, ...]:
        """:meth:`outer` over blocks that carry nothing from one to the next (the
        forward's query blocks; ``body`` is given ``()`` as its carry): an adapter may
        run them in any order, on threads (NumPy's)."""
        return self.outer(body, (), indices, axes)[1]

    def inner(self, step: Step, state: Any, partners: Sequence[Sequence[int]], index: Any) -> Any:
        """``step`` over the partners of outer block ``index``, in their order."""
        for other in partners[index]:
            state = step(state, other)
        return state

    def take(self, x: Any, start: Any, size: Any, axis: int) -> Any:
        """``size`` entries of ``x`` from ``start`` along ``axis`` (counted from the end)."""
        index = [slice(None)] * x.ndim
        index[x.ndim + axis] = slice(start, start + size)
        return x[tuple(index)]

    def full(self, shape: tuple[int, ...], dtype: Any, value: float, like: Sequence[Any]) -> Any:
        """A new array of ``value``, to accumulate in from the arrays ``like``."""
        return self.xp.full(shape, value, dtype=dtype, device=self.device)

    def accumulator(self, shape: tuple[int, ...], dtype: Any, like: Sequence[Any]) -> Any:
        """An accumulator for an inner loop's sums: None here (its first sum becomes it)."""
        return None

    def blocks(self, shape: tuple[int, ...], dtype: Any, like: Sequence[Any]) -> Any:
        """An empty store of blocks of an array of ``shape`` (a dict here)."""
        return {}

    def add_block(
        self,
        store: Any,
        key: tuple[Any, ...],
        starts: tuple[Any, ...],
        sizes: tuple[int, ...],
        axes: tuple[int, ...],
        add: Callable[[Any], Any],
    ) -> Any:
        """``store`` with its block ``key`` (at ``starts`` along ``axes``) replaced by
        ``add(block)``; the block is None the first time (a dict here, keyed by ``key``)."""
        store[key] = add(store.get(key))
        return store

    def assembled(
        self,
        store: Any,
        keys: Sequence[Sequence[Any]],
        axes: tuple[int, ...],
        zeros: Callable[[tuple[Any, ...]], Any],
    ) -> Any:
        """The array of ``store``'s blocks: ``keys[i]`` the block numbers along ``axes[i]``,
        ``zeros(key)`` for a block no step added to."""
        return self._join(store, keys, axes, zeros, ())

    def _join(
        self,
        store: Any,
        keys: Sequence[Sequence[Any]],
        axes: tuple[int, ...],
        zeros: Callable[[tuple[Any, ...]], Any],
        prefix: tuple[Any, ...],
    ) -> Any:
        if len(prefix) == len(keys):
            block = store.get(prefix)
            return zeros(prefix) if block is None else block
        depth = len(prefix)
        parts = [self._join(store, keys, axes, zeros, (*prefix, i)) for i in keys[depth]]
        return _concat(self.xp, parts, axes[depth])


def unstacked(xp: Any, x: Any, axis: int) -> Any:
    """Blocks stacked on a leading axis (a compiled loop's outputs, ``[blocks, ..., rows,
    ...]``) moved to ``axis`` and merged with the rows after it."""
    x = xp.moveaxis(x, 0, axis)
    shape = x.shape
    return xp.reshape(
        x, (*shape[: x.ndim + axis], shape[axis] * shape[axis + 1], *shape[x.ndim + axis + 2 :])
    )


def joined(xp: Any, parts: Sequence[tuple[Any, ...]], axes: tuple[int, ...]) -> tuple[Any, ...]:
    """Each output of the blocks' ``parts`` (one tuple per block) joined along its axis."""
    return tuple(_concat(xp, [p[i] for p in parts], axis) for i, axis in enumerate(axes))


def _concat(xp: Any, blocks: list[Any], axis: int) -> Any:
    return blocks[0] if len(blocks) == 1 else xp.concat(blocks, axis=axis)
