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


def offset(lq: int, lk: int, align: str) -> int:
    """``p(0)``: query 0's aligned key position (``Lk - Lq`` lower-right, else 0)."""
    return lk - lq if align == "lower_right" else 0


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
    # No distance on the grid exceeds lq + lk: larger sides mean unbounded, and clamping
    # keeps them from overflowing (or wrapping in) the framework's integer dtype. Symbolic
    # lengths (an export with dynamic shapes) cannot be compared: the bound is then
    # int32's largest, past any length an index array holds.
    bound = lq + lk if type(lq) is int and type(lk) is int else _INT32_MAX
    left = None if left is None else min(left, bound)
    right = None if right is None else min(right, bound)
    return within(j - (i + offset(lq, lk, align)), left, right)
