"""The block grid of the blockwise path: block sizes, the pairs of blocks to compute, and
one pass's view of a call's operands on its blocks (:class:`Pass`): slices, masks, bands.

Both passes of :mod:`portable_attention._blockwise` walk the same static grid of ``size x
size`` blocks (:func:`block_size`) and skip the blocks that ``causal``/``window`` (and a
block plan) mask entirely (:func:`pairs`); the forward may take a run of consecutive key
blocks that the band keeps whole in one step where its loop asks (:func:`merged`). A block
is addressed by spans ``(start, length)``, whose start is a Python int on a static loop
and a traced integer on a compiled one (:class:`~portable_attention._block_loop.BlockLoop`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from portable_attention import _band, _core, _mods
from portable_attention._block_loop import BlockLoop
from portable_attention._core import Operands, operands
from portable_attention._mods import Mods
from portable_attention._spec import Call

#: ``host_bool(x) -> bool or None``: a 0-d boolean array as a Python bool where the
#: framework runs eagerly (None while a compiler traces): blocks that segment ids or a
#: ``mask_mod`` mask entirely are then skipped (``Adapter.host_bool``).
HostBool = Callable[[Any], "bool | None"]


def block_size(call: Call, loop: BlockLoop | None = None) -> int:
    """The block length of both passes: a block plan's, ``chunk_size``, else
    :func:`_core.auto_chunk` of the loop's budget; never longer than the call needs (a
    padded loop pads every call to whole blocks: a ring step's 8 x 8 block padded to
    1024 x 1024 took 0.8 s on JAX)."""
    if call.blocks is not None:  # its pairs are blocks of its size
        return int(call.blocks.block_size)
    if call.chunk_size is not None:
        size = call.chunk_size
    else:
        budget = _core.CHUNK_BUDGET if loop is None else loop.budget(call, _core.CHUNK_BUDGET)
        size = min(_core.auto_chunk(call, budget), band_block(call))
    longest = max(call.q_shape[-2], call.k_shape[-2], 1)
    return min(size, max(16, 1 << (longest - 1).bit_length()))


#: The shortest block :func:`band_block` gives a narrow window: shorter blocks cost more
#: in per-block overhead than the scores they save (window (255, 0), L = 4096, JAX
#: ``jit(grad)``: 149 ms with blocks of 64, 142 with 128).
BAND_BLOCK_FLOOR = 64


def band_block(call: Call) -> int:
    """The longest block for a band of bounded width ``w = left + right + 1`` (both sides
    bounded: a sliding window): ``w / 2`` rounded down to a power of two (at least
    :data:`BAND_BLOCK_FLOOR`); unbounded otherwise. A query block of ``b`` rows computes
    about ``w + b`` keys per row, so blocks much longer than the band compute mostly
    masked scores: window (255, 0) at ``[1, 8, 4096, 64]`` float32, forward + backward,
    blocks of 128 took 140 ms on torch and 142 on JAX ``jit(grad)`` against 169 and 178
    with the 256 of :func:`_core.auto_chunk` (docs/fast-paths.md)."""
    left, right = _core.window_sides(call)
    if not call.global_band or left is None or right is None or call.symbolic:
        return 1 << 62
    half = max((left + right + 1) // 2, 1)
    return max(BAND_BLOCK_FLOOR, 1 << (half.bit_length() - 1))


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
    if not call.global_band:
        if call.blocks is not None:  # its pairs, query block by query block
            return list(call.blocks.kept)
        nq, nk = grid(call, size)
        return [(qi, ki) for qi in range(nq) for ki in range(nk)]
    left, right = _core.window_sides(call)
    band = band_blocks(call.q_shape[-2], call.k_shape[-2], size, left, right, call.band_offset)
    if call.blocks is None:
        return list(band[0])
    kept = set(call.blocks.kept)
    return [pair for pair in band[0] if pair in kept]


@functools.lru_cache(maxsize=128)
def band_blocks(
    lq: int, lk: int, size: int, left: int | None, right: int | None, offset: int
) -> tuple[tuple[tuple[int, int], ...], frozenset[tuple[int, int]]]:
    """The band's block summary on the ``[lq, lk]`` grid of ``size`` blocks: the pairs
    that the band ``(left, right)`` with ``offset`` keeps some score of (query block by
    query block), and those it keeps whole (no mask needed there). Cached: it depends on
    the lengths and the band alone (the blockwise path's :func:`pairs` and Flex's
    ``BlockMask`` both read it; at L = 8192 the walk over the grid takes milliseconds)."""
    nq, nk = -(-lq // size), -(-lk // size)
    kept: list[tuple[int, int]] = []
    full: set[tuple[int, int]] = set()
    for qi in range(nq):
        rows = span(lq, size, qi)
        for ki in range(nk):
            cols = span(lk, size, ki)
            if _band.block_empty(rows, cols, offset, left, right):
                continue
            kept.append((qi, ki))
            if _band.block_full(rows, cols, offset, left, right):
                full.add((qi, ki))
    return tuple(kept), frozenset(full)


def partners(todo: list[tuple[int, int]], count: int, *, by_keys: bool) -> list[list[int]]:
    """Each query block's key blocks (``by_keys``: each key block's query blocks), in the
    order of ``todo``: the inner loops' tables."""
    table: list[list[int]] = [[] for _ in range(count)]
    for qi, ki in todo:
        if by_keys:
            table[ki].append(qi)
        else:
            table[qi].append(ki)
    return table


