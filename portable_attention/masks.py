"""Boolean attention masks, array-API only. **True means "may attend"** everywhere.

Builders that take no array argument make NumPy arrays unless given ``xp=`` (any
array-API namespace or framework module: ``torch``, ``jax.numpy``, ``cupy`` ...) and
``device=``. Builders that take arrays use those arrays' namespace and device.
"""

from __future__ import annotations

from functools import reduce
from typing import Any

import array_api_compat

from portable_attention import _validate

__all__ = [
    "causal_mask",
    "combine",
    "key_padding_mask",
    "padding_mask_from_tokens",
    "segment_mask",
    "window_mask",
]


def _namespace(xp: Any) -> Any:
    """The array-API namespace for ``xp`` (None means NumPy)."""
    if xp is None:
        import numpy as xp
    _validate.check_namespace(xp)
    return array_api_compat.array_namespace(xp.asarray(0))


def band(
    xp: Any,
    lq: int,
    lk: int,
    *,
    left: int | None,
    right: int | None,
    align: str,
    device: Any = None,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> Any:
    """Mask keeping keys j with ``-left <= j - p(i) <= right`` on the ``[Lq, Lk]`` grid.

    ``p(i)`` is query i's aligned key position: ``i + (Lk - Lq)`` for "lower_right",
    ``i`` for "upper_left". ``None`` leaves a side unbounded. ``rows``/``cols``
    (``(start, stop)``) select a block of the grid; the core's chunked path uses them.
    """
    q0, q1 = rows if rows is not None else (0, lq)
    k0, k1 = cols if cols is not None else (0, lk)
    # No distance on the grid exceeds lq + lk: larger sides mean unbounded, and clamping
    # keeps them from overflowing (or wrapping in) the framework's integer dtype.
    left = None if left is None else min(left, lq + lk)
    right = None if right is None else min(right, lq + lk)
    offset = lk - lq if align == "lower_right" else 0
    i = xp.reshape(xp.arange(q0, q1, device=device), (q1 - q0, 1))
    j = xp.reshape(xp.arange(k0, k1, device=device), (1, k1 - k0))
    distance = j - (i + offset)
    keep = xp.ones((q1 - q0, k1 - k0), dtype=xp.bool, device=device)
    if left is not None:
        keep = keep & (distance >= -left)
    if right is not None:
        keep = keep & (distance <= right)
    return keep


def causal_mask(
    lq: int,
    lk: int | None = None,
    *,
    align: str = "lower_right",
    xp: Any = None,
    device: Any = None,
) -> Any:
    """Causal mask ``[Lq, Lk]`` (``lk`` defaults to ``lq``).

    Parameters
    ----------
    lq, lk : int
        Query and key lengths.
    align : {"lower_right", "upper_left"}
        ``"lower_right"`` (the default, as ``causal=True``): query i sees keys
        ``j <= i + (Lk - Lq)``, the KV-cache convention. ``"upper_left"``: ``j <= i``.
    xp, device
        Namespace (default NumPy) and device of the result.

    Returns
    -------
    array of bool, shape ``[Lq, Lk]``, True where the query may attend.
    """
    lq = _validate.check_length("lq", lq)
    lk = lq if lk is None else _validate.check_length("lk", lk)
    align = _validate.normalize_align(align)
    return band(_namespace(xp), lq, lk, left=None, right=0, align=align, device=device)


def window_mask(
    lq: int,
    lk: int,
    window: int | tuple[int | None, int | None],
    *,
    align: str = "lower_right",
    xp: Any = None,
    device: Any = None,
) -> Any:
    """Sliding-window (local) mask ``[Lq, Lk]``.

    Key j is kept for query i when ``p - left <= j <= p + right``, ``p`` being the
    query's aligned position (see :func:`causal_mask`). ``window`` is an int ``w``
    (``(w, w)``) or ``(left, right)`` with ints >= 0 or ``None`` for unbounded.
    """
    lq = _validate.check_length("lq", lq)
    lk = _validate.check_length("lk", lk)
    align = _validate.normalize_align(align)
    left, right = _validate.check_window_sides(_validate.normalize_window(window))
    return band(_namespace(xp), lq, lk, left=left, right=right, align=align, device=device)


def key_padding_mask(lengths: Any, lk: int) -> Any:
    """``[B, 1, 1, Lk]`` mask, True for the first ``lengths[b]`` (real) keys of batch b.

    Namespace and device are those of ``lengths`` (an integer array ``[B]``).
    """
    xp = _validate.check_mask_array("lengths", lengths, integer=True)
    lk = _validate.check_length("lk", lk)
    _validate.check_lengths_shape(tuple(lengths.shape))
    device = array_api_compat.device(lengths)
    # Positions in the default integer dtype: arange in a small dtype (uint8) would wrap.
    positions = xp.reshape(xp.arange(lk, device=device), (1, 1, 1, lk))
    lengths = xp.astype(lengths, positions.dtype)
    return positions < xp.reshape(lengths, (lengths.shape[0], 1, 1, 1))


def padding_mask_from_tokens(tokens: Any, pad_id: int) -> Any:
    """``[B, 1, 1, L]`` mask from token ids ``[B, L]``: True where ``tokens != pad_id``."""
    xp = _validate.check_mask_array("tokens", tokens)
    _validate.check_ndim("tokens", tokens, 1, "[B, L]")
    shape = tuple(tokens.shape)
    return xp.reshape(tokens != pad_id, (*shape[:-1], 1, 1, shape[-1]))


def segment_mask(q_segments: Any, k_segments: Any = None) -> Any:
    """Block-diagonal mask for packed sequences: ``[B, 1, Lq, Lk]``, True where ids match.

    ``q_segments [B, Lq]`` and ``k_segments [B, Lk]`` (default: ``q_segments``) hold
    the segment id of each position.
    """
    xp = _validate.check_mask_array("q_segments", q_segments)
    if k_segments is None:
        k_segments = q_segments
    _validate.check_arrays(q_segments=q_segments, k_segments=k_segments)
    _validate.check_ndim("q_segments", q_segments, 1, "[B, Lq]")
    _validate.check_ndim("k_segments", k_segments, 1, "[B, Lk]")
    _validate.check_mask_shapes("q_segments", q_segments, "k_segments", k_segments, "batch dims")
    qs, ks = tuple(q_segments.shape), tuple(k_segments.shape)
    qcol = xp.reshape(q_segments, (*qs[:-1], 1, qs[-1], 1))
    krow = xp.reshape(k_segments, (*ks[:-1], 1, 1, ks[-1]))
    return qcol == krow


def combine(*masks: Any) -> Any:
    """Logical and of boolean masks with broadcasting; ``None`` entries are skipped.

    Returns ``None`` when every mask is ``None`` (no masking).
    """
    named = {f"masks[{i}]": m for i, m in enumerate(masks) if m is not None}
    if not named:
        return None
    _validate.check_bool_masks(named)
    return reduce(lambda a, b: a & b, named.values())
