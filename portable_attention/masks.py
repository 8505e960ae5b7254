"""Boolean attention masks, array-API only. **True means "may attend"** everywhere.

Builders that take no array argument make NumPy arrays unless given ``xp=`` (any
array-API namespace or framework module: ``torch``, ``jax.numpy``, ``cupy`` ...) and
``device=``. Builders that take arrays use those arrays' namespace and device.
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Any

import array_api_compat

from portable_attention import _band, _options, _spec
from portable_attention._block_plan import BlockLayout, BlockPlan, block_plan
from portable_attention._checks import as_int, backend_name, broadcast_shape, is_kind, shape_of
from portable_attention._spec import check_arrays, namespace_of
from portable_attention.backends import adapter

__all__ = [
    "BlockLayout",
    "BlockPlan",
    "block_plan",
    "causal_mask",
    "combine",
    "key_padding_mask",
    "padding_mask_from_tokens",
    "segment_ids_from_cu_seqlens",
    "segment_ids_from_lengths",
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
    (``(start, stop)``) select a block of the grid; the blockwise path uses them.
    """
    q0, q1 = rows if rows is not None else (0, lq)
    k0, k1 = cols if cols is not None else (0, lk)
    i = xp.reshape(xp.arange(q0, q1, device=device), (q1 - q0, 1))
    j = xp.reshape(xp.arange(k0, k1, device=device), (1, k1 - k0))
    keep = _band.keep_at(i, j, lq, lk, left=left, right=right, align=align)
    if keep is None:
        return xp.ones((q1 - q0, k1 - k0), dtype=xp.bool, device=device)
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
    align = _options.normalize_align(align)
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
    align = _options.normalize_align(align)
    left, right = _check_window_sides(_options.normalize_window(window))
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


def segment_ids_from_lengths(lengths: Any, total: int | None = None) -> Any:
    """Segment ids ``[*batch, total]`` of packed sequences, from their lengths.

    Position ``p`` of a row gets the index (``0 .. n - 1``) of the segment it falls in,
    the segments lying one after another from position 0 in the order of ``lengths``.
    The result is ready for ``attend(..., segment_ids=...)``.

    Parameters
    ----------
    lengths : integer array ``[*batch, n]``
        The length (>= 0) of each of the ``n`` segments of each row. A segment of length
        0 takes no position (its index appears nowhere).
    total : int, optional
        The number of positions of every row. Default: the longest row's sum of lengths
        (the sum for 1-D ``lengths``), read on the host; required where ``lengths`` is
        traced (under ``jax.jit``) or lazy (dask), where the result's shape must be
        static.

    Returns
    -------
    array ``[*batch, total]`` of the default integer dtype
        In the namespace and on the device of ``lengths``. Positions past a row's sum of
        lengths get id ``-1`` (padding). Padding positions attend each other only, as one
        more segment would: mask those query rows out of the loss, or drop them.

    Raises
    ------
    TypeError
        ``lengths`` is not an integer array.
    ValueError
        ``lengths`` is 0-d or holds a negative length, or ``total`` is not an int >= 0 or
        is smaller than a row's sum of lengths. The checks that read values (negative
        lengths, a too small ``total``) run where ``lengths`` is concrete (NumPy, PyTorch,
        CuPy, JAX outside a trace); under ``jax.jit`` or ``torch.compile`` they are
        skipped and such lengths give meaningless ids (a too small ``total`` cuts the
        segments off at ``total``).

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention import masks
    >>> masks.segment_ids_from_lengths(np.array([2, 0, 3])).tolist()
    [0, 0, 2, 2, 2]
    >>> masks.segment_ids_from_lengths(np.array([[1, 2], [3, 1]])).tolist()
    [[0, 1, 1, -1], [0, 0, 0, 1]]
    """
    xp = _check_mask_array("lengths", lengths, integer=True)
    _check_ndim("lengths", lengths, 1, "[*batch, n]")
    total = _check_segment_lengths(xp, lengths, total)
    shape = tuple(lengths.shape)
    batch, n = shape[:-1], shape[-1]
    rows = math.prod(batch)
    device = array_api_compat.device(lengths)
    positions = xp.arange(total, device=device)  # the default integer dtype: no wrapping
    ends = xp.cumulative_sum(xp.astype(lengths, positions.dtype), axis=-1)
    ends = xp.reshape(xp.clip(ends, max=total), (rows, n))  # each row's ends, in [0, total]
    # One sorted 1-D array for every row: row r's ends and positions shifted by r * total.
    # Position p of row r then counts all ends of the rows before r (r * n of them) and
    # its own row's ends <= p: the index of its segment.
    row = xp.reshape(xp.arange(rows, device=device), (rows, 1))
    flat_ends = xp.reshape(ends + row * total, (rows * n,))
    flat_positions = xp.reshape(xp.reshape(positions, (1, total)) + row * total, (rows * total,))
    found = xp.astype(xp.searchsorted(flat_ends, flat_positions, side="right"), positions.dtype)
    ids = xp.reshape(found, (rows, total)) - row * n
    ids = xp.where(ids < n, ids, xp.full_like(ids, -1))
    return xp.reshape(ids, (*batch, total))


