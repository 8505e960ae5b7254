"""JAX: the ring with ``lax.ppermute`` and Ulysses with ``lax.all_to_all`` inside
``jax.shard_map``, the layouts' re-distribution between shards, and ``sharded_attend``.

Imported only when JAX arrays reach :mod:`portable_attention.parallel`.

Every shard runs one program (SPMD): where the schedule gives shards different blocks at
a step, the step is a ``lax.switch`` over the distinct block lists, indexed by the shard's
``lax.axis_index`` (a shard runs only its own branch). The ring is a ``jax.custom_vjp``:
the forward saves ``q, k, v, out, lse`` of the local shard (``O(L/P * D)``), and the
backward sends each K/V shard around the ring again together with its ``dk``/``dv``
accumulators, which return to their owner at the end.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from portable_attention import _options, _spec
from portable_attention._options import Options
from portable_attention.parallel import _agree, _layout, _ring
from portable_attention.parallel._schedule import Block, Schedule, Step

XP = None  # the array-API namespace of JAX arrays, bound on first use


def _xp() -> Any:
    global XP
    if XP is None:
        import array_api_compat

        XP = array_api_compat.array_namespace(jnp.zeros(1))
    return XP


# -- what parallel/__init__ asks of either framework's collectives ------------------------


def check_link(axis_name: object, group: object, what: str) -> None:
    """JAX arrays go with ``axis_name``: ``group`` (torch.distributed's) is a TypeError
    that says what to pass."""
    if group is not None:
        msg = (
            f"`group` is torch.distributed's, but `{what}` got JAX arrays: pass the mesh axis "
            "the sequence is sharded over as `axis_name=` inside `jax.shard_map`."
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
    """The ring's mesh axis and its options, normalised once (every shard traces the
    same call: nothing to agree on)."""
    if refused is not None:
        raise refused
    return axis_name, _options.options(**_agree.scalars(given))


def ulysses_shard(
    axis_name: object,
    group: object,
    q: Any,
    k: Any,
    v: Any,
    options: dict[str, Any],
    layout: str,
) -> tuple[Any, int, Any, Options]:
    """Ulysses' mesh axis, its size, this shard's (traced) index and the options,
    normalised once."""
    size = axis_size(axis_name)
    return axis_name, size, shard_index(axis_name), _options.options(**_agree.scalars(options))


def axis_size(axis_name: object) -> int:
    """The size of the bound mesh axis ``axis_name``; a ValueError that says where to
    call from where it is not bound."""
    if axis_name is None:
        msg = (
            "`axis_name` is required for JAX arrays: call ring_attend/ulysses_attend inside "
            "`jax.shard_map` with the name of the mesh axis the sequence is sharded over "
            "(e.g. `axis_name='seq'`), or call `sharded_attend(q, k, v, mesh=..., axis=...)` "
            "on global arrays."
        )
        raise ValueError(msg)
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        msg = (
            f"`axis_name={axis_name!r}` is not a bound mesh axis here: call this inside "
            f"`jax.shard_map(..., mesh=mesh)` over a mesh with an axis named {axis_name!r} "
            "(or use `sharded_attend(q, k, v, mesh=..., axis=...)` on global arrays)."
        )
        raise ValueError(msg) from None


def _shift(axis_name: Any, size: int, shift: int, tree: Any) -> Any:
    """Each shard sends ``tree`` to shard ``r + shift`` (receives from ``r - shift``)."""
    shift %= size
    if shift == 0:
        return tree
    perm = [(r, (r + shift) % size) for r in range(size)]
    return jax.lax.ppermute(tree, axis_name, perm)


def _varying_axes(x: Any) -> set[Any]:
    """The manual axes ``x`` varies over: ``manual_axis_type.varying`` from jax 0.10, the
    aval's ``vma`` before (0.8.2-0.9, which the floors session runs)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return set(manual.varying if manual is not None else aval.vma)


def _varying(x: Any, *like: Any) -> Any:
    """``x`` marked as varying over every manual axis that ``like`` varies over (the
    branches of a ``lax.switch`` inside ``shard_map`` must agree on it)."""
    want: set[Any] = set()
    for y in like:
        want |= _varying_axes(y)
    missing = want - _varying_axes(x)
    if not missing:
        return x
    return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def _per_shard(
    axis_name: Any, step: Step, run: Callable[[tuple[Block, ...]], Callable[..., Any]], *ops: Any
) -> Any:
    """``run(blocks)(*ops)`` with this shard's blocks of ``step``: one call where every
    shard has the same blocks, else a ``lax.switch`` on the axis index."""
    distinct = list(dict.fromkeys(step.blocks))
    if len(distinct) == 1:
        return run(distinct[0])(*ops)
    table = jnp.asarray([distinct.index(b) for b in step.blocks], dtype=jnp.int32)
    index = table[jax.lax.axis_index(axis_name)]
    return jax.lax.switch(index, [run(blocks) for blocks in distinct], *ops)


