"""Every argument check of the package and every error message, in one place.

`validate_call` turns the raw arguments of :func:`portable_attention.attend` into a
:class:`Call`: the array namespace, the shapes, dtypes and the normalised options. It
looks only at shapes, dtypes, types and Python option values, never at array data, so
it runs unchanged under ``jax.jit`` and ``torch.compile``.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import array_api_compat

CAUSAL_ALIGNMENTS = ("lower_right", "upper_left")
IMPLEMENTATIONS = ("auto", "portable", "fused")


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
    causal: str | None
    window: tuple[int | None, int | None] | None
    scale: float
    softcap: float | None
    dropout: float
    seeded: bool
    chunk_size: int | None
    return_weights: bool
    return_lse: bool

    @property
    def align(self) -> str:
        """The alignment of causal and window masks: upper-left only when asked for."""
        return "upper_left" if self.causal == "upper_left" else "lower_right"

    @property
    def grouped(self) -> bool:
        """Grouped-query (or multi-query) heads: ``Hq != Hk``."""
        return len(self.q_shape) > 2 and self.q_shape[-3] != self.k_shape[-3]

    def options(self) -> tuple[Any, ...]:
        """The options that can change which path runs (the plan-cache key, with types)."""
        return (
            self.mask_shape is not None,
            self.bias_shape is not None,
            self.causal,
            self.window,
            self.softcap is not None,
            self.dropout > 0,
            self.seeded,
            self.chunk_size,
            self.return_weights,
            self.return_lse,
            self.grouped,
            self.q_shape[-2] != self.k_shape[-2],
            self.q_shape[-1] != self.v_shape[-1],
            0 in (self.q_shape[-2], self.k_shape[-2]),
            self.q_shape[-2] >= LONG_QUERIES,
        )


#: From this many query rows on, a kernel may split the queries into blocks (JAX on CPU);
#: the plan cache tells the two sides apart.
LONG_QUERIES = 512


def _type_name(x: object) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


# Namespace, backend name and device getter depend only on an array's type: cached by type.
_TYPES: dict[type, tuple[Any, str, Callable[[Any], Any]]] = {}


def _type_info(name: str, x: object) -> tuple[Any, str, Callable[[Any], Any]]:
    info = _TYPES.get(type(x))
    if info is not None:
        return info
    _refuse_numpy_special(name, x)
    if not array_api_compat.is_array_api_obj(x) or isinstance(x, (bool, int, float, complex)):
        msg = (
            f"`{name}` must be an array of your framework (NumPy, CuPy, PyTorch, JAX or "
            f"another array-API library), got {_type_name(x)}; convert it first, e.g. "
            f"`xp.asarray({name})`."
        )
        raise TypeError(msg)
    try:
        xp = array_api_compat.array_namespace(x)
    except TypeError as err:  # an array type array-api-compat cannot wrap
        msg = f"`{name}` of type {_type_name(x)} is not a supported array type: {err}"
        raise TypeError(msg) from None
    backend = backend_name(x)
    if backend == "torch":
        global _torch_strided
        _torch_strided = sys.modules["torch"].strided
    get_device = _DEVICE_GETTERS.get(backend, array_api_compat.device)
    info = (xp, backend, get_device)
    if not (backend == "jax" and type(x).__module__ == "numpy"):  # JAX's float0 gradients
        _KEYS[type(x)] = _KEY_GETTERS.get(backend) or _generic_key(get_device)
        _QKV_KEYS[type(x)] = _QKV_KEY_GETTERS.get(backend) or _generic_qkv_key(get_device)
        _TYPES[type(x)] = info
    return info


def _torch_key(x: Any) -> tuple[Any, ...]:
    # The layout tells sparse tensors from dense ones of the same shape: validation
    # refuses those, so the memo must never take one for the other. (A plain function:
    # torch.compile traces this, and cannot trace ``operator.attrgetter``.)
    return (x.shape, x.dtype, x.device, x.layout)


def _torch_qkv_key(q: Any, k: Any, v: Any) -> tuple[Any, ...]:
    # Flat: one tuple to build and hash. (The layout as in _torch_key.)
    return (
        type(k),
        type(v),
        q.shape,
        q.dtype,
        q.device,
        q.layout,
        k.shape,
        k.dtype,
        k.device,
        k.layout,
        v.shape,
        v.dtype,
        v.device,
        v.layout,
    )


def _numpy_qkv_key(q: Any, k: Any, v: Any) -> tuple[Any, ...]:
    return (type(k), type(v), q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)


#: What of an array enters the call memo's key, by type (filled with ``_TYPES``): its
#: shape, dtype and device (mask and bias), and the same of q, k and v in one flat tuple
#: by the type of q (``type(k)`` and ``type(v)`` in it). A repeated torch call sits right
#: after a kernel that has flushed the caches, where every Python step of the key costs:
#: right after SDPA, one getter for q, k and v took 1.6-2.2 us where three took 1.8-2.7.
_KEYS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}
_KEY_GETTERS: dict[str, Callable[[Any], tuple[Any, ...]]] = {
    "numpy": operator.attrgetter("shape", "dtype"),  # always on the CPU
    "torch": _torch_key,
}
_QKV_KEYS: dict[type, Callable[[Any, Any, Any], tuple[Any, ...]]] = {}
_QKV_KEY_GETTERS: dict[str, Callable[[Any, Any, Any], tuple[Any, ...]]] = {
    "numpy": _numpy_qkv_key,
    "torch": _torch_qkv_key,
}


def _generic_key(get_device: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    def key(x: Any) -> tuple[Any, ...]:
        return (x.shape, x.dtype, get_device(x))

    return key


def _generic_qkv_key(get_device: Callable[[Any], Any]) -> Callable[[Any, Any, Any], Any]:
    one = _generic_key(get_device)  # off the torch and NumPy hot paths: built from it

    def key(q: Any, k: Any, v: Any) -> tuple[Any, ...]:
        return (type(k), type(v), *one(q), *one(k), *one(v))

    return key


def _refuse_numpy_special(name: str, x: object) -> None:
    """NumPy scalars are not arrays (as Python scalars are not); a masked array's mask
    would be ignored silently: both are TypeErrors that say what to pass instead."""
    np = sys.modules.get("numpy")
    if np is None:
        return
    if isinstance(x, np.generic):
        msg = (
            f"`{name}` must be an array of your framework, got the NumPy scalar {x!r} of type "
            f"{_type_name(x)}; convert it first, e.g. `xp.asarray({name})`."
        )
        raise TypeError(msg)
    if isinstance(x, np.ma.MaskedArray):
        msg = (
            f"`{name}` is a numpy.ma.MaskedArray {_shape(x)}, whose mask attend would ignore; "
            f"pass `{name}.filled(0.0)` (plain data) and express what is masked out with "
            "`mask=` (boolean, True = may attend)."
        )
        raise TypeError(msg)


def _cpu(x: Any) -> str:
    return "cpu"


def _device_attribute(x: Any) -> Any:
    return x.device


#: ``torch.strided``, set when the first torch tensor type is registered (never imported).
_torch_strided: Any = None


def _check_dense_tensor(name: str, x: Any) -> None:
    """Sparse and nested torch tensors: our TypeError, not torch's from inside a kernel."""
    if x.is_nested or x.layout is not _torch_strided:
        kind, fix = (
            ("nested", f"`{name}.to_padded_tensor(0.0)` with a `mask=` for the padding")
            if x.is_nested
            else (str(x.layout), f"`{name}.to_dense()`")
        )
        msg = f"`{name}` is a {kind} tensor; attend takes dense (strided) tensors: pass {fix}."
        raise TypeError(msg)


