"""The :class:`ArrayBackend` handle the pytest plugin's ``array_backend`` fixture yields."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_attention.testing._convert import (
    check_name,
    import_backend,
    source_framework,
    to_backend,
    to_numpy,
)


@dataclass(frozen=True)
class ArrayBackend:
    """One array framework, by name, with conversions to and from it.

    Parameters
    ----------
    name : {"numpy", "torch", "jax", "cupy", "array_api_strict"}
        The framework; it must import.

    Attributes
    ----------
    name : str
        The framework's name (also ``str(backend)``).
    module : module
        Its own top-level module (``numpy``, ``torch``, ``jax.numpy``, ``cupy``,
        ``array_api_strict``).
    """

    name: str

    def __post_init__(self) -> None:
        check_name(self.name)
        import_backend(self.name)

    def __str__(self) -> str:
        return self.name

    @property
    def module(self) -> Any:
        """The framework's own module (``jax.numpy`` for jax)."""
        return import_backend(self.name)

    @functools.cached_property
    def xp(self) -> Any:
        """The array-API namespace of this framework's arrays (``array_api_compat``)."""
        import array_api_compat

        return array_api_compat.array_namespace(self.asarray(np.zeros(1, dtype=np.float32)))

    def asarray(self, obj: Any, dtype: str | None = None, device: Any = None) -> Any:
        """``obj`` as an array of this framework.

        Parameters
        ----------
        obj : array, scalar or nested sequence
            An array of any framework (converted by :func:`to_backend`, dtype kept) or data
            NumPy can make an array of.
        dtype : str, optional
            A dtype name (``"float32"``, ``"bfloat16"``, ...) to cast to first (in NumPy,
            bfloat16 through ``ml_dtypes``).
        device : str, optional
            As in :func:`to_backend`.

        Returns
        -------
        array
        """
        try:
            source_framework(obj)
            a = obj
        except TypeError:  # data, not an array
            a = np.asarray(obj)
        if dtype is not None:
            a = to_numpy(a).astype(numpy_dtype(dtype))
        return to_backend(a, self.name, device=device)

    def to_numpy(self, x: Any) -> np.ndarray:
        """:func:`to_numpy`: an array of any framework as a NumPy array."""
        return to_numpy(x)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name (bfloat16: ``ml_dtypes.bfloat16``)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise dtype_name_error(name) from None


# -- argument checks and messages of this module ----------------------------------------


def dtype_name_error(name: object) -> ValueError:
    """The error of ``ArrayBackend.asarray`` for a ``dtype`` that names no dtype."""
    msg = f"`dtype` must be a dtype name like 'float32' or 'bfloat16', got {name!r}."
    return ValueError(msg)
