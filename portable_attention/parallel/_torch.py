"""torch.distributed: the ring with ``batch_isend_irecv`` and Ulysses with
``all_to_all_single``, each a ``torch.autograd.Function``.

Imported only when torch tensors reach :mod:`portable_attention.parallel`.

Each rank runs its own blocks of the schedule (its rank in the group is its shard).
Tensors that travel together are packed into one buffer per dtype, so a forward step
sends one message (K and V together); the next shard's transfer is started before the
current step's blocks are computed, and waited for after them.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from portable_attention import _spec
from portable_attention._checks import type_name
from portable_attention._options import Options
from portable_attention.parallel import _agree, _layout, _ring
from portable_attention.parallel._schedule import Schedule

XP: Any = None


def _xp() -> Any:
    global XP
    if XP is None:
        import array_api_compat

        XP = array_api_compat.array_namespace(torch.zeros(1))
    return XP


# -- what parallel/__init__ asks of either framework's collectives ------------------------


def check_link(axis_name: object, group: object, what: str) -> None:
    """torch tensors go with ``group``: ``axis_name`` (a JAX mesh axis) is a TypeError
    that says what to pass."""
    if axis_name is not None:
        msg = (
            f"`axis_name` names a JAX mesh axis, but `{what}` got torch tensors: pass a "
            "torch.distributed ProcessGroup (or a 1-D DeviceMesh) as `group=`, or nothing "
            "for the world group."
        )
        raise TypeError(msg)


def ring_options(
    axis_name: object,
    group: object,
    q: Any,
    k: Any,
    v: Any,
    given: dict[str, Any],
    layout: str,
    refused: Exception | None,
) -> tuple[Any, Options]:
    """The ring's group and its options, normalised once and agreed by every rank (the
    ring's segment ids travel with K/V; whether a score_mod takes autograd's route too)."""
    link = resolve_group(group, q)
    route: dict[str, object] = {
        "autograd route (a score_mod with grad mode on)": differentiated(given["score_mod"])
    }
    travels = {"segment_ids": given["segment_ids"]}
    options = _agree.agree(
        check_agreement, link, q, k, v, given, layout, travels=travels, refused=refused, extra=route
    )
    return link, options


def ulysses_shard(
    axis_name: object,
    group: object,
    q: Any,
    k: Any,
    v: Any,
    options: dict[str, Any],
    layout: str,
) -> tuple[Any, int, int, Options]:
    """Ulysses' group, its size, this rank's index and the options, normalised once and
    agreed by every rank."""
    link = resolve_group(group, q)
    normalised = _agree.agree(check_agreement, link, q, k, v, options, layout)
    return link, group_size(link), group_rank(link), normalised


def fold_rng(rng: Any, index: int) -> Any:
    """Each rank's dropout generator is its own: kept as given."""
    return rng


def permute_sharded(x: Any, size: int, layout: str, axis: int, *, inverse: bool) -> None:
    """A rank's tensor holds no other rank's shards: None, the array-API permutation
    runs."""
    return None


def resolve_group(group: object, x: Any) -> Any:
    """The ProcessGroup of ``group`` (None: the world group; a 1-D DeviceMesh: its
    group), checked against torch.distributed's state and the tensors' device."""
    if not dist.is_available() or not dist.is_initialized():
        msg = (
            "torch.distributed is not initialized: call "
            "`torch.distributed.init_process_group(backend, ...)` on every rank first "
            "(gloo for CPU tensors, nccl for CUDA), or call `attend` on one device."
        )
        raise RuntimeError(msg)
    if group is None:
        group = dist.group.WORLD
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            msg = (
                f"`group` is a DeviceMesh of {group.ndim} dims {tuple(group.shape)}; pass a "
                "1-D mesh (e.g. `mesh['seq']`) or its ProcessGroup."
            )
            raise ValueError(msg)
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        msg = (
            f"`group` for torch tensors must be a torch.distributed ProcessGroup or a 1-D "
            f"DeviceMesh (None: the world group), got {type_name(group)}; a JAX mesh axis "
            "goes with JAX arrays as `axis_name=`."
        )
        raise TypeError(msg)
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl" and x.device.type != "cuda":
        msg = (
            f"`group` uses the NCCL backend, which moves CUDA tensors, but the tensors are on "
            f"{x.device}: move them to the rank's GPU (`.cuda(local_rank)`) or use a gloo "
            "group for CPU tensors (`torch.distributed.new_group(backend='gloo')`)."
        )
        raise ValueError(msg)
    return group


