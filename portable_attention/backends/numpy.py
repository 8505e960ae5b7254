"""NumPy: dropout from a ``numpy.random.Generator``, which is the generic adapter's RNG."""

from __future__ import annotations

from portable_attention.backends.generic import RNG, keep_mask

__all__ = ["RNG", "keep_mask"]
