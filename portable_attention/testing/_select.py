"""Which backends a test run covers: the one reader of ``PORTABLE_ATTENTION_BACKENDS``.

The package's pytest plugin (its ``array_backend`` fixture) and the package's own test
suite both choose their backends with :func:`selected_backends`, so the variable means
one thing everywhere:

* set (a comma list, e.g. ``numpy,torch``): exactly those backends; one that is unknown
  or does not import (or CuPy without a GPU) is an error, never a silent skip;
* unset or blank: NumPy and every other known backend that imports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from portable_attention.testing._convert import BACKEND_NAMES, cupy_has_gpu, import_backend

BACKENDS_ENV_VAR = "PORTABLE_ATTENTION_BACKENDS"
"""The environment variable :func:`selected_backends` reads."""


def selected_backends(
    request: str | None = None, *, known: Sequence[str] = BACKEND_NAMES, source: str = ""
) -> tuple[str, ...]:
    """The backends to test: those ``request`` names, else every one of ``known`` here.

    Parameters
    ----------
    request : str, optional
        A comma list of backend names (``"numpy,torch"``), e.g. a command-line option's
        value. Default: the environment variable ``PORTABLE_ATTENTION_BACKENDS``, where
        unset or blank means "every one of ``known`` that imports".
    known : sequence of str
        The names this run can test, in the order to test them when nothing is
        requested; default :data:`BACKEND_NAMES` (``numpy``, ``torch``, ``jax``,
        ``cupy``, ``array_api_strict``).
    source : str
        Where ``request`` came from, for the error messages (default: the variable's
        name, or ``"request"`` for an explicit ``request``).

    Returns
    -------
    tuple of str
        The requested names in the order given (each once), or the importable ones of
        ``known`` in its order (CuPy only where it finds a GPU).

    Raises
    ------
    ValueError
        A request that names no backend, a name not in ``known``, or a backend that does
        not import (or CuPy without a GPU): a backend asked for is never skipped.

    Examples
    --------
    >>> from portable_attention.testing import selected_backends
    >>> selected_backends("numpy")
    ('numpy',)
    """
    if request is None:
        request = os.environ.get(BACKENDS_ENV_VAR, "")
        source = source or BACKENDS_ENV_VAR
        if not request.strip():
            return tuple(name for name in known if _usable(name) is None)
    source = source or "request"
    names = tuple(dict.fromkeys(n.strip() for n in request.split(",") if n.strip()))
    if not names:
        raise no_backend_selected_error(source, request, known)
    for name in names:
        if name not in known:
            raise unknown_backend_error(source, request, name, known)
        why = _usable(name)
        if why is not None:
            raise unusable_backend_error(source, request, name, why)
    return names


def _usable(name: str) -> str | None:
    """None when backend ``name`` imports (and CuPy finds a GPU); else why not."""
    try:
        module = import_backend(name)
    except ValueError as err:
        return str(err)
    if name == "cupy" and not cupy_has_gpu(module):
        return "CuPy finds no GPU here"
    return None


# -- argument checks and messages of this module ----------------------------------------


def no_backend_selected_error(source: str, request: str, known: Sequence[str]) -> ValueError:
    """A request (from ``source``) that names no backend."""
    msg = f"{source}={request!r} names no backend; known: {', '.join(known)}."
    return ValueError(msg)


def unknown_backend_error(source: str, request: str, name: str, known: Sequence[str]) -> ValueError:
    """A request for a backend this run does not know."""
    msg = (
        f"{source}={request!r} requests backend {name!r}, which is not usable: it is not "
        f"one of {', '.join(known)}."
    )
    return ValueError(msg)


def unusable_backend_error(source: str, request: str, name: str, why: str) -> ValueError:
    """A request for a backend that does not import here (or CuPy without a GPU)."""
    msg = f"{source}={request!r} requests backend {name!r}, which is not usable: {why}"
    return ValueError(msg)