def _device_mesh_type() -> Any:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device meshes
        return None
    return DeviceMesh


def check_agreement(group: Any, arrays: dict[str, Any], options: dict[str, object]) -> None:
    """Every rank holds shards of the same shapes and dtypes and calls with the same
    options, found by one small all-reduce: unequal shards would deadlock or corrupt the
    ring's transfers, and unequal options make each rank compute its own attention, so
    the global result would be silently wrong. Where they differ, every rank learns it
    from the same all-reduce and raises (after one gather of what each rank has, to name
    the ranks)."""
    first = arrays["q"]
    slots = [n for x in arrays.values() for n in _array_slots(x)]
    slots += [n for value in options.values() for n in _option_slots(value)]
    mine = torch.tensor([*slots, *(-n for n in slots)], dtype=torch.int64, device=first.device)
    seen = mine.clone()
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)  # max, and -min, per slot
    if torch.equal(seen, mine):
        return
    described = {
        name: "None" if x is None else f"{tuple(x.shape)} {x.dtype}" for name, x in arrays.items()
    }
    described.update({name: repr(value) for name, value in options.items()})
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, described, group=group)
    differ = [name for name in described if len({d[name] for d in every}) > 1]
    held = "; ".join(
        f"`{name}`: " + ", ".join(f"rank {r} {d[name]}" for r, d in enumerate(every))
        for name in differ
    )
    if any(name in arrays for name in differ):
        msg = (
            f"the ranks of the group hold shards of unequal shapes or dtypes ({held}): "
            "every rank must hold an equal slice of the sequence; pad the sequence to a "
            "multiple of the layout's chunk count and split it evenly (see "
            "`portable_attention.parallel.reorder`)."
        )
    else:
        msg = (
            f"the ranks of the group call with different options ({held}): each would "
            "compute its own attention and the global result would be wrong; pass the same "
            "options on every rank."
        )
    raise ValueError(msg)


def _array_slots(x: Any) -> list[int]:
    """A shard's rank, dtype and first 8 dims (-1 past its rank; the product of the rest
    in the last), a fixed count of int64 slots whatever the array (all -2: None)."""
    if x is None:
        return [-2] * 10
    dims = list(x.shape)
    if len(dims) > 8:
        dims = [*dims[:7], math.prod(dims[7:])]
    return [x.ndim, zlib.crc32(str(x.dtype).encode()), *dims, *[-1] * (8 - len(dims))]


def _option_slots(value: object) -> list[int]:
    """An option as three int64 slots (kind, two values), equal for equal options."""
    if value is None:
        return [0, 0, 0]
    if isinstance(value, bool):
        return [1, int(value), 0]
    if isinstance(value, int):
        return [2, min(value, 2**62), 0]
    if isinstance(value, float):
        return [3, struct.unpack("<q", struct.pack("<d", value))[0], 0]
    if isinstance(value, str):
        return [4, zlib.crc32(value.encode()), 0]
    if isinstance(value, tuple) and len(value) == 2:  # a window: sides >= 0 or None
        left, right = (-1 if side is None else min(int(side), 2**62) for side in value)
        return [5, left, right]
    msg = f"an option of type {type(value).__name__} cannot be compared across ranks"
    raise TypeError(msg)


@dataclass(frozen=True)
class Ring:
    """One ring call's fixed parts."""

    group: Any
    rank: int
    size: int
    plan: Schedule
    options: Options
    #: The user's mods (seeing global positions), or None.
    mods: _ring.UserMods | None = None
    #: With mods: the layout's ``[P, L/P]`` tables of query and key positions, on the
    #: tensors' device (built once per call).
    positions: tuple[Any, Any] | None = None

    def peer(self, shift: int) -> int:
        """The global rank ``shift`` places after this one in the group."""
        return int(dist.get_global_rank(self.group, (self.rank + shift) % self.size))