def _when(keep: Any, compute: Callable[[Any], Any], state: Any) -> Any:
    """A ring block computed only on the shards whose ``keep`` holds (``lax.cond``: a
    block in which no query shares a segment id with a visiting key costs one
    comparison of the ids)."""
    return jax.lax.cond(keep, compute, lambda unchanged: unchanged, state)


def _positions(axis_name: Any, plan: Schedule, user: Any) -> Callable[[int], tuple[Any, ...]]:
    """The global positions of this shard's query rows and of the keys it holds at a
    step, by the step's shift (for the user's mods; nothing without them), from the
    layout's tables, built once."""
    if user is None:
        return lambda shift: ()
    size = plan.num_shards
    tables = (
        jnp.asarray(_layout.position_table(plan.q_length, size, plan.layout)),
        jnp.asarray(_layout.position_table(plan.k_length, size, plan.layout)),
    )
    me = jax.lax.axis_index(axis_name)
    return lambda shift: _ring.step_positions(tables, me, shift, size)


def _forward(
    axis_name: Any,
    plan: Schedule,
    options: Options,
    user: _ring.UserMods | None,
    q: Any,
    k: Any,
    v: Any,
    ids: Any = None,
) -> tuple[Any, Any]:
    """``(out, lse)`` of the local query rows, in the compute dtype; ``ids``: the local
    segment ids (they travel with K/V), or None; ``user``: the ring's mods, or None."""
    xp = _xp()
    compute = _spec.compute_dtype_for(xp, q.dtype)
    qc = q.astype(compute)
    out = _varying(jnp.zeros((*q.shape[:-1], v.shape[-1]), compute), q, k, v)
    lse = _varying(jnp.full(q.shape[:-1], -jnp.inf, compute), q, k, v)

    def run(blocks: tuple[Block, ...]) -> Callable[..., Any]:
        def step(out: Any, lse: Any, pos: Any, kb: Any, vb: Any, *kv_ids: Any) -> Any:
            kc, vc = kb.astype(compute), vb.astype(compute)
            pair = (ids, kv_ids[0]) if kv_ids else None
            mods = None if user is None else (user, *pos)
            return _ring.forward_blocks(
                xp, blocks, options, out, lse, qc, kc, vc, pair, mods, _when
            )

        return step

    size = plan.num_shards
    positions = _positions(axis_name, plan, user)
    held, kv = 0, (k, v) if ids is None else (k, v, ids)
    shifts = [s.shift for s in plan.steps]
    for i, step in enumerate(plan.steps):
        if step.shift != held:
            kv, held = _shift(axis_name, size, step.shift - held, kv), step.shift
        # The next shard's transfer is issued before this step's compute (XLA overlaps the
        # collective-permute with it where the backend can).
        upcoming = None
        if i + 1 < len(shifts) and shifts[i + 1] != held:
            upcoming = _shift(axis_name, size, shifts[i + 1] - held, kv)
        out, lse = _per_shard(axis_name, step, run, out, lse, positions(step.shift), *kv)
        if upcoming is not None:
            kv, held = upcoming, shifts[i + 1]
    return out, lse