_DEVICE_GETTERS: dict[str, Callable[[Any], Any]] = {
    "numpy": _cpu,
    "torch": _device_attribute,
    "cupy": _device_attribute,
}


def _namespace_of(name: str, x: object) -> Any:
    return _type_info(name, x)[0]


def backend_name(x: object) -> str:
    """The framework of array ``x``: numpy, torch, jax, cupy, else its top-level module."""
    if array_api_compat.is_numpy_array(x):
        return "numpy"
    if array_api_compat.is_torch_array(x):
        return "torch"
    if array_api_compat.is_jax_array(x):
        return "jax"
    if array_api_compat.is_cupy_array(x):
        return "cupy"
    return type(x).__module__.split(".")[0]


def check_arrays(**arrays: Any) -> tuple[Any, str, Any]:
    """Check that every given array (``None`` skipped) is an array of one framework on one
    device; return ``(xp, backend name, device)``."""
    present = [(name, x) for name, x in arrays.items() if x is not None]
    first_name, first = present[0]
    xp, backend, get_device = _type_info(first_name, first)
    if backend == "torch":
        _check_dense_tensor(first_name, first)
    device = get_device(first)
    for name, x in present[1:]:
        if _type_info(name, x)[0] is not xp:
            msg = (
                f"`{name}` is a {_type_name(x)} but `{first_name}` is a {_type_name(first)}: "
                "all arrays passed to attend must come from one framework; convert them "
                "first (e.g. `xp.from_dlpack` or `xp.asarray`)."
            )
            raise TypeError(msg)
        if backend == "torch":
            _check_dense_tensor(name, x)
        dev = get_device(x)
        if device is not None and dev is not None and _placement(dev) != _placement(device):
            msg = (
                f"`{name}` is on device {dev!r} but `{first_name}` is on {device!r}: move "
                "all arrays to one device first."
            )
            raise ValueError(msg)
    if _placement(device) is not device:  # sharded: JAX places what the call makes, as in jit
        device = None
    return xp, backend, device


def _placement(device: Any) -> Any:
    """Where an array lives, for comparing arrays: a JAX array on several devices reports
    its sharding as its device, and compares by the set of devices (q sharded by batch
    with k and v replicated share their devices; JAX computes on them as they are)."""
    return getattr(device, "device_set", device)


def _is_kind(xp: Any, dtype: Any, kind: str) -> bool | None:
    """``xp.isdtype(dtype, kind)``; None for a dtype outside the standard (ml_dtypes'
    bfloat16 or float8 on NumPy arrays, JAX key arrays), which the namespace refuses with
    a TypeError of its own that names no argument."""
    try:
        return bool(xp.isdtype(dtype, kind))
    except (TypeError, ValueError):
        return None


def compute_dtype_for(xp: Any, dtype: Any) -> Any:
    """The dtype scores, softmax and lse are computed in: float32 for 16-bit floats."""
    return xp.float32 if xp.finfo(dtype).bits < 32 else dtype


