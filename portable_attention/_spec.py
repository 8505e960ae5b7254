"""The contract of ``attend``: the call's description (:class:`Call`) and its checks.

:func:`validate_call` turns the arrays and functions of a call of
:func:`portable_attention.attend`, with its options already normalised
(:func:`portable_attention._options.options`), into a :class:`Call`: the array namespace,
the shapes, dtypes and the options. It
looks only at shapes, dtypes, types and Python option values, never at array data, so
it runs unchanged under ``jax.jit`` and ``torch.compile``. Every message names the
argument, shows what was passed and says what to do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import array_api_compat

if TYPE_CHECKING:
    from portable_attention._block_plan import BlockLayout
    from portable_attention.backends._base import Adapter

from portable_attention import _band
from portable_attention._checks import backend_name, broadcasts, is_kind, shape_of, type_name
from portable_attention._options import Options, default_scale
from portable_attention.backends import adapter


@dataclass(frozen=True)
class Call:
    """A validated call of ``attend``: everything but the arrays themselves."""

    xp: Any
    backend: str
    device: Any
    dtype: Any
    compute_dtype: Any
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    mask_shape: tuple[int, ...] | None
    bias_shape: tuple[int, ...] | None
    #: The call's options, normalised (:mod:`portable_attention._options`).
    options: Options
    #: The score scale: the given one, or ``1 / sqrt(Dk)``.
    scale: float
    #: Whether an ``rng`` was passed.
    rng_given: bool
    #: Shape of ``sinks`` (None: no sinks).
    sinks_shape: tuple[int, ...] | None = None
    #: ``segment_ids``: "self" (one array for q and k), "pair" (``(q_ids, kv_ids)``),
    #: "slices" (the ids of a block's rows and of its columns cut from one array, as the
    #: ring's blocks are: the global band is exact, and a row may have no key), None.
    segments: str | None = None
    #: Whether a ``score_mod`` / ``mask_mod`` is given (the functions travel with the
    #: arrays in :class:`portable_attention._mods.Mods`, not in the call's description).
    score_mod: bool = False
    mask_mod: bool = False
    #: The blocks of the ``masks.BlockPlan`` given as ``mask_mod`` (its ``layout``: plain
    #: data, by value; the plan and its function stay out of the description, so that the
    #: caches keyed by it keep nothing of the user's alive), or None.
    blocks: BlockLayout | None = None
    #: Whether a dimension of q, k or v is unknown: None in the shape, as the array API
    #: allows a lazy library (ndonnx's symbolic dims). It cannot be written in a
    #: ``reshape``: the grouping of heads then stacks slices, and the band reads its
    #: positions from the arrays. Read once per call: decided here, with the shapes.
    unknown_dims: bool = False

    def __hash__(self) -> int:
        # Plans are cached by the whole Call; a device type may not be hashable (CuPy's).
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        return hash((fields[:2], hashable_device(self.device), fields[3:]))

    @property
    def causal(self) -> str | None:
        return self.options.causal

    @property
    def window(self) -> tuple[int | None, int | None] | None:
        return self.options.window

    @property
    def softcap(self) -> float | None:
        return self.options.softcap

    @property
    def dropout(self) -> float:
        return self.options.dropout

    @property
    def chunk_size(self) -> int | None:
        return self.options.chunk_size

    @property
    def return_weights(self) -> bool:
        return self.options.return_weights

    @property
    def return_lse(self) -> bool:
        return self.options.return_lse

    @property
    def implementation(self) -> str:
        return self.options.implementation

    @property
    def align(self) -> str:
        """The alignment of causal and window masks: upper-left only when asked for."""
        return _band.align_of(self.causal)

    @property
    def band_sides(self) -> tuple[int | None, int | None]:
        """``(left, right)`` of the band of ``causal`` and ``window`` (None: unbounded)."""
        return _band.sides(self.causal, self.window)

    @property
    def band_offset(self) -> int:
        """Query 0's aligned key position on the ``[Lq, Lk]`` grid (see :mod:`._band`)."""
        return _band.offset(self.q_shape[-2], self.k_shape[-2], self.align)

    @property
    def global_band(self) -> bool:
        """Whether ``causal``/``window`` are a band on the ``[Lq, Lk]`` grid, decided from
        shapes alone: given, and not aligned within the segments of a ``(q_ids, kv_ids)``
        pair (their band depends on the ids; one array of ids keeps the global band)."""
        return (self.causal is not None or self.window is not None) and self.segments != "pair"

    @property
    def modded(self) -> bool:
        """Whether the call has segment ids, a score_mod or a mask_mod."""
        return self.segments is not None or self.score_mod or self.mask_mod

    @property
    def symbolic(self) -> bool:
        """Whether a dimension of q, k or v is symbolic (``torch.export`` with dynamic
        shapes, ``jax.export`` with ``symbolic_shape``): decisions that compare sizes are
        then taken so that they hold for every value of it."""
        return not all(type(d) is int for d in (*self.q_shape, *self.k_shape, *self.v_shape))

    @property
    def symbolic_lengths(self) -> bool:
        """Whether ``Lq`` or ``Lk`` is symbolic (the blockwise loops need them static)."""
        return type(self.q_shape[-2]) is not int or type(self.k_shape[-2]) is not int

    @property
    def grouped(self) -> bool:
        """Grouped-query (or multi-query) heads: ``Hq != Hk``."""
        return len(self.q_shape) > 2 and self.q_shape[-3] != self.k_shape[-3]


