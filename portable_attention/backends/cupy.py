"""CuPy: dropout from a ``cupy.random.Generator`` or ``RandomState``."""

from __future__ import annotations

from typing import Any

import cupy

from portable_attention import _validate

NAME = "CuPy"
RNG = "a cupy.random.Generator or cupy.random.RandomState (or None for CuPy's global RNG)"


def keep_mask(rng: Any, p: float, xp: Any, device: Any) -> Any:
    """Keep mask drawn on the arrays' GPU."""
    if rng is None:
        rng = cupy.random.get_random_state()
    if isinstance(rng, cupy.random.Generator):
        uniform = rng.random
    elif isinstance(rng, cupy.random.RandomState):
        uniform = rng.random_sample
    else:
        raise _validate.rng_type_error(NAME, RNG, rng)

    def draw(shape: tuple[int, ...]) -> Any:
        with device:
            return uniform(shape, dtype=cupy.float32) >= p

    return draw
