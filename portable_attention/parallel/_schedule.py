"""The ring's schedule, framework-free: which blocks each shard computes at each step.

At ring step ``t`` shard ``r`` holds the K/V shard of shard ``(r - shift_t) mod P``. The
global ``causal``/``window`` band relates its query chunks to the visiting key chunks; the
schedule turns that relation into a few calls of :func:`portable_attention.attend` on
``rows x cols`` sub-blocks of the local arrays, each with a ``causal``/``window`` of its
own (lower-right aligned on the sub-block) that reproduces the global band exactly:

- chunk pairs whose band is the same diagonal band are computed in one call (zigzag's
  first step is one ``causal=True`` call on the whole local arrays);
- rows and columns the band leaves empty are cut off (a sub-block whose rows all see
  every key is a plain, unmasked call);
- pairs the band masks entirely are not computed, and ring steps where no shard has
  work are skipped (a window narrower than a shard touches two steps of ``P``).

Everything here is integers: the schedule is built once per configuration
(``functools.lru_cache``) and is the same Python object on every shard, so each framework
runs it its own way (JAX: one ``lax.switch`` branch per distinct block list, chosen by
the axis index; torch: each rank runs its own list).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from portable_attention import _band
from portable_attention._block_plan import BlockLayout
from portable_attention.parallel._layout import chunks, global_spans, pieces

#: A band of diagonals ``lo <= j - i <= hi`` in some block's local coordinates
#: (``-inf``/``inf`` for an unbounded side).
Band = tuple[float, float]


@dataclass(frozen=True)
class Block:
    """One ``attend`` call of a ring step: local query ``rows``, visiting key ``cols``.

    ``causal`` and ``window`` are the call's own options on the ``rows x cols`` sub-block
    (lower-right aligned, as :func:`portable_attention.attend` takes them); both unset
    means every score of the sub-block is kept. ``lo, hi``: the band in the sub-block's
    coordinates (``lo <= j - i <= hi`` is kept), for counting the work.
    """

    rows: tuple[int, int]
    cols: tuple[int, int]
    causal: bool
    window: tuple[int | None, int | None] | None
    lo: float
    hi: float
    #: Whether the block calls the ring's ``mask_mod`` (False: its block plan keeps every
    #: score of the block, so no mask is built).
    masked: bool = True

    @property
    def area(self) -> int:
        """Scores computed (rows times columns)."""
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])

    @property
    def kept(self) -> int:
        """Scores the band keeps in this block (the work a kernel that skips masked
        scores does)."""
        nq, nk = self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]
        total = 0
        for i in range(nq):
            first = max(0, i + self.lo)
            last = min(nk - 1, i + self.hi)
            total += max(0, int(last - first) + 1)
        return total


@dataclass(frozen=True)
class Step:
    """One ring step: shard ``r`` computes ``blocks[r]`` against the K/V shard of shard
    ``(r - shift) % P``."""

    shift: int
    blocks: tuple[tuple[Block, ...], ...]


@dataclass(frozen=True)
class Schedule:
    """The ring's steps for one configuration; see :func:`schedule`."""

    num_shards: int
    layout: str
    q_length: int
    k_length: int
    causal: str | None
    window: tuple[int | None, int | None] | None
    steps: tuple[Step, ...]

    @property
    def transfers(self) -> int:
        """K/V shard transfers of the forward pass (one per step after the first, and
        one before the first where it is not the shard's own)."""
        shifts = [0, *(step.shift for step in self.steps)]
        return sum(1 for a, b in itertools.pairwise(shifts) if b != a)

    def work(self) -> list[list[int]]:
        """Kept scores per step (rows) and shard (columns), per head and batch entry."""
        return [[sum(b.kept for b in blocks) for blocks in step.blocks] for step in self.steps]

    def balance(self) -> float:
        """Load balance of the schedule: the sum over steps of the busiest shard's work
        over the sum of the mean work (1.0: perfectly balanced; each step waits for its
        busiest shard)."""
        work = self.work()
        busiest = sum(max(row) for row in work)
        mean = sum(sum(row) / len(row) for row in work)
        return busiest / mean if mean else 1.0


