"""What ``sinks``, ``segment_ids``, ``score_mod`` and ``mask_mod`` add to a call of attend.

Array-API only, as :mod:`portable_attention._core`. The three features enter the
computation at three places:

- **sinks** after the softmax's sum: a kernel's ``(out, lse)`` over the keys is merged
  with a "sink" of value 0 and logit ``sink`` (:func:`portable_attention._core.add_sinks`),
  by the one log-sum-exp merge of two partial results. Every path that gives ``lse`` takes sinks
  so, and autodiff (or the blockwise backward's ``dlse``) carries their gradient.
- **segment ids** and **mask_mod** as one more boolean mask of a block of scores
  (:func:`block_mask`), built from the ids and from the index arrays of the block.
- **score_mod** on a block of scores after softcap and bias, before the masks
  (:func:`apply_score_mod`).

:class:`Mods` carries the arrays and functions of a call (the ids, the aligned positions
that causal/window take within segments, the mods) next to the static
:class:`~portable_attention._spec.Call`, which records only that they are there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import array_api_compat

from portable_attention import _band
from portable_attention._block_plan import check_mod_axes
from portable_attention._checks import broadcasts, is_kind, shape_of, type_name
from portable_attention._spec import Call

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature).
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]
#: ``mask_mod(b, h, q_idx, kv_idx) -> bool array``: True = may attend.
MaskMod = Callable[[Any, Any, Any, Any], Any]


@dataclass(frozen=True)
class Mods:
    """The arrays and functions of a call's segment ids and mods.

    ``q_ids [*batch, Lq]`` and ``kv_ids [*batch, Lk]`` (the same array for packed
    self-attention); ``q_pos`` / ``kv_pos`` the coordinates that ``causal``/``window``
    compare within a segment (None where the call's global band is exact: one array of
    ids, or no band).
    """

    q_ids: Any = None
    kv_ids: Any = None
    q_pos: Any = None
    kv_pos: Any = None
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None


def prepare(call: Call, segment_ids: Any, score_mod: Any, mask_mod: Any) -> Mods | None:
    """The :class:`Mods` of a validated call (None where it has none of them)."""
    if call.segments is None and not call.score_mod and not call.mask_mod:
        return None
    q_ids = kv_ids = q_pos = kv_pos = None
    if call.segments is not None:
        q_ids, kv_ids = segment_ids if call.segments == "pair" else (segment_ids, segment_ids)
        if call.segments == "pair" and (call.causal is not None or call.window is not None):
            q_pos = aligned_positions(call.xp, q_ids, call.align)
            kv_pos = aligned_positions(call.xp, kv_ids, call.align)
    mask_fn = getattr(mask_mod, "mask_mod", mask_mod)  # a BlockPlan carries its mask_mod
    return Mods(q_ids, kv_ids, q_pos, kv_pos, score_mod, mask_fn)


def aligned_positions(xp: Any, ids: Any, align: str) -> Any:
    """Each position's coordinate within its segment (all positions of its id, in each
    row of ``ids [*batch, L]``): ``i - end`` (lower-right; ``end`` one past the id's last
    position) or ``i - start`` (upper-left; ``start`` its first position). A query and a
    key of one id, in q's and k's ids, are aligned when their coordinates are equal (as
    ``flash_attn_varlen_func`` aligns the causal mask of each sequence); for one array of
    ids the difference of two coordinates is the difference of the positions.

    By sorting: the positions ordered by (row, id, position) with two stable argsorts,
    each id's group numbered, its first or last member found by ``searchsorted`` on the
    group numbers, and the result put back in place by the inverse permutation."""
    shape = tuple(ids.shape)
    length = shape[-1]
    dev = _device(ids)
    size = math.prod(shape)
    # int32 where the flat indices fit (JAX without x64 has no int64), else int64.
    it = xp.int32 if size + length < 2**31 else xp.int64
    if size == 0:
        return xp.zeros(shape, dtype=it, device=dev)
    flat = xp.reshape(ids, (size,))
    index = xp.arange(size, dtype=it, device=dev)
    row = index // length
    by_id = xp.argsort(flat, stable=True)
    order = xp.take(by_id, xp.argsort(xp.take(row, by_id), stable=True))  # row, id, position
    sorted_ids, sorted_rows = xp.take(flat, order), xp.take(row, order)
    new_group = (sorted_ids[1:] != sorted_ids[:-1]) | (sorted_rows[1:] != sorted_rows[:-1])
    first = xp.zeros((1,), dtype=it, device=dev)
    group = xp.cumulative_sum(xp.concat([first, xp.astype(new_group, it)]))
    if align == "lower_right":
        edge = xp.take(order, xp.astype(xp.searchsorted(group, group, side="right"), it) - 1) + 1
    else:
        edge = xp.take(order, xp.astype(xp.searchsorted(group, group, side="left"), it))
    # Back to the positions' own order: ``order``'s inverse is its argsort.
    edge = xp.take(xp.astype(edge, it), xp.argsort(order))
    return xp.reshape(index - edge, shape)


def _device(x: Any) -> Any:
    return array_api_compat.device(x)


# ------------------------------------------------------------------------------------------
# Blocks of scores: index arrays, score_mod, the mask of segment ids and mask_mod.


def user_shape(call: Call, rows: int, cols: int) -> tuple[int, ...]:
    """The shape of a block of scores as the mods see it: ``[..., Hq, rows, cols]``
    (``[rows, cols]`` for 2-D q)."""
    return (*call.q_shape[:-2], rows, cols)


def indices(
    call: Call, rows: tuple[Any, int], cols: tuple[Any, int], *, lq: int | None = None
) -> tuple[Any, Any, Any, Any]:
    """``(b, h, q_idx, kv_idx)``, int32 index arrays that broadcast against a block of
    scores in :func:`user_shape`: ``b [*batch, 1, 1, 1]`` (the flat batch index), ``h
    [Hq, 1, 1]``, ``q_idx [rows, 1]``, ``kv_idx [1, cols]``. ``rows``/``cols`` are
    ``(start, length)``; ``start`` may be a traced integer (JAX's scan), and indices past
    the call's length (padded blocks) are clipped to the last one."""
    xp, dev, i32 = call.xp, call.device, call.xp.int32
    ndim = len(call.q_shape)
    lead = call.q_shape[:-3] if ndim >= 3 else ()
    count = 1
    for n in lead:
        count *= n
    if ndim >= 4:
        b = xp.reshape(xp.arange(count, dtype=i32, device=dev), (*lead, 1, 1, 1))
    else:
        b = xp.zeros((1,) * ndim, dtype=i32, device=dev)
    if ndim >= 3:
        h = xp.reshape(xp.arange(call.q_shape[-3], dtype=i32, device=dev), (call.q_shape[-3], 1, 1))
    else:
        h = xp.zeros((1, 1), dtype=i32, device=dev)
    q_idx = xp.reshape(_positions(xp, rows, call.q_shape[-2], dev), (rows[1], 1))
    kv_idx = xp.reshape(_positions(xp, cols, call.k_shape[-2], dev), (1, cols[1]))
    return b, h, q_idx, kv_idx


def _positions(xp: Any, span: tuple[Any, int], length: int, dev: Any) -> Any:
    start, n = span
    idx = xp.arange(n, dtype=xp.int32, device=dev) + start
    if not isinstance(start, int) or start + n > length:
        idx = xp.minimum(idx, max(length - 1, 0))
    return xp.astype(idx, xp.int32, copy=False)


def apply_score_mod(
    call: Call, mods: Mods, s: Any, rows: tuple[Any, int], cols: tuple[Any, int]
) -> Any:
    """``score_mod`` of a block of scores ``s`` (the kernels' layout, heads grouped),
    called in :func:`user_shape` and checked: the same shape, the scores' dtype."""
    xp = call.xp
    assert mods.score_mod is not None
    shape = user_shape(call, rows[1], cols[1])
    given = xp.reshape(s, shape)
    got = mods.score_mod(given, *indices(call, rows, cols))
    check_score_mod_result(got, shape, s.dtype, xp)
    return xp.reshape(got, tuple(s.shape))


def block_mask(
    call: Call,
    mods: Mods,
    rows: tuple[Any, int],
    cols: tuple[Any, int],
    layout: tuple[int, ...],
    *,
    slice_ids: Callable[[Any, tuple[Any, int]], Any] | None = None,
) -> Any:
    """The mask of segment ids (with causal/window within segments where they need
    positions) and ``mask_mod`` on a block, broadcastable to ``layout`` (the kernels'
    shape of the block of scores); None where neither is given. ``slice_ids(x, span)``
    cuts ``span`` from the last axis of an ids array (default: a static slice)."""
    xp = call.xp
    cut = slice_ids or _cut
    keep = None
    if mods.q_ids is not None:
        qi = cut(mods.q_ids, rows)
        ki = cut(mods.kv_ids, cols)
        # The ids' leading dims align with q's batch dims (from the right), then heads.
        heads = len(layout) - 2 - len(call.q_shape[:-3])
        if call.unknown_dims:  # one array of ids, whole (no reshape of unknown dims)
            q_col, k_row = xp.expand_dims(qi, axis=-1), xp.expand_dims(ki, axis=-2)
            for _ in range(heads):
                q_col, k_row = xp.expand_dims(q_col, axis=-3), xp.expand_dims(k_row, axis=-3)
        else:
            q_col = xp.reshape(qi, (*qi.shape[:-1], *(1,) * heads, rows[1], 1))
            k_row = xp.reshape(ki, (*ki.shape[:-1], *(1,) * heads, 1, cols[1]))
        keep = q_col == k_row
        if mods.q_pos is not None:
            qp = xp.reshape(cut(mods.q_pos, rows), tuple(q_col.shape))
            kp = xp.reshape(cut(mods.kv_pos, cols), tuple(k_row.shape))
            band = _band.within(kp - qp, *call.band_sides)
            if band is not None:
                keep = keep & band
    if mods.mask_mod is not None:
        shape = user_shape(call, rows[1], cols[1])
        got = mods.mask_mod(*indices(call, rows, cols))
        check_mask_mod_result(xp, got, shape)
        if call.blocks is not None:
            plan = call.blocks
            check_mod_axes(shape_of(got), heads=plan.heads, batch=plan.batch)
        if got.ndim > 2 and tuple(layout) != shape:  # per head: split like the scores' heads
            got = xp.reshape(xp.broadcast_to(got, shape), layout)
        keep = got if keep is None else keep & got
    return keep


def _cut(x: Any, span: tuple[Any, int]) -> Any:
    start, n = span
    return x[..., start : None if n is None else start + n]  # None: all (unknown length)


def _check_framework(xp: Any, got: Any, name: str, inputs: str) -> None:
    """Where a mod's result is refused: if it is another framework's array, a TypeError
    that says so (a mod written with torch operations, called on NumPy index arrays,
    returns a torch tensor whose dtype would otherwise be the puzzle in the message)."""
    try:
        returned = array_api_compat.array_namespace(got)
    except TypeError:  # not an array: the caller's message says what to return
        return
    if returned is not xp:
        framework = xp.__name__.removeprefix("array_api_compat.")
        msg = (
            f"`{name}` returned a {type_name(got)}, but {inputs} are {framework} arrays: "
            "write it with its inputs' namespace (e.g. `xp = "
            "array_api_compat.array_namespace(q_idx)`) or with the framework of q, k, v."
        )
        raise TypeError(msg)


def check_score_mod_result(got: Any, shape: tuple[int, ...], dtype: Any, xp: Any) -> None:
    """A score_mod must return the scores' shape and dtype."""
    got_shape = getattr(got, "shape", None)
    if got_shape is None or tuple(got_shape) != shape or got.dtype != dtype:
        _check_framework(xp, got, "score_mod", "its inputs (the scores, the index arrays)")
        what = f"{type_name(got)}" if got_shape is None else f"{shape_of(got)} {got.dtype}"
        hint = (
            "return `score` modified elementwise (e.g. `score + bias[h, q_idx, kv_idx]`), "
            "not a reduction or a Python number"
        )
        if got_shape is not None and tuple(got_shape) == shape:  # the dtype alone differs
            hint = (
                f"cast what you combine with it to {dtype} (NumPy promotes float32 with "
                "int32 indices to float64: use e.g. `xp.astype(q_idx - kv_idx, score.dtype)`)"
            )
        msg = (
            f"`score_mod` must return an array of the scores' shape and dtype ({shape} "
            f"{dtype}), got {what}; {hint}."
        )
        raise ValueError(msg) if got_shape is not None and got.dtype == dtype else TypeError(msg)


def check_mask_mod_result(xp: Any, got: Any, shape: tuple[int, ...]) -> None:
    """A mask_mod must return booleans that broadcast to the block's shape."""
    got_shape = getattr(got, "shape", None)
    if got_shape is None or not is_kind(xp, got.dtype, "bool"):
        _check_framework(xp, got, "mask_mod", "its inputs (the index arrays)")
        what = type_name(got) if got_shape is None else f"dtype {got.dtype}"
        msg = (
            f"`mask_mod` must return a boolean array (True = may attend), got {what}; "
            "compare the indices, e.g. `q_idx >= kv_idx`."
        )
        raise TypeError(msg)
    if not broadcasts(shape_of(got), shape):
        msg = (
            f"`mask_mod` returned shape {shape_of(got)}, which does not broadcast to the "
            f"block of scores {shape} ([..., Hq, rows, cols])."
        )
        raise ValueError(msg)


def backward_score_mod_error() -> ValueError:
    """``attend_backward`` cannot differentiate a user's function."""
    msg = (
        "`attend_backward` does not take `score_mod`: its derivative needs autodiff. "
        "Differentiate `attend(..., score_mod=...)` with torch autograd or `jax.grad` "
        "(both give the score_mod's captured arrays their gradients too)."
    )
    return ValueError(msg)


def unsupported(call: Call, kernel: str) -> str | None:
    """Why a fused kernel (named ``kernel``) declines a call with sinks, segment ids or
    mods (None: the call has none of them)."""
    if call.score_mod or call.mask_mod:
        return (
            f"{kernel} takes no score_mod/mask_mod: the portable path applies them block by block"
        )
    if call.segments is not None:
        return (
            f"{kernel} takes no segment ids: the portable path builds each block's mask from "
            "them (its blockwise path skips blocks with no matching pair)"
        )
    if call.sinks_shape is not None:
        return f"{kernel} has no attention sinks and returns no lse to merge them with"
    return None
