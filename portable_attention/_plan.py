"""Which path runs a call of ``attend`` and why: a :class:`Plan` with ``.path`` and ``.reason``.

Decisions depend only on the array type, device, dtype and options (plus whether the
dense score matrix would be large), never on data, and are cached by that key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from portable_attention._validate import Call, fused_unavailable_error
from portable_attention.backends import adapter

#: Above this many bytes of dense scores, ``auto`` takes the chunked portable path.
DENSE_LIMIT_BYTES = 256 << 20

PORTABLE = "portable"
CHUNKED = "portable:chunked"


@dataclass(frozen=True)
class Plan:
    """The path ``attend`` takes for a call, and why.

    Attributes
    ----------
    path : str
        ``"fused:torch"``, ``"fused:jax"``, ``"fused:cupy-via-torch"``: the framework's
        fused kernel; ``"native:numpy"``: a NumPy-only blocked kernel; ``"native:jax"``:
        the dense path on query blocks under ``lax.map`` (JAX on CPU); ``"portable"``:
        the array-API implementation with the whole score matrix;
        ``"portable:chunked"``: the array-API online softmax over key/query blocks.
    reason : str
        In words, why this path and not a faster one.
    """

    path: str
    reason: str


_cache: dict[tuple[Any, ...], Plan] = {}


def dense_bytes(call: Call) -> int:
    """Bytes of the whole score matrix in the compute dtype (NumPy's longdouble: 16)."""
    itemsize = call.xp.finfo(call.compute_dtype).bits // 8
    return math.prod(call.q_shape[:-1]) * call.k_shape[-2] * itemsize


def _portable(call: Call, why: str) -> Plan:
    if call.return_weights:
        return Plan(PORTABLE, f"{why}; return_weights needs the whole score matrix")
    if dense_bytes(call) > DENSE_LIMIT_BYTES:
        return Plan(
            CHUNKED,
            f"{why}; the dense scores would take over {DENSE_LIMIT_BYTES >> 20} MiB, "
            "so key/query blocks with an online softmax run",
        )
    return Plan(PORTABLE, why)


def _decide(call: Call, implementation: str) -> Plan:
    if call.chunk_size is not None:  # before any kernel: every backend would decline
        return Plan(CHUNKED, f"chunk_size={call.chunk_size} asks for the portable chunked path")
    if implementation == "portable":
        return _portable(call, "implementation='portable' was asked for")
    backend = adapter(call.backend)
    fused_reason = getattr(backend, "fused_reason", None)
    if fused_reason is None:
        why = f"{call.backend} has no fused attention kernel"
    else:
        why = fused_reason(call)
    if why is None and implementation == "auto":
        preferred = getattr(backend, "portable_preferred", None)
        why = None if preferred is None else preferred(call)
    if why is None:
        return Plan(backend.PATH, backend.FUSED_WHY)
    native_reason = getattr(backend, "native_reason", None)
    if implementation == "auto" and native_reason is not None:
        not_native = native_reason(call)
        if not_native is None:
            return Plan(backend.NATIVE_PATH, f"{why}; {backend.NATIVE_WHY}")
        why = f"{why}; not {backend.NATIVE_PATH}: {not_native}"
    return _portable(call, why)


def choose(call: Call, implementation: str) -> Plan:
    """The plan for ``call``; ``implementation="fused"`` raises where none applies."""
    key = (
        call.backend,
        str(call.device),
        str(call.dtype),
        call.options(),
        dense_bytes(call) > DENSE_LIMIT_BYTES,
        implementation,
    )
    plan = _cache.get(key)
    if plan is None:
        plan = _decide(call, implementation)
        # setdefault on a dict of builtin keys is atomic: threads agree on one Plan, no lock
        # (which torch.compile could not trace either).
        plan = _cache.setdefault(key, plan)
    if implementation == "fused" and not plan.path.startswith("fused"):
        raise fused_unavailable_error(plan.reason)
    return plan
