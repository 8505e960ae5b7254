"""Which path runs a call of ``attend`` and why: a :class:`Plan` with ``.path`` and ``.reason``.

Decisions depend only on the array type, device, dtype and options, never on data, and
are cached by that key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from portable_attention._validate import Call, fused_unavailable_error


@dataclass(frozen=True)
class Plan:
    """The path ``attend`` takes for a call, and why.

    Attributes
    ----------
    path : str
        ``"portable"``: the array-API implementation in ``_core``.
    reason : str
        In words, why no faster path was taken (or why this one was).
    """

    path: str
    reason: str


_NO_FUSED = {
    "numpy": "NumPy has no fused attention kernel",
}
_NOT_YET = "no fused kernel is wired in for {backend} arrays yet"

_cache: dict[tuple[Any, ...], Plan] = {}
_lock = threading.Lock()


def _key(call: Call, implementation: str) -> tuple[Any, ...]:
    return (call.backend, str(call.device), str(call.dtype), call.options(), implementation)


def _decide(call: Call, implementation: str) -> Plan:
    why = _NO_FUSED.get(call.backend, _NOT_YET.format(backend=call.backend))
    if implementation == "portable":
        return Plan("portable", "implementation='portable' was asked for")
    return Plan("portable", f"{why}; the portable array-API path runs")


def choose(call: Call, implementation: str) -> Plan:
    """The plan for ``call``; ``implementation="fused"`` raises where none applies."""
    key = _key(call, implementation)
    plan = _cache.get(key)
    if plan is None:
        plan = _decide(call, implementation)
        with _lock:
            _cache.setdefault(key, plan)
    if implementation == "fused" and not plan.path.startswith("fused"):
        raise fused_unavailable_error(plan.reason)
    return plan