class _Pending:
    """Tensors in flight: started by :func:`send`, received by :meth:`wait`."""

    def __init__(self, works: Sequence[Any], buffers: list[Any], layout: list[Any]) -> None:
        self.works, self.buffers, self.layout = works, buffers, layout

    def wait(self) -> list[Any]:
        for work in self.works:
            work.wait()
        received: list[Any] = [None] * sum(len(idx) for idx, _ in self.layout)
        for buffer, (indices, shapes) in zip(self.buffers, self.layout, strict=True):
            parts = torch.split(buffer, [int(torch.Size(s).numel()) for s in shapes])
            for i, part, shape in zip(indices, parts, shapes, strict=True):
                received[i] = part.view(shape)
        return received


#: Message tags of the gradient accumulators (K/V use 0, 1, ...): both may be in flight.
ACC_TAG = 16


def send(ring: Ring, tensors: Sequence[Any], shift: int, *, tag: int = 0) -> _Pending:
    """Send ``tensors`` to the rank ``shift`` ahead and receive as many from the rank
    ``shift`` behind (one ``batch_isend_irecv``; one message per dtype)."""
    shift %= ring.size
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    if shift == 0:
        return _Done(list(tensors))
    ops, buffers, layout = [], [], []
    to, source = ring.peer(shift), ring.peer(-shift)
    for offset, indices in enumerate(by_dtype.values()):
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        incoming = torch.empty_like(flat)
        ops.append(dist.P2POp(dist.isend, flat, to, ring.group, tag + offset))
        ops.append(dist.P2POp(dist.irecv, incoming, source, ring.group, tag + offset))
        buffers.append(incoming)
        layout.append((indices, [tuple(tensors[i].shape) for i in indices]))
    return _Pending(dist.batch_isend_irecv(ops), buffers, layout)


class _Done(_Pending):
    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors

    def wait(self) -> list[Any]:
        return self.tensors


def _positioned(ring: Ring, shift: int) -> _ring.Positioned | None:
    """The ring's mods with the global positions of this rank's query rows and of the
    keys it holds at a step of ``shift`` (None without mods)."""
    if ring.mods is None or ring.positions is None:
        return None
    return ring.mods, *_ring.step_positions(ring.positions, ring.rank, shift, ring.size)


def _forward(ring: Ring, q: Any, k: Any, v: Any, ids: Any = None) -> tuple[Any, Any]:
    xp = _xp()
    compute = _spec.compute_dtype_for(xp, q.dtype)
    qc = q.to(compute)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=compute, device=q.device)
    lse = torch.full(q.shape[:-1], -torch.inf, dtype=compute, device=q.device)
    held, kv = 0, [k, v] if ids is None else [k, v, ids]  # the ids travel with their K/V
    steps = ring.plan.steps
    pending = send(ring, kv, steps[0].shift) if steps and steps[0].shift else None
    for i, step in enumerate(steps):
        if pending is not None:
            kv, held, pending = pending.wait(), step.shift, None
        if i + 1 < len(steps):  # the next shard travels while this one is computed
            pending = send(ring, kv, steps[i + 1].shift - held)
        blocks = step.blocks[ring.rank]
        if blocks:
            kc, vc = kv[0].to(compute), kv[1].to(compute)
            pair = None if ids is None else (ids, kv[2])
            mods = _positioned(ring, step.shift)
            out, lse = _ring.forward_blocks(
                xp, blocks, ring.options, out, lse, qc, kc, vc, pair, mods
            )
    return out, lse


