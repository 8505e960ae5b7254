"""Per-framework adapters, imported only when that framework's arrays arrive.

Each module defines ``ADAPTER``, an instance of a subclass of
:class:`portable_attention.backends._base.Adapter`: the RNG for dropout, the scores'
matmul where the framework has a faster one, and its fused and tuned kernels where it
has them (see :mod:`portable_attention.backends._base`). A new backend is a module here
and one line in ``_MODULES``.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: the contract (_spec) asks the adapters, and _base
    # imports the kernel, which imports the contract
    from portable_attention.backends._base import Adapter

#: Framework name (``portable_attention._checks.backend_name``) -> adapter module.
_MODULES = {
    "numpy": "numpy",
    "torch": "torch",
    "jax": "jax",
    "cupy": "cupy",
    "dask": "dask",
    "sparse": "refused",  # array-api-compat knows them; attend refuses them, saying why
    "marray": "refused",
}


def adapter(backend: str) -> Adapter:
    """The adapter of ``backend``; the generic one for other array-API libraries."""
    name = f"{__name__}.{_MODULES.get(backend, 'generic')}"
    # A dict lookup that torch.compile traces. A module another thread is still importing
    # is in sys.modules without its ADAPTER yet: import_module waits for that import.
    found: Adapter | None = getattr(sys.modules.get(name), "ADAPTER", None)
    if found is None:
        found = importlib.import_module(name).ADAPTER
    return found


def preload() -> None:
    """Import the adapters of frameworks that are already imported (never a framework).

    Called when the package is imported, so that a first call of ``attend`` traced by
    ``torch.compile`` (which cannot import modules) finds its adapter loaded.
    """
    for framework, module in _MODULES.items():
        if framework in sys.modules and framework != "numpy":
            importlib.import_module(f"{__name__}.{module}")
