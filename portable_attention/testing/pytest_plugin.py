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

The choice is :func:`~portable_attention.testing.selected_backends`, the package's one
reader of the variable (its own test suite uses it too).

``pytest --co`` and the report header show the choice.
"""

from __future__ import annotations

import pytest

from portable_attention.testing._backend import ArrayBackend
from portable_attention.testing._convert import BACKEND_NAMES
from portable_attention.testing._select import BACKENDS_ENV_VAR, selected_backends

ENV_VAR = BACKENDS_ENV_VAR
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


def pytest_configure(config: pytest.Config) -> None:
    option = config.getoption("array_backends", default=None)
    try:
        if option is not None:
            selected = selected_backends(option, source="--array-backends")
        else:  # the environment variable, else every backend that imports
            selected = selected_backends()
    except ValueError as err:  # a backend asked for is never skipped: the run fails
        raise pytest.UsageError(str(err)) from None
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


def _indirect_array_backend_message() -> str:
    """The ``array_backend`` fixture requested without the plugin's parametrization."""
    return "`array_backend` is parametrized by the plugin; do not request it indirectly."