# Namespace, backend name and adapter depend only on an array's type: cached by type.
_TYPES: dict[type, tuple[Any, str, Adapter]] = {}


def _type_info(name: str, x: object) -> tuple[Any, str, Adapter]:
    info = _TYPES.get(type(x))
    if info is not None:
        return info
    backend = backend_name(x)
    framework = adapter(backend)
    framework.check_array(name, x)  # before the generic refusals: a NumPy scalar is
    # an array-API object, and a masked array an ndarray
    if not array_api_compat.is_array_api_obj(x) or isinstance(x, (bool, int, float, complex)):
        msg = (
            f"`{name}` must be an array of your framework (NumPy, CuPy, PyTorch, JAX or "
            f"another array-API library), got {type_name(x)}; convert it first, e.g. "
            f"`xp.asarray({name})`."
        )
        raise TypeError(msg)
    try:
        xp = array_api_compat.array_namespace(x)
    except TypeError as err:  # an array type array-api-compat cannot wrap
        msg = f"`{name}` of type {type_name(x)} is not a supported array type: {err}"
        raise TypeError(msg) from None
    info = (xp, backend, framework)
    if framework.caches_type(x):
        _TYPES[type(x)] = info
    return info


def hashable_device(device: Any) -> Any:
    """``device`` as part of a hash key: itself, or its ``repr`` where its type is not
    hashable (``cupy.cuda.Device``), equal for equal devices."""
    return device if type(device).__hash__ is not None else repr(device)


def is_registered(array_type: type) -> bool:
    """Whether arrays of this type have been validated (and are arrays, not JAX's NumPy
    float0 gradients): only those enter the call memo's keys."""
    return array_type in _TYPES


def namespace_of(name: str, x: object) -> Any:
    return _type_info(name, x)[0]


def check_arrays(**arrays: Any) -> tuple[Any, str, Any]:
    """Check that every given array (``None`` skipped) is an array of one framework on one
    device; return ``(xp, backend name, device)``."""
    present = [(name, x) for name, x in arrays.items() if x is not None]
    first_name, first = present[0]
    xp, backend, framework = _type_info(first_name, first)
    framework.check_array(first_name, first)
    device = framework.device(first)
    placed = framework.placement
    for name, x in present[1:]:
        if _type_info(name, x)[0] is not xp:
            msg = (
                f"`{name}` is a {type_name(x)} but `{first_name}` is a {type_name(first)}: "
                "all arrays passed to attend must come from one framework; convert them "
                "first (e.g. `xp.from_dlpack` or `xp.asarray`)."
            )
            raise TypeError(msg)
        framework.check_array(name, x)
        dev = framework.device(x)
        if device is not None and dev is not None and placed(dev) != placed(device):
            msg = (
                f"`{name}` is on device {dev!r} but `{first_name}` is on {device!r}: move "
                "all arrays to one device first."
            )
            raise ValueError(msg)
    if placed(device) is not device:  # sharded: JAX places what the call makes, as in jit
        device = None
    return xp, backend, device