def _backward(
    axis_name: Any,
    plan: Schedule,
    options: Options,
    user: _ring.UserMods | None,
    residuals: tuple[Any, ...],
    cotangents: tuple[Any, Any],
) -> tuple[Any, Any, Any]:
    xp = _xp()
    q, k, v, out, lse, *rest = residuals
    ids = rest[0] if rest else None
    dout, dlse = cotangents
    compute = out.dtype
    qc = q.astype(compute)
    given_dlse = dlse.astype(compute) if options.return_lse else None
    saved = (dout.astype(compute), qc, out, lse, given_dlse)
    dq = _varying(jnp.zeros(q.shape, compute), q, k, v, dout)
    dk = _varying(jnp.zeros(k.shape, compute), q, k, v, dout)
    dv = _varying(jnp.zeros(v.shape, compute), q, k, v, dout)

    def run(blocks: tuple[Block, ...]) -> Callable[..., Any]:
        def step(dq: Any, dk: Any, dv: Any, pos: Any, kb: Any, vb: Any, *kv_ids: Any) -> Any:
            kc, vc = kb.astype(compute), vb.astype(compute)
            pair = (ids, kv_ids[0]) if kv_ids else None
            mods = None if user is None else (user, *pos)
            grads = (dq, dk, dv)
            return _ring.backward_blocks(
                xp, blocks, options, grads, saved, kc, vc, pair, mods, _when
            )

        return step

    size = plan.num_shards
    positions = _positions(axis_name, plan, user)
    held, kv = 0, (k, v) if ids is None else (k, v, ids)
    for step in plan.steps:
        if step.shift != held:
            # K/V go first (they do not wait for this step's compute); their gradient
            # accumulators follow them once computed.
            kv = _shift(axis_name, size, step.shift - held, kv)
            dk, dv = _shift(axis_name, size, step.shift - held, (dk, dv))
            held = step.shift
        dq, dk, dv = _per_shard(axis_name, step, run, dq, dk, dv, positions(step.shift), *kv)
    dk, dv = _shift(axis_name, size, -held, (dk, dv))  # home to their owners
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _captures_tracer(fn: Any, depth: int = 3) -> bool:
    """Whether ``fn`` holds a traced array (a jit argument): in its closure, in a
    ``functools.partial``'s arguments, in a bound method's or a callable object's
    attributes, and in the functions those hold, ``depth`` levels deep."""
    seen = [fn]
    for _ in range(depth):
        found: list[Any] = []
        for item in seen:
            held: list[Any] = []
            for cell in getattr(item, "__closure__", None) or ():
                try:
                    held.append(cell.cell_contents)
                except ValueError:  # a cell not yet filled
                    continue
            if isinstance(item, functools.partial):
                held += [item.func, *item.args, *item.keywords.values()]
            owner = getattr(item, "__self__", None)
            if owner is not None:
                held.append(owner)
            if not isinstance(item, types.FunctionType):
                held += list(getattr(item, "__dict__", {}).values())
            for value in held:
                if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
                    return True
                if callable(value) or hasattr(value, "__dict__"):
                    found.append(value)
        seen = found
    return False


@functools.lru_cache(maxsize=128)
def _ring_function(
    axis_name: Any, plan: Schedule, options: Options, user: _ring.UserMods | None = None
) -> Any:
    """The ring's ``custom_vjp`` function of ``(q, k, v, *ids) -> (out, lse)`` for one
    configuration (cached: a repeated trace reuses it; a call with mods builds its own,
    uncached, so that no cache keeps the user's functions alive); ``ids``: the local
    segment ids, or nothing (integers: their cotangent is None)."""

    @jax.custom_vjp
    def ring(q: Any, k: Any, v: Any, *ids: Any) -> tuple[Any, Any]:
        out, lse = _forward(axis_name, plan, options, user, q, k, v, *ids)
        return out.astype(q.dtype), lse

    def ring_fwd(q: Any, k: Any, v: Any, *ids: Any) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
        out, lse = _forward(axis_name, plan, options, user, q, k, v, *ids)
        return (out.astype(q.dtype), lse), (q, k, v, out, lse, *ids)

    def ring_bwd(residuals: tuple[Any, ...], cotangents: tuple[Any, Any]) -> tuple[Any, ...]:
        grads = _backward(axis_name, plan, options, user, residuals, cotangents)
        return (*grads, *(None for _ in residuals[5:]))

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


def _differentiated_ring(
    axis_name: Any, plan: Schedule, options: Options, user: _ring.UserMods
) -> Any:
    """The ring that JAX's own autodiff differentiates, for mods the ``custom_vjp``
    cannot take: a ``score_mod`` (each block's gradient through it, and through the
    arrays it captures, is the attend path's), or a ``mask_mod`` that closes over traced
    arrays. It saves what autodiff saves: every step's visiting K/V."""

    def ring(q: Any, k: Any, v: Any, *ids: Any) -> tuple[Any, Any]:
        if axis_name in _varying_axes(q):
            raise _checked_vma_error()
        out, lse = _forward(axis_name, plan, options, user, q, k, v, *ids)
        return out.astype(q.dtype), lse

    return ring