def band_of(
    causal: str | None, window: tuple[int | None, int | None] | None, q_length: int, k_length: int
) -> tuple[float, float, int]:
    """``(left, right, offset)`` of the global band: key ``j`` is kept for query ``i``
    when ``-left <= j - (i + offset) <= right`` (as :func:`portable_attention.attend`:
    causal caps ``right`` at 0; lower-right alignment unless ``"upper_left"``)."""
    left, right = _band.sides(causal, window)
    offset = _band.offset(q_length, k_length, _band.align_of(causal))
    return (
        math.inf if left is None else float(left),
        math.inf if right is None else float(right),
        offset,
    )


@dataclass(frozen=True)
class _Pair:
    """A (query chunk, key chunk) pair inside a candidate group: its rectangle in the
    group's coordinates and its true band there."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    band: Band

    def clip(self, band: Band) -> tuple[float, float] | None:
        """The diagonals of ``band`` this rectangle holds (None: none)."""
        dmin, dmax = _band.distances(self.rows, self.cols, 0)
        lo, hi = max(band[0], dmin), min(band[1], dmax)
        return (lo, hi) if lo <= hi else None


def _fit(pairs: list[_Pair]) -> Band | None:
    """One band that keeps exactly what each pair's own band keeps in its rectangle, or
    None where no single band does."""
    los = {-math.inf, *(p.band[0] for p in pairs)}
    his = {math.inf, *(p.band[1] for p in pairs)}
    for p in pairs:  # bands that pass beside an empty pair
        if p.clip(p.band) is None:
            los.add(float(p.cols[1] - 1 - p.rows[0] + 1))
            his.add(float(p.cols[0] - (p.rows[1] - 1) - 1))
    for lo in sorted(los):
        for hi in sorted(his, reverse=True):
            if lo <= hi and all(p.clip((lo, hi)) == p.clip(p.band) for p in pairs):
                return lo, hi
    return None


def _block(rows: tuple[int, int], cols: tuple[int, int], band: Band) -> Block | None:
    """The sub-block of ``rows x cols`` (local offsets) that ``band`` (in the block's
    coordinates) leaves non-empty, with the ``causal``/``window`` that express it; None
    where nothing is kept."""
    nq, nk = rows[1] - rows[0], cols[1] - cols[0]
    lo, hi = band
    i0, i1 = max(0, -hi), min(nq, nk - lo)
    if i0 >= i1:
        return None
    k0, k1 = max(0, i0 + lo), min(nk, i1 + hi)
    if k0 >= k1:
        return None
    i0, i1, k0, k1 = int(i0), int(i1), int(k0), int(k1)
    # Lower-right alignment on the sub-block puts diagonal k1 - i1 at distance 0.
    corner = k1 - i1
    sub_lo, sub_hi = lo - (k0 - i0), hi - (k0 - i0)  # the band in the sub-block
    nq2, nk2 = i1 - i0, k1 - k0
    aligned = nk2 - nq2
    left = None if math.isinf(lo) else int(corner - lo)
    right = None if math.isinf(hi) else int(hi - corner)
    if left is not None and left >= nq2 - 1 + aligned:
        left = None  # wider than the sub-block: keeps every score on that side
    if right is not None and right >= nk2 - 1 - aligned:
        right = None
    causal = right == 0 and left is None
    window = None if causal or (left is None and right is None) else (left, right)
    return Block(
        rows=(rows[0] + i0, rows[0] + i1),
        cols=(cols[0] + k0, cols[0] + k1),
        causal=causal,
        window=window,
        lo=sub_lo,
        hi=sub_hi,
    )


def _groupings(nq: int, nk: int) -> list[list[tuple[range, range]]]:
    """Ways to cut ``nq`` query chunks x ``nk`` key chunks into rectangular groups."""
    whole = [(range(nq), range(nk))]
    by_rows = [(range(i, i + 1), range(nk)) for i in range(nq)]
    by_cols = [(range(nq), range(j, j + 1)) for j in range(nk)]
    single = [(range(i, i + 1), range(j, j + 1)) for i in range(nq) for j in range(nk)]
    return [whole, by_rows, by_cols, single]


def _device_blocks(
    q_chunks: tuple[tuple[int, int], ...],
    k_chunks: tuple[tuple[int, int], ...],
    left: float,
    right: float,
    offset: int,
) -> tuple[Block, ...]:
    """The blocks one shard computes against one visiting K/V shard."""
    q_local = _local_starts(q_chunks)
    k_local = _local_starts(k_chunks)
    best: tuple[tuple[int, int], tuple[Block, ...]] | None = None
    for grouping in _groupings(len(q_chunks), len(k_chunks)):
        blocks: list[Block] = []
        for qs, ks in grouping:
            r0, c0 = q_local[qs[0]], k_local[ks[0]]
            r1 = q_local[qs[-1]] + _size(q_chunks[qs[-1]])
            c1 = k_local[ks[-1]] + _size(k_chunks[ks[-1]])
            pairs = []
            for i in qs:
                for j in ks:
                    qa, ka = q_local[i] - r0, k_local[j] - c0
                    # global j - (i + offset) = local (j - i) + e
                    e = (k_chunks[j][0] - ka) - (q_chunks[i][0] - qa) - offset
                    pairs.append(
                        _Pair(
                            rows=(qa, qa + _size(q_chunks[i])),
                            cols=(ka, ka + _size(k_chunks[j])),
                            band=(-left - e, right - e),
                        )
                    )
            fitted = _fit(pairs)
            if fitted is None:
                break
            block = _block((r0, r1), (c0, c1), fitted)
            if block is not None:
                blocks.append(block)
        else:
            score = (len(blocks), sum(b.area for b in blocks))
            if best is None or score < best[0]:
                best = (score, tuple(blocks))
    assert best is not None  # one chunk pair always fits its own band
    return best[1]


def _size(chunk: tuple[int, int]) -> int:
    return chunk[1] - chunk[0]


def _local_starts(chunk_list: tuple[tuple[int, int], ...]) -> list[int]:
    starts, at = [], 0
    for chunk in chunk_list:
        starts.append(at)
        at += _size(chunk)
    return starts


@functools.lru_cache(maxsize=256)
def schedule(
    num_shards: int,
    layout: str,
    q_length: int,
    k_length: int,
    causal: str | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> Schedule:
    """The ring schedule of ``num_shards`` shards for global lengths ``q_length`` and
    ``k_length`` (multiples of the layout's chunk count), ``causal`` (None,
    ``"lower_right"`` or ``"upper_left"``) and ``window`` (``(left, right)`` or None)."""
    left, right, offset = band_of(causal, window, q_length, k_length)
    steps = []
    for shift in range(num_shards):
        per_device: list[tuple[Block, ...]] = []
        for r in range(num_shards):
            source = (r - shift) % num_shards
            q_chunks = chunks(q_length, num_shards, layout, r)
            k_chunks = chunks(k_length, num_shards, layout, source)
            if q_length == 0 or k_length == 0:
                per_device.append(())
                continue
            per_device.append(_device_blocks(q_chunks, k_chunks, left, right, offset))
        if any(per_device):
            steps.append(Step(shift=shift, blocks=tuple(per_device)))
    assert pieces(layout) in (1, 2)
    return Schedule(
        num_shards=num_shards,
        layout=layout,
        q_length=q_length,
        k_length=k_length,
        causal=causal,
        window=window,
        steps=tuple(steps),
    )


def pruned(plan: Schedule, layout: BlockLayout) -> Schedule:
    """``plan`` with only the blocks where a block plan (a ``mask_mod``'s
    :class:`~portable_attention.masks.BlockLayout` over the global lengths) keeps a
    score: a block whose plan blocks are all full calls no mask (``masked=False``), one
    with none kept is dropped, and so is a step with no block left on any shard. Exact:
    a plan block is kept where its mod keeps any score."""
    size = layout.block_size
    grid = np.zeros((-(-plan.q_length // size), -(-plan.k_length // size)), dtype=np.int8)
    for qi, ki in layout.kept:
        grid[qi, ki] = 2 if (qi, ki) in layout.full else 1

    def blocks_of(length: int, shard: int, span: tuple[int, int]) -> list[int]:
        spans = global_spans(length, plan.num_shards, plan.layout, shard, span)
        return sorted({i for a, b in spans for i in range(a // size, (b - 1) // size + 1)})

    steps = []
    for step in plan.steps:
        per_shard = []
        for r, blocks in enumerate(step.blocks):
            source = (r - step.shift) % plan.num_shards
            kept = []
            for block in blocks:
                cells = grid[
                    np.ix_(
                        blocks_of(plan.q_length, r, block.rows),
                        blocks_of(plan.k_length, source, block.cols),
                    )
                ]
                if cells.any():
                    kept.append(dataclasses.replace(block, masked=not bool((cells == 2).all())))
            per_shard.append(tuple(kept))
        if any(per_shard):
            steps.append(Step(shift=step.shift, blocks=tuple(per_shard)))
    return dataclasses.replace(plan, steps=tuple(steps))
