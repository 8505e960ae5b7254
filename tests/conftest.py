"""Backend registry and fixtures shared by the whole test suite.

One list of backends (:data:`BACKENDS`) drives every parametrized test. It is chosen by the
environment variable ``PORTABLE_ATTENTION_BACKENDS`` (a comma list of ``numpy``,
``array_api_strict``, ``torch``, ``jax``), read by the package's own reader,
:func:`portable_attention.testing.selected_backends` (its pytest plugin's too):

* set: exactly those backends are tested, and one that fails to import makes the run fail
  (a usage error, pytest exits non-zero) -- a requested backend is never skipped;
* unset (or empty): NumPy plus every other backend that imports.

``array_api_strict`` runs with ``ArrayAPIStrictFlags(boolean_indexing=False,
data_dependent_shapes=False)`` active for the whole test (a stand-in for tracing under a jit
compiler): the contract's jit-safety rule is the stricter of the two settings, and the
package's code is the same under both, so one instance tests both (a plain instance ran
every parametrized test a second time and found nothing the flagged one did not).

Fixtures
--------
backend
    The :class:`Backend` under test (with its flags context active).
xp
    The array-API namespace of the backend's arrays (``array_namespace(x)``).
float_dtype
    Name of a floating dtype the backend has (``float16``/``bfloat16`` only where available);
    requesting it parametrizes over (backend, dtype) pairs.
hp_dtype
    Like ``float_dtype`` but only ``float32`` and ``float64``.
half_dtype
    Like ``float_dtype`` but only ``float16`` and ``bfloat16`` (where the backend has them).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from portable_attention import backends as _adapters
from portable_attention.testing import BACKENDS_ENV_VAR, selected_backends, to_numpy, tolerance

ENV_VAR = BACKENDS_ENV_VAR

# Hypothesis profiles (tests/test_properties.py): "ci" (the default) runs a fixed, derandomized
# set of examples; HYPOTHESIS_PROFILE=thorough (nox -s properties) runs 8x as many, random.
settings.register_profile(
    "ci",
    max_examples=30,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    # `backend` is function-scoped but stateless across examples (a flags context at most)
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
settings.register_profile(
    "thorough", settings.get_profile("ci"), max_examples=240, derandomize=False
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

KNOWN = ("numpy", "array_api_strict", "torch", "jax")
HALF = ("float16", "bfloat16")
FLOATING = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Backend:
    """Everything a test needs to know about one array library."""

    name: str
    module: Any  # the framework's own top-level module (numpy, torch, jax.numpy, ...)
    xp: Any  # array_api_compat.array_namespace() of the backend's arrays
    dtypes: dict[str, Any]  # floating dtypes this backend has, by name
    int_dtype: Any
    bool_dtype: Any
    complex_dtype: Any
    _asarray: Callable[[np.ndarray, Any], Any]
    _check_type: Callable[[Any], None]  # a TypeError unless it is this backend's array
    make_rng: Callable[[int], Any]  # the framework's RNG for dropout, from a seed
    wrong_rng: Callable[[], Any]  # an RNG object of another framework (a TypeError for `rng`)
    flags: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Backend({self.name})"

    # -- conversions ------------------------------------------------------------------------
    def asarray(self, a: Any, dtype: str | Any | None = None) -> Any:
        """NumPy data -> this backend's array, cast to ``dtype`` (a name or a dtype)."""
        a = np.asarray(a)
        if isinstance(dtype, str):
            dtype = self.dtypes[dtype] if dtype in self.dtypes else getattr(self.xp, dtype)
        if dtype is None:
            if a.dtype == np.bool_:
                dtype = self.bool_dtype
            elif np.issubdtype(a.dtype, np.integer):
                dtype = self.int_dtype
            elif np.issubdtype(a.dtype, np.complexfloating):
                dtype = self.complex_dtype
            else:
                dtype = self.dtypes["float64"]
        return self._asarray(a, dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        """This backend's array -> NumPy (floating data as float64, exactly); a TypeError
        for an array of another framework."""
        self._check_type(x)
        floating = str(x.dtype).rsplit(".", 1)[-1] in FLOATING
        return to_numpy(x, dtype="float64") if floating else np.asarray(to_numpy(x))

    def dtype(self, name: str) -> Any:
        return self.dtypes[name]

    @property
    def device(self) -> Any:
        import array_api_compat

        return array_api_compat.device(self.asarray(np.zeros(1)))


# --------------------------------------------------------------------------------------------
# Backend constructors: each imports its framework (ImportError propagates).


def _numpy_backend() -> Backend:
    import array_api_compat

    def check_type(x: Any) -> None:
        if not isinstance(x, np.ndarray):
            msg = f"expected a numpy.ndarray, got {type(x)}"
            raise TypeError(msg)

    return Backend(
        name="numpy",
        module=np,
        xp=array_api_compat.array_namespace(np.zeros(1)),
        dtypes={"float16": np.float16, "float32": np.float32, "float64": np.float64},
        int_dtype=np.int64,
        bool_dtype=np.bool_,
        complex_dtype=np.complex128,
        _asarray=lambda a, dt: np.array(a, dtype=dt, copy=True),
        _check_type=check_type,
        make_rng=np.random.default_rng,
        wrong_rng=_foreign_rng_for_numpy,
    )


def _foreign_rng_for_numpy() -> Any:
    """An object that is not a NumPy Generator but looks rng-like."""
    try:
        import torch

        return torch.Generator().manual_seed(0)
    except ImportError:
        return "not-a-generator"


def _strict_backend() -> Backend:
    import array_api_compat
    import array_api_strict as xs

    array_type = type(xs.asarray(0.0))

    def check_type(x: Any) -> None:
        if type(x) is not array_type:
            msg = f"expected an array_api_strict.Array, got {type(x)}"
            raise TypeError(msg)

    def asarray(a: np.ndarray, dt: Any) -> Any:
        return xs.astype(xs.asarray(a), dt)

    def flags() -> contextlib.AbstractContextManager[Any]:
        return xs.ArrayAPIStrictFlags(boolean_indexing=False, data_dependent_shapes=False)

    return Backend(
        name="array_api_strict",
        module=xs,
        xp=array_api_compat.array_namespace(xs.asarray([1.0])),
        dtypes={"float32": xs.float32, "float64": xs.float64},
        int_dtype=xs.int64,
        bool_dtype=xs.bool,
        complex_dtype=xs.complex128,
        _asarray=asarray,
        _check_type=check_type,
        make_rng=np.random.default_rng,
        wrong_rng=_foreign_rng_for_numpy,
        flags=flags,
        extra={"other_device": xs.Device("device1")},
    )


def _torch_backend() -> Backend:
    import array_api_compat
    import torch

    def check_type(x: Any) -> None:
        if not isinstance(x, torch.Tensor):
            msg = f"expected a torch.Tensor, got {type(x)}"
            raise TypeError(msg)

    return Backend(
        name="torch",
        module=torch,
        xp=array_api_compat.array_namespace(torch.zeros(1)),
        dtypes={
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "float32": torch.float32,
            "float64": torch.float64,
        },
        int_dtype=torch.int64,
        bool_dtype=torch.bool,
        complex_dtype=torch.complex128,
        _asarray=lambda a, dt: torch.from_numpy(np.array(a, copy=True)).to(dt),
        _check_type=check_type,
        make_rng=lambda seed: torch.Generator().manual_seed(seed),
        wrong_rng=lambda: np.random.default_rng(0),
    )


def _jax_backend() -> Backend:
    import array_api_compat
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    def check_type(x: Any) -> None:
        if not isinstance(x, jax.Array):
            msg = f"expected a jax.Array, got {type(x)}"
            raise TypeError(msg)

    return Backend(
        name="jax",
        module=jnp,
        xp=array_api_compat.array_namespace(jnp.zeros(1)),
        dtypes={
            "float16": jnp.float16,
            "bfloat16": jnp.bfloat16,
            "float32": jnp.float32,
            "float64": jnp.float64,
        },
        int_dtype=jnp.int64,
        bool_dtype=jnp.bool_,
        complex_dtype=jnp.complex128,
        _asarray=lambda a, dt: jnp.asarray(np.array(a, copy=True)).astype(dt),
        _check_type=check_type,
        make_rng=jax.random.key,
        wrong_rng=lambda: np.random.default_rng(0),
    )


_CONSTRUCTORS: dict[str, Callable[[], list[Backend]]] = {
    "numpy": lambda: [_numpy_backend()],
    "array_api_strict": lambda: [_strict_backend()],
    "torch": lambda: [_torch_backend()],
    "jax": lambda: [_jax_backend()],
}


def _select_backends() -> list[Backend]:
    try:
        names = selected_backends(known=KNOWN)
    except ValueError as err:  # a requested backend must fail the run, never be skipped
        raise pytest.UsageError(str(err)) from None
    selected: list[Backend] = []
    for name in names:
        selected.extend(_CONSTRUCTORS[name]())
    # The package was imported (by the reader) before these frameworks: load their
    # adapters now, as importing the package after them would (torch.compile needs it).
    _adapters.preload()
    return selected


# Importing jax (and enabling x64) happens here, at conftest import, before any test runs.
BACKENDS: list[Backend] = _select_backends()
BACKEND_NAMES: tuple[str, ...] = tuple(b.name for b in BACKENDS)
BY_NAME: dict[str, Backend] = {b.name: b for b in BACKENDS}


def requires_backend(*names: str) -> pytest.MarkDecorator:
    """Skip marker for tests that exercise one specific framework's machinery."""
    missing = [n for n in names if n not in BY_NAME]
    return pytest.mark.skipif(
        bool(missing), reason=f"backend(s) {missing} not selected ({ENV_VAR})"
    )


def foreign_array(backend: Backend, a: np.ndarray) -> Any:
    """``a`` as an array of a framework other than ``backend``'s (None if none imports)."""
    order = ["numpy", "torch", "array_api_strict", "jax"]
    for name in order:
        if backend.name.startswith(name):
            continue
        other = _try_backend(name)
        if other is not None:
            return other.asarray(a)
    return None


@functools.cache
def _try_backend(name: str) -> Backend | None:
    if name in BY_NAME:
        return BY_NAME[name]
    try:
        return _CONSTRUCTORS[name]()[0]
    except ImportError:
        return None


def pytest_report_header(config: pytest.Config) -> str:
    return f"portable_attention backends: {', '.join(BACKEND_NAMES)}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    for dtype_fixture, allowed in (
        ("float_dtype", ("float16", "bfloat16", "float32", "float64")),
        ("hp_dtype", ("float32", "float64")),
        ("half_dtype", HALF),
    ):
        if dtype_fixture in metafunc.fixturenames:
            params = [
                pytest.param(b, d, id=f"{b.name}-{d}")
                for b in BACKENDS
                for d in allowed
                if d in b.dtypes
            ]
            metafunc.parametrize(("backend", dtype_fixture), params, indirect=["backend"])
            return
    metafunc.parametrize("backend", BACKENDS, ids=[b.name for b in BACKENDS], indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b: Backend = request.param
    with b.flags():
        yield b


@pytest.fixture
def xp(backend: Backend) -> Any:
    return backend.xp


# --------------------------------------------------------------------------------------------
# Tolerances by dtype, from the package's one table (portable_attention.testing.TOLERANCES):
# (rtol, atol) for out/weights, and for lse, which half inputs compute in float32.

TOLERANCES: dict[str, tuple[float, float]] = {
    name: tolerance(name, "out") for name in ("float64", "float32", "float16", "bfloat16")
}
LSE_TOLERANCES: dict[str, tuple[float, float]] = {
    name: tolerance(name, "lse") for name in ("float64", "float32", "float16", "bfloat16")
}


def compute_dtype_name(dtype_name: str) -> str:
    return "float32" if dtype_name in HALF else dtype_name
