"""Any other array-API library (array_api_strict, ...): dropout from a NumPy Generator."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_attention import _spec
from portable_attention._blockwise import BlockKeep
from portable_attention._core import KeepMask
from portable_attention.backends._base import Adapter


class GenericAdapter(Adapter):
    """An array-API library with nothing of its own: the portable path, NumPy's RNG."""

    name = "array-API"
    rng = "a numpy.random.Generator (e.g. `numpy.random.default_rng(0)`)"

    def keep_mask(self, rng: Any, p: float, xp: Any, device: Any) -> KeepMask:
        """Keep mask drawn with a NumPy Generator, converted to ``xp`` on ``device``."""
        rng = self._generator(rng, xp)

        def draw(shape: tuple[int, ...]) -> Any:
            return xp.asarray(rng.random(shape, dtype=np.float32) >= p, device=device)

        return draw

    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> BlockKeep:
        """The blockwise path's keep masks from a NumPy Generator, converted to ``xp`` on
        ``device``: one 63-bit seed read from ``rng`` now, then block ``b``'s mask from a
        generator seeded with ``(seed, b)`` (NumPy's SeedSequence mixes the pair), so the
        backward draws each block's mask again."""
        seed = int(self._generator(rng, xp).integers(0, 2**63 - 1))

        def draw(block: Any, shape: tuple[int, ...]) -> Any:
            block_rng = np.random.default_rng((seed, int(block)))
            return xp.asarray(block_rng.random(shape, dtype=np.float32) >= p, device=device)

        return draw

    def _generator(self, rng: Any, xp: Any) -> np.random.Generator:
        """``rng``, a fresh Generator where it is None; any other type refused."""
        if rng is None:
            return np.random.default_rng()
        if not isinstance(rng, np.random.Generator):
            raise _spec.rng_type_error(xp.__name__, self.rng, rng)
        return rng


ADAPTER = GenericAdapter()
