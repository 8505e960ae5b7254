"""Sequence layouts across shards, array-API only: which global positions a shard holds.

A layout splits a sequence of length ``L`` over ``P`` shards of ``L / P`` positions:

- ``"contiguous"``: shard ``r`` holds positions ``[r * L/P, (r + 1) * L/P)``.
- ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``L / (2P)``; shard ``r`` holds
  chunks ``r`` and ``2P - 1 - r`` (in that order), so under a causal mask every shard has
  one early and one late chunk and the ring's work is balanced (the dual-chunk split of
  ring-flash-attention and Megatron).
- ``"document_zigzag"``: the zigzag of each packed document, from its segment ids (see
  :mod:`._documents`).

:func:`reorder` permutes a global array so that an even split along the sequence axis
gives each shard its layout's positions; :func:`restore` is its inverse. Both are
reshapes, a flip and a stack (no gather, no fancy indexing), so they run on any array-API
array and under a compiler.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_attention._checks import as_int, type_name
from portable_attention.parallel._documents import DOCUMENT_ZIGZAG

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object, *, documents: bool = False) -> str:
    """``"contiguous"`` or ``"zigzag"`` (or, with ``documents``, ``"document_zigzag"``),
    else a ValueError naming them."""
    known = (*LAYOUTS, DOCUMENT_ZIGZAG) if documents else LAYOUTS
    if layout not in known:
        names = ", ".join(repr(name) for name in known)
        more = "" if documents else f" ({DOCUMENT_ZIGZAG!r} is reorder's and ring_attend's)"
        msg = f"`layout` must be one of {names}{more}, got {layout!r}."
        raise ValueError(msg)
    return str(layout)


def check_shards(num_shards: object) -> int:
    """A number of shards: an int >= 1."""
    number = as_int(num_shards)
    if number is None or number < 1:
        msg = (
            f"`num_shards` must be an int >= 1, got {num_shards!r} of type {type_name(num_shards)}."
        )
        raise ValueError(msg)
    return number


def pieces(layout: str) -> int:
    """Chunks per shard: 1 (contiguous) or 2 (zigzag; per document for document_zigzag)."""
    return 1 if layout == "contiguous" else 2


def check_length(length: int, num_shards: int, layout: str, *, name: str = "the sequence") -> None:
    """The global ``length`` splits evenly into the layout's chunks: ``P`` (contiguous) or
    ``2P`` (zigzag) equal pieces."""
    parts = num_shards * pieces(layout)
    if length % parts:
        fixes = {
            "contiguous": f"pad it to a multiple of {parts}",
            "zigzag": f"pad it to a multiple of {parts} (with a mask or window that hides the "
            "padding) or use layout='contiguous'",
        }
        fix = fixes.get(
            layout,
            f"pad each document at its end to a multiple of {parts} (under a causal mask "
            "padding that keeps the document's id is seen by none of its tokens)",
        )
        msg = (
            f"{name} has length {length}, which layout {layout!r} cannot split over "
            f"{num_shards} shards: it needs a multiple of {parts} "
            f"({'1 chunk' if layout == 'contiguous' else '2 chunks'} per shard); {fix}."
        )
        raise ValueError(msg)


def chunks(length: int, num_shards: int, layout: str, shard: int) -> tuple[tuple[int, int], ...]:
    """The global ``(start, stop)`` of each chunk shard ``shard`` holds, in local order
    (the chunks are consecutive in the shard's local array)."""
    check_length(length, num_shards, layout)
    if layout == "contiguous":
        size = length // num_shards
        return ((shard * size, (shard + 1) * size),)
    size = length // (2 * num_shards)
    late = 2 * num_shards - 1 - shard
    return ((shard * size, (shard + 1) * size), (late * size, (late + 1) * size))


def global_spans(
    length: int, num_shards: int, layout: str, shard: int, span: tuple[int, int]
) -> list[tuple[int, int]]:
    """The global ``(start, stop)`` intervals of the local rows ``span`` of shard
    ``shard`` (one per chunk it touches)."""
    spans, at = [], 0
    for start, stop in chunks(length, num_shards, layout, shard):
        first, last = max(span[0], at), min(span[1], at + stop - start)
        if first < last:
            spans.append((start + first - at, start + last - at))
        at += stop - start
    return spans


def position_table(length: int, num_shards: int, layout: str) -> np.ndarray:
    """``[P, L/P]`` int32: the global position of each local row of each shard (what a
    ring's ``mask_mod`` is called with)."""
    rows = [
        np.concatenate([np.arange(a, b) for a, b in chunks(length, num_shards, layout, r)])
        for r in range(num_shards)
    ]
    return np.stack(rows).astype(np.int32)


def positions(length: int, num_shards: int, layout: str, shard: int) -> list[int]:
    """The global position of each local row of shard ``shard`` (for tests and docs)."""
    return [
        p for start, stop in chunks(length, num_shards, layout, shard) for p in range(start, stop)
    ]


def _axis(x: Any, axis: object) -> int:
    number = as_int(axis)
    if number is None or not -x.ndim <= number < x.ndim:
        msg = (
            f"`axis` must be an int in [-{x.ndim}, {x.ndim}) for an array of shape "
            f"{tuple(x.shape)}, got {axis!r}."
        )
        raise ValueError(msg)
    return number % x.ndim


def permute(xp: Any, x: Any, num_shards: int, layout: str, axis: int, *, inverse: bool) -> Any:
    """:func:`reorder` (``inverse=False``) or :func:`restore` on a validated call."""
    if layout == "contiguous" or num_shards == 1:
        return x
    shape = tuple(x.shape)
    lead, rest = shape[:axis], shape[axis + 1 :]
    size = shape[axis] // (2 * num_shards)
    if not inverse:
        # natural order [2, P, c]: the first half's chunks 0..P-1, the second half's
        # P..2P-1; flipping the second half lines chunk 2P-1-r up with chunk r.
        halves = xp.reshape(x, (*lead, 2, num_shards, size, *rest))
        early = halves[(slice(None),) * axis + (0, ...)]
        late = xp.flip(halves[(slice(None),) * axis + (1, ...)], axis=axis)
        return xp.reshape(xp.stack([early, late], axis=axis + 1), shape)
    # shard order [P, 2, c]: shard r's chunk r, then its chunk 2P-1-r.
    pairs = xp.reshape(x, (*lead, num_shards, 2, size, *rest))
    early = pairs[(slice(None),) * (axis + 1) + (0, ...)]
    late = xp.flip(pairs[(slice(None),) * (axis + 1) + (1, ...)], axis=axis)
    return xp.reshape(xp.concat([early, late], axis=axis), shape)


def prepare(x: Any, num_shards: object, layout: object, axis: object) -> tuple[int, str, int]:
    """Check the arguments of :func:`reorder` / :func:`restore`: ``(P, layout, axis)``."""
    shards = check_shards(num_shards)
    name = check_layout(layout, documents=True)
    ax = _axis(x, axis)
    check_length(
        int(x.shape[ax]), shards, name, name=f"`x` of shape {tuple(x.shape)} along axis {ax}"
    )
    return shards, name, ax
