"""Sequence parallelism: attention over a sequence sharded across devices.

- :func:`ring_attend`: ring attention. Each shard keeps its queries; the K/V shards
  travel the ring (``lax.ppermute`` inside ``jax.shard_map``; ``batch_isend_irecv`` on
  torch.distributed) and each step's blocks merge by log-sum-exp. Exact against one
  device, with a backward that sends K/V around again together with their gradients.
- :func:`ulysses_attend`: all-to-all from sequence shards to head shards, plain
  :func:`portable_attention.attend` with its whole contract, all-to-all back.
- :func:`sharded_attend` (JAX): either of them on global arrays over a mesh axis.
- :func:`reorder` / :func:`restore`: the permutation of a layout (``"contiguous"``,
  ``"zigzag"``, ``"document_zigzag"`` from segment ids) on any array-API array;
  :func:`schedule`: the ring's steps and their work.

The framework code lives in ``portable_attention.parallel._jax`` and ``._torch``, imported
only when that framework's arrays arrive, each with the same interface (``check_link``,
``ring_options``, ``ulysses_shard``, ``fold_rng``, ``permute_sharded``, the all-to-alls and
the ring), so this module never asks which framework it runs; the layouts, the schedule,
the ranks' agreement and the lse merge are array-API code shared by both.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from portable_attention import _options, _spec
from portable_attention._attention import run_call
from portable_attention._checks import type_name
from portable_attention._core import add_sinks
from portable_attention.parallel import _agree, _documents
from portable_attention.parallel._layout import (
    LAYOUTS,
    check_layout,
    check_shards,
    permute,
    prepare,
)
from portable_attention.parallel._schedule import Block, Schedule, Step
from portable_attention.parallel._schedule import schedule as _schedule

__all__ = [
    "LAYOUTS",
    "Block",
    "Schedule",
    "Step",
    "reorder",
    "restore",
    "ring_attend",
    "schedule",
    "sharded_attend",
    "ulysses_attend",
]

_FRAMEWORKS = {"jax": "_jax", "torch": "_torch"}


def _framework(backend: str, what: str) -> Any:
    """The module of ``backend``'s collectives, imported now (never before its arrays
    arrive)."""
    module = _FRAMEWORKS.get(backend)
    if module is None:
        msg = (
            f"`{what}` runs on JAX arrays (inside `jax.shard_map`) and torch tensors (on "
            f"torch.distributed ranks), got {backend} arrays; on one device call "
            "`portable_attention.attend`."
        )
        raise TypeError(msg)
    return importlib.import_module(f"{__name__}.{module}")


def ring_attend(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis_name: Any = None,
    group: Any = None,
    layout: str = "zigzag",
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    chunk_size: int | None = None,
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> Any:
    """Ring attention over a sequence sharded across devices; called on every shard.

    Each shard passes its local ``q``, ``k``, ``v``; the result is this shard's rows of
    ``attend`` over the whole sequence. The K/V shards travel the ring with their ``Hk``
    heads (never expanded for grouped queries); each step's blocks are
    :func:`portable_attention.attend` calls merged by a guarded log-sum-exp merge. Ring
    steps that ``causal``/``window`` leave empty on every shard are skipped.

    Parameters
    ----------
    q, k, v : arrays ``[..., H, L/P, D]``
        This shard's slices of the sequence (axis -2), in ``layout``'s order: JAX arrays
        inside ``jax.shard_map``, or torch tensors on a torch.distributed rank.
    axis_name : str, JAX only
        The mesh axis the sequence is sharded over (bound by the enclosing
        ``shard_map``).
    group : ProcessGroup or 1-D DeviceMesh, torch only
        The ranks of the ring, in shard order (default: the world group).
    layout : {"zigzag", "contiguous", "document_zigzag"}
        Which positions each shard holds (see :func:`reorder`). ``"zigzag"`` balances
        causal work; ``"contiguous"`` suits windows narrower than a shard;
        ``"document_zigzag"`` (with ``segment_ids``, no ``window``) balances packed
        documents under a causal mask: the zigzag of each document.
    causal, window, scale, softcap, chunk_size
        As :func:`portable_attention.attend`, in global positions (causal is lower-right
        over the global lengths ``P * L/P``).
    sinks : float array ``[..., Hq]``, optional
        Attention sinks as :func:`portable_attention.attend` takes them (the same array
        on every shard): merged into each row's result after the ring, so its lse
        includes them; differentiable.
    segment_ids : int array ``[..., L/P]``, optional
        Packed documents: this shard's segment ids, in ``layout``'s order as q, k, v
        (``reorder(ids, P, layout, axis=-1)`` of the global ids), with the meaning of
        :func:`portable_attention.attend`'s one array of ids (a query attends only keys of
        its own id; ``causal`` and ``window`` within it, which for one array of ids is the
        global band). They travel the ring with their K/V shard: one small integer array
        per step, so no shard needs the global ids. The blocks where no query shares an
        id with any visiting key are not computed: one host read of the block's ids on
        torch, a ``lax.cond`` on each device under ``shard_map``.
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's), called with
        global positions and heads as ``mask_mod`` below. Differentiable, the arrays it
        captures included: with a ``score_mod`` the ring is differentiated by the
        framework's autodiff (torch autograd through differentiable K/V shifts; JAX
        through ``ppermute``), which saves every step's visiting K/V, ``O(L * D)`` per
        device instead of ``O(L/P * D)``.
    mask_mod : callable or masks.BlockPlan, optional
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's signature, True = may
        attend), called with **global** positions in natural order (and the global head
        numbers, which are the local ones: every shard holds every head), as
        :func:`portable_attention.attend` takes it on one device; combined with the band
        and the segment ids. A ``masks.block_plan(mask_mod, L, L, block_size)`` of the
        global lengths also drops the ring's blocks, and whole ring steps, in which it
        keeps no score (on every shard, JAX and torch alike), and builds no mask for the
        blocks it keeps whole. Not with ``layout="document_zigzag"``.
    return_lse : bool
        Also return this shard's rows of the logsumexp ``[..., H, L/P]``.

    Returns
    -------
    out ``[..., Hq, L/P, Dv]`` in the input dtype, or ``(out, lse)``.
        Rows with no key on any shard give ``out = 0`` and ``lse = -inf`` (never NaN).

    Raises
    ------
    ValueError
        An unbound ``axis_name``, a global length the layout cannot split (zigzag needs
        multiples of ``2P``), ``"document_zigzag"`` without ``segment_ids``, with a
        ``window`` or a ``mask_mod`` (or, where the ids can be read, with a document of
        odd length on the shard), a block plan not built for the global lengths, shards
        of unequal shapes or dtypes across ranks, options (or the layout, or which of
        ``sinks``, ``segment_ids``, ``score_mod`` and ``mask_mod`` are given) that
        differ across
        torch.distributed ranks (raised on every rank, naming the option and what each
        rank passed), or any of :func:`~portable_attention.attend`'s checks.
    TypeError
        Arrays other than JAX or torch, ``group`` with JAX arrays or ``axis_name`` with
        torch tensors, a ``group`` that is not a ProcessGroup, ``segment_ids`` given as
        a pair.

    Notes
    -----
    Differentiable: the backward is a ``jax.custom_vjp`` / ``torch.autograd.Function``
    built on :func:`portable_attention.attend_backward`, which sends each K/V shard around
    the ring once more together with its ``dk``/``dv`` accumulators; it saves only
    ``q, k, v, out, lse`` of the local shard (``O(L/P * D)`` per device). A ``score_mod``,
    or on JAX a ``mask_mod`` that closes over traced arrays (which a ``custom_vjp``
    cannot take), is differentiated by autodiff instead (see ``score_mod``).
    """
    layout = check_layout(layout, documents=True)
    given = {"causal": causal, "window": window, "scale": scale, "softcap": softcap}
    given.update({"chunk_size": chunk_size, "return_lse": return_lse, "sinks": sinks})
    given.update({"segment_ids": segment_ids, "score_mod": score_mod, "mask_mod": mask_mod})
    _, backend, _ = _spec.check_arrays(q=q, k=k, v=v)
    module = _framework(backend, "ring_attend")
    module.check_link(axis_name, group, "ring_attend")
    _check_ring_ids(segment_ids)
    refused = None
    if layout == _documents.DOCUMENT_ZIGZAG:
        modded = mask_mod is not None or score_mod is not None
        refused = _refuse_documents(q, segment_ids, window, modded)
    # The options normalised once (on torch.distributed, agreed by every rank first).
    link, options = module.ring_options(axis_name, group, q, k, v, given, layout, refused)
    if sinks is not None:  # the sinks merge after the ring, from its lse
        options = dataclasses.replace(options, return_lse=True)
    # A block plan is for the global lengths: the ring checks it (its function here).
    function = getattr(mask_mod, "mask_mod", mask_mod)
    call = _spec.validate_call(
        q, k, v, options, sinks=sinks, segment_ids=segment_ids, score_mod=score_mod,
        mask_mod=function,
    )  # fmt: skip
    if layout == _documents.DOCUMENT_ZIGZAG:
        result = _ring_of_halves(call, module, link, (q, k, v), segment_ids)
    else:
        result = module.ring_attend(call, q, k, v, link, layout, segment_ids, mask_mod, score_mod)
    if sinks is None:
        return result
    out, lse = result
    out, _, lse = add_sinks(call, sinks, out, None, lse)
    return (out, lse) if return_lse else out


def _ring_of_halves(
    call: _spec.Call, module: Any, link: Any, qkv: tuple[Any, Any, Any], ids: Any
) -> Any:
    """The ring on shards in per-document zigzag order: each shard's rows regrouped into
    its two halves (:func:`._documents.halves`), the plain zigzag ring with the ids, the
    rows put back."""
    xp = call.xp
    ids = _documents.batched(xp, ids, qkv[0])
    order = _documents.halves(xp, ids)
    q, k, v = (_documents.take(xp, x, order, -2) for x in qkv)
    result = module.ring_attend(call, q, k, v, link, "zigzag", _documents.take(xp, ids, order, -1))
    back = _documents.inverse(xp, order)
    if not isinstance(result, tuple):
        return _documents.take(xp, result, back, -2)
    out, lse = result
    return _documents.take(xp, out, back, -2), _documents.take(xp, lse, back, -1)


def _refuse_documents(q: Any, ids: Any, window: object, modded: bool) -> Exception | None:
    """What makes this shard's call in the per-document layout impossible (None:
    nothing), found before torch's ranks exchange their options so that every rank
    raises it, none waits."""
    try:
        if ids is None or _options.normalize_window(window) is not None or modded:
            msg = (
                f"layout {_documents.DOCUMENT_ZIGZAG!r} balances packed documents under a "
                "causal mask: it takes `segment_ids` (this shard's, in that layout) and no "
                "`window`, `score_mod` or `mask_mod` (use layout='zigzag' or 'contiguous' "
                "for those)."
            )
            raise ValueError(msg)
        if not hasattr(ids, "ndim"):
            return None  # validate_call refuses it, with attend's message
        xp = _spec.check_arrays(q=q)[0]
        batched = _documents.batched(xp, ids, q)
        _documents.check_ids(batched, q, -2)
        _documents.check_documents(batched, None)
    except (TypeError, ValueError) as err:
        return err
    return None


def _check_ring_ids(segment_ids: object) -> None:
    """The ring takes one array of ids (packed self-attention), not a pair."""
    if isinstance(segment_ids, (tuple, list)):
        msg = (
            "ring_attend takes `segment_ids` as one integer array [..., L/P] of this "
            "shard's ids (packed self-attention), not a pair (q_ids, kv_ids): use "
            "ulysses_attend, or `attend` on one device, for a pair."
        )
        raise TypeError(msg)


def _check_heads(hq: int, hk: int, size: int) -> None:
    """Ulysses splits heads over the shards: ``Hq % P == 0``, and ``Hk % P == 0`` or
    ``P % Hk == 0`` (K/V heads are then repeated ``P / Hk`` times)."""
    if hq % size != 0 or not (hk % size == 0 or size % hk == 0):
        msg = (
            f"ulysses_attend splits the heads over the shards: it needs Hq % P == 0, and "
            f"Hk % P == 0 or P % Hk == 0 (K/V heads are then repeated), got Hq={hq}, Hk={hk}, "
            f"P={size}; use ring_attend, which has no such condition, or a sequence axis of "
            "another size."
        )
        raise ValueError(msg)


def ulysses_attend(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis_name: Any = None,
    group: Any = None,
    layout: str = "contiguous",
    **options: Any,
) -> Any:
    """DeepSpeed-Ulysses attention: all-to-all from sequence shards to head shards, one
    :func:`portable_attention.attend` over the whole sequence, all-to-all back.

    Parameters
    ----------
    q, k, v : arrays ``[..., H, L/P, D]``
        This shard's slices of the sequence (as :func:`ring_attend`). Needs
        ``Hq % P == 0`` and ``Hk % P == 0`` or ``P % Hk == 0``.
    axis_name, group
        As :func:`ring_attend`.
    layout : {"contiguous", "zigzag"}
        The order the shards hold the sequence in (as :func:`ring_attend`); the
        whole-sequence call sees it in natural order either way.
    **options
        Every option of :func:`portable_attention.attend`, with ``mask``/``bias``
        broadcastable to the **global** ``[..., Hq, Lq, Lk]`` in natural positions (each
        shard takes its heads), ``sinks`` of the global heads, ``segment_ids`` of the
        whole sequence in natural positions, and ``score_mod``/``mask_mod`` seeing the
        global head numbers (a block plan must not depend on heads). ``rng``: JAX keys
        are folded with the shard index, so each shard's heads draw their own dropout;
        torch ranks use their own generator.

    Returns
    -------
    As ``attend``: ``out [..., Hq, L/P, Dv]`` (this shard's rows), and where asked
    ``weights [..., Hq, L/P, Lk]`` (all keys, natural order) and ``lse [..., Hq, L/P]``.
    Differentiable through both all-to-alls (their backward is the inverse all-to-all).

    Raises
    ------
    ValueError
        Head counts the shards cannot split (naming ``Hq``, ``Hk`` and ``P``), an unbound
        ``axis_name``, shards of unequal shapes or dtypes across ranks, options (or which
        arrays and functions are given, or the layout) that differ across
        torch.distributed ranks (on every rank, naming them), or ``attend``'s checks.
    TypeError
        As :func:`ring_attend`.
    """
    layout = check_layout(layout)
    xp, backend, _device = _spec.check_arrays(q=q, k=k, v=v)
    module = _framework(backend, "ulysses_attend")
    module.check_link(axis_name, group, "ulysses_attend")
    if q.ndim < 3 or k.ndim < 3:
        msg = (
            f"ulysses_attend splits the heads (axis -3) over the shards: q, k, v need "
            f"[..., H, L, D], got q {tuple(q.shape)}, k {tuple(k.shape)}."
        )
        raise ValueError(msg)
    # The options normalised once (on torch.distributed, agreed by every rank first).
    link, size, index, normalised = module.ulysses_shard(axis_name, group, q, k, v, options, layout)
    hq, hk = q.shape[-3], k.shape[-3]
    _check_heads(hq, hk, size)
    if hk % size != 0:  # P % Hk == 0: each shard's query heads use one K/V head
        k, v = (_repeat_heads(xp, x, size // hk) for x in (k, v))
    qh, kh, vh = (module.seq_to_heads(x, link) for x in (q, k, v))
    if layout != "contiguous":  # the all-to-all concatenates the shards in shard order
        qh, kh, vh = (permute(xp, x, size, layout, x.ndim - 2, inverse=True) for x in (qh, kh, vh))
    heads = hq // size
    for name in ("mask", "bias"):
        x = options.get(name)
        if x is not None and x.ndim >= 3 and x.shape[-3] == hq and hq != heads:
            options[name] = module.head_slice(x, index * heads, heads, -3)
    sinks = options.get("sinks")
    if sinks is not None and sinks.ndim >= 1 and sinks.shape[-1] == hq and hq != heads:
        options["sinks"] = module.head_slice(sinks, index * heads, heads, -1)
    for name in ("score_mod", "mask_mod"):
        if callable(options.get(name)) and hq != heads:
            options[name] = _global_heads(options[name], index * heads, name)
    if options.get("rng") is not None:
        options["rng"] = module.fold_rng(options["rng"], index)
    arrays = {name: options.get(name) for name in _agree.GIVEN}
    call = _spec.validate_call(qh, kh, vh, normalised, **arrays)
    result = run_call(call, qh, kh, vh, **arrays)
    return_lse = normalised.return_lse
    items = list(result) if isinstance(result, tuple) else [result]
    back = []
    for position, item in enumerate(items):
        seq = -1 if return_lse and position == len(items) - 1 else -2  # lse: [..., H, L]
        if layout != "contiguous":
            item = permute(xp, item, size, layout, item.ndim + seq, inverse=False)
        back.append(module.heads_to_seq(item, link, heads=seq - 1, seq=seq))
    return tuple(back) if isinstance(result, tuple) else back[0]


def _global_heads(mod: Any, first: Any, name: str) -> Any:
    """A score_mod/mask_mod called with this shard's heads numbered as the global ones
    (``h + first``)."""
    if name == "score_mod":

        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return mod(score, b, h + first, q_idx, kv_idx)

        return score_mod

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mod(b, h + first, q_idx, kv_idx)

    return mask_mod


def _repeat_heads(xp: Any, x: Any, times: int) -> Any:
    """``[..., Hk, L, D] -> [..., Hk * times, L, D]``, each head repeated in place."""
    *lead, h, length, d = x.shape
    wide = xp.broadcast_to(xp.reshape(x, (*lead, h, 1, length, d)), (*lead, h, times, length, d))
    return xp.reshape(wide, (*lead, h * times, length, d))


def sharded_attend(
    q: Any,
    k: Any,
    v: Any,
    *,
    mesh: Any,
    axis: str,
    method: str = "ring",
    layout: str | None = None,
    **options: Any,
) -> Any:
    """JAX: attention on global arrays whose sequence is sharded over a mesh axis.

    Runs :func:`ring_attend` or :func:`ulysses_attend` under ``jax.shard_map`` over
    ``mesh``, with q, k, v sharded along the sequence (axis -2) over ``axis``: each
    shard's contiguous block is re-distributed into ``layout`` by ``ppermute`` inside
    (no gather) and the result comes back in natural order, sharded the same way. Works
    on Explicit meshes (``jax.make_mesh``'s default) and Auto ones, eagerly and under
    ``jax.jit``.

    Parameters
    ----------
    q, k, v : JAX arrays ``[..., H, L, D]``
        The global arrays, moved onto the mesh where they are not already there (an
        array committed to one device, ``jax.device_put(x, jax.devices()[0])``, or to
        another mesh included; so are the array options). Under your own ``jax.jit``
        the arguments are jit's: jit refuses ones committed outside the mesh, so
        ``jax.device_put`` them onto it before the call.
    mesh : jax.sharding.Mesh
    axis : str
        The mesh axis to shard the sequence over.
    method : {"ring", "ulysses"}
    layout : {"zigzag", "contiguous"}, optional
        The ring's layout (default ``"zigzag"``; Ulysses: ``"contiguous"``, where the
        layout changes nothing but the cost of moving data).
    **options
        The options of :func:`ring_attend` or :func:`ulysses_attend`; ``segment_ids``
        of the global sequence ``[..., L]`` in natural positions (the ring shards them
        with q, k, v).

    Returns
    -------
    As ``attend`` on the global arrays, sharded along the sequence over ``axis``.
    """
    if method not in ("ring", "ulysses"):
        msg = f"`method` must be 'ring' or 'ulysses', got {method!r}."
        raise ValueError(msg)
    chosen = check_layout(
        layout if layout is not None else ("zigzag" if method == "ring" else "contiguous")
    )
    _xp, backend, _device = _spec.check_arrays(q=q, k=k, v=v)
    module = _FRAMEWORKS.get(backend)
    if module != "_jax":
        msg = (
            f"sharded_attend takes JAX arrays and a JAX mesh, got {backend} arrays; on "
            "torch.distributed call ring_attend/ulysses_attend on each rank's shard."
        )
        raise TypeError(msg)
    for name in ("axis_name", "group"):
        if name in options:
            msg = f"sharded_attend takes the mesh axis as `axis=`, not `{name}=`."
            raise TypeError(msg)
    if method == "ring":
        unknown = sorted(set(options) - _RING_OPTIONS)
        if unknown:
            msg = (
                f"ring_attend does not take {unknown}; its options are "
                f"{sorted(_RING_OPTIONS)} (mask, bias, dropout and weights: method='ulysses')."
            )
            raise TypeError(msg)
    return _framework(backend, "sharded_attend").sharded_attend(
        q, k, v, mesh=mesh, axis=axis, method=method, layout=chosen, extra=options
    )


_RING_OPTIONS = {
    "causal",
    "window",
    "scale",
    "softcap",
    "return_lse",
    "chunk_size",
    "sinks",
    "segment_ids",
    "score_mod",
    "mask_mod",
}


def reorder(
    x: Any,
    num_shards: int,
    layout: str,
    axis: int = -2,
    *,
    segment_ids: Any = None,
    cu_seqlens: Any = None,
) -> Any:
    """Permute a global array so that an even split along ``axis`` gives each of
    ``num_shards`` shards the positions ``layout`` assigns it.

    ``"contiguous"`` is the identity. ``"zigzag"`` cuts ``axis`` into ``2P`` chunks and
    orders them ``0, 2P-1, 1, 2P-2, ...``: shard ``r`` gets chunks ``r`` and ``2P-1-r``.
    Works on any array-API array (reshapes, a flip and a stack: no gather), and on JAX
    arrays sharded along ``axis`` over a mesh axis of ``num_shards`` devices by moving
    half-shards between them (Explicit and Auto meshes).

    ``"document_zigzag"`` does that to each packed document: the documents are given as
    ``segment_ids`` ``[..., L]`` (each document one run of its own id; leading axes
    those of ``x`` or 1, one permutation per batch entry) or as ``cu_seqlens``
    (``[0, len_0, len_0 + len_1, ..., L]``, one packing for the whole batch); each is cut
    into ``2P`` chunks and shard ``r`` gets, document after document, chunks ``r`` and
    ``2P-1-r`` of each: the per-rank positions of ring-flash-attention's varlen zigzag
    functions. A gather (``take_along_axis``), so it runs under ``jax.jit`` too; pass the
    same ids to :func:`restore`, and reorder the ids themselves with ``axis=-1``.

    Raises
    ------
    ValueError
        An unknown layout, ``num_shards < 1``, or a length along ``axis`` that the layout
        cannot split (zigzag: a multiple of ``2P``); for ``"document_zigzag"``, neither or
        both of ``segment_ids`` and ``cu_seqlens``, ids that do not fit ``x``, or (where
        the ids can be read) a document whose length is not a multiple of ``2P`` or an id
        that names two runs.
    """
    return _permute(x, num_shards, layout, axis, (segment_ids, cu_seqlens), inverse=False)


def restore(
    x: Any,
    num_shards: int,
    layout: str,
    axis: int = -2,
    *,
    segment_ids: Any = None,
    cu_seqlens: Any = None,
) -> Any:
    """The inverse of :func:`reorder`: shard order back to natural positions (for
    ``"document_zigzag"``, given the natural order's ``segment_ids`` or ``cu_seqlens``)."""
    return _permute(x, num_shards, layout, axis, (segment_ids, cu_seqlens), inverse=True)


def _permute(
    x: Any, num_shards: int, layout: str, axis: int, documents: tuple[Any, Any], *, inverse: bool
) -> Any:
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        msg = f"`x` must be an array, got {type_name(x)}."
        raise TypeError(msg)
    shards, name, ax = prepare(x, num_shards, layout, axis)
    xp, backend, _device = _spec.check_arrays(x=x)
    if name == _documents.DOCUMENT_ZIGZAG:
        return _permute_documents(xp, x, shards, ax, documents, inverse=inverse)
    if documents != (None, None):
        msg = f"`segment_ids` and `cu_seqlens` go with layout {_documents.DOCUMENT_ZIGZAG!r}."
        raise TypeError(msg)
    if backend in _FRAMEWORKS and name != "contiguous" and shards > 1:
        # On JAX, an array sharded along the axis moves between its devices (ppermute).
        module = _framework(backend, "reorder")
        moved = module.permute_sharded(x, shards, name, ax, inverse=inverse)
        if moved is not None:
            return moved
    return permute(xp, x, shards, name, ax, inverse=inverse)


def _permute_documents(
    xp: Any, x: Any, shards: int, axis: int, documents: tuple[Any, Any], *, inverse: bool
) -> Any:
    """:func:`reorder` / :func:`restore` of the per-document zigzag layout."""
    ids = _documents.ids_of(xp, x, int(x.shape[axis]), *documents)
    _documents.check_ids(ids, x, axis)
    _documents.check_documents(ids, shards)
    order = _documents.order(xp, ids, shards)
    if inverse:
        order = _documents.inverse(xp, order)
    return _documents.take(xp, x, order, axis)


def schedule(
    num_shards: int,
    layout: str,
    q_length: int,
    k_length: int | None = None,
    *,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
) -> Schedule:
    """The ring's schedule for global lengths ``q_length`` and ``k_length`` (default
    ``q_length``): per step, the blocks each shard computes (:class:`Schedule`), with
    :meth:`Schedule.work` and :meth:`Schedule.balance` for the load balance."""
    shards = check_shards(num_shards)
    name = check_layout(layout)
    k_length = q_length if k_length is None else k_length
    from portable_attention.parallel._layout import check_length

    check_length(q_length, shards, name, name="`q_length`")
    check_length(k_length, shards, name, name="`k_length`")
    return _schedule(
        shards,
        name,
        int(q_length),
        int(k_length),
        _options.normalize_causal(causal),
        _options.normalize_window(window),
    )
