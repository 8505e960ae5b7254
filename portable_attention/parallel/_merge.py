"""The guarded log-sum-exp merge of partial attention results, array-API only.

Two partial results ``(out_a, lse_a)`` and ``(out_b, lse_b)`` over disjoint key sets
combine into the result over their union::

    lse = log(exp(lse_a) + exp(lse_b))
    out = (exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b)

by the package's one guarded log-sum-exp merge, :func:`portable_attention._core.merge_lse`
(also the merge of a sink): a row with no key in either part (both lse ``-inf``) stays
``out = 0``, ``lse = -inf``, and no gradient through it is NaN. The merge computes in the
dtype of its operands: float64 stays float64.
"""

from __future__ import annotations

from typing import Any

from portable_attention import _core


def merge(xp: Any, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """``(out, lse)`` of the union of two partial results (``out [..., L, D]``,
    ``lse [..., L]``, one dtype)."""
    lse, wa, wb = _core.merge_lse(xp, lse_a, lse_b)
    return wa[..., None] * out_a + wb[..., None] * out_b, lse


def splice(xp: Any, whole: Any, rows: tuple[int, int], part: Any, axis: int) -> Any:
    """``whole`` with ``rows`` along ``axis`` (negative) replaced by ``part``: a
    functional update (no in-place write) for any array-API array."""
    n = whole.shape[axis]
    if rows == (0, n):
        return part
    after = (slice(None),) * (-axis - 1)
    pieces = []
    if rows[0] > 0:
        pieces.append(whole[(..., slice(0, rows[0]), *after)])
    pieces.append(part)
    if rows[1] < n:
        pieces.append(whole[(..., slice(rows[1], n), *after)])
    return xp.concat(pieces, axis=axis)


def merge_rows(
    xp: Any, acc_out: Any, acc_lse: Any, rows: tuple[int, int], out: Any, lse: Any
) -> tuple[Any, Any]:
    """Merge a partial result of the query rows ``rows`` into the running ``(out, lse)``
    of all local rows."""
    cut_out = acc_out[..., rows[0] : rows[1], :]
    cut_lse = acc_lse[..., rows[0] : rows[1]]
    new_out, new_lse = merge(xp, cut_out, cut_lse, out, lse)
    return splice(xp, acc_out, rows, new_out, -2), splice(xp, acc_lse, rows, new_lse, -1)


def add_rows(xp: Any, acc: Any, rows: tuple[int, int], part: Any) -> Any:
    """``acc`` with ``part`` added to its ``rows`` along axis -2 (gradient accumulation)."""
    return splice(xp, acc, rows, acc[..., rows[0] : rows[1], :] + part, -2)
