"""Array conversion between frameworks: the one place the package moves arrays across them.

:func:`to_backend` takes an array of NumPy, PyTorch, JAX, CuPy or array_api_strict (or any
object with ``__dlpack__``) and returns the same data as an array of another of these
frameworks. It tries DLPack first (``from_dlpack``: no copy where the memory can be shared)
and falls back to a copy through NumPy where DLPack cannot carry the array (a strided view
JAX cannot import, a read-only NumPy array, a dtype DLPack lacks). The dtype is kept
exactly, bfloat16 included; a conversion that would change it is a ``TypeError``.

The source framework is found the way ``array-api-compat`` finds it: from the array's type
and ``sys.modules``. No framework is imported just to find out; only the *target* framework
is imported.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_attention._checks import backend_name, type_name

BACKEND_NAMES = ("numpy", "torch", "jax", "cupy", "array_api_strict")
"""Every name :func:`to_backend` knows, in the order :func:`available_backends` lists them."""

# Dtypes NumPy has only through ml_dtypes (which comes with JAX); DLPack carries none of them
# between NumPy and the other frameworks, so they move as same-width integers.
_ML_DTYPES = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
_DLPACK_ERRORS = (BufferError, RuntimeError, TypeError, ValueError, AttributeError)


class ConversionError(TypeError):
    """A conversion this module refuses itself, with a message that says what to do.

    :func:`to_backend` lets it through as it is, and wraps any other error a framework
    raises during a conversion in a ``TypeError`` that names the source, dtype, shape and
    target. It is a ``TypeError``: callers catch it as one.
    """


# -- which framework an array comes from -------------------------------------------------------


def source_framework(x: object) -> str:
    """The framework of array ``x``: one of :data:`BACKEND_NAMES`, or ``"dlpack"``.

    ``"dlpack"`` is any other object with ``__dlpack__`` (another array-API library).
    Python scalars, lists and tuples are not arrays: a ``TypeError``.
    """
    check_convertible(x)
    name = backend_name(x)
    if name in ("numpy", "torch", "jax", "cupy", "array_api_strict"):
        return name
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    raise unknown_array_error(x)


def dtype_name(dtype: Any) -> str:
    """A framework-neutral dtype name: ``float32``, ``bfloat16``, ``bool``, ..."""
    name = getattr(dtype, "name", None)  # NumPy, JAX, CuPy and ml_dtypes dtypes
    if isinstance(name, str):
        return name
    if isinstance(dtype, type):  # scalar types: numpy.float32, jax.numpy.bfloat16
        try:
            return np.dtype(dtype).name
        except TypeError:
            pass
    return str(dtype).rsplit(".", 1)[-1]  # torch.float32, array_api_strict.float32


# -- importing the target ------------------------------------------------------------------------


def check_name(name: object) -> str:
    """``name`` of :func:`to_backend`: one of :data:`BACKEND_NAMES`."""
    return check_backend_name(name, BACKEND_NAMES)


def import_backend(name: str) -> Any:
    """The target framework's module (``jax.numpy`` for jax); a ValueError if it won't import."""
    try:
        if name == "jax":
            importlib.import_module("jax")
            return importlib.import_module("jax.numpy")
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or a broken install failing at import
        raise backend_import_error(name, err) from err


def cupy_has_gpu(cupy: Any) -> bool:
    """Whether CuPy (the module) finds a GPU; False where its runtime cannot tell."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def available_backends() -> tuple[str, ...]:
    """The names :func:`to_backend` can convert to here, NumPy first.

    A framework counts when it imports; CuPy only where it also finds a GPU. The order is
    that of :data:`BACKEND_NAMES`: ``numpy``, ``torch``, ``jax``, ``cupy``,
    ``array_api_strict``.

    Returns
    -------
    tuple of str
        For example ``("numpy", "torch", "jax", "array_api_strict")``.
    """
    found = []
    for name in BACKEND_NAMES:
        try:
            module = import_backend(name)
        except ValueError:
            continue
        if name == "cupy" and not cupy_has_gpu(module):
            continue
        found.append(name)
    return tuple(found)


# -- devices -----------------------------------------------------------------------------------

_DEVICE_RE = re.compile(r"^(cpu|cuda|gpu|rocm|tpu)(?::(\d+))?$")


def _parse_device(device: str) -> tuple[str, int]:
    match = _DEVICE_RE.match(device.strip().lower())
    if match is None:
        raise device_string_error(device)
    return match.group(1), int(match.group(2) or 0)


