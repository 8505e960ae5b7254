"""Per-framework adapters, imported only when that framework's arrays arrive.

Each module binds what the array API standard cannot express for its framework. In
the core that is the random number generator for dropout: ``keep_mask(rng, p,
device)`` returns a function ``shape -> bool array`` (True = keep) drawn from the
framework's own RNG.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_ADAPTERS = {"numpy": "numpy", "torch": "torch", "jax": "jax", "cupy": "cupy"}


def adapter(backend: str) -> ModuleType:
    """The adapter module of ``backend``; ``generic`` for other array-API libraries."""
    name = _ADAPTERS.get(backend, "generic")
    return importlib.import_module(f"portable_attention.backends.{name}")