def _checked_vma_error() -> ValueError:
    """Under ``check_vma=True`` autodiff puts the psum of a replicated capture's gradient
    inside the ring's ``lax.switch``/``lax.cond`` branches, where only some shards run it:
    wrong gradients, then shards waiting in different collectives."""
    msg = (
        "ring_attend with a `score_mod` (or a `mask_mod` that closes over traced arrays) "
        "is differentiated by JAX's autodiff, which inside `jax.shard_map(..., "
        "check_vma=True)` would sum a captured array's gradient on some shards only: pass "
        "check_vma=False to your shard_map (sharded_attend does)."
    )
    return ValueError(msg)


def ring_attend(
    call: _spec.Call,
    q: Any,
    k: Any,
    v: Any,
    axis_name: Any,
    layout: str,
    ids: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Any:
    """The ring on JAX arrays (checked by the caller): see
    :func:`portable_attention.parallel.ring_attend`."""
    size = axis_size(axis_name)
    lq, lk = q.shape[-2] * size, k.shape[-2] * size
    _layout.check_length(
        lq, size, layout, name=f"the global query sequence ({size} shards of {q.shape[-2]})"
    )
    _layout.check_length(
        lk, size, layout, name=f"the global key sequence ({size} shards of {k.shape[-2]})"
    )
    plan = _ring.ring_schedule(call, size, layout, lq, lk, mask_mod)
    options = call.options
    user = _ring.user_mods(score_mod, mask_mod)
    if user is None:
        ring = _ring_function(axis_name, plan, options)
    elif user.score_mod is not None or _captures_tracer(user.mask_mod):
        ring = _differentiated_ring(axis_name, plan, options, user)
    else:
        ring = _ring_function.__wrapped__(axis_name, plan, options, user)
    out, lse = ring(q, k, v) if ids is None else ring(q, k, v, ids)
    return (out, lse) if call.return_lse else out


# -- Ulysses ----------------------------------------------------------------------------


def seq_to_heads(x: Any, axis_name: Any, *, heads: int = -3, seq: int = -2) -> Any:
    """``[..., H, L/P, D] -> [..., H/P, L, D]``: the all-to-all of Ulysses (the shard
    order of the sequence is kept: shard 0's positions first)."""
    return jax.lax.all_to_all(x, axis_name, x.ndim + heads, x.ndim + seq, tiled=True)


def heads_to_seq(x: Any, axis_name: Any, *, heads: int = -3, seq: int = -2) -> Any:
    """The inverse of :func:`seq_to_heads`."""
    return jax.lax.all_to_all(x, axis_name, x.ndim + seq, x.ndim + heads, tiled=True)


def shard_index(axis_name: Any) -> Any:
    return jax.lax.axis_index(axis_name)


def head_slice(x: Any, start: Any, size: int, axis: int) -> Any:
    """``size`` entries from the (traced) ``start`` along ``axis``."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis % x.ndim)


def fold_rng(rng: Any, index: Any) -> Any:
    """A different dropout key on each shard (each holds other heads)."""
    return jax.random.fold_in(rng, index)


# -- layouts between shards (inside shard_map) --------------------------------------------


def _destination(chunk: int, size: int) -> int:
    """The zigzag shard of natural chunk ``chunk`` (of ``2P``)."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def to_layout(x: Any, axis_name: Any, size: int, layout: str, *, axis: int = -2) -> Any:
    """Inside ``shard_map``: from contiguous shards (shard ``r`` holds natural chunks
    ``2r, 2r + 1`` of ``2P``) to ``layout``'s shards, with two ``ppermute``s of half a
    shard each (no gather)."""
    if layout == "contiguous" or size == 1:
        return x
    first, second = jnp.split(x, 2, axis=axis)
    # Natural chunk 2s (first half of shard s) and 2s + 1 each go to their zigzag shard;
    # both maps are permutations of the shards.
    even = jax.lax.ppermute(first, axis_name, [(s, _destination(2 * s, size)) for s in range(size)])
    odd = jax.lax.ppermute(
        second, axis_name, [(s, _destination(2 * s + 1, size)) for s in range(size)]
    )
    # Shard r's zigzag chunks are r and 2P-1-r; one is even, one odd: r's parity orders them.
    is_even = jax.lax.axis_index(axis_name) % 2 == 0
    return jnp.concatenate(
        [jnp.where(is_even, even, odd), jnp.where(is_even, odd, even)], axis=axis
    )


def from_layout(x: Any, axis_name: Any, size: int, layout: str, *, axis: int = -2) -> Any:
    """The inverse of :func:`to_layout`."""
    if layout == "contiguous" or size == 1:
        return x
    early, late = jnp.split(x, 2, axis=axis)  # shard r's chunks r and 2P-1-r
    is_even = jax.lax.axis_index(axis_name) % 2 == 0
    even, odd = jnp.where(is_even, early, late), jnp.where(is_even, late, early)

    def home(r: int, parity: int) -> int:  # natural chunk c lives on contiguous shard c // 2
        chunk = r if r % 2 == parity else 2 * size - 1 - r
        return chunk // 2

    first = jax.lax.ppermute(even, axis_name, [(r, home(r, 0)) for r in range(size)])
    second = jax.lax.ppermute(odd, axis_name, [(r, home(r, 1)) for r in range(size)])
    return jnp.concatenate([first, second], axis=axis)


def _seq_spec(ndim: int, axis: int, name: Any) -> P:
    spec: list[Any] = [None] * ndim
    spec[axis % ndim] = name
    return P(*spec)


def _mesh_axis(x: Any, axis: int) -> tuple[Any, Any] | None:
    """``(mesh, mesh axis name)`` where ``x`` (an array or a tracer) is sharded along
    ``axis`` over exactly one mesh axis; None where it is not (or JAX does not say)."""
    if isinstance(x, jax.core.Tracer):  # under jit: what the type says (Explicit meshes)
        sharding = getattr(jax.typeof(x), "sharding", None)
    else:  # a concrete array: where its shards are
        sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is None or spec is None or getattr(mesh, "empty", False) or axis >= len(spec):
        return None
    entry = spec[axis]
    if isinstance(entry, tuple):
        entry = entry[0] if len(entry) == 1 else None
    if entry is None:
        return None
    return mesh, entry


def permute_sharded(x: Any, size: int, layout: str, axis: int, *, inverse: bool) -> Any | None:
    """:func:`portable_attention.parallel.reorder` (or ``restore``) of a JAX array sharded
    along ``axis`` over a mesh axis of ``size`` shards, by ``ppermute`` between the shards
    inside ``shard_map`` (the reshapes of the generic version raise on Explicit meshes
    and gather on Auto ones); None where ``x`` is not sharded that way."""
    found = _mesh_axis(x, axis)
    if found is None:
        return None
    mesh, name = found
    if mesh.shape[name] != size:
        return None
    spec = _seq_spec(x.ndim, axis, name)
    move = from_layout if inverse else to_layout
    body = functools.partial(move, axis_name=name, size=size, layout=layout, axis=axis - x.ndim)
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)


