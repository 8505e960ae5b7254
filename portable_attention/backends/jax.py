"""JAX: dropout from a PRNG key, which is required (JAX has no global RNG)."""

from __future__ import annotations

from typing import Any

import jax

from portable_attention import _validate

NAME = "JAX"
RNG = "a JAX PRNG key (`jax.random.key(0)` or `jax.random.PRNGKey(0)`)"


def _is_key(rng: Any) -> bool:
    if not isinstance(rng, jax.Array):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return True
    return rng.dtype == jax.numpy.uint32 and rng.shape == (2,)  # raw PRNGKey


def keep_mask(rng: Any, p: float, xp: Any, device: Any) -> Any:
    """Keep mask from ``jax.random.bernoulli``; jit-, vmap- and grad-safe."""
    if rng is None:
        raise _validate.missing_rng_error(NAME, RNG)
    if not _is_key(rng):
        raise _validate.rng_type_error(NAME, RNG, rng)

    def draw(shape: tuple[int, ...]) -> Any:
        return jax.random.bernoulli(rng, 1.0 - p, shape)

    return draw
