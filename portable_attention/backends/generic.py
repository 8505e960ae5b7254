"""Any other array-API library (array_api_strict, ...): dropout from a NumPy Generator."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_attention import _validate

RNG = "a numpy.random.Generator (e.g. `numpy.random.default_rng(0)`)"


def keep_mask(rng: Any, p: float, xp: Any, device: Any) -> Any:
    """Keep mask drawn with a NumPy Generator, converted to ``xp`` on ``device``."""
    if rng is None:
        rng = np.random.default_rng()
    if not isinstance(rng, np.random.Generator):
        raise _validate.rng_type_error(xp.__name__, RNG, rng)

    def draw(shape: tuple[int, ...]) -> Any:
        return xp.asarray(rng.random(shape, dtype=np.float32) >= p, device=device)

    return draw