# -- sharded_attend ----------------------------------------------------------------------


def _place(x: Any, mesh: Any, spec: P) -> Any:
    """``x`` sharded as ``spec`` over ``mesh``, wherever it lives.

    A concrete array goes there by ``jax.device_put``: one committed to a single device
    (``jax.device_put(x, jax.devices()[0])``) or to another mesh's devices cannot be
    ``jax.reshard``-ed onto this mesh, nor handed to its ``shard_map`` (JAX raises
    "incompatible devices"). Under a transformation (a tracer): on Auto axes
    ``device_put`` moves it (differentiable, and right under ``vmap``); on Explicit
    axes, where shard_map takes its inputs only as they are typed, ``jax.reshard``,
    and where the value is committed elsewhere (``jax.vjp``/``vmap`` of a committed
    array) a replicated ``device_put`` onto the mesh first (``device_put`` straight to a
    sharded spec mis-places the batch dimension of ``vmap``). Under ``jax.jit`` the
    arguments are jit's: one committed to devices outside the mesh is jit's own
    "incompatible devices" error, raised before this runs. An ``AbstractMesh`` (no
    devices to put on) leaves placing to ``shard_map`` and ``jax.reshard``."""
    target = NamedSharding(mesh, spec)
    current = getattr(jax.typeof(x), "sharding", None)
    if isinstance(current, NamedSharding) and current.spec == spec and current.mesh == mesh:
        return x
    explicit = AxisType.Explicit in mesh.axis_types
    if isinstance(mesh, jax.sharding.Mesh) and (not isinstance(x, jax.core.Tracer) or not explicit):
        return jax.device_put(x, target)
    if not explicit:
        return x
    try:
        return jax.reshard(x, target)
    except ValueError:  # committed to other devices (eager vjp or vmap of such an array)
        return jax.reshard(jax.device_put(x, NamedSharding(mesh, P())), target)