def _target_device(name: str, device: object, module: Any) -> Any:
    """Check ``device`` for the target framework; return what its placement call takes."""
    if device is None:
        return None
    if name == "torch":
        torch = module
        if isinstance(device, torch.device):
            return device
        if isinstance(device, (str, int)) and not isinstance(device, bool):
            try:
                return torch.device(device)
            except (RuntimeError, ValueError, TypeError) as err:
                raise bad_device_error(name, device, str(err)) from None
        raise bad_device_error(name, device)
    if name == "jax":
        import jax

        if isinstance(device, jax.Device):
            return device
        if not isinstance(device, str):
            raise bad_device_error(name, device)
        kind, index = _parse_device(device)
        platform = "gpu" if kind in ("cuda", "rocm") else kind
        try:
            devices = jax.devices(platform)
        except RuntimeError as err:
            raise jax_platform_error(device, platform, err) from None
        if index >= len(devices):
            raise jax_device_index_error(device, platform, len(devices))
        return devices[index]
    if name == "numpy":
        if isinstance(device, str) and device.strip().lower() == "cpu":
            return None
        raise bad_device_error(name, device)
    if name == "array_api_strict":
        if isinstance(device, module.Device):
            return device
        if isinstance(device, str) and device.strip().lower() == "cpu":
            return module.Device("CPU_DEVICE")
        raise bad_device_error(name, device)
    # cupy
    if isinstance(device, module.cuda.Device):
        return int(device.id)
    if isinstance(device, str):
        kind, index = _parse_device(device)
        if kind in ("cuda", "gpu", "rocm"):
            return index
    raise bad_device_error(name, device)


# -- to NumPy ----------------------------------------------------------------------------------


def _ml_dtype(name: str, framework: str) -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise ml_dtypes_missing_error(name, framework) from None
    return np.dtype(getattr(ml_dtypes, name))


def _torch_plain(x: Any) -> Any:
    """A torch tensor DLPack can export: detached, conjugate and negative bits resolved."""
    x = x.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    return x


def _strict_to_numpy(x: Any) -> np.ndarray:
    # array_api_strict wraps NumPy; every device of it is host memory.
    try:
        return np.from_dlpack(x)
    except _DLPACK_ERRORS:
        cpu = type(x.device)("CPU_DEVICE")
        return np.asarray(x.to_device(cpu))


def _numpy_from(x: Any, src: str) -> np.ndarray:
    if src == "numpy":
        return np.asarray(x)  # np.generic -> 0-d array; an ndarray as it is
    if src == "torch":
        t = _torch_plain(x)
        if t.device.type != "cpu":
            t = t.cpu()
        name = dtype_name(t.dtype)
        if name in _ML_DTYPES:
            import torch

            bits = getattr(torch, _ML_DTYPES[name])
            return t.view(bits).numpy().view(_ml_dtype(name, "torch"))
        try:
            return np.from_dlpack(t)
        except _DLPACK_ERRORS:
            return t.numpy()
    if src == "jax":
        return np.asarray(x)  # copies from an accelerator; ml_dtypes for bfloat16
    if src == "cupy":
        return x.get()
    if src == "array_api_strict":
        return _strict_to_numpy(x)
    try:
        return np.from_dlpack(x)
    except _DLPACK_ERRORS as err:
        raise dlpack_to_numpy_error(x, err) from None


# -- to each framework -------------------------------------------------------------------------


