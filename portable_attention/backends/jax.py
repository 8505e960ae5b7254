"""JAX: ``jax.nn.dot_product_attention`` as the fused path, dropout from a PRNG key,
which is required (JAX has no global RNG), and the blockwise path as a ``jax.custom_vjp``
over :mod:`portable_attention._blockwise`'s forward and backward, the kernel every
framework runs, with compiled loops (:class:`ScanLoop`): a ``lax.scan`` over query (or
key) blocks and a ``lax.fori_loop`` over the blocks that ``causal``/``window`` leave to
each, so the program holds one block's code whatever L is, and skipped blocks cost
nothing."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from portable_attention import _block_grid, _blockwise, _blockwise_backward, _core, _spec
from portable_attention._block_loop import BlockLoop, unstacked
from portable_attention.backends._base import Adapter, Kernel

if TYPE_CHECKING:
    from portable_attention._blockwise import Grads
    from portable_attention._core import KeepMask
    from portable_attention.backends.jax_rng import KeyedKeep

NAME = "JAX"
RNG = "a JAX PRNG key (`jax.random.key(0)` or `jax.random.PRNGKey(0)`)"


def _scores(q: Any, k: Any) -> Any:
    """``q @ k^T`` as one dot_general: XLA's CPU backend ran ``matmul(q, swapaxes(k))``
    2x slower for one query (the transposed copy), 1.2x at 128 queries."""
    return jnp.einsum("...qd,...kd->...qk", q, k)


# ------------------------------------------------------------------------------------------
# The blockwise path: _blockwise's kernel with compiled loops, as a custom_vjp.


class ScanLoop(BlockLoop):
    """The blockwise kernel's loops compiled: the outer one a ``lax.scan`` over the query
    (forward) or key (backward) blocks, the inner one a ``lax.fori_loop`` over a table of
    each block's partners (the slots past its count skipped by ``lax.cond``: blocks that
    ``causal``/``window`` skip cost no block's work), so the program holds one block's code
    whatever L is. Offsets are traced: every operand is padded to whole blocks, slices are
    ``dynamic_slice``, and the carries are typed as varying over every ``shard_map`` axis
    their inputs vary over."""

    static = False
    # XLA fuses the subtractions into the exponential: the folded columns' copies of q and
    # dout cost 41 MiB of temporaries under jit(grad) at [1, 8, 16384, 64] (143 MiB
    # against 102) for no time measured (L=4096: 809-851 ms folded, 804-871 not).
    fold_columns = False

    def budget(self, call: _spec.Call, default: int) -> int:
        # XLA fuses each block's elementwise work, so blocks pay for themselves in steps of
        # the scan, not in passes over memory: unmasked, [1, 8, 2048, 64] float32 took
        # 104 ms forward and 449 ms under jit(grad) with blocks of 512, 119 and 493 ms with
        # blocks of 256; causal, blocks of 256 or less measured fastest.
        return 4 * default if _core.band_keeps_all(call) else default

    def length(self, total: int, size: int, index: Any) -> Any:
        return size

    def pad(self, x: Any, length: int, axis: int, value: float | bool) -> Any:
        extra = length - x.shape[axis]
        if extra == 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[x.ndim + axis] = (0, extra)
        return jnp.pad(x, widths, constant_values=value)

    def outer(self, body: Any, carry: Any, indices: Any, axes: tuple[int, ...]) -> Any:
        carry, stacked = jax.lax.scan(body, carry, jnp.asarray(list(indices), dtype=jnp.int32))
        return carry, tuple(
            unstacked(jnp, x, axis - 1) for x, axis in zip(stacked, axes, strict=True)
        )

    def inner(self, step: Any, state: Any, partners: Any, index: Any) -> Any:
        table, counts = _block_grid.padded(partners)
        row = jnp.asarray(table, dtype=jnp.int32)[index]
        count = jnp.asarray(counts, dtype=jnp.int32)[index]

        # A fixed trip count, the slots past the block's count skipped by lax.cond: a
        # count read from the table would make a while_loop, which reverse mode cannot
        # differentiate (the gradient of a gradient goes through the backward's loops).
        def body(j: Any, state: Any) -> Any:
            return jax.lax.cond(j < count, lambda s: step(s, row[j]), lambda s: s, state)

        return jax.lax.fori_loop(0, len(table[0]), body, state)

    def take(self, x: Any, start: Any, size: Any, axis: int) -> Any:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim + axis)

    def full(self, shape: tuple[int, ...], dtype: Any, value: float, like: Any) -> Any:
        # Under shard_map's check_vma a loop's carry must keep its type, and the steps make
        # it vary as the inputs do; a zero scalar zeros_like each input carries its type
        # and reads none of its data.
        x = jnp.full(shape, value, dtype)
        for a in like:
            x = x + jnp.zeros_like(a, dtype=dtype, shape=())
        return x

    def blocks(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
        return self.full(shape, dtype, 0.0, like)

    accumulator = blocks  # a compiled loop's carry is an array from the start: zeros

    def add_block(self, store: Any, keep: Any, starts: Any, sizes: Any, axes: Any, add: Any) -> Any:
        block = store
        for start, size, axis in zip(starts, sizes, axes, strict=True):
            block = self.take(block, start, size, axis)
        index: list[Any] = [jnp.int32(0)] * store.ndim
        for start, axis in zip(starts, axes, strict=True):
            index[store.ndim + axis] = jnp.asarray(start, dtype=jnp.int32)
        return jax.lax.dynamic_update_slice(store, add(block), index)

    def assembled(self, store: Any, keys: Any, axes: Any, zeros: Any) -> Any:
        return store


_LOOP = ScanLoop(jnp)


@functools.lru_cache(maxsize=64)
def _blockwise_fn(call: _spec.Call) -> Any:
    """The blockwise path of a call as a jitted ``custom_vjp`` of
    ``(q, k, v, mask, bias, keep) -> (out, lse)`` (cached: a Call is hashable)."""

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any) -> Any:
        return _blockwise.forward(call, q, k, v, mask, bias, keep)

    def fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any) -> Any:
        out, lse = _blockwise.forward(call, q, k, v, mask, bias, keep)
        return (out, lse), (q, k, v, mask, bias, keep, out, lse)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, mask, bias, keep, out, lse = res
        dout, dlse = cotangents
        grads = _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse
        )
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None

    run.defvjp(fwd, bwd)
    return jax.jit(run)


@functools.lru_cache(maxsize=64)
def _backward_fn(call: _spec.Call) -> Any:
    """``attend_backward`` of a call, jitted (cached: a Call is hashable)."""

    def backward(
        dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any, bias: Any,
        keep: Any, dlse: Any, sinks: Any,
    ) -> Grads:  # fmt: skip
        return _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, sinks=sinks
        )  # fmt: skip

    return jax.jit(backward)


class JaxAdapter(Adapter):
    """JAX: jax.nn's kernel, query blocks on CPU, an einsum for the scores, PRNG keys."""

    name = NAME
    rng = RNG
    autodiff = True

    @property
    def fused(self) -> Kernel:
        from portable_attention.backends.jax_kernels import FUSED

        return FUSED

    @property
    def tuned(self) -> Kernel:
        from portable_attention.backends.jax_kernels import TUNED

        return TUNED

    def keep_mask(self, rng: Any, p: float, xp: Any, device: Any) -> KeepMask:
        from portable_attention.backends.jax_rng import keep_mask

        return keep_mask(self.name, self.rng, rng, p)

    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> KeyedKeep:
        from portable_attention.backends.jax_rng import block_keep

        return block_keep(self.name, self.rng, rng, p)

    def blockwise(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        mods: Any = None,
    ) -> tuple[Any, Any]:
        if mods is not None:
            from portable_attention.backends.jax_mods import modded_blockwise

            return modded_blockwise(call, q, k, v, mask, bias, keep, mods, _LOOP)
        out, lse = _blockwise_fn(call)(q, k, v, mask, bias, keep)
        return out, lse

    def blockwise_backward(
        self,
        call: _spec.Call,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        dlse: Any,
        mods: Any = None,
        sinks: Any = None,
    ) -> Grads:
        if mods is None:
            grads: Grads = _backward_fn(call)(
                dout, q, k, v, out, lse, mask, bias, keep, dlse, sinks
            )
            return grads
        return _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, mods=mods, sinks=sinks
        )

    def scores(self, xp: Any) -> Any:
        return _scores

    def block_loop(self, call: _spec.Call) -> BlockLoop:
        return _LOOP

    def placement(self, device: Any) -> Any:
        # A sharded array reports its sharding as its device, and compares by its set of
        # devices: q sharded by batch with k and v replicated share them, and JAX computes
        # on them as they are.
        return getattr(device, "device_set", device)

    def caches_type(self, x: Any) -> bool:
        return type(x).__module__ != "numpy"  # JAX's float0 gradients are NumPy arrays

    static_hint = " (under jax.jit: a static argument, `static_argnames`)"

    def traced(self, x: Any) -> bool:
        return isinstance(x, jax.core.Tracer)


ADAPTER = JaxAdapter()
