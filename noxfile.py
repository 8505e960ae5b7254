"""nox sessions for portable_attention.

Plain ``nox`` runs ``tests-all`` (every CPU backend in one environment, the whole suite,
then the tests of composed computations again with torch rounding float32 another way),
``compile``, ``lint`` and ``docs``; each framework is installed once.
``nox -l`` lists all sessions; ``nox -s torch`` runs one backend alone. Environments are
reused between runs. The test sessions spread their tests over one process per core
(:data:`WORKERS`); ``compile`` and ``parallel`` run theirs in one.

Every test session sets ``PORTABLE_ATTENTION_BACKENDS`` to exactly the backends it
installed, so the suite fails (it does not skip) when one of them does not import.

PyTorch is pinned to ``torch==2.13.0``: on the project's machines that version is a CPU
build on local disk, while any looser spec (``torch``, ``torch>=2``) pulls a CUDA build
of several GB. Override with ``TORCH_SPEC`` (for example ``TORCH_SPEC="torch==2.5.1"``).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = ROOT / "pyproject.toml"

# The one place the framework requirements are spelled out.
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
JAX_SPEC = os.environ.get("JAX_SPEC", "jax")  # the PyPI `jax` wheel runs on the CPU

SOURCES = ("portable_attention", "tests", "benchmarks", "examples", "noxfile.py")

nox.options.sessions = ["tests-all", "compile", "lint", "docs"]
# Reuse environments between local runs (`nox -N` or `--reuse-venv=no` to rebuild).
# Every session still runs its pip install, so a reused environment stays current.
nox.options.reuse_venv = "yes"


def _dependency_group(name: str) -> list[str]:
    """Requirements of a ``[dependency-groups]`` entry in pyproject.toml."""
    project = getattr(nox, "project", None)
    if project is not None and hasattr(project, "dependency_groups"):
        pyproject = project.load_toml(PYPROJECT)
        return list(project.dependency_groups(pyproject, name))
    # Older nox (before 2025.02.09): read the group directly (no include-group support).
    import tomllib

    with PYPROJECT.open("rb") as f:
        groups = tomllib.load(f).get("dependency-groups", {})
    return [req for req in groups[name] if isinstance(req, str)]


def _framework_requirements(backends: tuple[str, ...]) -> list[str]:
    reqs: list[str] = []
    if "torch" in backends:
        # transformers for the Hugging Face integration's tests; it does not pin torch,
        # so the pinned CPU build above stays.
        reqs += [TORCH_SPEC, "transformers"]
    if "jax" in backends:
        reqs += [JAX_SPEC, "flax"]  # flax for the NNX multi-head module's tests
    return reqs


def _install(session: nox.Session, backends: tuple[str, ...]) -> None:
    # One pip call: the pinned torch is resolved together with the package and the test
    # group, so nothing can ask for a newer torch behind our back. The package is
    # installed without extras (its `torch`/`jax` extras are unpinned ranges).
    session.install(*_framework_requirements(backends), ".", *_dependency_group("test"))


#: pytest-xdist's options for the test sessions whose tests are independent of one another:
#: one worker process per core, idle workers taking tests from busy ones. On the 2-core
#: machine the whole suite took 432 s on two workers against 629 s in one process (the tests
#: are mostly single-threaded: XLA compiles each eager JAX operation, Python dispatches).
#: The compile and parallel sessions stay in one process (inductor's on-disk cache;
#: gloo's ranks and the simulated devices are processes of their own).
WORKERS = ("-n", "auto", "--dist", "worksteal")


def _run_tests(
    session: nox.Session, backends: tuple[str, ...], *args: str, workers: bool = True
) -> None:
    _install(session, backends)
    env = {"PORTABLE_ATTENTION_BACKENDS": ",".join(backends)}
    if "jax" in backends:
        # CPU jaxlib; skip the accelerator probe and its warnings.
        env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
    spread = WORKERS if workers else ()
    session.run("python", "-m", "pytest", *spread, *args, *session.posargs, env=env)


@nox.session
def numpy(session: nox.Session) -> None:
    """Test suite on NumPy only."""
    _run_tests(session, ("numpy",))


@nox.session(name="array_api_strict")
def array_api_strict(session: nox.Session) -> None:
    """Test suite on array_api_strict only (the array API standard, nothing more)."""
    _run_tests(session, ("array_api_strict",))


@nox.session
def torch(session: nox.Session) -> None:
    """Test suite on PyTorch (CPU build, pinned) only."""
    _run_tests(session, ("torch",))


@nox.session
def jax(session: nox.Session) -> None:
    """Test suite on JAX (CPU) only."""
    _run_tests(session, ("jax",))


@nox.session(name="tests-all")
def tests_all(session: nox.Session) -> None:
    """Whole suite with every CPU backend installed together (the ``torch.compile`` tests
    run in the ``compile`` session), the composed-computation tests again with torch
    rounding float32 another way (the ``rounding`` session), then the consistency report."""
    _run_tests(session, ("numpy", "array_api_strict", "torch", "jax"), "-m", "not compile")
    _rerun_rounding_another_way(session)
    # The README's first command: the consistency report exits 1 on a disagreement.
    session.run("python", "-m", "portable_attention", "--quiet")


#: The tests that compare a computation composed of many operations (models, multi-head
#: modules, gradients through layers) between implementations, in float32 or a half dtype
#: with a bound argued from the computation, or in float64.
ROUNDING_TESTS = (
    "tests/test_transformers.py",
    "tests/test_mha.py",
    "tests/test_grad.py",
    "tests/test_blockwise.py",
    "tests/test_properties.py",
)


def _rerun_rounding_another_way(session: nox.Session, *args: str) -> None:
    """The tests of composed computations again, with torch's CPU kernels rounding float32
    another way: ``ATEN_CPU_CAPABILITY=default`` (no AVX2/AVX-512 code) changes which bits
    round which way on this very machine, as another CPU would. A tolerance that merely
    passed here fails under it (measured: a float32 gpt-oss gradient moved from 2.7e-5 to
    1.7e-4 from float64), before it fails on a user's machine. Thread counts and JAX's
    ``--xla_cpu_max_isa`` changed no float32 result measured, so torch's switch is the one.
    (The compile tests stay out: inductor's cache holds kernels built for the machine's
    vector width.)"""
    env = {
        "PORTABLE_ATTENTION_BACKENDS": "numpy,torch",
        "ATEN_CPU_CAPABILITY": "default",
        "JAX_PLATFORMS": "cpu",  # installed in tests-all's environment, though not selected
    }
    session.run("python", "-m", "pytest", "-m", "not compile", *ROUNDING_TESTS, *args, env=env)


@nox.session
def rounding(session: nox.Session) -> None:
    """Only the rerun of the composed-computation tests that ``tests-all`` ends with."""
    _install(session, ("numpy", "torch"))
    _rerun_rounding_another_way(session, *session.posargs)


@nox.session(name="compile")
def compile_tests(session: nox.Session) -> None:
    """The ``torch.compile`` tests (``-m compile``, 10-40 s each): every entry point that
    claims ``fullgraph=True`` is compiled and checked against eager."""
    # NumPy calls before compiling.
    _run_tests(session, ("numpy", "torch"), "-m", "compile", workers=False)


@nox.session
def parallel(session: nox.Session) -> None:
    """Sequence parallelism (``tests/test_parallel*.py`` and the Scaling-out page's examples)
    on 8 simulated JAX devices and gloo process groups of 2 and 4 ranks on 127.0.0.1.

    The device count is an XLA flag read when JAX starts, so it is set here, for this
    session's interpreter alone; ``PORTABLE_ATTENTION_PARALLEL=1`` makes those modules
    run (elsewhere they skip, saying so) and fail where the devices are missing.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    session.env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    session.env["PORTABLE_ATTENTION_PARALLEL"] = "1"
    _run_tests(
        session,
        ("numpy", "torch", "jax"),
        "tests/test_parallel.py",
        "tests/test_parallel_jax.py",
        "tests/test_parallel_torch.py",
        "tests/test_docs.py",
        "-k",
        "test_parallel or scaling-out",
        workers=False,
    )


#: The lower bounds of pyproject.toml, installed as they are: NumPy's and array-api-compat's
#: (the NumPy backend: its suite in full), JAX's (with the NumPy it needs: the tests of the
#: JAX adapter's paths, kernels and exports). torch has only its 2.13 CPU build on this
#: machine: its older versions are honoured by a version gate in the adapter instead.
FLOORS_NUMPY = ("numpy==1.26.4", "array-api-compat==1.14.0")
FLOORS_JAX = ("jax==0.9.0", "jaxlib==0.9.0", "numpy==2.0.2", "array-api-compat==1.14.0")
#: What the JAX floor's run covers (the whole JAX suite takes 7 minutes here).
FLOORS_JAX_TESTS = (
    "tests/test_attend.py",
    "tests/test_paths.py",
    "tests/test_blockwise.py",
    "tests/test_grad.py",
    "tests/test_export.py",
    "tests/test_flax_mha.py",
)
#: Test dependencies the floors leave out: array-api-strict's releases that take NumPy
#: 1.26 fail their own device moves there, and dask, ONNX (ndonnx too), pydata sparse and
#: marray serve backends not run here (their tests skip where they do not import).
_NOT_AT_FLOORS = ("array-api-strict", "dask", "distributed", "onnx", "ndonnx", "sparse", "marray")


def _floors_install(session: nox.Session, pins: tuple[str, ...], *extra: str) -> None:
    test = [r for r in _dependency_group("test") if not r.startswith(_NOT_AT_FLOORS)]
    session.install(*pins, *extra, ".", *test)


@nox.session(name="floors")
def floors(session: nox.Session) -> None:
    """The suite at the lower bounds pyproject.toml declares: NumPy 1.26 with
    array-api-compat 1.14 (every NumPy test), then JAX 0.9.0 (its adapter's tests)."""
    _floors_install(session, FLOORS_NUMPY)
    session.run(
        "python", "-m", "pytest", *WORKERS, "-m", "not compile", *session.posargs,
        env={"PORTABLE_ATTENTION_BACKENDS": "numpy"},
    )  # fmt: skip
    _floors_install(session, FLOORS_JAX, "flax")
    session.run(
        "python", "-m", "pytest", *WORKERS, "-m", "not compile", *FLOORS_JAX_TESTS,
        *session.posargs, env={"PORTABLE_ATTENTION_BACKENDS": "jax", "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and mypy over the package."""
    # The package (NumPy, array-api-compat) is installed so mypy sees real types;
    # torch/jax are not: mypy's ignore_missing_imports covers the optional backends.
    session.install(".", *_dependency_group("lint"))
    session.run("ruff", "check", *SOURCES)
    session.run("ruff", "format", "--check", "--diff", *SOURCES)
    session.run("mypy", "-p", "portable_attention")


@nox.session
def properties(session: nox.Session) -> None:
    """The hypothesis property suite alone, with every CPU backend, at a larger example count."""
    session.env["HYPOTHESIS_PROFILE"] = "thorough"
    _run_tests(session, ("numpy", "array_api_strict", "torch", "jax"), "tests/test_properties.py")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site (MkDocs) with warnings as errors."""
    session.install(".", *_dependency_group("docs"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / ".nox" / "site"))
