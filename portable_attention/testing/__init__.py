"""Helpers for testing code that runs on several array frameworks, and attention kernels.

For users' own test suites as much as for this package's:

* :func:`to_backend` / :func:`to_numpy` convert arrays between NumPy, PyTorch, JAX, CuPy
  and array_api_strict (DLPack first, dtype kept exactly, bfloat16 included; the one
  conversion path of the package);
* :func:`available_backends` lists the frameworks that import here, and
  :func:`selected_backends` reads ``PORTABLE_ATTENTION_BACKENDS`` as the pytest plugin
  and the package's own suite do;
* :data:`TOLERANCES` / :func:`tolerance`: the one tolerance table, ``(rtol, atol)`` per
  dtype for attention's out, weights and lse;
* :func:`assert_backends_agree` runs one function on every backend and compares the
  results;
* :func:`reference_attention`: the contract's attention in float64 NumPy, written apart
  from the package's kernels (the consistency report's oracle);
* :func:`check_attention` runs the contract's edge cases on any attention function
  (yours, torch SDPA, ``jax.nn.dot_product_attention``, flash-attn) and says case by case
  where it departs;
* :class:`ArrayBackend` is what the opt-in pytest plugin's ``array_backend`` fixture
  yields (``pytest_plugins = ["portable_attention.testing.pytest_plugin"]``).
"""

from portable_attention.testing._agree import assert_backends_agree
from portable_attention.testing._backend import ArrayBackend
from portable_attention.testing._check import (
    CASES,
    AttentionReport,
    CaseResult,
    check_attention,
)
from portable_attention.testing._convert import (
    BACKEND_NAMES,
    available_backends,
    to_backend,
    to_numpy,
)
from portable_attention.testing._reference import Reference, reference_attention
from portable_attention.testing._select import BACKENDS_ENV_VAR, selected_backends
from portable_attention.testing._tolerance import TOLERANCES, Tolerance, tolerance

__all__ = [
    "BACKENDS_ENV_VAR",
    "BACKEND_NAMES",
    "CASES",
    "TOLERANCES",
    "ArrayBackend",
    "AttentionReport",
    "CaseResult",
    "Reference",
    "Tolerance",
    "assert_backends_agree",
    "available_backends",
    "check_attention",
    "reference_attention",
    "selected_backends",
    "to_backend",
    "to_numpy",
    "tolerance",
]