def _backward(ring: Ring, saved: Sequence[Any], dout: Any, dlse: Any) -> tuple[Any, Any, Any]:
    xp = _xp()
    q, k, v, out, lse, *rest = saved
    ids = rest[0] if rest else None
    compute = out.dtype
    if dout is None:
        dout = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=compute, device=q.device)
    given_dlse = dlse.to(compute) if dlse is not None and ring.options.return_lse else None
    local = (dout.to(compute), q.to(compute), out, lse, given_dlse)
    dq = torch.zeros(q.shape, dtype=compute, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute, device=q.device)
    held, kv, acc = 0, [k, v] if ids is None else [k, v, ids], [dk, dv]
    steps = ring.plan.steps
    for i, step in enumerate(steps):
        if step.shift != held:  # the first step, where it is not the own shard
            kv = send(ring, kv, step.shift - held).wait()
            acc = send(ring, acc, step.shift - held, tag=ACC_TAG).wait()
            held = step.shift
        after = steps[i + 1].shift if i + 1 < len(steps) else None
        upcoming = send(ring, kv, after - held) if after is not None else None
        blocks = step.blocks[ring.rank]
        if blocks:
            kc, vc = kv[0].to(compute), kv[1].to(compute)
            grads = (dq, acc[0], acc[1])
            pair = None if ids is None else (ids, kv[2])
            mods = _positioned(ring, step.shift)
            dq, dk, dv = _ring.backward_blocks(
                xp, blocks, ring.options, grads, local, kc, vc, pair, mods
            )
            acc = [dk, dv]
        if upcoming is not None and after is not None:  # the accumulators follow their K/V
            acc = send(ring, acc, after - held, tag=ACC_TAG).wait()
            kv, held = upcoming.wait(), after
    dk, dv = send(ring, acc, -held, tag=ACC_TAG).wait()  # home to their owner
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Shift(torch.autograd.Function):
    """K/V (and their ids) sent ``shift`` ranks ahead, differentiably: the gradient of
    what arrived goes back ``shift`` ranks behind (a shift's transpose). Every rank runs
    the same chain of shifts, so their backward sends meet in the same order."""

    @staticmethod
    def forward(ctx: Any, ring: Ring, shift: int, *tensors: Any) -> tuple[Any, ...]:
        ctx.ring, ctx.shift = ring, shift
        received = tuple(send(ring, tensors, shift).wait())
        ctx.mark_non_differentiable(*(t for t in received if not t.is_floating_point()))
        return received

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        floating = [i for i, g in enumerate(grads) if g is not None and g.is_floating_point()]
        back = send(ctx.ring, [grads[i].contiguous() for i in floating], -ctx.shift).wait()
        given: list[Any] = [None] * len(grads)
        for i, g in zip(floating, back, strict=True):
            given[i] = g
        return (None, None, *given)


def _forward_autograd(ring: Ring, q: Any, k: Any, v: Any, ids: Any = None) -> tuple[Any, Any]:
    """The ring's forward that autograd differentiates (a ``score_mod``): the blocks as
    ``attend`` computes them under autograd, K/V moved by :class:`_Shift`. Saves what
    autograd saves: every step's visiting K/V."""
    xp = _xp()
    compute = _spec.compute_dtype_for(xp, q.dtype)
    qc = q.to(compute)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=compute, device=q.device)
    lse = torch.full(q.shape[:-1], -torch.inf, dtype=compute, device=q.device)
    held, kv = 0, [k, v] if ids is None else [k, v, ids]
    for step in ring.plan.steps:
        if step.shift != held:
            kv, held = list(_Shift.apply(ring, step.shift - held, *kv)), step.shift
        blocks = step.blocks[ring.rank]
        if blocks:
            pair = None if ids is None else (ids, kv[2])
            mods = _positioned(ring, step.shift)
            kc, vc = kv[0].to(compute), kv[1].to(compute)
            out, lse = _ring.forward_blocks(
                xp, blocks, ring.options, out, lse, qc, kc, vc, pair, mods
            )
    # Every rank's backward must run the last shift's (a send the others wait for), and
    # out and lse need a gradient path to q, k, v where no block touched them.
    out, lse = _Tie.apply(out, lse, q, k, v, *(kv if held else ()))
    return out.to(q.dtype), lse


def differentiated(score_mod: object) -> bool:
    """Whether the ring runs the forward that autograd differentiates (a ``score_mod``
    with grad mode on): the ranks must agree, their backwards exchange differently."""
    return score_mod is not None and torch.is_grad_enabled()


class _Tie(torch.autograd.Function):
    """``(out, lse)`` unchanged, with tensors they need not depend on as inputs of zero
    gradient: q, k, v (a rank whose blocks were all skipped) and the last K/V that
    arrived, so that the backward of their :class:`_Shift` runs on every rank, whatever
    the loss uses of ``out`` and ``lse``."""

    @staticmethod
    def forward(ctx: Any, out: Any, lse: Any, *tied: Any) -> tuple[Any, Any]:
        ctx.tied = [(t.shape, t.dtype, t.device, t.is_floating_point()) for t in tied]
        return out.clone(), lse.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Any, d_lse: Any) -> tuple[Any, ...]:
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) if floating else None
            for shape, dtype, device, floating in ctx.tied
        ]
        return (d_out, d_lse, *zeros)