def compute_dtype_for(xp: Any, dtype: Any) -> Any:
    """The dtype scores, softmax and lse are computed in: float32 for 16-bit floats."""
    return xp.float32 if xp.finfo(dtype).bits < 32 else dtype


def _check_dtypes(xp: Any, q: Any, k: Any, v: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        floating = is_kind(xp, x.dtype, "real floating")
        if floating is None:
            msg = (
                f"`{name}` has the dtype {x.dtype}, which is not an array-API dtype of its "
                "framework (ml_dtypes' bfloat16 and float8 on NumPy arrays, JAX key arrays): "
                "attend does not compute in it; pass float16, bfloat16 (torch, JAX), float32 "
                f"or float64, e.g. `{name}.astype(numpy.float32)` for a NumPy array."
            )
            raise TypeError(msg)
        if not floating:
            msg = (
                f"`{name}` must have a real floating dtype (float16, bfloat16, float32, "
                f"float64), got {x.dtype}; cast it with `xp.astype({name}, xp.float32)`."
            )
            raise TypeError(msg)
        if xp.finfo(x.dtype).bits < 16:
            msg = (
                f"`{name}` has the 8-bit float dtype {x.dtype}, which attend does not compute "
                f"in; cast it with `xp.astype({name}, xp.bfloat16)` (or float16/float32) first."
            )
            raise TypeError(msg)
    if not (q.dtype == k.dtype == v.dtype):
        msg = (
            "`q`, `k` and `v` must share one dtype, got "
            f"q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them to one dtype first "
            "(nothing is cast silently)."
        )
        raise TypeError(msg)


def _check_shapes(q: Any, k: Any, v: Any) -> None:
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    shapes = f"q {qs}, k {ks}, v {vs}"
    if min(len(qs), len(ks), len(vs)) < 2:
        msg = f"`q`, `k` and `v` need at least 2 dims ([L, D] or [..., H, L, D]), got {shapes}."
        raise ValueError(msg)
    if not (len(qs) == len(ks) == len(vs)):
        msg = f"`q`, `k` and `v` must have the same number of dims, got {shapes}."
        raise ValueError(msg)
    if not (qs[:-3] == ks[:-3] == vs[:-3]):
        msg = f"`q`, `k` and `v` must have equal leading (batch) dims, got {shapes}."
        raise ValueError(msg)
    if len(qs) >= 3:
        hq, hk, hv = qs[-3], ks[-3], vs[-3]
        if hk != hv:
            msg = f"`k` and `v` must have the same number of heads (axis -3), got {shapes}."
            raise ValueError(msg)
        if hk == 0:
            msg = (
                f"`k` and `v` have 0 heads (axis -3), got {shapes}; attend needs at least one "
                "key/value head (an empty batch goes on a leading axis)."
            )
            raise ValueError(msg)
        if hq % hk != 0:
            msg = (
                f"the query heads of `q` ({hq}) must be a multiple of the key/value heads "
                f"of `k` ({hk}) for grouped-query attention (axis -3), got {shapes}."
            )
            raise ValueError(msg)
    if qs[-1] != ks[-1]:
        msg = f"`q` and `k` must have the same feature size Dk (last axis), got {shapes}."
        raise ValueError(msg)
    if ks[-2] != vs[-2]:
        msg = f"`k` and `v` must have the same sequence length Lk (axis -2), got {shapes}."
        raise ValueError(msg)


def _check_unknown_dims(
    q: Any,
    k: Any,
    v: Any,
    options: Options,
    segments: str | None,
    score_mod: object,
    mask_mod: object,
) -> None:
    """Dimensions a lazy library leaves unknown (None in the shape, as the array API
    allows: ndonnx's symbolic dims) may be the batch and the lengths, where the dense
    path reads what it needs from the arrays; not the heads and features, which the
    grouping of heads and the scale are written with, nor what builds per-position
    arrays on the host (a pair of segment ids, mods, dropout's masks, blocks). One array
    of segment ids (packed self-attention) is compared with itself, no length needed."""
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    if not any(d is None for d in (*qs, *ks, *vs)):
        return
    shapes = f"q {qs}, k {ks}, v {vs}"
    heads = [s[-3] for s in (qs, ks, vs) if len(s) >= 3]  # (other ranks: _check_shapes)
    fixed = [qs[-1], ks[-1], vs[-1], *heads]
    if any(d is None for d in fixed):
        msg = (
            f"the heads (axis -3) and feature sizes (axis -1) of `q`, `k` and `v` must be "
            f"known, got {shapes} (None: a dimension the library leaves unknown, such as "
            "ndonnx's symbolic dims); give them fixed sizes, e.g. "
            '`ndx.argument(shape=("B", 8, "L", 64), ...)`.'
        )
        raise ValueError(msg)
    given = [
        name
        for name, there in (
            ("segment_ids", segments == "pair"),
            ("score_mod", score_mod is not None),
            ("mask_mod", mask_mod is not None),
            ("dropout", options.dropout > 0),
        )
        if there
    ]
    if given:
        fix = {
            "dropout": "",
            "segment_ids": (
                " (one array of ids, for packed self-attention, needs none), or pass what "
                "the pair means as a boolean `mask=` of the same dims"
            ),
        }.get(
            given[0], ", or pass what it means as a boolean `mask=` or a `bias=` of the same dims"
        )
        msg = (
            f"`{given[0]}` builds arrays of the call's lengths on the host, but {shapes} "
            "has unknown (None) dimensions (such as ndonnx's symbolic dims); give the batch "
            f"and lengths fixed sizes{fix}."
        )
        raise ValueError(msg)


def check_mask_bias(xp: Any, mask: Any, bias: Any, dtype: Any, score_shape: tuple) -> None:
    if mask is not None:
        if not is_kind(xp, mask.dtype, "bool"):
            msg = (
                f"`mask` must be boolean (True = may attend), got dtype {mask.dtype} of shape "
                f"{shape_of(mask)}. For an additive float mask (0 / -inf) pass it as `bias=` "
                "instead; for a 0/1 mask where 1 = may attend use `mask=(m != 0)`, where "
                "1 = masked out (the polarity of nn.MultiheadAttention's masks) use "
                "`mask=(m == 0)`."
            )
            raise TypeError(msg)
        if not broadcasts(shape_of(mask), score_shape):
            msg = (
                f"`mask` of shape {shape_of(mask)} does not broadcast to the score shape "
                f"{score_shape} ([..., Hq, Lq, Lk])."
            )
            raise ValueError(msg)
    if bias is not None:
        allowed = (dtype, compute_dtype_for(xp, dtype))
        if not is_kind(xp, bias.dtype, "real floating") or bias.dtype not in allowed:
            msg = (
                f"`bias` must be an additive float array of the inputs' dtype {dtype} or "
                f"the compute dtype {allowed[1]}, got {bias.dtype}; for a boolean mask use "
                "`mask=`."
            )
            raise TypeError(msg)
        if not broadcasts(shape_of(bias), score_shape):
            msg = (
                f"`bias` of shape {shape_of(bias)} does not broadcast to the score shape "
                f"{score_shape} ([..., Hq, Lq, Lk])."
            )
            raise ValueError(msg)


def validate_call(
    q: Any,
    k: Any,
    v: Any,
    options: Options,
    *,
    mask: Any = None,
    bias: Any = None,
    rng: object = None,
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: object = None,
    mask_mod: object = None,
) -> Call:
    """Check every array and function of a call of ``attend`` with these (already
    normalised) ``options``; return its :class:`Call`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None:  # check_arrays skips None (mask, bias): q, k, v are required
            _type_info(name, x)
    q_ids, kv_ids, segments = _segment_arrays(segment_ids)
    id_names = ("segment_ids", "") if segments == "self" else ("segment_ids[0]", "segment_ids[1]")
    ids = {id_names[0]: q_ids, id_names[1]: kv_ids} if segments is not None else {}
    xp, _, _ = check_arrays(q=q, k=k, v=v, mask=mask, bias=bias, sinks=sinks, **ids)
    _check_dtypes(xp, q, k, v)
    _check_unknown_dims(q, k, v, options, segments, score_mod, mask_mod)
    _check_shapes(q, k, v)
    qs, ks = shape_of(q), shape_of(k)
    check_mask_bias(xp, mask, bias, q.dtype, (*qs[:-1], ks[-2]))
    if sinks is not None:
        _check_sinks(xp, sinks, q.dtype, qs)
    if segments is not None:
        _check_segment_ids(xp, q_ids, kv_ids, segments, qs, ks)
    plan = _check_mods(score_mod, mask_mod, qs, ks, options.chunk_size)
    return describe(
        options,
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        rng_given=rng is not None,
        sinks=sinks,
        segments=segments,
        score_mod=score_mod is not None,
        mask_mod=mask_mod is not None,
        blocks=None if plan is None else plan.layout,
    )


def describe(
    options: Options,
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    rng_given: bool = False,
    sinks: Any = None,
    segments: str | None = None,
    score_mod: bool = False,
    mask_mod: bool = False,
    blocks: BlockLayout | None = None,
) -> Call:
    """The :class:`Call` of arrays known to be valid (checked by :func:`validate_call`, or
    slices of arrays it checked): shapes, dtypes and device read, nothing checked again."""
    xp, backend, framework = _type_info("q", q)
    device = framework.device(q)
    if framework.placement(device) is not device:  # sharded: as check_arrays
        device = None
    qs = shape_of(q)
    return Call(
        xp=xp,
        backend=backend,
        device=device,
        dtype=q.dtype,
        compute_dtype=compute_dtype_for(xp, q.dtype),
        q_shape=qs,
        k_shape=shape_of(k),
        v_shape=shape_of(v),
        mask_shape=None if mask is None else shape_of(mask),
        bias_shape=None if bias is None else shape_of(bias),
        options=options,
        scale=default_scale(qs[-1]) if options.scale is None else options.scale,
        rng_given=rng_given,
        sinks_shape=None if sinks is None else shape_of(sinks),
        segments=segments,
        score_mod=score_mod,
        mask_mod=mask_mod,
        blocks=blocks,
        unknown_dims=any(d is None for d in (*qs, *shape_of(k), *shape_of(v))),
    )


def _segment_arrays(segment_ids: Any) -> tuple[Any, Any, str | None]:
    """``(q_ids, kv_ids or None, form)`` of ``segment_ids``: one array ("self") or a
    pair ("pair"); ``(None, None, None)`` without."""
    if segment_ids is None:
        return None, None, None
    if isinstance(segment_ids, (tuple, list)):
        if not any(hasattr(x, "shape") and hasattr(x, "dtype") for x in segment_ids):
            msg = (
                "`segment_ids` must be one integer array [..., L] or a pair of arrays "
                f"(q_ids, kv_ids), got a {type_name(segment_ids)} of Python values; "
                "convert it first, e.g. `xp.asarray(segment_ids)`."
            )
            raise TypeError(msg)
        if len(segment_ids) != 2:
            msg = (
                "`segment_ids` must be one integer array [..., L] (packed self-attention) or "
                f"a pair (q_ids [..., Lq], kv_ids [..., Lk]), got a {type_name(segment_ids)} "
                f"of {len(segment_ids)} items."
            )
            raise ValueError(msg)
        _type_info("segment_ids[0]", segment_ids[0])
        _type_info("segment_ids[1]", segment_ids[1])
        return segment_ids[0], segment_ids[1], "pair"
    _type_info("segment_ids", segment_ids)
    return segment_ids, None, "self"


def _check_segment_ids(
    xp: Any, q_ids: Any, kv_ids: Any, form: str, qs: tuple[int, ...], ks: tuple[int, ...]
) -> None:
    names = ("segment_ids",) if form == "self" else ("segment_ids[0]", "segment_ids[1]")
    arrays = (q_ids,) if form == "self" else (q_ids, kv_ids)
    lengths = (qs[-2],) if form == "self" else (qs[-2], ks[-2])
    batch = qs[:-3] if len(qs) >= 3 else ()
    if form == "self" and qs[-2] != ks[-2]:
        msg = (
            f"one array of `segment_ids` is for packed self-attention (Lq == Lk), but q has "
            f"{qs[-2]} queries and k {ks[-2]} keys; pass a pair `segment_ids=(q_ids, kv_ids)`."
        )
        raise ValueError(msg)
    for index, (name, x, length) in enumerate(zip(names, arrays, lengths, strict=True)):
        if not is_kind(xp, x.dtype, "integral"):
            msg = (
                f"`{name}` must be an integer array of segment ids, got dtype {x.dtype}; "
                f"cast it with `xp.astype({name}, xp.int32)` (ids are compared for equality)."
            )
            raise TypeError(msg)
        shape = shape_of(x)
        if len(shape) < 1 or shape[-1] != length or not broadcasts(shape[:-1], batch):
            what = "[..., L]" if form == "self" else ("[..., Lq]", "[..., Lk]")[index]
            msg = (
                f"`{name}` must have shape {what} with leading dims that broadcast to q's "
                f"batch dims {batch} (ids are per batch row, shared by the heads), got "
                f"{shape} for q {qs} and k {ks}."
            )
            raise ValueError(msg)


def _check_sinks(xp: Any, sinks: Any, dtype: Any, qs: tuple[int, ...]) -> None:
    allowed = (dtype, compute_dtype_for(xp, dtype))
    if not is_kind(xp, sinks.dtype, "real floating") or sinks.dtype not in allowed:
        msg = (
            f"`sinks` must be a float array of the inputs' dtype {dtype} or the compute dtype "
            f"{allowed[1]}, got {sinks.dtype}; cast it with `xp.astype(sinks, ...)`."
        )
        raise TypeError(msg)
    heads = qs[:-2] if len(qs) >= 3 else (1,)
    if not broadcasts(shape_of(sinks), heads):
        msg = (
            f"`sinks` must broadcast to q's heads {heads} ([..., Hq]: one logit per query "
            f"head), got shape {shape_of(sinks)} for q {qs}."
        )
        raise ValueError(msg)


def _check_mods(
    score_mod: object, mask_mod: object, qs: tuple[int, ...], ks: tuple[int, ...], chunk: object
) -> Any:
    """Check ``score_mod`` and ``mask_mod`` (a function or a ``masks.BlockPlan``); return
    the block plan (None where ``mask_mod`` is a function or absent)."""
    from portable_attention._block_plan import BlockPlan, check_plan_for

    if score_mod is not None and not callable(score_mod):
        msg = (
            "`score_mod` must be a function `score_mod(score, b, h, q_idx, kv_idx) -> score` "
            f"(FlexAttention's signature), got {type_name(score_mod)}."
        )
        raise TypeError(msg)
    if isinstance(mask_mod, BlockPlan):
        check_plan_for(mask_mod, qs, ks, chunk)
        return mask_mod
    if mask_mod is not None and not callable(mask_mod):
        msg = (
            "`mask_mod` must be a function `mask_mod(b, h, q_idx, kv_idx) -> bool` "
            f"(FlexAttention's signature) or a `masks.block_plan(...)`, got {type_name(mask_mod)}."
        )
        raise TypeError(msg)
    return None


def rng_type_error(backend: str, expected: str, rng: object) -> TypeError:
    """The error for an ``rng`` of the wrong type for the arrays' framework."""
    msg = (
        f"`rng` for {backend} arrays must be {expected}, got {type_name(rng)}; "
        "pass the framework's own random generator."
    )
    return TypeError(msg)


def rng_device_error(rng_device: object, device: object) -> ValueError:
    """The error for a generator on another device than the arrays."""
    msg = (
        f"`rng` draws on {rng_device} but the arrays are on {device}; make a generator "
        f"on the arrays' device, e.g. `torch.Generator(device={str(device)!r})`."
    )
    return ValueError(msg)


def missing_rng_error(backend: str, expected: str) -> ValueError:
    """The error for dropout without the ``rng`` a framework needs."""
    msg = f"`dropout` > 0 on {backend} arrays needs `rng=`: pass {expected}."
    return ValueError(msg)


def fused_unavailable_error(reason: str) -> ValueError:
    """The error of ``implementation="fused"`` where no fused path applies."""
    msg = f'`implementation="fused"` cannot run this call: {reason}'
    return ValueError(msg)