def segment_ids_from_cu_seqlens(cu_seqlens: Any, total: int | None = None) -> Any:
    """Segment ids ``[total]`` from FlashAttention's varlen ``cu_seqlens``.

    For users of ``flash_attn_varlen_func``: segment ``s`` holds the positions
    ``cu_seqlens[s] <= p < cu_seqlens[s + 1]``. Queries and keys have their own
    ``cu_seqlens``; pass ``segment_ids=(segment_ids_from_cu_seqlens(cu_seqlens_q),
    segment_ids_from_cu_seqlens(cu_seqlens_k))`` to ``attend`` (the packed tokens
    ``[total, H, D]`` laid out as ``[H, total, D]``).

    Parameters
    ----------
    cu_seqlens : integer array ``[n + 1]``
        The cumulative sequence lengths: starts at 0, non-decreasing (int32 in
        FlashAttention; any integer dtype here).
    total : int, optional
        The number of positions. Default ``cu_seqlens[-1]``, read on the host; required
        where ``cu_seqlens`` is traced (under ``jax.jit``) or lazy (dask).

    Returns
    -------
    array ``[total]`` of the default integer dtype
        In the namespace and on the device of ``cu_seqlens``. Positions from
        ``cu_seqlens[-1]`` on get id ``-1`` (padding; they attend each other only: mask
        or drop them).

    Raises
    ------
    TypeError
        ``cu_seqlens`` is not an integer array.
    ValueError
        ``cu_seqlens`` is not 1-D with at least one entry, does not start at 0 or
        decreases, or ``total`` is not an int >= 0 or is smaller than ``cu_seqlens[-1]``.
        The checks that read values run where ``cu_seqlens`` is concrete, as in
        :func:`segment_ids_from_lengths`.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention import masks
    >>> masks.segment_ids_from_cu_seqlens(np.array([0, 2, 2, 5], dtype=np.int32)).tolist()
    [0, 0, 2, 2, 2]
    >>> masks.segment_ids_from_cu_seqlens(np.array([0, 1, 3], dtype=np.int32), 5).tolist()
    [0, 1, 1, -1, -1]
    """
    xp = _check_mask_array("cu_seqlens", cu_seqlens, integer=True)
    total = _check_cu_seqlens(xp, cu_seqlens, total)
    n = shape_of(cu_seqlens)[0] - 1
    positions = xp.arange(total, device=array_api_compat.device(cu_seqlens))
    ends = xp.clip(xp.astype(cu_seqlens[1:], positions.dtype), max=total)
    ids = xp.searchsorted(ends, positions, side="right")  # the segments ending at or before p
    ids = xp.astype(ids, positions.dtype)  # JAX's searchsorted gives int32
    return xp.where(ids < n, ids, xp.full_like(ids, -1))


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


def _is_traced(x: Any) -> bool:
    """Whether ``x``'s values cannot be read on the host (its framework's adapter says:
    a JAX tracer, a tensor while ``torch.compile`` traces)."""
    return adapter(backend_name(x)).traced(x)


def _check_total(total: object, need: int | None, name: str, what: str) -> int:
    """``total`` of the segment-id builders: an int >= 0, at least ``need`` positions (when
    known; None where the array ``name`` is traced); ``None`` means ``need``."""
    if total is None:
        if need is None:
            msg = (
                f"`total` is required when `{name}` is traced (under jax.jit or "
                "torch.compile) or lazy (a dask array, which reading would compute): the "
                "ids' length must be known without reading them; pass `total=` (the number "
                "of positions)."
            )
            raise ValueError(msg)
        return need
    checked = _check_length("total", total)
    if need is not None and checked < need:
        msg = f"`total` ({checked}) is smaller than {what} ({need} positions)."
        raise ValueError(msg)
    return checked


def _check_segment_lengths(xp: Any, lengths: Any, total: object) -> int:
    """``lengths`` of :func:`segment_ids_from_lengths`: no negative length (where the values
    can be read); return ``total``, checked against the longest row."""
    need = None
    if not _is_traced(lengths):
        if math.prod(tuple(lengths.shape)) == 0:
            need = 0
        else:
            smallest = int(xp.min(lengths))
            if smallest < 0:
                msg = f"`lengths` must be >= 0 (segment lengths), got a length {smallest}."
                raise ValueError(msg)
            need = int(xp.max(xp.sum(xp.astype(lengths, xp.arange(1).dtype), axis=-1)))
    return _check_total(total, need, "lengths", "the longest row of `lengths`")


def _check_cu_seqlens(xp: Any, cu_seqlens: Any, total: object) -> int:
    """``cu_seqlens`` of :func:`segment_ids_from_cu_seqlens`: ``[n + 1]``, from 0,
    non-decreasing (where the values can be read); return ``total``, checked."""
    shape = tuple(cu_seqlens.shape)
    if len(shape) != 1 or shape[0] < 1:
        msg = f"`cu_seqlens` must have shape [n + 1] (1-D, starting with 0), got {shape}."
        raise ValueError(msg)
    need = None
    if not _is_traced(cu_seqlens):
        first = int(cu_seqlens[0])
        if first != 0:
            msg = f"`cu_seqlens` must start at 0 (cumulative lengths), got {first} first."
            raise ValueError(msg)
        steps = cu_seqlens[1:] - cu_seqlens[:-1]
        if shape[0] > 1 and bool(xp.any(steps < 0)):
            at = int(xp.argmax(xp.astype(steps < 0, xp.int8)))
            before, after = int(cu_seqlens[at]), int(cu_seqlens[at + 1])
            msg = (
                f"`cu_seqlens` must be non-decreasing (cumulative lengths), got {before} "
                f"then {after} at index {at + 1}."
            )
            raise ValueError(msg)
        need = int(cu_seqlens[-1])
    return _check_total(total, need, "cu_seqlens", "`cu_seqlens[-1]`")
