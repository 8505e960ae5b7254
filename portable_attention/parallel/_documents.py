"""The per-document zigzag layout of packed sequences, array-API only.

A packed sequence holds several documents, each a run of equal segment ids. Under a
causal document mask the plain zigzag layout balances the work only when one document
fills the sequence; ``"document_zigzag"`` balances every document: each is cut into
``2P`` chunks of ``len / (2P)``, and shard ``r`` holds, document after document, chunks
``r`` and ``2P - 1 - r`` of each. These are the per-rank positions of
ring-flash-attention's varlen zigzag functions (``extract_local`` of its
``test/test_zigzag_ring_flash_attn_varlen_func.py``) and the per-rank picture of torch's
``_PerDocumentHeadTailLoadBalancer`` docstring (``torch.distributed.tensor.experimental.
_context_parallel._load_balancer``).

On the ring, the shard's rows are regrouped into its two *halves*: the chunks ``r`` of
all its documents, then the chunks ``2P - 1 - r``. A query of half ``a`` of shard ``r``
and a key of half ``b`` of shard ``s`` of one document then relate exactly as in the
plain zigzag layout (chunk ``r`` or ``2P - 1 - r`` against ``s`` or ``2P - 1 - s``), and
within a half one document's positions keep their order: the plain zigzag schedule with
the segment ids computes the causal document mask exactly (:func:`halves`).

Everything is computed from the ids with array-API calls (a cumulative sum, two
``searchsorted`` and an ``argsort``), so it runs under ``jax.jit`` too; the checks that
read the ids on the host run where they are not traced.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

from portable_attention._checks import type_name
from portable_attention.backends import adapter

#: The layout's name, beside :data:`~._layout.LAYOUTS` (which need no ids).
DOCUMENT_ZIGZAG = "document_zigzag"


def _runs(xp: Any, ids: Any) -> tuple[Any, Any, Any]:
    """For each entry of ``ids [..., n]``: its offset in its run of equal ids, the run's
    length (a run never crosses a row) and its position in the row. No array is made on
    a device of its own: everything derives from ``ids`` (a sharded JAX array too)."""
    n = ids.shape[-1]
    flat = xp.reshape(ids, (-1,))
    index = xp.cumulative_sum(xp.ones_like(flat)) - 1
    column = index % n
    changed = xp.concat([flat[:1] != flat[:1], flat[1:] != flat[:-1]])
    run = xp.cumulative_sum(xp.astype(changed | (column == 0), index.dtype))
    start = xp.astype(xp.searchsorted(run, run, side="left"), index.dtype)
    stop = xp.astype(xp.searchsorted(run, run, side="right"), index.dtype)
    shape = ids.shape
    return (
        xp.reshape(index - start, shape),
        xp.reshape(stop - start, shape),
        xp.reshape(column, shape),
    )


def order(xp: Any, ids: Any, num_shards: int) -> Any:
    """``[..., L]``: the natural position of each position of the per-document zigzag
    order (shard ``r``'s rows are ``order[..., r * L/P : (r + 1) * L/P]``)."""
    offset, length, column = _runs(xp, ids)
    chunk = (offset * (2 * num_shards)) // length
    shard = xp.where(chunk < num_shards, chunk, 2 * num_shards - 1 - chunk)
    return xp.argsort(shard * ids.shape[-1] + column, axis=-1, stable=True)


def halves(xp: Any, ids: Any) -> Any:
    """``[..., L/P]``: a shard's rows in per-document zigzag order regrouped into its
    halves (each document's first half of rows, then each one's second half)."""
    offset, length, column = _runs(xp, ids)
    late = xp.astype(2 * offset >= length, offset.dtype)
    return xp.argsort(late * ids.shape[-1] + column, axis=-1, stable=True)


def inverse(xp: Any, permutation: Any) -> Any:
    """The inverse of a permutation along the last axis."""
    return xp.argsort(permutation, axis=-1, stable=True)


def take(xp: Any, x: Any, permutation: Any, axis: int) -> Any:
    """``x`` permuted along ``axis`` by ``permutation [..., n]``, whose leading axes are
    ``x``'s leading axes (or 1): one permutation per batch entry, shared by the heads."""
    axis %= x.ndim
    lead = permutation.shape[:-1]
    shape = (*lead, *(1,) * (axis - len(lead)), x.shape[axis], *(1,) * (x.ndim - axis - 1))
    index = xp.broadcast_to(xp.reshape(permutation, shape), x.shape)
    return xp.take_along_axis(x, index, axis=axis)


def batched(xp: Any, ids: Any, q: Any) -> Any:
    """A shard's ids ``[..., L/P]`` with as many leading axes as ``q``'s batch axes
    (``q.ndim - 3``), 1s in front: ``attend`` aligns the ids' leading axes with the batch
    axes from the right, :func:`take` from the left."""
    missing = q.ndim - 2 - ids.ndim
    return xp.reshape(ids, (*(1,) * missing, *ids.shape)) if missing > 0 else ids


def check_ids(ids: Any, x: Any, axis: int) -> None:
    """The ids fit ``x``: an integer array ``[..., n]`` with ``n`` the length of ``x``
    along ``axis`` and leading axes that are ``x``'s leading axes (or 1)."""
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
        msg = f"`segment_ids` must be an integer array [..., L], got {type_name(ids)}."
        raise TypeError(msg)
    if not array_api_compat.array_namespace(ids).isdtype(ids.dtype, "integral"):
        msg = f"`segment_ids` must be an integer array, got dtype {ids.dtype}."
        raise TypeError(msg)
    axis %= x.ndim
    lead, shape = tuple(ids.shape[:-1]), tuple(x.shape)
    fits = ids.ndim >= 1 and ids.shape[-1] == shape[axis] and len(lead) <= axis
    if not fits or any(a not in (1, b) for a, b in zip(lead, shape, strict=False)):
        msg = (
            f"`segment_ids` of shape {tuple(ids.shape)} do not fit `x` of shape {shape} along "
            f"axis {axis}: they must be [..., {shape[axis]}] with leading axes that are x's "
            "leading axes (or 1)."
        )
        raise ValueError(msg)


def ids_of(xp: Any, like: Any, length: int, segment_ids: Any, cu_seqlens: Any) -> Any:
    """The segment ids of the layout: ``segment_ids`` as given, or the document number of
    each position from ``cu_seqlens`` (``[0, len_0, len_0 + len_1, ..., L]``)."""
    if (segment_ids is None) == (cu_seqlens is None):
        msg = (
            f"layout {DOCUMENT_ZIGZAG!r} cuts each document: pass its documents as "
            "`segment_ids=` (one id per position) or `cu_seqlens=` (their boundaries), "
            "exactly one of them."
        )
        raise ValueError(msg)
    if segment_ids is not None:
        return _like(xp, like, segment_ids)
    if not isinstance(cu_seqlens, (list, tuple)) and adapter(_backend(cu_seqlens)).traced(
        cu_seqlens
    ):
        msg = (
            "`cu_seqlens` are read on the host, but these are traced (under jax.jit): pass "
            "them as Python ints, or pass `segment_ids`, which trace."
        )
        raise ValueError(msg)
    bounds = _host(cu_seqlens)
    rises = bounds.ndim == 1 and bounds.size >= 2 and np.issubdtype(bounds.dtype, np.integer)
    if not rises or bounds[0] != 0 or bounds[-1] != length or np.any(np.diff(bounds) < 0):
        msg = (
            f"`cu_seqlens` must be 1-D integers rising from 0 to the sequence's length "
            f"{length} ([0, len_0, len_0 + len_1, ..., {length}]), got {bounds.tolist()}."
        )
        raise ValueError(msg)
    return _like(xp, like, np.searchsorted(bounds[1:], np.arange(length), side="right"))


def _like(xp: Any, x: Any, ids: Any) -> Any:
    """The ids as an array of ``x``'s framework (NumPy ids with torch or JAX arrays, as a
    data loader gives them), on ``x``'s device where that is one device."""
    if isinstance(ids, (list, tuple)) or _backend(ids) != _backend(x):
        host = _host(ids)
        try:
            return xp.asarray(host, device=array_api_compat.device(x))
        except (TypeError, ValueError):  # a sharding over several devices (JAX)
            return xp.asarray(host)
    return ids


def _host(x: Any) -> np.ndarray:
    """A list, NumPy or other framework's array of ints as a NumPy array."""
    if isinstance(x, (list, tuple, np.ndarray)):
        return np.asarray(x)
    return np.asarray(adapter(_backend(x)).to_host(x))


def _backend(x: Any) -> str:
    from portable_attention._spec import check_arrays

    return check_arrays(segment_ids=x)[1]


def check_documents(ids: Any, num_shards: int | None) -> None:
    """Where the ids can be read: every document (a run of equal ids) has a length that
    is a multiple of ``2P`` (``num_shards=None``: one shard's ids, each document's two
    chunks, an even length), and no id names two runs of a row."""
    if adapter(_backend(ids)).traced(ids):
        return
    host = _host(ids).reshape(-1, ids.shape[-1])
    parts = 2 * (num_shards or 1)
    for row in host:
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        lengths = np.diff(np.append(starts, row.size))
        bad = np.flatnonzero(lengths % parts)
        if bad.size:
            at, size = int(starts[bad[0]]), int(lengths[bad[0]])
            where = (
                f"the document of id {row[at]} at positions [{at}, {at + size}) has length {size}"
            )
            if num_shards is None:
                msg = (
                    f"layout {DOCUMENT_ZIGZAG!r}: a shard holds two equal chunks of each "
                    f"document, but in this shard's `segment_ids` {where}: pass the shard's "
                    f"ids in that layout (`reorder(ids, P, {DOCUMENT_ZIGZAG!r}, axis=-1, ...)` "
                    "of the global ids, split evenly)."
                )
            else:
                msg = (
                    f"layout {DOCUMENT_ZIGZAG!r} cuts each document into {parts} chunks (2 "
                    f"per shard, {num_shards} shards), but {where}: pad each document at its "
                    f"end to a multiple of {parts} (under a causal mask padding that keeps the "
                    "document's id is seen by none of its tokens), or use layout='zigzag'."
                )
            raise ValueError(msg)
        values, counts = np.unique(row[starts], return_counts=True)
        if np.any(counts > 1):
            msg = (
                f"layout {DOCUMENT_ZIGZAG!r} takes each document as one run of its id, but id "
                f"{values[counts > 1][0]} names {int(counts[counts > 1][0])} runs of a row: "
                "give each document its own id."
            )
            raise ValueError(msg)
