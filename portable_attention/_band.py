"""The band rule of ``causal`` and ``window``, once for every caller.

Query ``i`` keeps key ``j`` when ``-left <= j - p(i) <= right``, where ``p(i) = i +
offset`` is the query's aligned key position (``offset = Lk - Lq`` lower-right, ``0``
upper-left) and ``causal`` caps ``right`` at 0. The mask builders (``masks.band``), the
kernels' block bounds and traced band (``_core``, ``_block_grid``), the mods' positions
within segments (``_mods``) and the ring's schedule (``parallel/_schedule``) all read it
from here. Plain Python and array-API operators only: this module imports nothing of the
package.
"""

from __future__ import annotations

from typing import Any

_INT32_MAX = 2**31 - 1


def sides(
    causal: str | None, window: tuple[int | None, int | None] | None
) -> tuple[int | None, int | None]:
    """``(left, right)`` of the band of normalised ``causal`` and ``window`` (None:
    unbounded): causal never looks past the aligned position, whatever the window."""
    left, right = window if window is not None else (None, None)
    if causal is not None:
        right = 0
    return left, right


def align_of(causal: str | None) -> str:
    """The alignment of causal and window masks for normalised ``causal``: upper-left only
    when asked for."""
    return "upper_left" if causal == "upper_left" else "lower_right"


def offset(lq: int, lk: int, align: str) -> int:
    """``p(0)``: query 0's aligned key position (``Lk - Lq`` lower-right, else 0)."""
    return lk - lq if align == "lower_right" else 0


def distances(rows: tuple[int, int], cols: tuple[int, int], offset: int) -> tuple[int, int]:
    """The smallest and largest ``j - (i + offset)`` over the block of query rows ``rows``
    and key columns ``cols`` (each ``(start, stop)``): the diagonals the block holds."""
    return cols[0] - (rows[1] - 1) - offset, (cols[1] - 1) - rows[0] - offset


def block_empty(
    rows: tuple[int, int], cols: tuple[int, int], offset: int, left: int | None, right: int | None
) -> bool:
    """Whether the band ``(left, right)`` keeps no score of the block ``rows x cols``."""
    nearest, farthest = distances(rows, cols, offset)
    return (left is not None and farthest < -left) or (right is not None and nearest > right)


def block_full(
    rows: tuple[int, int], cols: tuple[int, int], offset: int, left: int | None, right: int | None
) -> bool:
    """Whether the band ``(left, right)`` keeps every score of the block ``rows x cols``."""
    nearest, farthest = distances(rows, cols, offset)
    return (left is None or nearest >= -left) and (right is None or farthest <= right)


def widest(lq: Any, lk: Any) -> int:
    """A side no distance on the ``[Lq, Lk]`` grid exceeds, ``Lq + Lk``: a larger side keeps
    what an unbounded one keeps, and clamped to it, it cannot overflow (or wrap in) an
    integer dtype. Symbolic lengths (an export with dynamic shapes) cannot be added to a
    Python int: then int32's largest, past any length an index array holds."""
    return lq + lk if type(lq) is int and type(lk) is int else _INT32_MAX


def clamped(side: int | None, wide: int) -> int | None:
    """``side`` clamped to :func:`widest`'s ``wide`` (None stays unbounded)."""
    return None if side is None else min(side, wide)


def within(distance: Any, left: int | None, right: int | None) -> Any:
    """``-left <= distance <= right`` (None: that side unbounded; None if both are)."""
    keep = None
    if left is not None:
        keep = distance >= -left
    if right is not None:
        upper = distance <= right
        keep = upper if keep is None else keep & upper
    return keep


def keep_at(
    i: Any, j: Any, lq: int, lk: int, *, left: int | None, right: int | None, align: str
) -> Any:
    """Whether query positions ``i`` keep key positions ``j`` (broadcasting integer arrays;
    a kernel's may start at a traced offset) on the ``[Lq, Lk]`` grid; None where both
    sides are unbounded."""
    wide = widest(lq, lk)
    return within(j - (i + offset(lq, lk, align)), clamped(left, wide), clamped(right, wide))