#: A run of consecutive key blocks ``(first, stop)`` that one step of a static loop takes
#: at once (:func:`merged`).
Run = tuple[int, int]


def merged(call: Call, run: Pass, table: list[list[int]], blocks: int) -> list[list[Any]]:
    """Each query block's partners of ``table`` with runs of up to ``blocks``
    consecutive key blocks that the band keeps whole (every pair where no band applies)
    joined into one :data:`Run`: fewer, larger matrix products, as FlashAttention's
    blocks are shaped for a GPU's tiles but a CPU's BLAS wants long spans. A block the
    band cuts stays alone (its mask covers only it)."""
    if blocks <= 1:
        return table
    full = None
    if call.global_band:
        left, right = _core.window_sides(call)
        lq, lk = call.q_shape[-2], call.k_shape[-2]
        full = band_blocks(lq, lk, run.size, left, right, call.band_offset)[1]
    out: list[list[Any]] = []
    for qi, keys in enumerate(table):
        row: list[Any] = []
        for ki in keys:
            whole = full is None or (qi, ki) in full
            last = row[-1] if row else None
            if whole and isinstance(last, tuple) and last[1] == ki and ki - last[0] < blocks:
                row[-1] = (last[0], ki + 1)
            else:
                row.append((ki, ki + 1) if whole else ki)
        out.append(row)
    return out


