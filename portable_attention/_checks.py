"""Shared check primitives: argument types and values that many modules check alike."""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

import array_api_compat

from portable_attention.backends import adapter


def type_name(x: object) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


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


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def is_kind(xp: Any, dtype: Any, kind: str) -> bool | None:
    """``xp.isdtype(dtype, kind)``; None for a dtype outside the standard (ml_dtypes'
    bfloat16 or float8 on NumPy arrays, JAX key arrays), which the namespace refuses with
    a TypeError of its own that names no argument."""
    try:
        result = bool(xp.isdtype(dtype, kind))
    except (TypeError, ValueError):
        return None
    if not result and dtype not in xp.__array_namespace_info__().dtypes().values():
        return None  # (array-api-compat 1.11 on NumPy 1.26 said False for bfloat16)
    return result


def same_length(a: Any, b: Any) -> bool:
    """``a == b`` decided without a compiler's guard: equal ints, or one symbolic length
    (the same expression of an export's dynamic dimensions); two different symbols are
    not known to be equal (for a choice that must hold for every value of them)."""
    if type(a) is int and type(b) is int:
        return a == b
    return type(a) is type(b) and str(a) == str(b)


def _must_equal(a: Any, b: Any) -> bool:
    """``a == b`` where the call needs it (shapes that must broadcast): as
    :func:`same_length`, and torch's SymInts by ``==``, a guard that ``torch.export``
    checks against its ``Dim``s (it names each input's dimension apart, even where
    inputs share one ``Dim``)."""
    if same_length(a, b):
        return True
    if "SymInt" in (type(a).__name__, type(b).__name__):
        return bool(a == b)
    return False


def broadcast_shape(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The broadcast of two shapes (NumPy's rule), or None where they do not broadcast.
    Symbolic dimensions (an export's) broadcast with 1 and with themselves."""
    out = []
    for x, y in itertools.zip_longest(reversed(a), reversed(b), fillvalue=1):
        if type(x) is int and x == 1:
            out.append(y)
        elif (type(y) is int and y == 1) or _must_equal(x, y):
            out.append(x)
        else:
            return None
    return tuple(reversed(out))


def broadcasts(small: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """``small`` broadcasts to ``target`` without changing it."""
    return len(small) <= len(target) and broadcast_shape(small, target) == target


def as_int(value: object) -> int | None:
    """A Python int from an int-like option (NumPy integers too), None for anything else
    (bools included: ``window=True`` is a mistake, not 1)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def real_number(name: str, value: object) -> float:
    if isinstance(value, (bool, str)):
        msg = f"`{name}` must be a Python float, got {value!r} of type {type_name(value)}."
        raise TypeError(msg)
    if isinstance(value, (int, float)):  # first: torch.compile(dynamic=True) makes floats
        return _as_float(value)  # symbolic, and cannot trace the getattr below on them
    framework = adapter(backend_name(value)) if hasattr(value, "shape") else None
    refusal = None if framework is None else framework.scalar_refusal(name, value)
    if refusal is not None:
        msg = f"`{name}` must be a Python float, got {refusal}."
        raise TypeError(msg)
    try:
        return float(value)  # type: ignore[arg-type]  # NumPy scalars, 0-d arrays
    except (TypeError, ValueError):
        msg = f"`{name}` must be a Python float, got {value!r} of type {type_name(value)}."
        if framework is not None:  # a traced or many-element array
            hint = framework.static_hint
            msg += f" A value that chooses the computation must be a Python number{hint}."
        raise TypeError(msg) from None


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float range: as infinite as inf
        return math.inf if value > 0 else -math.inf


def flag(name: str, value: object) -> bool:
    """``return_weights`` / ``return_lse``: True or False (NumPy's bool too), nothing else."""
    if isinstance(value, bool) or is_numpy_bool(value):
        return bool(value)
    msg = f"`{name}` must be True or False, got {value!r} of type {type_name(value)}."
    raise TypeError(msg)


def is_numpy_bool(value: object) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_dropout(dropout: object, name: str = "dropout") -> float:
    """A dropout probability in ``[0, 1)`` (of ``attend``, the multi-head modules and
    ``mha.dropout``, whose argument is ``p``)."""
    dropout_f = real_number(name, dropout)
    if not 0.0 <= dropout_f < 1.0:
        msg = f"`{name}` must be in [0, 1), got {dropout!r}."
        raise ValueError(msg)
    return dropout_f


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