class _RingFunction(torch.autograd.Function):
    """The ring as one autograd node: saves ``q, k, v, out, lse`` of the local shard."""

    @staticmethod
    def forward(ctx: Any, q: Any, k: Any, v: Any, ring: Ring, ids: Any) -> tuple[Any, Any]:
        out, lse = _forward(ring, q, k, v, ids)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse, *(() if ids is None else (ids,)))
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        dq, dk, dv = _backward(ctx.ring, ctx.saved_tensors, dout, dlse)
        return dq, dk, dv, None, None


def ring_attend(
    call: _spec.Call,
    q: Any,
    k: Any,
    v: Any,
    group: object,
    layout: str,
    ids: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Any:
    """The ring on torch tensors (checked by the caller, ``group`` resolved and the ranks
    agreeing): see :func:`portable_attention.parallel.ring_attend`."""
    resolved: Any = group
    size, rank = dist.get_world_size(resolved), dist.get_rank(resolved)
    lq, lk = q.shape[-2] * size, k.shape[-2] * size
    _layout.check_length(
        lq, size, layout, name=f"the global query sequence ({size} shards of {q.shape[-2]})"
    )
    _layout.check_length(
        lk, size, layout, name=f"the global key sequence ({size} shards of {k.shape[-2]})"
    )
    plan = _ring.ring_schedule(call, size, layout, lq, lk, mask_mod)
    mods = _ring.user_mods(score_mod, mask_mod)
    positions = None
    if mods is not None:
        positions = (
            torch.as_tensor(_layout.position_table(lq, size, layout), device=q.device),
            torch.as_tensor(_layout.position_table(lk, size, layout), device=q.device),
        )
    ring = Ring(
        group=resolved,
        rank=rank,
        size=size,
        plan=plan,
        options=call.options,
        mods=mods,
        positions=positions,
    )
    if differentiated(score_mod):
        # The ring's backward cannot differentiate a score_mod: autograd does, through
        # each block's checkpointed forward and differentiable shifts of K/V.
        out, lse = _forward_autograd(ring, q, k, v, ids)
    else:
        out, lse = _RingFunction.apply(q, k, v, ring, ids)
    return (out, lse) if call.return_lse else out


# -- Ulysses ----------------------------------------------------------------------------


def _all_to_all(x: Any, group: Any, split: int, concat: int) -> Any:
    """Split ``x`` into P parts along ``split``, send part p to rank p, and concatenate the
    parts received along ``concat`` (in rank order)."""
    size = dist.get_world_size(group)
    split %= x.ndim
    concat %= x.ndim
    shape = list(x.shape)
    parts = shape[split] // size
    # [..., P, parts, ...] with the P axis moved first: all_to_all_single splits dim 0.
    chunked = x.reshape(*shape[:split], size, parts, *shape[split + 1 :])
    chunked = torch.movedim(chunked, split, 0).contiguous()
    received = torch.empty_like(chunked)
    dist.all_to_all_single(received, chunked, group=group)
    # received[p] is rank p's part: put the P axis in front of the concat axis and merge.
    moved = torch.movedim(received, 0, concat)
    new = list(moved.shape)
    return moved.reshape(*new[:concat], new[concat] * new[concat + 1], *new[concat + 2 :])


class _AllToAll(torch.autograd.Function):
    """All-to-all whose backward is the inverse all-to-all of the (contiguous) gradient."""

    @staticmethod
    def forward(ctx: Any, x: Any, group: Any, split: int, concat: int) -> Any:
        ctx.group, ctx.split, ctx.concat = group, split, concat
        return _all_to_all(x, group, split, concat)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        back = _AllToAll.apply(grad.contiguous(), ctx.group, ctx.concat, ctx.split)
        return back, None, None, None


def seq_to_heads(x: Any, group: Any, *, heads: int = -3, seq: int = -2) -> Any:
    """``[..., H, L/P, D] -> [..., H/P, L, D]``."""
    return _AllToAll.apply(x, group, heads, seq)


def heads_to_seq(x: Any, group: Any, *, heads: int = -3, seq: int = -2) -> Any:
    """The inverse of :func:`seq_to_heads`."""
    return _AllToAll.apply(x, group, seq, heads)


def group_size(group: Any) -> int:
    return int(dist.get_world_size(group))


def group_rank(group: Any) -> int:
    return int(dist.get_rank(group))


def head_slice(x: Any, start: int, size: int, axis: int) -> Any:
    """``size`` entries from ``start`` along ``axis``."""
    return x.narrow(axis % x.ndim, start, size)