#: Options of sharded_attend that are arrays (passed to the compiled function; the
#: rest are static and key its cache).
ARRAY_OPTIONS = ("mask", "bias", "rng", "sinks", "segment_ids")


def _freeze(value: Any) -> Any:
    """A hashable form of a static option (a window given as a list)."""
    return tuple(value) if isinstance(value, list) else value


def sharded_attend(
    q: Any, k: Any, v: Any, *, mesh: Any, axis: Any, method: str, layout: str, extra: dict[str, Any]
) -> Any:
    """``ring_attend``/``ulysses_attend`` under ``shard_map`` over ``mesh`` with the
    sequence (axis -2) of q, k, v sharded over ``axis``, compiled once per configuration:
    each shard's contiguous block is re-distributed into ``layout`` and back by
    ``ppermute`` inside (no gather)."""
    if axis not in mesh.axis_names:
        msg = (
            f"`axis={axis!r}` is not an axis of the mesh, whose axes are {tuple(mesh.axis_names)}."
        )
        raise ValueError(msg)
    size = mesh.shape[axis]
    for name, x in (("q", q), ("k", k), ("v", v)):
        _layout.check_length(
            int(x.shape[-2]), size, layout, name=f"`{name}` of shape {tuple(x.shape)} (axis -2)"
        )
    arrays = {key: extra[key] for key in ARRAY_OPTIONS if extra.get(key) is not None}
    static = tuple(sorted((key, _freeze(val)) for key, val in extra.items() if key not in arrays))
    seq = _seq_spec(q.ndim, -2, axis)
    placed = [_place(x, mesh, seq) for x in (q, k, v)]
    specs = tuple(_spec_of(name, x, method, axis) for name, x in arrays.items())
    placed += [jax.tree.map(lambda a, s=s: _place(a, mesh, s), x)
               for x, s in zip(arrays.values(), specs, strict=True)]  # fmt: skip
    # A user's mod (and what it captures) must not outlive the call in the cache: a call
    # with one builds its function for itself, as does one with an unhashable option.
    build: Callable[..., Any] = _sharded_function
    if extra.get("mask_mod") is not None or extra.get("score_mod") is not None:
        build = _sharded_function.__wrapped__
    try:
        function = build(mesh, axis, method, layout, static, tuple(arrays), specs, q.ndim)
    except TypeError:  # an unhashable static option: build it for this call alone
        function = _sharded_function.__wrapped__(
            mesh, axis, method, layout, static, tuple(arrays), specs, q.ndim
        )
    return function(*placed)


def _spec_of(name: str, x: Any, method: str, axis: Any) -> P:
    """How ``sharded_attend`` hands an array option to the shards: the ring's segment ids
    sharded with the sequence (each shard holds its positions' ids), all else whole."""
    if method == "ring" and name == "segment_ids" and hasattr(x, "ndim"):
        return _seq_spec(x.ndim, -1, axis)
    return P()


@functools.lru_cache(maxsize=64)
def _sharded_function(
    mesh: Any,
    axis: Any,
    method: str,
    layout: str,
    static: tuple[tuple[str, Any], ...],
    array_names: tuple[str, ...],
    array_specs: tuple[P, ...],
    ndim: int,
) -> Any:
    from portable_attention.parallel import ring_attend, ulysses_attend

    local = ring_attend if method == "ring" else ulysses_attend
    size = mesh.shape[axis]
    options = dict(static)

    def body(q: Any, k: Any, v: Any, *given: Any) -> Any:
        q, k, v = (to_layout(x, axis, size, layout) for x in (q, k, v))
        arrays = dict(zip(array_names, given, strict=True))
        if method == "ring" and "segment_ids" in arrays:
            arrays["segment_ids"] = to_layout(arrays["segment_ids"], axis, size, layout, axis=-1)
        result = local(q, k, v, axis_name=axis, layout=layout, **options, **arrays)
        if not isinstance(result, tuple):
            return from_layout(result, axis, size, layout)
        return tuple(
            from_layout(item, axis, size, layout, axis=-1 if item.ndim == ndim - 1 else -2)
            for item in result
        )

    seq = _seq_spec(ndim, -2, axis)
    outs: list[P] = [seq]
    if options.get("return_weights"):
        outs.append(seq)
    if options.get("return_lse"):
        outs.append(_seq_spec(ndim - 1, -1, axis))
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(seq, seq, seq, *array_specs),
        out_specs=outs[0] if len(outs) == 1 else tuple(outs),
        check_vma=False,
    )
    return jax.jit(mapped)