def _check_dtypes(xp: Any, q: Any, k: Any, v: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        floating = _is_kind(xp, x.dtype, "real floating")
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
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
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


def _broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """NumPy's broadcast of two shapes, or None where they do not broadcast."""
    width = max(len(a), len(b))
    pa, pb = (1,) * (width - len(a)) + a, (1,) * (width - len(b)) + b
    if any(x != y and 1 not in (x, y) for x, y in zip(pa, pb, strict=True)):
        return None
    return tuple(y if x == 1 else x for x, y in zip(pa, pb, strict=True))


def _broadcasts(small: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """``small`` broadcasts to ``target`` without changing it."""
    return len(small) <= len(target) and _broadcast_shape(small, target) == target


def _check_mask_bias(xp: Any, mask: Any, bias: Any, dtype: Any, score_shape: tuple) -> None:
    if mask is not None:
        if not _is_kind(xp, mask.dtype, "bool"):
            msg = (
                f"`mask` must be boolean (True = may attend), got dtype {mask.dtype} of shape "
                f"{_shape(mask)}. For an additive float mask (0 / -inf) pass it as `bias=` "
                "instead; for a 0/1 mask where 1 = may attend use `mask=(m != 0)`, where "
                "1 = masked out (the polarity of nn.MultiheadAttention's masks) use "
                "`mask=(m == 0)`."
            )
            raise TypeError(msg)
        if not _broadcasts(_shape(mask), score_shape):
            msg = (
                f"`mask` of shape {_shape(mask)} does not broadcast to the score shape "
                f"{score_shape} ([..., Hq, Lq, Lk])."
            )
            raise ValueError(msg)
    if bias is not None:
        allowed = (dtype, compute_dtype_for(xp, dtype))
        if not _is_kind(xp, bias.dtype, "real floating") or bias.dtype not in allowed:
            msg = (
                f"`bias` must be an additive float array of the inputs' dtype {dtype} or "
                f"the compute dtype {allowed[1]}, got {bias.dtype}; for a boolean mask use "
                "`mask=`."
            )
            raise TypeError(msg)
        if not _broadcasts(_shape(bias), score_shape):
            msg = (
                f"`bias` of shape {_shape(bias)} does not broadcast to the score shape "
                f"{score_shape} ([..., Hq, Lq, Lk])."
            )
            raise ValueError(msg)


def normalize_causal(causal: object) -> str | None:
    """``False -> None``, ``True -> "lower_right"`` (NumPy's bools too), a known alignment
    string -> itself."""
    if _is_numpy_bool(causal):
        causal = bool(causal)
    if causal is False:
        return None
    if causal is True:
        return "lower_right"
    if isinstance(causal, str):
        if causal in CAUSAL_ALIGNMENTS:
            return causal
        msg = f"`causal` must be True, False, 'lower_right' or 'upper_left', got {causal!r}."
        raise ValueError(msg)
    msg = (
        "`causal` must be True, False, 'lower_right' or 'upper_left', "
        f"got {causal!r} of type {_type_name(causal)}."
    )
    raise TypeError(msg)


def normalize_align(align: object) -> str:
    """Check the ``align=`` of the mask builders."""
    if align not in CAUSAL_ALIGNMENTS:
        msg = f"`align` must be 'lower_right' or 'upper_left', got {align!r}."
        raise ValueError(msg)
    return str(align)


def normalize_window(window: object) -> tuple[int | None, int | None] | None:
    """``None``, an int ``w`` (means ``(w, w)``) or ``(left, right)`` of ints >= 0 / None."""
    if window is None:
        return None
    sides: Sequence[object]
    if _as_int(window) is not None:
        sides = (window, window)
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        sides = window
    else:
        msg = (
            "`window` must be an int w (meaning (w, w)) or a pair (left, right) of ints >= 0 "
            f"or None (unbounded), got {window!r}."
        )
        raise ValueError(msg)
    ints = [None if side is None else _as_int(side) for side in sides]
    for side, as_int in zip(sides, ints, strict=True):
        if side is not None and (as_int is None or as_int < 0):
            why = "; a negative window keeps no key" if as_int is not None else ""
            msg = f"`window` sides must be ints >= 0 or None (unbounded), got {window!r}{why}."
            raise ValueError(msg)
    return (ints[0], ints[1])


def _as_int(value: object) -> int | None:
    """A Python int from an int-like option (NumPy integers too), None for anything else
    (bools included: ``window=True`` is a mistake, not 1)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _real_number(name: str, value: object) -> float:
    if isinstance(value, (bool, str)):
        msg = f"`{name}` must be a Python float, got {value!r} of type {_type_name(value)}."
        raise TypeError(msg)
    if isinstance(value, (int, float)):  # first: torch.compile(dynamic=True) makes floats
        return _as_float(value)  # symbolic, and cannot trace the getattr below on them
    if getattr(value, "requires_grad", False):
        msg = (
            f"`{name}` must be a Python float, got a tensor that requires grad; its gradient "
            "would be lost: multiply q (or the scores' inputs) by it instead."
        )
        raise TypeError(msg)
    try:
        return float(value)  # type: ignore[arg-type]  # NumPy scalars, 0-d arrays
    except (TypeError, ValueError):
        msg = f"`{name}` must be a Python float, got {value!r} of type {_type_name(value)}."
        if hasattr(value, "shape"):  # a traced or many-element array
            msg += (
                " Under jax.jit pass it as a static argument (`static_argnames`) or a "
                "Python constant; a traced value cannot choose the computation."
            )
        raise TypeError(msg) from None


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float range: as infinite as inf
        return math.inf if value > 0 else -math.inf


def default_scale(dk: int) -> float:
    """The score scale when ``scale=None``: ``1 / sqrt(Dk)`` (1 for ``Dk == 0``)."""
    return 1.0 / math.sqrt(dk) if dk > 0 else 1.0


def _check_options(
    scale: object, softcap: object, dropout: object, dk: int
) -> tuple[float, float | None, float]:
    if scale is None:
        scale_f = default_scale(dk)
    else:
        scale_f = _real_number("scale", scale)
        if not 0 < scale_f < math.inf:  # comparisons only: torch.compile traces them on
            # symbolic floats (dynamic=True), math.isfinite it cannot
            msg = (
                f"`scale` must be a finite number > 0 (or None for 1/sqrt(Dk)), got {scale!r}; "
                "0 would weigh every key alike and a negative scale inverts the attention "
                "(check for an integer division such as `1 // d`)."
            )
            raise ValueError(msg)
    softcap_f = None
    if softcap is not None:
        softcap_f = _real_number("softcap", softcap)
        if not 0 < softcap_f < math.inf:  # NaN fails both; as scale's, traceable
            msg = f"`softcap` must be a finite number > 0 (or None), got {softcap!r}."
            raise ValueError(msg)
    return scale_f, softcap_f, check_dropout(dropout)


def check_dropout(dropout: object, name: str = "dropout") -> float:
    """A dropout probability in ``[0, 1)`` (of ``attend``, the multi-head modules and
    ``mha.dropout``, whose argument is ``p``)."""
    dropout_f = _real_number(name, dropout)
    if not 0.0 <= dropout_f < 1.0:
        msg = f"`{name}` must be in [0, 1), got {dropout!r}."
        raise ValueError(msg)
    return dropout_f


def _check_chunk_size(chunk_size: object, return_weights: bool) -> int | None:
    if chunk_size is None:
        return None
    size = _as_int(chunk_size)
    if size is None or size <= 0:
        msg = f"`chunk_size` must be an int > 0 (or None for automatic), got {chunk_size!r}."
        raise ValueError(msg)
    if return_weights:
        msg = (
            "`chunk_size` asks for the chunked path, which never holds the whole weight "
            "matrix: drop `return_weights=True` or `chunk_size`."
        )
        raise ValueError(msg)
    return size


def _flag(name: str, value: object) -> bool:
    """``return_weights`` / ``return_lse``: True or False (NumPy's bool too), nothing else."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    msg = f"`{name}` must be True or False, got {value!r} of type {_type_name(value)}."
    raise TypeError(msg)


def _is_numpy_bool(value: object) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_implementation(implementation: object) -> str:
    """``"auto"``, ``"portable"`` or ``"fused"``."""
    if implementation not in IMPLEMENTATIONS:
        msg = f"`implementation` must be 'auto', 'portable' or 'fused', got {implementation!r}."
        raise ValueError(msg)
    return str(implementation)


def validate_call(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: object = False,
    window: object = None,
    scale: object = None,
    softcap: object = None,
    dropout: object = 0.0,
    rng: object = None,
    chunk_size: object = None,
    return_weights: object = False,
    return_lse: object = False,
) -> Call:
    """Check every argument of ``attend``; return the normalised :class:`Call`."""
    weights_f, lse_f = _flag("return_weights", return_weights), _flag("return_lse", return_lse)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None:  # check_arrays skips None (mask, bias): q, k, v are required
            _type_info(name, x)
    xp, backend, device = check_arrays(q=q, k=k, v=v, mask=mask, bias=bias)
    _check_dtypes(xp, q, k, v)
    _check_shapes(q, k, v)
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    score_shape = (*qs[:-1], ks[-2])
    _check_mask_bias(xp, mask, bias, q.dtype, score_shape)
    scale_f, softcap_f, dropout_f = _check_options(scale, softcap, dropout, qs[-1])
    return Call(
        xp=xp,
        backend=backend,
        device=device,
        dtype=q.dtype,
        compute_dtype=compute_dtype_for(xp, q.dtype),
        q_shape=qs,
        k_shape=ks,
        v_shape=vs,
        mask_shape=None if mask is None else _shape(mask),
        bias_shape=None if bias is None else _shape(bias),
        causal=normalize_causal(causal),
        window=normalize_window(window),
        scale=scale_f,
        softcap=softcap_f,
        dropout=dropout_f,
        seeded=rng is not None,
        chunk_size=_check_chunk_size(chunk_size, weights_f),
        return_weights=weights_f,
        return_lse=lse_f,
    )


def _signature(x: Any) -> tuple[Any, ...]:
    return (type(x), _KEYS[type(x)](x))


_KEYABLE = (bool, int, float, str, type(None))


_KEYABLE_TYPES = frozenset(_KEYABLE)


def _typed(option: object) -> object:
    """An option as part of a memo key: builtin values with their type, else TypeError
    (a tensor is hashable by identity but can change in place: never memoised)."""
    if isinstance(option, tuple):
        return (tuple, *(_typed(o) for o in option))
    if type(option) not in _KEYABLE:
        raise TypeError
    return (type(option), option)


def call_key(q: Any, k: Any, v: Any, mask: Any, bias: Any, options: tuple[Any, ...]) -> Any:
    """A key that determines the :class:`Call` of these arguments, given the type of
    ``q`` (the memo keeps one dict per type), or None where an array's type is not yet
    validated or its key cannot be read.

    Built from array types, shapes, dtypes and devices and from the option values with
    their types (``causal=1`` must not hit the entry of ``causal=True``). The key may be
    unhashable (a list as ``window``): the lookup fails and the call is validated in
    full. Only keys that :func:`memoisable` accepts are stored, so a lookup never
    compares options of other types: the types come first in the key.
    """
    try:
        types = tuple(map(type, options))
        if tuple in types:  # window=(left, right): the types of its sides count too
            options, types = tuple(map(_typed, options)), ()
        return (
            types,
            options,
            _QKV_KEYS[type(q)](q, k, v),
            None if mask is None else _signature(mask),
            None if bias is None else _signature(bias),
        )
    except Exception:  # anything unusual is validated in full
        return None


def memoisable(key: Any) -> bool:
    """Whether a call of ``key`` may be memoised: hashable, with options of builtin types
    only (a tensor as ``scale`` hashes by identity but can change in place)."""
    try:
        hash(key)
    except Exception:
        return False
    return _KEYABLE_TYPES.issuperset(key[0])


def rng_type_error(backend: str, expected: str, rng: object) -> TypeError:
    """The error for an ``rng`` of the wrong type for the arrays' framework."""
    msg = (
        f"`rng` for {backend} arrays must be {expected}, got {_type_name(rng)}; "
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


def check_mask_array(name: str, x: Any, *, integer: bool = False) -> Any:
    """Namespace of a mask-builder argument; check it is an array (of integers if asked)."""
    xp = _namespace_of(name, x)
    if integer and not _is_kind(xp, x.dtype, "integral"):
        msg = f"`{name}` must be an integer array, got dtype {x.dtype}."
        raise TypeError(msg)
    return xp


def check_mha_call(
    params: dict[str, Any],
    query: Any,
    key: Any,
    value: Any,
    num_heads: int,
    num_kv_heads: int,
    key_padding_mask: Any,
    mask: Any,
    bias: Any,
    weights: tuple[str, ...],
) -> Any:
    """Every argument check of ``mha.multi_head_attention``; returns the namespace.

    ``mask`` and ``bias`` are checked here as :func:`attend` would, against the scores
    ``[B, Hq, Lq, Lk]``: ``mask`` is combined with ``key_padding_mask`` before ``attend``
    sees it."""
    missing = [n for n in weights if n not in params]
    if missing:
        msg = f"`params` lacks {missing}; expected keys {list(weights)} (+ optional biases)"
        raise ValueError(msg)
    if not isinstance(num_heads, int) or num_heads <= 0:
        msg = f"`num_heads` must be a positive int, got {num_heads!r}"
        raise ValueError(msg)
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
        msg = (
            f"`num_kv_heads` must be a positive divisor of `num_heads`={num_heads}, "
            f"got {num_kv_heads!r}"
        )
        raise ValueError(msg)
    named = {f"params[{n!r}]": p for n, p in params.items() if p is not None}
    xp, _, _ = check_arrays(
        query=query,
        key=key,
        value=value,
        key_padding_mask=key_padding_mask,
        mask=mask,
        bias=bias,
        **named,
    )
    if key_padding_mask is not None and not _is_kind(xp, key_padding_mask.dtype, "bool"):
        msg = (
            f"`key_padding_mask` must be boolean [B, Lk] (True = real key), got dtype "
            f"{key_padding_mask.dtype}; for 0/1 where 1 = real key pass `key_padding_mask != 0`, "
            "for torch's True = padding pass its negation."
        )
        raise TypeError(msg)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 3:
            got = getattr(x, "shape", type(x))
            msg = f"`{name}` must be a batch-first [B, L, E] array, got {got}"
            raise ValueError(msg)
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        msg = f"batch sizes differ: `query` {query.shape}, `key` {key.shape}, `value` {value.shape}"
        raise ValueError(msg)
    if key.shape[1] != value.shape[1]:
        msg = f"`key` {key.shape} and `value` {value.shape} must have the same length"
        raise ValueError(msg)
    shapes = {n: tuple(params[n].shape) for n in weights}
    wq, wk, wv, wo = (shapes[n] for n in weights)
    ok = (
        len(wq) == len(wk) == len(wv) == len(wo) == 2
        and wq[1] % num_heads == 0
        and wk[1] % num_kv_heads == 0
        and wv[1] % num_kv_heads == 0
        and wq[1] // num_heads == wk[1] // num_kv_heads
        and wo[0] == num_heads * (wv[1] // num_kv_heads)
        and wq[0] == query.shape[2]
        and wk[0] == key.shape[2]
        and wv[0] == value.shape[2]
    )
    if not ok:
        msg = (
            f"parameter shapes {shapes} do not fit `num_heads`={num_heads}, "
            f"`num_kv_heads`={num_kv_heads} and inputs `query` {query.shape}, `key` {key.shape}, "
            f"`value` {value.shape}; expected w_q (E, Hq*D), w_k (kdim, Hk*D), "
            "w_v (vdim, Hk*Dv), w_o (Hq*Dv, E)"
        )
        raise ValueError(msg)
    for name, arr in params.items():
        if arr is not None and arr.dtype != query.dtype:
            msg = f"`params[{name!r}]` has dtype {arr.dtype}, `query` has {query.dtype}; cast one"
            raise TypeError(msg)
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (
        key.shape[0],
        key.shape[1],
    ):
        msg = (
            f"`key_padding_mask` must be boolean [B, Lk] = {(key.shape[0], key.shape[1])}, "
            f"got shape {tuple(key_padding_mask.shape)}"
        )
        raise ValueError(msg)
    scores = (query.shape[0], num_heads, query.shape[1], key.shape[1])
    _check_mask_bias(xp, mask, bias, query.dtype, scores)
    return xp


def check_torch_attn_mask_shapes(
    key_padding_mask: Any, attn_mask: Any, batch: int | None, heads: int, lq: int, lk: int
) -> None:
    """``torch_compat_forward``'s masks, in torch's names and shapes: ``key_padding_mask
    [B, Lk]``, ``attn_mask [Lq, Lk]`` or ``[B * H, Lq, Lk]``; unbatched inputs
    (``batch=None``) take ``[Lk]`` and ``[Lq, Lk]`` or ``[H, Lq, Lk]``."""
    kpm_shape, kpm_text = ((lk,), "[Lk]") if batch is None else ((batch, lk), "[B, Lk]")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != kpm_shape:
        msg = (
            f"`key_padding_mask` must be {kpm_text} = {kpm_shape}, got shape "
            f"{tuple(key_padding_mask.shape)}"
        )
        raise ValueError(msg)
    stacked, stacked_text = (
        ((heads, lq, lk), "[num_heads, Lq, Lk]")
        if batch is None
        else ((batch * heads, lq, lk), "[B * num_heads, Lq, Lk]")
    )
    if attn_mask is not None and tuple(attn_mask.shape) not in ((lq, lk), stacked):
        msg = (
            f"`attn_mask` must be [Lq, Lk] = {(lq, lk)} or {stacked_text} = {stacked}, "
            f"got shape {tuple(attn_mask.shape)}"
        )
        raise ValueError(msg)


def check_bool_masks(named: dict[str, Any]) -> None:
    """Masks to combine: arrays of one framework and device, boolean, shapes that broadcast."""
    xp, _, _ = check_arrays(**named)
    shape: tuple[int, ...] = ()
    for name, m in named.items():
        if not _is_kind(xp, m.dtype, "bool"):
            msg = f"`{name}` must be boolean (True = may attend), got dtype {m.dtype}."
            raise TypeError(msg)
        combined = _broadcast_shape(shape, _shape(m))
        if combined is None:
            msg = (
                f"`{name}` of shape {_shape(m)} does not broadcast with the masks before it "
                f"{shape}."
            )
            raise ValueError(msg)
        shape = combined


def check_namespace(xp: object) -> None:
    """``xp=`` of the mask builders: an array namespace or a framework module."""
    if not callable(getattr(xp, "asarray", None)) or not callable(getattr(xp, "arange", None)):
        msg = (
            f"`xp` must be an array namespace or framework module (numpy, torch, jax.numpy, "
            f"cupy, array_api_strict), got {xp!r}."
        )
        raise TypeError(msg)


def check_ndim(name: str, x: Any, least: int, layout: str) -> None:
    """A mask-builder array with at least ``least`` dims."""
    if x.ndim < least:
        msg = f"`{name}` must have shape {layout}, got {tuple(x.shape)}."
        raise ValueError(msg)


def check_length(name: str, value: object) -> int:
    """A sequence length for the mask builders: an int >= 0 (NumPy integers too)."""
    length = _as_int(value)
    if length is None or length < 0:
        msg = f"`{name}` must be an int >= 0, got {value!r}."
        raise ValueError(msg)
    return length


def check_mask_shapes(name_a: str, a: Any, name_b: str, b: Any, axes: str) -> None:
    """Mask-builder inputs whose leading (batch) shapes must agree."""
    if _shape(a)[:-1] != _shape(b)[:-1]:
        msg = f"`{name_a}` {_shape(a)} and `{name_b}` {_shape(b)} must have the same {axes}."
        raise ValueError(msg)


# -- Checks and messages of the helpers: conversions, plot, testing, report, transformers ---------
# integration. The modules call these functions (a check raises; a `..._error` function builds
# the exception for the caller to raise, with its own `from` chaining).

# conversions (portable_attention._convert: to_backend and its helpers)

#: How to install each framework to_backend converts to (in its import error).
_INSTALL = {
    "numpy": "pip install numpy",
    "torch": "pip install torch",
    "jax": "pip install jax",
    "cupy": "pip install cupy-cuda12x (or the build for your CUDA)",
    "array_api_strict": "pip install array-api-strict",
}

#: What ``device=`` of to_backend takes, per target framework.
_DEVICE_HINTS = {
    "torch": "pass a string like 'cpu' or 'cuda:1'",
    "jax": "pass a string like 'cpu' or 'cuda:1'",
    "numpy": "NumPy arrays live on the CPU; pass 'cpu' or None",
    "array_api_strict": "pass 'cpu' or an array_api_strict.Device",
    "cupy": "CuPy arrays live on a GPU; pass 'cuda' or 'cuda:N'",
}


def check_convertible(x: object) -> None:
    """``x`` of ``to_backend``: None, Python scalars, strings and containers are not arrays
    (NumPy scalars are, as 0-d arrays: ``numpy.float64`` subclasses ``float`` too)."""
    python = (bool, int, float, complex, str, bytes, list, tuple, dict)
    if x is None or (isinstance(x, python) and type(x).__module__ != "numpy"):
        msg = (
            f"`x` must be an array (NumPy, PyTorch, JAX, CuPy or array_api_strict), got "
            f"{_type_name(x)}; make an array of it first, e.g. `numpy.asarray(x)`."
        )
        raise TypeError(msg)


def unknown_array_error(x: object) -> TypeError:
    """The error for an ``x`` of no known framework and without ``__dlpack__``."""
    msg = (
        f"`x` must be an array (NumPy, PyTorch, JAX, CuPy, array_api_strict or any array "
        f"with `__dlpack__`), got {_type_name(x)}."
    )
    return TypeError(msg)


def check_backend_name(name: object, known: Sequence[str]) -> str:
    """A target framework's ``name``: one of ``known``."""
    if not isinstance(name, str) or name not in known:
        msg = f"`name` must be one of {', '.join(map(repr, known))}, got {name!r}."
        raise ValueError(msg)
    return name


def backend_import_error(name: str, err: BaseException) -> ValueError:
    """The error for a target framework that does not import."""
    msg = (
        f"`name`={name!r}, but {name} does not import here ({err!r}); install it "
        f"({_INSTALL[name]}) or pick one of available_backends()."
    )
    return ValueError(msg)


def device_string_error(device: object) -> ValueError:
    """The error for a ``device`` string that names no device."""
    msg = f"`device` must be a device string like 'cpu', 'cuda' or 'cuda:1', got {device!r}."
    return ValueError(msg)


def bad_device_error(name: str, device: object, what: str | None = None) -> ValueError:
    """The error for a ``device`` the target ``name`` cannot use: ``what`` is wrong (by
    default, what that target takes)."""
    why = _DEVICE_HINTS[name] if what is None else what
    msg = f"`device`={device!r} is not a device for name={name!r}: {why}."
    return ValueError(msg)


def jax_platform_error(device: object, platform: str, err: BaseException) -> ValueError:
    """The error for a ``device`` on a platform JAX has no devices of."""
    return bad_device_error("jax", device, f"JAX has no {platform!r} devices ({err})")


def jax_device_index_error(device: object, platform: str, count: int) -> ValueError:
    """The error for a ``device`` index beyond JAX's devices of that platform."""
    return bad_device_error("jax", device, f"JAX has {count} {platform} device(s)")


def device_placement_error(name: str, device: object, err: BaseException) -> ValueError:
    """The error for a result that the target framework cannot move to ``device``."""
    return bad_device_error(name, device, f"{type(err).__name__}: {err}")


def ml_dtypes_missing_error(dtype: str, framework: str) -> TypeError:
    """The error for a dtype NumPy has only through ml_dtypes, which is not installed."""
    msg = (
        f"`x` has dtype {dtype}, which NumPy has only through the ml_dtypes package: "
        f"install it (pip install ml_dtypes; it comes with jax) to convert {framework} "
        f"{dtype} arrays to NumPy, or cast `x` to float32 first."
    )
    return TypeError(msg)


def dlpack_to_numpy_error(x: object, err: BaseException) -> TypeError:
    """The error for an array of another library that DLPack cannot bring to NumPy."""
    msg = f"`x` of type {_type_name(x)} cannot be converted to NumPy by DLPack: {err}"
    return TypeError(msg)


def cupy_dtype_error(dtype: str) -> TypeError:
    """The error for a dtype CuPy lacks (bfloat16, float8)."""
    msg = f"`x` has dtype {dtype}, which CuPy does not have; cast it to float32 first."
    return TypeError(msg)


def strict_dtype_error(dtype: str) -> TypeError:
    """The error for a dtype array_api_strict lacks (the 16-bit floats, float8)."""
    msg = (
        f"`x` has dtype {dtype}, which array_api_strict does not have; cast it "
        "to float32 first (or compare 16-bit floats on numpy, torch and jax)."
    )
    return TypeError(msg)


def jax_x64_error(dtype: str) -> TypeError:
    """The error for a 64-bit dtype going to JAX without ``jax_enable_x64``."""
    msg = (
        f"`x` has dtype {dtype}, but JAX runs without 64-bit types and would "
        "silently make it 32-bit: enable them with "
        "`jax.config.update('jax_enable_x64', True)` at startup, or cast `x` first."
    )
    return TypeError(msg)


def conversion_error(
    src: str, dtype: str, shape: tuple[int, ...], name: str, err: BaseException
) -> TypeError:
    """The error for a conversion the frameworks refused (their error appended)."""
    msg = (
        f"cannot convert `x` ({src} array of dtype {dtype}, shape "
        f"{shape}) to {name}: {type(err).__name__}: {err}"
    )
    return TypeError(msg)


def dtype_changed_error(before: str, name: str, after: str) -> TypeError:
    """The error for a conversion that would change the dtype."""
    msg = (
        f"converting `x` of dtype {before} to {name} gave dtype {after}; the "
        "conversion must keep the dtype: cast `x` to a dtype both frameworks have."
    )
    return TypeError(msg)


# plot (portable_attention.plot: heatmap and side_by_side)


def matplotlib_missing_error() -> ImportError:
    """The error of ``portable_attention.plot`` without matplotlib."""
    msg = (
        "portable_attention.plot needs matplotlib, which is not installed: "
        "pip install 'portable-attention[plot]' (or pip install matplotlib)"
    )
    return ImportError(msg)


def weights_type_error(name: str, weights: object, err: BaseException) -> TypeError:
    """The error for weights that cannot be converted to NumPy."""
    msg = f"`{name}` must be an array of weights [..., Lq, Lk], got {type(weights).__name__}: {err}"
    return TypeError(msg)


def real_weights_error(name: str, dtype: object) -> TypeError:
    """The error for weights that do not hold real numbers."""
    msg = f"`{name}` must hold real numbers, got dtype {dtype}"
    return TypeError(msg)


def check_weights_shape(name: str, shape: tuple[int, ...]) -> None:
    """Weights to draw: at least ``[Lq, Lk]``, neither of them 0."""
    if len(shape) < 2:
        msg = f"`{name}` must have at least 2 dimensions [..., Lq, Lk], got shape {list(shape)}"
        raise ValueError(msg)
    if shape[-1] == 0 or shape[-2] == 0:
        msg = f"`{name}` of shape {list(shape)} has no query or no key to draw"
        raise ValueError(msg)


def check_labels(labels: Sequence[Any] | None, n: int, name: str, axis: str) -> None:
    """Tick labels: one per query (``axis="queries"``) or key (``axis="keys"``), or None."""
    if labels is not None and not hasattr(labels, "__len__"):
        msg = f"`{name}` must be a sequence of labels (a list or tuple), got {_type_name(labels)}"
        raise TypeError(msg)
    if labels is not None and len(labels) != n:
        msg = (
            f"`{name}` has {len(labels)} labels but the weights have {n} {axis} "
            f"(axis {'-2' if axis == 'queries' else '-1'}); pass one label per "
            f"{'query' if axis == 'queries' else 'key'}"
        )
        raise ValueError(msg)


def check_head(head: object, shape: tuple[int, ...]) -> int | tuple[Any, ...]:
    """``head=`` of the plots: weights of ``shape`` with leading axes, an int or a tuple
    (returned; :func:`check_head_index` checks that it is in range)."""
    if not shape[:-2]:
        msg = f"`head` needs weights with leading (head) axes; these are 2-D {list(shape)}"
        raise ValueError(msg)
    index = _as_int(head)  # NumPy integers too
    if index is not None:
        return index
    sides = tuple(_as_int(h) for h in head) if isinstance(head, tuple) else (None,)
    if None in sides:
        msg = f"`head` must be an int or a tuple of ints, got {head!r}"
        raise TypeError(msg)
    return sides


def check_head_index(head: int | tuple[Any, ...], shape: tuple[int, ...]) -> None:
    """``head=`` (after :func:`check_head`) indexes the leading axes of ``shape``."""
    lead = shape[:-2]
    panels = math.prod(lead)
    if isinstance(head, int):
        if not -panels <= head < panels:
            msg = (
                f"`head={head}` is out of range for weights {list(shape)}: "
                f"{panels} panels over the leading axes {list(lead)}"
            )
            raise ValueError(msg)
    elif len(head) != len(lead) or not all(
        isinstance(i, int) and -n <= i < n for i, n in zip(head, lead, strict=False)
    ):
        msg = (
            f"`head={head}` does not index the leading axes {list(lead)} of weights "
            f"{list(shape)}; pass one int per leading axis"
        )
        raise ValueError(msg)


def check_grid(shape: tuple[int, ...], ax: object, max_panels: int) -> None:
    """A grid of every head of weights ``shape``: no ``ax=``, at most ``max_panels``."""
    n = math.prod(shape[:-2])
    if ax is not None:
        msg = (
            f"`ax` takes one heatmap, but weights {list(shape)} with head=None draw a grid "
            f"of {n} heads; pass head=... to draw one, or fig=..."
        )
        raise ValueError(msg)
    if n > max_panels:
        msg = (
            f"weights {list(shape)} have {n} heads, more than {max_panels} panels; "
            "pass `head=` to draw one (or slice the weights first)"
        )
        raise ValueError(msg)


def check_color_limits(vmin: float | None, vmax: float | None) -> None:
    """``vmin``/``vmax`` of the plots, when both are given: ``vmin < vmax``."""
    if vmin is not None and vmax is not None and not vmin < vmax:
        msg = f"`vmin`={vmin!r} must be below `vmax`={vmax!r}"
        raise ValueError(msg)


def check_any_weights(weights: object) -> None:
    """``weights`` of ``side_by_side``: a mapping (title -> weights), not empty."""
    from collections.abc import Mapping

    if not isinstance(weights, Mapping):
        msg = (
            f"`weights` must be a mapping of panel title -> weights array (a dict), got "
            f"{_type_name(weights)}; e.g. `side_by_side({{'numpy': w_np, 'torch': w_pt}})`"
        )
        raise TypeError(msg)
    if not weights:
        msg = "`weights` is empty: pass a mapping of panel title -> weights array"
        raise ValueError(msg)


def check_side_panel(name: object, shape: tuple[int, ...], head: object) -> None:
    """One entry of ``side_by_side``: weights with leading axes need ``head=``."""
    if len(shape) > 2 and head is None:
        msg = (
            f"`weights[{name!r}]` has shape {list(shape)}: pass `head=` to pick one [Lq, Lk] panel"
        )
        raise ValueError(msg)


def check_same_shapes(shapes: dict[str, tuple[int, ...]]) -> None:
    """The panels of ``side_by_side``: all of one shape."""
    if len(set(shapes.values())) > 1:
        msg = f"`weights` must all have one shape, got {shapes}"
        raise ValueError(msg)


# testing (portable_attention.testing: tolerance, assert_backends_agree, ArrayBackend, plugin)


def no_tolerance_error(dtype: object, known: Sequence[str]) -> ValueError:
    """The error of ``tolerance`` for a dtype without a default tolerance."""
    msg = (
        f"`dtype` {dtype!r} has no default tolerance (known: "
        f"{', '.join(known)}); pass `rtol` and `atol` explicitly."
    )
    return ValueError(msg)


def backends_type_error(backends: object) -> TypeError:
    """The error for ``backends=`` that is not a sequence of names."""
    msg = (
        f"`backends` must be a sequence of backend names like ('numpy', 'torch'), got {backends!r}."
    )
    return TypeError(msg)


def no_backends_error() -> ValueError:
    """The error for an empty ``backends=``."""
    msg = "`backends` is empty: name at least one backend, e.g. ('numpy', 'torch')."
    return ValueError(msg)


def unusable_backend_error(name: str, err: BaseException) -> ValueError:
    """The error for a name in ``backends=`` that is unknown or does not import."""
    msg = f"`backends` has {name!r}: {err}"
    return ValueError(msg)


def dtype_name_error(name: object) -> ValueError:
    """The error of ``ArrayBackend.asarray`` for a ``dtype`` that names no dtype."""
    msg = f"`dtype` must be a dtype name like 'float32' or 'bfloat16', got {name!r}."
    return ValueError(msg)


# The pytest plugin raises pytest.UsageError (pytest is not imported here): messages only.


def no_backend_selected_message(source: str, raw: str, known: Sequence[str]) -> str:
    """``--array-backends`` (or its variable, ``source``) naming no backend."""
    return f"{source}={raw!r} names no backend; known: {', '.join(known)}."


def unusable_backend_message(source: str, raw: str, name: str, err: BaseException) -> str:
    """A backend the selection asks for that is unknown or does not import."""
    return f"{source}={raw!r} requests backend {name!r}, which is not usable: {err}"


def cupy_without_gpu_message(source: str, raw: str) -> str:
    """The selection asks for cupy where CuPy finds no GPU."""
    return f"{source}={raw!r} requests backend 'cupy', but CuPy finds no GPU here."


def indirect_array_backend_message() -> str:
    """The ``array_backend`` fixture requested without the plugin's parametrization."""
    return "`array_backend` is parametrized by the plugin; do not request it indirectly."


# report (python -m portable_attention: the argparse type check of its comma lists)


def check_cli_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """The names of a comma list option ``--what``, each one of ``known``; else the
    ``argparse.ArgumentTypeError`` the report turns into a usage error."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))  # once each
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        import argparse  # only the command line gets here: the library does not import it

        msg = (
            f"--{what} {text!r}: unknown {what} {unknown or text!r}; choose from {', '.join(known)}"
        )
        raise argparse.ArgumentTypeError(msg)
    return names


def check_cli_output(path: str) -> None:
    """``--json FILE``: a file in an existing directory, checked before the run (not after
    minutes of it); else the ``argparse.ArgumentTypeError`` of a usage error."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or os.path.isdir(path):
        import argparse

        msg = f"--json {path!r}: not a file in an existing directory"
        raise argparse.ArgumentTypeError(msg)


# transformers integration (portable_attention.integrations.transformers)

#: transformers' own attn_implementation names, which ``register`` must not replace.
_TRANSFORMERS_BUILTIN = frozenset({"eager", "sdpa", "flex_attention", "paged|eager"})


def transformers_missing_error() -> ImportError:
    """The error of ``register`` without transformers."""
    msg = (
        "`register` needs Hugging Face transformers (>= 4.48): "
        "pip install 'portable-attention[transformers]'"
    )
    return ImportError(msg)


def check_attn_implementation(name: object) -> None:
    """``name`` of ``register``: a new, non-empty string, none of transformers' own."""
    if not isinstance(name, str) or not name or name in _TRANSFORMERS_BUILTIN or "flash" in name:
        msg = (
            f"`name` must be a new, non-empty attn_implementation string such as 'portable', "
            f"got {name!r} (transformers' own implementations cannot be replaced)."
        )
        raise ValueError(msg)


def attention_mask_dtype_error(dtype: object) -> TypeError:
    """The error for an ``attention_mask`` neither boolean nor floating."""
    msg = (
        f"`attention_mask` must be boolean (True = may attend) or an additive float "
        f"mask, got dtype {dtype}; convert it with `.bool()` if its "
        "nonzero entries mean 'attend'."
    )
    return TypeError(msg)


def check_sliding_window(sliding_window: object) -> None:
    """transformers' ``sliding_window``: an int."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        msg = f"`sliding_window` must be an int, got {sliding_window!r}."
        raise TypeError(msg)


def bidirectional_window_error(sliding_window: int, lq: int, lk: int) -> ValueError:
    """The error for a sliding window without a mask on a bidirectional layer."""
    msg = (
        f"`sliding_window={sliding_window}` without an attention mask on a bidirectional "
        f"layer (Lq={lq}, Lk={lk}) would cut keys, and its two-sided convention is "
        "model-specific; pass the mask transformers builds (the registered mask function "
        "does) or use attn_implementation='eager'."
    )
    return ValueError(msg)


def unsupported_kwarg_error(name: str, what: str | None) -> TypeError:
    """The error for a keyword from transformers that would change the result: ``what`` it
    does (None: a keyword the integration does not know)."""
    about = "an option this integration does not know" if what is None else what
    msg = (
        f"portable_attention's transformers integration got `{name}` ({about}), which "
        "would change the attention result but is not supported; use "
        "attn_implementation='eager' (or 'sdpa') for this model."
    )
    return TypeError(msg)


# -- Checks of the mask builders and multi-head modules: masks, mha and the torch / flax modules
# (portable_attention.backends.torch_mha, .flax_mha). Plain values only (names, shapes, flags):
# no framework object is inspected here.


def check_window_sides(
    sides: tuple[int | None, int | None] | None,
) -> tuple[int | None, int | None]:
    """``window`` of ``window_mask`` after :func:`normalize_window`: not None."""
    if sides is None:
        msg = "`window` must be an int or a (left, right) pair, got None."
        raise ValueError(msg)
    return sides


def check_lengths_shape(shape: tuple[int, ...]) -> None:
    """``lengths`` of ``key_padding_mask``: one axis ``[B]``."""
    if len(shape) != 1:
        msg = f"`lengths` must have shape [B], got {shape}."
        raise ValueError(msg)


def check_mha_sizes(
    embed_dim: int, num_heads: int, num_kv_heads: int, kdim: int | None, vdim: int | None
) -> None:
    """``init_params``: positive ints; ``embed_dim`` a multiple of ``num_heads``, which
    ``num_kv_heads`` divides."""
    sizes = {"embed_dim": embed_dim, "num_heads": num_heads, "num_kv_heads": num_kv_heads}
    sizes |= {n: d for n, d in (("kdim", kdim), ("vdim", vdim)) if d is not None}
    for name, size in sizes.items():
        as_int = _as_int(size)
        if as_int is None or as_int <= 0:
            msg = f"`{name}` must be a positive int, got {size!r}"
            raise TypeError(msg) if as_int is None else ValueError(msg)
    if embed_dim % num_heads:
        msg = f"`embed_dim`={embed_dim} must be a positive multiple of `num_heads`={num_heads}"
        raise ValueError(msg)
    if num_heads % num_kv_heads:
        msg = f"`num_kv_heads`={num_kv_heads} must be a positive divisor of `num_heads`={num_heads}"
        raise ValueError(msg)


def check_dropout_input(x: Any) -> tuple[Any, str, Any]:
    """``mha.dropout``'s ``x``: one floating array; returns ``(xp, backend, device)``."""
    xp, backend, device = check_arrays(x=x)
    if not _is_kind(xp, x.dtype, "real floating"):
        msg = f"`x` must have a real floating dtype, got {x.dtype}."
        raise TypeError(msg)
    return xp, backend, device


def check_param_dtype(xp: Any, dtype: Any) -> None:
    """``init_params``: a real floating ``dtype`` of the namespace."""
    if not _is_kind(xp, dtype, "real floating"):
        msg = f"`dtype` must be a real floating dtype (float32, float64, ...), got {dtype!r}."
        raise TypeError(msg)


def check_made_dtype(got: Any, wanted: Any) -> None:
    """``init_params``: the framework made the asked dtype (JAX without 64-bit types makes
    float64 into float32 with only a warning)."""
    if got != wanted:
        name = getattr(wanted, "__name__", wanted)
        msg = (
            f"`dtype`={name} came out as {got}: the framework cannot hold it here (for JAX "
            "enable 64-bit types with `jax.config.update('jax_enable_x64', True)` at startup), "
            "or ask for the dtype it gives."
        )
        raise TypeError(msg)


def torch_mask_dtype_error(name: str, dtype: Any) -> TypeError:
    """``torch_compat_forward``: a mask neither boolean nor floating (torch refuses those)."""
    msg = (
        f"`{name}` must be boolean (torch's True = masked out) or floating (added to the "
        f"scores), got dtype {dtype}; for a 0/1 mask where 1 = masked out pass `{name}.bool()`."
    )
    return TypeError(msg)


def check_state_keys(state: Any, expected: Any) -> None:
    """The keys of a state to load (any iterable of names) are those of the parameters."""
    if set(state) != set(expected):
        msg = f"`state` keys {sorted(state)} != expected {sorted(expected)}"
        raise ValueError(msg)


def check_state_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    """One loaded parameter has the shape of the one it replaces."""
    if shape != expected:
        msg = f"`state[{name!r}]` has shape {shape}, expected {expected}"
        raise ValueError(msg)


def check_is_torch_mha(m: object, torch_mha: type) -> None:
    """``from_torch``: an ``nn.MultiheadAttention`` (or a subclass)."""
    if not isinstance(m, torch_mha):
        msg = f"`m` must be a torch.nn.MultiheadAttention, got {_type_name(m)}"
        raise TypeError(msg)


def flax_dropout_key_error() -> ValueError:
    """The Flax module in training mode with ``dropout > 0`` and no key to draw from."""
    msg = (
        "`dropout` > 0 in training mode needs JAX keys: build the module with "
        "`rngs=nnx.Rngs(dropout=0)`, pass `rng=jax.random.key(...)` to the call, or call "
        "`.eval()` to turn dropout off."
    )
    return ValueError(msg)


def check_torch_mha_extras(uses_extras: bool) -> None:
    """``from_torch``: an ``nn.MultiheadAttention`` without add_bias_kv / add_zero_attn."""
    if uses_extras:
        msg = "`m` uses add_bias_kv or add_zero_attn, which this module does not support"
        raise ValueError(msg)


def check_no_grouped_heads(num_kv_heads: int, num_heads: int) -> None:
    """``to_torch``: nn.MultiheadAttention has no grouped-query heads."""
    if num_kv_heads != num_heads:
        msg = (
            f"`num_kv_heads`={num_kv_heads} != `num_heads`={num_heads}: "
            "nn.MultiheadAttention has no grouped-query heads"
        )
        raise ValueError(msg)
