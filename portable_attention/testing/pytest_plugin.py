"""Opt-in pytest plugin: an ``array_backend`` fixture over every array framework here.

Enable it in your ``conftest.py`` at the root of your tests::

    pytest_plugins = ["portable_attention.testing.pytest_plugin"]

(or ``pytest -p portable_attention.testing.pytest_plugin``). A test that takes the
``array_backend`` fixture then runs once per backend, with ids ``numpy``, ``torch``,
``jax``, ``cupy``, ``array_api_strict``; the fixture is an
:class:`~portable_attention.testing.ArrayBackend` (``.name``, ``.module``, ``.xp``,
``.asarray(obj, dtype=None)``, ``.to_numpy(x)``)::

    def test_sum(array_backend):
        x = array_backend.asarray([1.0, 2.0], dtype="float32")
        assert float(array_backend.xp.sum(x)) == 3.0

Which backends:

* ``--array-backends=numpy,torch`` (or, without the option, the environment variable
  ``PORTABLE_ATTENTION_BACKENDS``): exactly those. One that does not import (or an
  unknown name, or cupy without a GPU) **fails** the run with a usage error: a backend you
  asked for is never silently skipped.
* neither: every backend that imports (:func:`~portable_attention.testing.available_backends`).

``pytest --co`` and the report header show the choice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from portable_attention._convert import (
    BACKEND_NAMES,
    _check_name,
    _cupy_has_gpu,
    _import,
    available_backends,
)
from portable_attention.testing._backend import ArrayBackend

ENV_VAR = "PORTABLE_ATTENTION_BACKENDS"
_SELECTED = pytest.StashKey[tuple[str, ...]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portable_attention", "portable_attention array backends")
    group.addoption(
        "--array-backends",
        dest="array_backends",
        default=None,
        metavar="NAMES",
        help=(
            "comma list of array backends for the `array_backend` fixture "
            f"({', '.join(BACKEND_NAMES)}); one that does not import fails the run. "
            f"Default: ${ENV_VAR}, else every backend that imports."
        ),
    )


def _select(raw: str, source: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    if not names:
        msg = _no_backend_selected_message(source, raw, BACKEND_NAMES)
        raise pytest.UsageError(msg)
    for name in names:
        try:
            _check_name(name)
            module = _import(name)
        except ValueError as err:
            msg = _unusable_backend_message(source, raw, name, err)
            raise pytest.UsageError(msg) from None
        if name == "cupy" and not _cupy_has_gpu(module):
            msg = _cupy_without_gpu_message(source, raw)
            raise pytest.UsageError(msg)
    return names


def pytest_configure(config: pytest.Config) -> None:
    option = config.getoption("array_backends", default=None)
    env = os.environ.get(ENV_VAR, "")
    selected: tuple[str, ...]
    if option is not None:
        selected = _select(option, "--array-backends")
    elif env.strip():
        selected = _select(env, ENV_VAR)
    else:
        selected = available_backends()
    config.stash[_SELECTED] = selected


def pytest_report_header(config: pytest.Config) -> str:
    selected = config.stash[_SELECTED]
    return f"array backends (array_backend fixture): {', '.join(selected)}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "array_backend" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if isinstance(argnames, str):
            argnames = [n.strip() for n in argnames.split(",")]
        if "array_backend" in argnames:
            return  # the test chose its own backends
    names = metafunc.config.stash[_SELECTED]
    metafunc.parametrize("array_backend", names, ids=list(names), indirect=True)


@pytest.fixture
def array_backend(request: pytest.FixtureRequest) -> ArrayBackend:
    """The array backend under test (parametrized over the selected backends)."""
    name = getattr(request, "param", None)
    if name is None:
        msg = _indirect_array_backend_message()
        raise pytest.UsageError(msg)
    return ArrayBackend(str(name))


# -- argument checks and messages of this module ----------------------------------------


def _no_backend_selected_message(source: str, raw: str, known: Sequence[str]) -> str:
    """``--array-backends`` (or its variable, ``source``) naming no backend."""
    return f"{source}={raw!r} names no backend; known: {', '.join(known)}."


def _unusable_backend_message(source: str, raw: str, name: str, err: BaseException) -> str:
    """A backend the selection asks for that is unknown or does not import."""
    return f"{source}={raw!r} requests backend {name!r}, which is not usable: {err}"


def _cupy_without_gpu_message(source: str, raw: str) -> str:
    """The selection asks for cupy where CuPy finds no GPU."""
    return f"{source}={raw!r} requests backend 'cupy', but CuPy finds no GPU here."


def _indirect_array_backend_message() -> str:
    """The ``array_backend`` fixture requested without the plugin's parametrization."""
    return "`array_backend` is parametrized by the plugin; do not request it indirectly."