def padded(table: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """:func:`partners`' table made rectangular (each row padded with zeros to the
    longest, at least one column) and each row's count of partners: what a compiled inner
    loop indexes with a traced block number."""
    width = max([1, *map(len, table)])
    return [row + [0] * (width - len(row)) for row in table], [len(row) for row in table]


Span = tuple[Any, int]  # (start, length) of a block on an axis; start may be traced


class Pass:
    """What both passes share: the call, its loop, block length and operands."""

    def __init__(
        self, call: Call, loop: BlockLoop, ops: Operands, mods: Mods | None, size: int
    ) -> None:
        self.call, self.loop, self.ops, self.mods, self.size = call, loop, ops, mods, size
        self.nq, self.nk = grid(call, size)
        #: A padded loop's last key block holds keys past Lk: they are masked.
        self.pad_keys = not loop.static and call.k_shape[-2] % size != 0
        #: Whether ``causal``/``window`` keep every score (:func:`_core.band_keeps_all`).
        self.keeps_band = _core.band_keeps_all(call)
        self.bands: dict[tuple[int, int, int], Any] = {}

    def rows(self, qi: Any) -> Span:
        return qi * self.size, self.loop.length(self.call.q_shape[-2], self.size, qi)

    def cols(self, ki: Any) -> Span:
        """Key block ``ki``'s span, or a :data:`Run`'s (:func:`merged`)."""
        if isinstance(ki, tuple):
            start, stop = ki[0] * self.size, min(ki[1] * self.size, self.call.k_shape[-2])
            return start, stop - start
        return ki * self.size, self.loop.length(self.call.k_shape[-2], self.size, ki)

    def block(self, x: Any, rows: Span, cols: Span) -> Any:
        """The ``rows x cols`` block of a broadcastable mask/bias (size-1 axes kept)."""
        if x is None:
            return None
        if x.shape[-2] != 1:
            x = self.loop.take(x, *rows, -2)
        if x.shape[-1] != 1:
            x = self.loop.take(x, *cols, -1)
        return x

    def band(self, rows: Span, cols: Span) -> Any:
        """``causal``/``window`` (and a padded loop's keys past Lk) on the block; None
        where they keep all of it (on a static loop, a block inside the band). The same
        positions and rule for every loop, its offsets Python ints or traced."""
        call, xp = self.call, self.call.xp
        if self.keeps_band and not self.pad_keys:
            return None
        if self.loop.static:  # (which pads nothing)
            r, c = (rows[0], rows[0] + rows[1]), (cols[0], cols[0] + cols[1])
            if _core.block_is_full(call, r, c):
                return None
        i = rows[0] + xp.reshape(xp.arange(rows[1], device=call.device), (rows[1], 1))
        j = cols[0] + xp.reshape(xp.arange(cols[1], device=call.device), (1, cols[1]))
        band = None
        if not self.keeps_band:
            left, right = _core.window_sides(call)
            lq, lk = call.q_shape[-2], call.k_shape[-2]
            band = _band.keep_at(i, j, lq, lk, left=left, right=right, align=call.align)
        if self.pad_keys:
            real = j < call.k_shape[-2]
            band = real if band is None else band & real
        return band

    def allow(self, rows: Span, cols: Span, pair: tuple[Any, Any]) -> Any:
        """The block's mask (True = may attend): the user's ``mask``, ``causal``/``window``,
        segment ids and ``mask_mod`` together; None where nothing masks. A block plan's
        full blocks skip the ``mask_mod``; on a static loop the band of a block is made
        once per offset and shape (it depends on nothing else)."""
        call, loop, mods = self.call, self.loop, self.mods
        user = self.block(self.ops.mask, rows, cols)
        if loop.static and user is None:
            key = (rows[0] - cols[0], rows[1], cols[1])
            if key not in self.bands:
                self.bands[key] = self.band(rows, cols)
            allow = self.bands[key]
        else:
            band = self.band(rows, cols)
            allow = user if band is None else (band if user is None else user & band)
        if mods is None or (mods.q_ids is None and mods.mask_mod is None):
            return allow
        if (
            loop.static
            and mods.mask_mod is not None
            and call.blocks is not None
            and pair in call.blocks.full
        ):
            mods = Mods(mods.q_ids, mods.kv_ids, mods.q_pos, mods.kv_pos, None, None)
        layout = (*self.ops.q.shape[:-2], rows[1], cols[1])

        def cut(x: Any, where: Span) -> Any:
            return loop.take(x, *where, -1)

        extra = _mods.block_mask(call, mods, rows, cols, layout, slice_ids=cut)
        if extra is None:
            return allow
        return extra if allow is None else allow & extra

    def like(self, *more: Any) -> tuple[Any, ...]:
        """The arrays a loop's carry is computed from (JAX types its carries by them)."""
        ops, mods = self.ops, self.mods
        ids = () if mods is None else (mods.q_ids, mods.kv_ids, mods.q_pos, mods.kv_pos)
        found = (ops.q, ops.k, ops.v, ops.mask, ops.bias, *ids, *more)
        return tuple(x for x in found if x is not None)


def prepared(
    call: Call,
    loop: BlockLoop,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    mods: Mods | None,
    units: float = 1.0,
) -> Pass:
    """The operands (and segment ids) of a pass, padded to whole blocks on a padded
    loop: padded keys are masked (:meth:`_Pass.band`), padded query rows dropped.
    ``units``: what the scores are multiplied by (``log2(e)`` for scores in base 2)."""
    size = block_size(call, loop)
    ops = operands(call, q, k, v, mask, bias, q_factor=_core.q_factor(call) * units)
    nq, nk = grid(call, size)
    lqp, lkp = nq * size, nk * size

    def scores_operand(x: Any, value: float | bool) -> Any:
        if x is None:
            return None
        if x.shape[-2] != 1:
            x = loop.pad(x, lqp, -2, value)
        if x.shape[-1] != 1:
            x = loop.pad(x, lkp, -1, value)
        return x

    ops = Operands(
        q=loop.pad(ops.q, lqp, -2, 0.0),
        k=loop.pad(ops.k, lkp, -2, 0.0),
        v=loop.pad(ops.v, lkp, -2, 0.0),
        mask=scores_operand(ops.mask, False),
        bias=scores_operand(ops.bias, 0.0),
    )
    if mods is not None and mods.q_ids is not None:

        def ids(x: Any, length: int) -> Any:
            return None if x is None else loop.pad(x, length, -1, 0)

        mods = Mods(
            ids(mods.q_ids, lqp),
            ids(mods.kv_ids, lkp),
            ids(mods.q_pos, lqp),
            ids(mods.kv_pos, lkp),
            mods.score_mod,
            mods.mask_mod,
        )
    return Pass(call, loop, ops, mods, size)


def masked_out(call: Call, allow: Any, host_bool: HostBool | None, mods: Mods | None) -> bool:
    """Whether a block's mask from segment ids or a ``mask_mod`` keeps nothing, where
    that can be read (eagerly: one host read per block; none without ids or a mask_mod)."""
    if host_bool is None or allow is None or mods is None:
        return False
    if mods.q_ids is None and mods.mask_mod is None:
        return False
    return host_bool(call.xp.any(allow)) is False


def block_number(qi: Any, ki: Any, n_key_blocks: int) -> Any:
    """The number of block ``(qi, ki)`` that dropout's keep masks are drawn for."""
    return qi * n_key_blocks + ki


def trimmed(x: Any, length: int, axis: int) -> Any:
    """``x`` cut to ``length`` along ``axis`` (a padded loop's rows past it dropped)."""
    if x.shape[axis] == length:
        return x
    index = [slice(None)] * x.ndim
    index[x.ndim + axis] = slice(0, length)
    return x[tuple(index)]
