"""A ``mask_mod``'s block plan: which blocks of the score grid it masks entirely.

:func:`block_plan` evaluates a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` once
over the ``[Lq, Lk]`` grid in blocks of ``block_size`` and records the blocks where it
keeps some score (and those where it keeps all). Passed to ``attend(mask_mod=plan)``, the
blockwise path computes only the kept blocks (in a static list, so under ``jax.jit`` too),
and calls the ``mask_mod`` only on blocks it keeps partly. Built once, it is reused by
every call of those lengths, as FlexAttention's ``BlockMask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from portable_attention._checks import as_int, backend_name, type_name


@dataclass(frozen=True)
class BlockLayout:
    """What a :class:`BlockPlan` says about the score grid, without its ``mask_mod``.

    A call's description (:class:`~portable_attention._spec.Call`, and so every cache keyed
    by it) holds this, never the plan: it is plain data, compared and hashed by value (the
    hash computed once), so no cache keeps the user's function or what it captures alive,
    and two plans of the same blocks share their cache entries. Attributes as
    :class:`BlockPlan`'s.
    """

    q_len: int
    kv_len: int
    block_size: int
    batch: int | None
    heads: int | None
    kept: tuple[tuple[int, int], ...]
    full: frozenset[tuple[int, int]]
    _hash: ClassVar[int]  # set per instance, once: not a field

    def __post_init__(self) -> None:  # the hash once (not a field: pickles rebuild it)
        object.__setattr__(self, "_hash", hash(self._fields()))

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.q_len,
            self.kv_len,
            self.block_size,
            self.batch,
            self.heads,
            self.kept,
            self.full,
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # from the fields: a hash of another process (of None, say) must not come along
        return (BlockLayout, self._fields())

    @property
    def density(self) -> float:
        """The fraction of the grid's blocks that are computed."""
        nq = -(-self.q_len // self.block_size)
        nk = -(-self.kv_len // self.block_size)
        return len(self.kept) / max(nq * nk, 1)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity
class BlockPlan:
    """Which ``block_size`` blocks of the score grid a ``mask_mod`` keeps.

    Attributes
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).
    layout : BlockLayout
        The blocks, without the function (what a call keeps of the plan).
    q_len, kv_len, block_size : int
        The grid it was built for.
    batch, heads : int or None
        The batch size and query heads the mod was evaluated over (None: it does not
        depend on ``b`` / ``h`` and was evaluated at 0).
    kept : tuple of (int, int)
        The ``(query block, key block)`` pairs where the mod keeps at least one score,
        query block by query block.
    full : frozenset of (int, int)
        The kept pairs where it keeps every score (no mask is applied there).
    """

    mask_mod: Any
    layout: BlockLayout

    q_len = property(lambda self: self.layout.q_len)
    kv_len = property(lambda self: self.layout.kv_len)
    block_size = property(lambda self: self.layout.block_size)
    batch = property(lambda self: self.layout.batch)
    heads = property(lambda self: self.layout.heads)
    kept = property(lambda self: self.layout.kept)
    full = property(lambda self: self.layout.full)

    @property
    def density(self) -> float:
        """The fraction of the grid's blocks that are computed."""
        return self.layout.density

    def __repr__(self) -> str:
        return (
            f"BlockPlan(q_len={self.q_len}, kv_len={self.kv_len}, block_size="
            f"{self.block_size}, kept {len(self.kept)} blocks ({self.density:.1%}), "
            f"{len(self.full)} full)"
        )


def block_plan(
    mask_mod: Any,
    q_len: int,
    kv_len: int,
    *,
    batch: int | None = None,
    heads: int | None = None,
    block_size: int = 128,
    like: Any = None,
) -> BlockPlan:
    """The block plan of ``mask_mod`` on a ``[q_len, kv_len]`` grid (FlexAttention's
    ``create_block_mask``).

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool array``, called with int32 index arrays
        ``b [B, 1, 1, 1]``, ``h [H, 1, 1]``, ``q_idx [rows, 1]``, ``kv_idx [1, cols]``.
    q_len, kv_len : int
        The query and key lengths of the calls it is for.
    batch, heads : int, optional
        Evaluate over this many batch rows / query heads, for a mod that reads ``b`` /
        ``h``; None: at index 0 only (the mod must not depend on it).
    block_size : int
        Block length of the blockwise path that uses the plan (its ``chunk_size``).
    like : array, optional
        The indices are made in this array's namespace and on its device (default NumPy),
        so a mod written with torch or JAX operations runs as written.

    Returns
    -------
    BlockPlan
        Pass it as ``attend(..., mask_mod=plan)``.
    """
    import array_api_compat
    import array_api_compat.numpy as numpy_namespace

    from portable_attention.backends import adapter

    q_len, kv_len, size = (
        _check_length("q_len", q_len),
        _check_length("kv_len", kv_len),
        _check_length("block_size", block_size, least=1),
    )
    n_batch = None if batch is None else _check_length("batch", batch, least=1)
    n_heads = None if heads is None else _check_length("heads", heads, least=1)
    if not callable(mask_mod):
        msg = (
            "`mask_mod` must be a function `mask_mod(b, h, q_idx, kv_idx) -> bool`, got "
            f"{type_name(mask_mod)}."
        )
        raise TypeError(msg)
    xp = array_api_compat.array_namespace(like) if like is not None else numpy_namespace
    dev = None if like is None else array_api_compat.device(like)
    i32 = xp.int32
    b = xp.reshape(xp.arange(n_batch or 1, dtype=i32, device=dev), (n_batch or 1, 1, 1, 1))
    h = xp.reshape(xp.arange(n_heads or 1, dtype=i32, device=dev), (n_heads or 1, 1, 1))
    kv_idx = xp.reshape(xp.arange(kv_len, dtype=i32, device=dev), (1, kv_len))
    nq, nk = -(-q_len // size), -(-kv_len // size)
    _check_axes_used(mask_mod, xp, dev, n_batch, n_heads, min(size, q_len), kv_idx)
    kept: list[tuple[int, int]] = []
    full: set[tuple[int, int]] = set()
    for qi in range(nq):
        r0, r1 = qi * size, min((qi + 1) * size, q_len)
        q_idx = xp.reshape(xp.arange(r0, r1, dtype=i32, device=dev), (r1 - r0, 1))
        got = mask_mod(b, h, q_idx, kv_idx)
        if not hasattr(got, "dtype") or not _is_bool(xp, got):
            msg = (
                f"`mask_mod` must return a boolean array (True = may attend), got "
                f"{type_name(got)}; compare the indices, e.g. `q_idx >= kv_idx`."
            )
            raise TypeError(msg)
        row = np.broadcast_to(
            adapter(backend_name(got)).to_host(got), (n_batch or 1, n_heads or 1, r1 - r0, kv_len)
        )
        for ki in range(nk):
            block = row[..., ki * size : min((ki + 1) * size, kv_len)]
            if block.any():
                kept.append((qi, ki))
                if block.all():
                    full.add((qi, ki))
    layout = BlockLayout(q_len, kv_len, size, n_batch, n_heads, tuple(kept), frozenset(full))
    return BlockPlan(mask_mod, layout)


def _check_axes_used(
    mask_mod: Any, xp: Any, dev: Any, batch: int | None, heads: int | None, rows: int, kv_idx: Any
) -> None:
    """A plan built without ``heads=`` (``batch=``) is evaluated at index 0 only: a mod
    whose result has a head (batch) axis, seen by calling it once with two heads (batch
    rows), would have blocks skipped that other heads need."""
    if rows == 0 or (heads is not None and batch is not None):
        return
    i32 = xp.int32
    b = xp.reshape(xp.arange(batch or 2, dtype=i32, device=dev), (batch or 2, 1, 1, 1))
    h = xp.reshape(xp.arange(heads or 2, dtype=i32, device=dev), (heads or 2, 1, 1))
    q_idx = xp.reshape(xp.arange(rows, dtype=i32, device=dev), (rows, 1))
    got = mask_mod(b, h, q_idx, kv_idx)
    check_mod_axes(tuple(getattr(got, "shape", ())), heads=heads, batch=batch)


def check_mod_axes(shape: tuple[int, ...], *, heads: int | None, batch: int | None) -> None:
    """A mask_mod result of ``shape`` has a head (batch) axis while the plan was built
    without ``heads=`` (``batch=``): refused, at the plan's build and at each block."""
    for name, axis, given in (("heads", -3, heads), ("batch", -4, batch)):
        if given is None and len(shape) >= -axis and shape[axis] > 1:
            what = "head" if name == "heads" else "batch row"
            msg = (
                f"`mask_mod` reads `{name[0]}` (its result has a {what} axis, shape {shape}): "
                f"build the plan with `{name}=` (without it only index 0 is evaluated, and "
                "blocks other heads or rows need would be skipped)."
            )
            raise ValueError(msg)


def _is_bool(xp: Any, x: Any) -> bool:
    try:
        return bool(x.dtype == xp.bool)
    except TypeError:
        return False


def check_plan_for(
    plan: BlockPlan, qs: tuple[int, ...], ks: tuple[int, ...], chunk_size: object
) -> None:
    """A block plan passed to attend must be for the call's lengths, batch and heads, and
    its block size is the call's ``chunk_size``."""
    batch = 1
    for n in qs[:-3]:
        batch *= n
    heads = qs[-3] if len(qs) >= 3 else 1
    problems = []
    if (plan.q_len, plan.kv_len) != (qs[-2], ks[-2]):
        problems.append(
            f"it was built for q_len={plan.q_len}, kv_len={plan.kv_len} but q has "
            f"{qs[-2]} queries and k {ks[-2]} keys"
        )
    if plan.batch is not None and plan.batch != batch:
        problems.append(f"it was built for batch={plan.batch}, the call has {batch}")
    if plan.heads is not None and plan.heads != heads:
        problems.append(f"it was built for heads={plan.heads}, the call has {heads}")
    size = as_int(chunk_size) if chunk_size is not None else None
    if size is not None and size != plan.block_size:
        problems.append(
            f"its block_size={plan.block_size} is the blockwise path's block length, but "
            f"chunk_size={chunk_size} was given (drop chunk_size, or build the plan with it)"
        )
    if problems:
        msg = f"`mask_mod` is a block plan that does not fit this call: {'; '.join(problems)}."
        raise ValueError(msg)


def _check_length(name: str, value: object, *, least: int = 0) -> int:
    number = as_int(value)
    if number is None or number < least:
        msg = f"`{name}` must be an int >= {least}, got {value!r}."
        raise ValueError(msg)
    return number
