"""Per-framework adapters, imported only when that framework's arrays arrive.

Each module binds what the array API standard cannot express for its framework: the RNG
for dropout (``keep_mask(rng, p, xp, device)`` returns ``shape -> bool keep mask``) and,
where the framework has one, its fused kernel (``fused_reason(call)`` says why it cannot
run a call, ``run_fused`` runs it) or a native kernel (``native_reason``/``run_native``).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

_ADAPTERS = {"numpy": "numpy", "torch": "torch", "jax": "jax", "cupy": "cupy"}


def adapter(backend: str) -> ModuleType:
    """The adapter module of ``backend``; ``generic`` for other array-API libraries."""
    name = f"{__name__}.{_ADAPTERS.get(backend, 'generic')}"
    module = sys.modules.get(name)  # a dict lookup that torch.compile traces
    return module if module is not None else importlib.import_module(name)


def preload() -> None:
    """Import the adapters of frameworks that are already imported (never a framework).

    Called when the package is imported, so that a first call of ``attend`` traced by
    ``torch.compile`` (which cannot import modules) finds its adapter loaded.
    """
    for framework, module in _ADAPTERS.items():
        if framework in sys.modules and framework != "numpy":
            importlib.import_module(f"{__name__}.{module}")
