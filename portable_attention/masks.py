"""Boolean attention masks, array-API only. **True means "may attend"** everywhere.

Builders that take no array argument make NumPy arrays unless given ``xp=`` (any
array-API namespace or framework module: ``torch``, ``jax.numpy``, ``cupy`` ...) and
``device=``. Builders that take arrays use those arrays' namespace and device.
"""

from __future__ import annotations

from functools import reduce
from typing import Any

import array_api_compat

from portable_attention import _spec
from portable_attention._checks import as_int, broadcast_shape, is_kind, shape_of
from portable_attention._spec import check_arrays, namespace_of

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
    _check_namespace(xp)
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
    lq = _check_length("lq", lq)
    lk = lq if lk is None else _check_length("lk", lk)
    align = _spec.normalize_align(align)
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
    lq = _check_length("lq", lq)
    lk = _check_length("lk", lk)
    align = _spec.normalize_align(align)
    left, right = _check_window_sides(_spec.normalize_window(window))
    return band(_namespace(xp), lq, lk, left=left, right=right, align=align, device=device)


def key_padding_mask(lengths: Any, lk: int) -> Any:
    """``[B, 1, 1, Lk]`` mask, True for the first ``lengths[b]`` (real) keys of batch b.

    Namespace and device are those of ``lengths`` (an integer array ``[B]``).
    """
    xp = _check_mask_array("lengths", lengths, integer=True)
    lk = _check_length("lk", lk)
    _check_lengths_shape(tuple(lengths.shape))
    device = array_api_compat.device(lengths)
    # Positions in the default integer dtype: arange in a small dtype (uint8) would wrap.
    positions = xp.reshape(xp.arange(lk, device=device), (1, 1, 1, lk))
    lengths = xp.astype(lengths, positions.dtype)
    return positions < xp.reshape(lengths, (lengths.shape[0], 1, 1, 1))


def padding_mask_from_tokens(tokens: Any, pad_id: int) -> Any:
    """``[B, 1, 1, L]`` mask from token ids ``[B, L]``: True where ``tokens != pad_id``."""
    xp = _check_mask_array("tokens", tokens)
    _check_ndim("tokens", tokens, 1, "[B, L]")
    shape = tuple(tokens.shape)
    return xp.reshape(tokens != pad_id, (*shape[:-1], 1, 1, shape[-1]))


def segment_mask(q_segments: Any, k_segments: Any = None) -> Any:
    """Block-diagonal mask for packed sequences: ``[B, 1, Lq, Lk]``, True where ids match.

    ``q_segments [B, Lq]`` and ``k_segments [B, Lk]`` (default: ``q_segments``) hold
    the segment id of each position.
    """
    xp = _check_mask_array("q_segments", q_segments)
    if k_segments is None:
        k_segments = q_segments
    _spec.check_arrays(q_segments=q_segments, k_segments=k_segments)
    _check_ndim("q_segments", q_segments, 1, "[B, Lq]")
    _check_ndim("k_segments", k_segments, 1, "[B, Lk]")
    _check_mask_shapes("q_segments", q_segments, "k_segments", k_segments, "batch dims")
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
    _check_bool_masks(named)
    return reduce(lambda a, b: a & b, named.values())


# -- argument checks and messages of this module ----------------------------------------


def _check_mask_array(name: str, x: Any, *, integer: bool = False) -> Any:
    """Namespace of a mask-builder argument; check it is an array (of integers if asked)."""
    xp = namespace_of(name, x)
    if integer and not is_kind(xp, x.dtype, "integral"):
        msg = f"`{name}` must be an integer array, got dtype {x.dtype}."
        raise TypeError(msg)
    return xp


def _check_bool_masks(named: dict[str, Any]) -> None:
    """Masks to combine: arrays of one framework and device, boolean, shapes that broadcast."""
    xp, _, _ = check_arrays(**named)
    shape: tuple[int, ...] = ()
    for name, m in named.items():
        if not is_kind(xp, m.dtype, "bool"):
            msg = f"`{name}` must be boolean (True = may attend), got dtype {m.dtype}."
            raise TypeError(msg)
        combined = broadcast_shape(shape, shape_of(m))
        if combined is None:
            msg = (
                f"`{name}` of shape {shape_of(m)} does not broadcast with the masks before it "
                f"{shape}."
            )
            raise ValueError(msg)
        shape = combined


def _check_namespace(xp: object) -> None:
    """``xp=`` of the mask builders: an array namespace or a framework module."""
    if not callable(getattr(xp, "asarray", None)) or not callable(getattr(xp, "arange", None)):
        msg = (
            f"`xp` must be an array namespace or framework module (numpy, torch, jax.numpy, "
            f"cupy, array_api_strict), got {xp!r}."
        )
        raise TypeError(msg)


def _check_ndim(name: str, x: Any, least: int, layout: str) -> None:
    """A mask-builder array with at least ``least`` dims."""
    if x.ndim < least:
        msg = f"`{name}` must have shape {layout}, got {tuple(x.shape)}."
        raise ValueError(msg)


def _check_length(name: str, value: object) -> int:
    """A sequence length for the mask builders: an int >= 0 (NumPy integers too)."""
    length = as_int(value)
    if length is None or length < 0:
        msg = f"`{name}` must be an int >= 0, got {value!r}."
        raise ValueError(msg)
    return length


def _check_mask_shapes(name_a: str, a: Any, name_b: str, b: Any, axes: str) -> None:
    """Mask-builder inputs whose leading (batch) shapes must agree."""
    if shape_of(a)[:-1] != shape_of(b)[:-1]:
        msg = f"`{name_a}` {shape_of(a)} and `{name_b}` {shape_of(b)} must have the same {axes}."
        raise ValueError(msg)


def _check_window_sides(
    sides: tuple[int | None, int | None] | None,
) -> tuple[int | None, int | None]:
    """``window`` of ``window_mask`` after :func:`normalize_window`: not None."""
    if sides is None:
        msg = "`window` must be an int or a (left, right) pair, got None."
        raise ValueError(msg)
    return sides


def _check_lengths_shape(shape: tuple[int, ...]) -> None:
    """``lengths`` of ``key_padding_mask``: one axis ``[B]``."""
    if len(shape) != 1:
        msg = f"`lengths` must have shape [B], got {shape}."
        raise ValueError(msg)