def _native(a: np.ndarray) -> np.ndarray:
    """``a`` in the machine's byte order (DLPack and the frameworks know no other)."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _torch_from_numpy(torch: Any, a: np.ndarray) -> Any:
    a = _native(a)
    name = a.dtype.name
    if name in _ML_DTYPES:
        return _torch_from_numpy(torch, a.view(_ML_DTYPES[name])).view(getattr(torch, name))
    if any(s < 0 for s in a.strides):  # torch cannot hold negative strides (DLPack aborts)
        a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # torch would share it as writable (it ignores DLPack's flag)
        return torch.from_numpy(np.array(a, copy=True))
    try:
        return torch.from_dlpack(a)
    except _DLPACK_ERRORS:
        return torch.from_numpy(np.array(a, copy=True))


def _on_host(x: Any) -> bool:
    try:
        return int(x.__dlpack_device__()[0]) == 1  # kDLCPU
    except Exception:
        return False


def _to_torch(x: Any, src: str, torch: Any) -> Any:
    if src == "torch":
        return _torch_plain(x)
    if src in ("numpy", "array_api_strict") or (src == "dlpack" and _on_host(x)):
        # through a NumPy view, which _torch_from_numpy rids of negative strides
        return _torch_from_numpy(torch, _numpy_from(x, src))
    if src == "cupy" and any(s < 0 for s in x.strides):
        x = x.copy()  # C-contiguous, positive strides
    try:
        return torch.from_dlpack(x)
    except _DLPACK_ERRORS:
        return _torch_from_numpy(torch, _numpy_from(x, src))


def _to_jax(x: Any, src: str, jnp: Any) -> Any:
    if src == "jax":
        return x
    if src == "torch":
        x = _torch_plain(x)
    if src in ("numpy", "array_api_strict"):
        a = _native(_numpy_from(x, src))
        if a.dtype.name in _ML_DTYPES:
            return jnp.asarray(a)
        x = a
    try:
        return jnp.from_dlpack(x)
    except _DLPACK_ERRORS:
        pass
    if src == "torch":  # a strided view JAX cannot import: compact it on its own device
        try:
            return jnp.from_dlpack(x.contiguous())
        except _DLPACK_ERRORS:
            pass
    return jnp.asarray(np.ascontiguousarray(_numpy_from(x, src)))


def _to_cupy(x: Any, src: str, cupy: Any) -> Any:
    if src == "cupy":
        return x
    if src == "torch":
        x = _torch_plain(x)
    if src in ("torch", "jax", "dlpack"):
        try:
            return cupy.from_dlpack(x)
        except _DLPACK_ERRORS:
            pass
    name = dtype_name(getattr(x, "dtype", None))
    if name in _ML_DTYPES:
        raise cupy_dtype_error(name)
    return cupy.asarray(_native(_numpy_from(x, src)))


def _to_strict(x: Any, src: str, xs: Any) -> Any:
    if src == "array_api_strict":
        return x
    name = dtype_name(getattr(x, "dtype", None))
    a = None if name in _ML_DTYPES else _native(_numpy_from(x, src))
    if a is not None:
        name = a.dtype.name
    if a is None or not hasattr(xs, name):
        raise strict_dtype_error(name)
    try:
        return xs.from_dlpack(a)
    except _DLPACK_ERRORS:
        return xs.asarray(np.array(a, copy=True))


def _place(out: Any, name: str, device: Any, module: Any, asked: object) -> Any:
    if device is None:
        return out
    try:
        if name == "torch":
            return out.to(device)
        if name == "jax":
            import jax

            return jax.device_put(out, device)
        if name == "array_api_strict":
            return out.to_device(device)
        if name == "cupy":
            with module.cuda.Device(device):
                return module.asarray(out)  # copies across GPUs; a no-op on the same one
    except Exception as err:  # e.g. torch without CUDA: an AssertionError from deep inside
        raise device_placement_error(name, asked, err) from err
    return out


def _check_jax_x64(x: Any) -> None:
    import jax

    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.config.read("jax_enable_x64"):
        return
    if dtype_name(dtype) in ("float64", "int64", "uint64", "complex128"):
        raise jax_x64_error(dtype_name(dtype))


_CONVERTERS = {"torch": _to_torch, "jax": _to_jax, "cupy": _to_cupy, "array_api_strict": _to_strict}


def to_backend(x: Any, name: str, device: Any = None) -> Any:
    """Convert array ``x`` to an array of the framework ``name``.

    DLPack first (``from_dlpack``: the result shares memory with ``x`` where the framework
    allows it), NumPy as the fallback (a copy). The dtype is kept exactly; arrays already of
    the target framework come back as they are (moved when ``device`` asks for it).

    Parameters
    ----------
    x : array
        A NumPy, PyTorch, JAX, CuPy or array_api_strict array (or any array with
        ``__dlpack__``). Python scalars and lists are not arrays: make them one first.
        A torch tensor that requires grad is **detached**: the result is data, outside the
        autograd graph (convert back and reattach if you need gradients).
    name : {"numpy", "torch", "jax", "cupy", "array_api_strict"}
        The target framework; it must import (see :func:`available_backends`).
    device : str or framework device, optional
        Where the result lives: a torch-style string (``"cpu"``, ``"cuda"``, ``"cuda:1"``)
        or the target framework's own device object. For JAX ``"cuda:1"`` means
        ``jax.devices("gpu")[1]``. ``None`` (default) keeps the source's device where the
        target can use it (a CUDA torch tensor stays on the GPU for jax and cupy), and the
        host for NumPy and array_api_strict; GPU arrays go to the host for NumPy.

    Returns
    -------
    array
        An array of framework ``name`` with the values, shape and dtype of ``x``.

    Raises
    ------
    ValueError
        ``name`` unknown or not installed, ``device`` not valid for the target.
    TypeError
        ``x`` is not an array; or its dtype does not exist in the target (bfloat16 in
        NumPy without ``ml_dtypes``, in array_api_strict or CuPy; 64-bit types in JAX
        without ``jax_enable_x64``).

    Notes
    -----
    bfloat16 (and the float8 types) become ``ml_dtypes`` dtypes in NumPy; they travel
    between NumPy and torch as same-width integers, bit for bit. Inputs are never modified,
    but the result may share their memory: write to a copy.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention.testing import to_backend
    >>> t = to_backend(np.ones((2, 3), dtype=np.float32), "torch")
    >>> t.dtype, tuple(t.shape)
    (torch.float32, (2, 3))
    """
    name = check_name(name)
    src = source_framework(x)
    module = import_backend(name)
    target_device = _target_device(name, device, module)
    if name == "jax":
        _check_jax_x64(x)
    try:
        out = _numpy_from(x, src) if name == "numpy" else _CONVERTERS[name](x, src, module)
    except ConversionError:  # ours, already saying what to do
        raise
    except (TypeError, ValueError, RuntimeError, BufferError) as err:
        dtype = dtype_name(getattr(x, "dtype", None))
        shape = tuple(getattr(x, "shape", ()))
        raise conversion_error(src, dtype, shape, name, err) from err
    out = _place(out, name, target_device, module, device)
    before, after = dtype_name(getattr(x, "dtype", None)), dtype_name(out.dtype)
    if before not in ("None", after):
        raise dtype_changed_error(before, name, after)
    return out


def to_numpy(x: Any, dtype: Any = None) -> np.ndarray:
    """``to_backend(x, "numpy")``: the array as a NumPy array (on the host, detached).

    Parameters
    ----------
    x : array
        An array of any framework :func:`to_backend` knows.
    dtype : str or numpy.dtype, optional
        Cast the result to this NumPy dtype (a copy). ``"float64"`` gives the values of
        any floating array exactly (every float16, bfloat16 and float32 value is a float64
        value), ready to compare; a bfloat16 array then needs no ``ml_dtypes``: where
        NumPy lacks bfloat16 it is widened to float32 (exactly) in its own framework first.

    Returns
    -------
    numpy.ndarray
        Same values and shape; dtype ``dtype``, else that of ``x`` (bfloat16 as
        ``ml_dtypes.bfloat16``). Without ``dtype`` it may share memory with ``x`` and may
        be read-only (JAX arrays are immutable).

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attention.testing import to_numpy
    >>> to_numpy(np.ones(2, dtype=np.float16), dtype="float64").dtype
    dtype('float64')
    """
    if dtype is None:
        out: np.ndarray = to_backend(x, "numpy")
        return out
    try:
        target = np.dtype(dtype)
    except TypeError:
        msg = f"`dtype` must be a NumPy dtype or its name like 'float64', got {dtype!r}."
        raise TypeError(msg) from None
    if dtype_name(getattr(x, "dtype", None)) == "bfloat16" and not _has_ml_dtypes():
        x = _widen_bfloat16(x)
    return np.asarray(to_backend(x, "numpy")).astype(target)


def _has_ml_dtypes() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def _widen_bfloat16(x: Any) -> Any:
    """A bfloat16 array as float32 in its own framework (exact; on its own device)."""
    if source_framework(x) == "torch":
        import torch

        return _torch_plain(x).to(torch.float32)
    import array_api_compat  # JAX always has ml_dtypes; any other array-API library

    xp = array_api_compat.array_namespace(x)
    return xp.astype(x, xp.float32)


# -- argument checks and messages of this module ----------------------------------------

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
            f"{type_name(x)}; make an array of it first, e.g. `numpy.asarray(x)`."
        )
        raise TypeError(msg)


def unknown_array_error(x: object) -> TypeError:
    """The error for an ``x`` of no known framework and without ``__dlpack__``."""
    msg = (
        f"`x` must be an array (NumPy, PyTorch, JAX, CuPy, array_api_strict or any array "
        f"with `__dlpack__`), got {type_name(x)}."
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


def ml_dtypes_missing_error(dtype: str, framework: str) -> ConversionError:
    """The error for a dtype NumPy has only through ml_dtypes, which is not installed."""
    msg = (
        f"`x` has dtype {dtype}, which NumPy has only through the ml_dtypes package: "
        f"install it (pip install ml_dtypes; it comes with jax) to convert {framework} "
        f"{dtype} arrays to NumPy, or cast `x` to float32 first."
    )
    return ConversionError(msg)


def dlpack_to_numpy_error(x: object, err: BaseException) -> ConversionError:
    """The error for an array of another library that DLPack cannot bring to NumPy."""
    msg = f"`x` of type {type_name(x)} cannot be converted to NumPy by DLPack: {err}"
    return ConversionError(msg)


def cupy_dtype_error(dtype: str) -> ConversionError:
    """The error for a dtype CuPy lacks (bfloat16, float8)."""
    msg = f"`x` has dtype {dtype}, which CuPy does not have; cast it to float32 first."
    return ConversionError(msg)


def strict_dtype_error(dtype: str) -> ConversionError:
    """The error for a dtype array_api_strict lacks (the 16-bit floats, float8)."""
    msg = (
        f"`x` has dtype {dtype}, which array_api_strict does not have; cast it "
        "to float32 first (or compare 16-bit floats on numpy, torch and jax)."
    )
    return ConversionError(msg)


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
