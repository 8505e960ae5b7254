"""Helpers for testing code that runs on several array frameworks.

For users' own test suites as much as for this package's:

* :func:`to_backend` / :func:`to_numpy` convert arrays between NumPy, PyTorch, JAX, CuPy
  and array_api_strict (DLPack first, dtype kept exactly, bfloat16 included);
* :func:`available_backends` lists the frameworks that import here;
* :func:`assert_backends_agree` runs one function on every backend and compares the
  results, with :func:`tolerance` giving the default ``(rtol, atol)`` per dtype;
* :class:`ArrayBackend` is what the opt-in pytest plugin's ``array_backend`` fixture
  yields (``pytest_plugins = ["portable_attention.testing.pytest_plugin"]``).
"""

from portable_attention._convert import BACKEND_NAMES, available_backends, to_backend, to_numpy
from portable_attention.testing._agree import assert_backends_agree, tolerance
from portable_attention.testing._backend import ArrayBackend

__all__ = [
    "BACKEND_NAMES",
    "ArrayBackend",
    "assert_backends_agree",
    "available_backends",
    "to_backend",
    "to_numpy",
    "tolerance",
]
