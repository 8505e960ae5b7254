"""JAX's dropout: keep masks from a PRNG key (``jax.random.bernoulli``), jit-, vmap- and
grad-safe; the blockwise path's masks are one key per block folded from the caller's, so
the backward draws the forward's masks again. Imported when a call first asks for
dropout."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from portable_attention import _spec


def _is_key(rng: Any) -> bool:
    if not isinstance(rng, jax.Array):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng.shape == ()  # one key, not a batch of keys
    return rng.dtype == jnp.uint32 and rng.shape == (2,)  # raw PRNGKey


#: Folded into the caller's key for the keys of a drawer's draws after the first.
_BLOCK_STREAM = 0x7A11_B10C


def keep_mask(framework: str, rng_text: str, rng: Any, p: float) -> Any:
    """Keep mask from ``jax.random.bernoulli``; jit-, vmap- and grad-safe."""
    if rng is None:
        raise _spec.missing_rng_error(framework, rng_text)
    if not _is_key(rng):
        raise _spec.rng_type_error(framework, rng_text, rng)

    draws = 0

    def draw(shape: tuple[int, ...]) -> Any:
        # A kernel that draws once per block: each draw after the first takes its own
        # key, or every block would get the same keep pattern. The keys descend from one
        # folded with _BLOCK_STREAM, not from rng's fold_in(rng, 1), (rng, 2), ... that a
        # caller may use for other draws.
        nonlocal draws
        key = (
            rng if draws == 0 else jax.random.fold_in(jax.random.fold_in(rng, _BLOCK_STREAM), draws)
        )
        draws += 1
        return jax.random.bernoulli(key, 1.0 - p, shape)

    return draw


#: Folded into the caller's key for the blockwise path's per-block keys (another stream
#: than the chunk-by-chunk draws of :func:`keep_mask`).
_BLOCKWISE_STREAM = 0xB10C_3EEB


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key"], meta_fields=["p"])
@dataclass(frozen=True)
class KeyedKeep:
    """The blockwise path's keep masks (a ``_blockwise.BlockKeep``): block ``b``'s is
    ``bernoulli(fold_in(fold_in(key, stream), b))``, ``b`` a Python int or a traced
    integer. A pytree (the key its leaf, ``p`` static), so it travels through ``jit``,
    ``custom_vjp`` and ``lax.scan`` as an argument."""

    key: Any
    p: float

    def __call__(self, block: Any, shape: tuple[int, ...]) -> Any:
        return _block_mask(self.key, self.p, block, shape)


def _block_mask(key: Any, p: float, block: Any, shape: tuple[int, ...]) -> Any:
    block_key = jax.random.fold_in(jax.random.fold_in(key, _BLOCKWISE_STREAM), block)
    return jax.random.bernoulli(block_key, 1.0 - p, shape)


def block_keep(framework: str, rng_text: str, rng: Any, p: float) -> KeyedKeep:
    keep_mask(framework, rng_text, rng, p)  # the same checks
    return KeyedKeep(rng, p)
