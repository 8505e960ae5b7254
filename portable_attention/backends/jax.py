"""JAX: ``jax.nn.dot_product_attention`` as the fused path, dropout from a PRNG key,
which is required (JAX has no global RNG), and the blockwise path as a ``jax.custom_vjp``
over :mod:`portable_attention._blockwise`'s forward and backward, the kernel every
framework runs, with compiled loops (:class:`ScanLoop`): a ``lax.scan`` over query (or
key) blocks and a ``lax.fori_loop`` over the blocks that ``causal``/``window`` leave to
each, so the program holds one block's code whatever L is, and skipped blocks cost
nothing."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from portable_attention import _block_grid, _blockwise, _core, _mods, _spec
from portable_attention._block_loop import BlockLoop, unstacked
from portable_attention._blockwise import Grads
from portable_attention._core import KeepMask
from portable_attention.backends._base import Adapter, Kernel

NAME = "JAX"
RNG = "a JAX PRNG key (`jax.random.key(0)` or `jax.random.PRNGKey(0)`)"


def _scores(q: Any, k: Any) -> Any:
    """``q @ k^T`` as one dot_general: XLA's CPU backend ran ``matmul(q, swapaxes(k))``
    2x slower for one query (the transposed copy), 1.2x at 128 queries."""
    return jnp.einsum("...qd,...kd->...qk", q, k)


def _is_key(rng: Any) -> bool:
    if not isinstance(rng, jax.Array):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng.shape == ()  # one key, not a batch of keys
    return rng.dtype == jnp.uint32 and rng.shape == (2,)  # raw PRNGKey


#: Folded into the caller's key for the keys of the chunked path's blocks after the first.
_BLOCK_STREAM = 0x7A11_B10C


def _keep_mask(rng: Any, p: float) -> Any:
    """Keep mask from ``jax.random.bernoulli``; jit-, vmap- and grad-safe."""
    if rng is None:
        raise _spec.missing_rng_error(NAME, RNG)
    if not _is_key(rng):
        raise _spec.rng_type_error(NAME, RNG, rng)

    draws = 0

    def draw(shape: tuple[int, ...]) -> Any:
        # The chunked path draws once per block: each draw after the first takes its own
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
#: than the chunk-by-chunk draws of ``_keep_mask``).
_BLOCKWISE_STREAM = 0xB10C_3EEB


@dataclass(frozen=True)
class KeyedKeep:
    """The blockwise path's keep masks (a ``_blockwise.BlockKeep``): block ``b``'s is
    ``bernoulli(fold_in(fold_in(key, stream), b))``, ``b`` a Python int or a traced
    integer. The key travels as an array through ``custom_vjp`` and ``lax.scan``."""

    key: Any
    p: float

    def __call__(self, block: Any, shape: tuple[int, ...]) -> Any:
        return _block_mask(self.key, self.p, block, shape)


def _block_mask(key: Any, p: float, block: Any, shape: tuple[int, ...]) -> Any:
    block_key = jax.random.fold_in(jax.random.fold_in(key, _BLOCKWISE_STREAM), block)
    return jax.random.bernoulli(block_key, 1.0 - p, shape)


def _block_keep(rng: Any, p: float) -> KeyedKeep:
    _keep_mask(rng, p)  # the same checks
    return KeyedKeep(rng, p)


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
        width = max(1, max(len(row) for row in partners))
        table = np.zeros((len(partners), width), dtype=np.int32)
        for i, row in enumerate(partners):
            table[i, : len(row)] = row
        counts = np.asarray([len(row) for row in partners], dtype=np.int32)
        row, count = jnp.asarray(table)[index], jnp.asarray(counts)[index]

        # A fixed trip count, the slots past the block's count skipped by lax.cond: a
        # count read from the table would make a while_loop, which reverse mode cannot
        # differentiate (the gradient of a gradient goes through the backward's loops).
        def body(j: Any, state: Any) -> Any:
            return jax.lax.cond(j < count, lambda s: step(s, row[j]), lambda s: s, state)

        return jax.lax.fori_loop(0, width, body, state)

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

    def accumulator(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
        return self.full(shape, dtype, 0.0, like)

    def blocks(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
        return self.full(shape, dtype, 0.0, like)

    def add_block(self, store: Any, key: Any, starts: Any, sizes: Any, axes: Any, add: Any) -> Any:
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


@dataclass(frozen=True)
class _ScoreGrad:
    """A ``score_mod`` closure-converted (``jax.closure_convert``) into ``score(s, b, h,
    q_idx, kv_idx, *consts)``, so the arrays it captures are explicit inputs of the
    ``custom_vjp`` and get their gradients (``_blockwise.ScoreGrad``)."""

    call: _spec.Call
    mods: _mods.Mods
    score: Any
    consts: tuple[Any, ...]

    def modded(self) -> _mods.Mods:
        """The mods whose score_mod applies ``score`` with ``consts``."""
        score, consts = self.score, self.consts

        def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score(s, b, h, q_idx, kv_idx, *consts)

        m = self.mods
        return _mods.Mods(m.q_ids, m.kv_ids, m.q_pos, m.kv_pos, score_mod, m.mask_mod)

    def __call__(self, s: Any, rows: Any, cols: Any) -> Any:
        def modded(s_: Any, *c: Any) -> Any:
            mods = _ScoreGrad(self.call, self.mods, self.score, tuple(c)).modded()
            return _mods.apply_score_mod(self.call, mods, s_, rows, cols)

        s_mod, pull = jax.vjp(modded, s, *self.consts)
        return s_mod, pull


def _keyed(call: _spec.Call, key: Any) -> KeyedKeep | None:
    return None if key is None else KeyedKeep(key, call.dropout)


def _forward(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, mods: Any = None
) -> Any:
    return _blockwise.forward(call, q, k, v, mask, bias, _keyed(call, key), mods=mods)


def _backward(
    call: _spec.Call, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any,
    bias: Any, key: Any, dlse: Any, mods: Any = None, score_grad: Any = None,
    sinks: Any = None,
) -> tuple[Grads, tuple[Any, ...]]:  # fmt: skip
    return _blockwise.backward_and_consts(
        call, dout, q, k, v, out, lse, mask, bias, _keyed(call, key), dlse=dlse, mods=mods,
        score_grad=score_grad, sinks=sinks,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _blockwise_fn(call: _spec.Call) -> Any:
    """The blockwise path of a call as a jitted ``custom_vjp`` of
    ``(q, k, v, mask, bias, key) -> (out, lse)`` (cached: a Call is hashable)."""

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any) -> Any:
        return _forward(call, q, k, v, mask, bias, key)

    def fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any) -> Any:
        out, lse = _forward(call, q, k, v, mask, bias, key)
        return (out, lse), (q, k, v, mask, bias, key, out, lse)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, mask, bias, key, out, lse = res
        dout, dlse = cotangents
        grads, _ = _backward(call, dout, q, k, v, out, lse, mask, bias, key, dlse)
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None

    run.defvjp(fwd, bwd)
    return jax.jit(run)


def _modded_blockwise(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, mods: _mods.Mods
) -> tuple[Any, Any]:
    """The blockwise path of a call with segment ids or mods: a ``custom_vjp`` built for
    this call (the mods are functions: it is traced again each call outside ``jit``), its
    ids and a score_mod's captured arrays passed explicitly."""
    converted: Any = None
    consts: Any = ()
    if mods.score_mod is not None:
        size = _block_grid.block_size(call, _LOOP)
        example_s = jnp.zeros(_mods.user_shape(call, size, size), call.compute_dtype)
        example = _mods.indices(call, (0, size), (0, size))
        converted, consts = jax.closure_convert(mods.score_mod, example_s, *example)
    arrays = (mods.q_ids, mods.kv_ids, mods.q_pos, mods.kv_pos)

    def grad_of(ids: Any, c: Any) -> _ScoreGrad:
        plain = _plain(ids, mods.mask_mod)
        return _ScoreGrad(call, plain, converted, tuple(c))

    def modded(ids: Any, c: Any) -> _mods.Mods:
        if converted is None:
            return _plain(ids, mods.mask_mod)
        return grad_of(ids, c).modded()

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, ids: Any, c: Any) -> Any:
        return _forward(call, q, k, v, mask, bias, key, modded(ids, c))

    def fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, ids: Any, c: Any) -> Any:
        out, lse = _forward(call, q, k, v, mask, bias, key, modded(ids, c))
        return (out, lse), (q, k, v, mask, bias, key, ids, c, out, lse)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, mask, bias, key, ids, c, out, lse = res
        dout, dlse = cotangents
        plain = _plain(ids, mods.mask_mod)
        score_grad = grad_of(ids, c) if converted is not None else None
        grads, dc = _backward(
            call, dout, q, k, v, out, lse, mask, bias, key, dlse, plain, score_grad
        )
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None, None, tuple(dc)

    run.defvjp(fwd, bwd)
    out, lse = run(q, k, v, mask, bias, key, arrays, tuple(consts))
    return out, lse


def _plain(ids: Any, mask_mod: Any) -> _mods.Mods:
    """The mods of segment ids ``(q_ids, kv_ids, q_pos, kv_pos)`` and a ``mask_mod``."""
    q_ids, kv_ids, q_pos, kv_pos = ids
    return _mods.Mods(q_ids, kv_ids, q_pos, kv_pos, None, mask_mod)


@functools.lru_cache(maxsize=64)
def _backward_fn(call: _spec.Call) -> Any:
    """``attend_backward`` of a call, jitted (cached: a Call is hashable)."""

    def backward(
        dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any, bias: Any,
        key: Any, dlse: Any, sinks: Any,
    ) -> Grads:  # fmt: skip
        return _backward(
            call, dout, q, k, v, out, lse, mask, bias, key, dlse, sinks=sinks
        )[0]  # fmt: skip

    return jax.jit(backward)


def _key_of(keep: Any) -> Any:
    """The PRNG key of this adapter's keep masks (None without dropout)."""
    assert keep is None or isinstance(keep, KeyedKeep)
    return None if keep is None else keep.key


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
        return _keep_mask(rng, p)

    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> KeyedKeep:
        return _block_keep(rng, p)

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
            return _modded_blockwise(call, q, k, v, mask, bias, _key_of(keep), mods)
        out, lse = _blockwise_fn(call)(q, k, v, mask, bias, _key_of(keep))
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
        args = (dout, q, k, v, out, lse, mask, bias, _key_of(keep), dlse)
        if mods is None:
            grads: Grads = _backward_fn(call)(*args, sinks)
            return grads
        return _backward(call, *args, mods, sinks=sinks)[0]

    def scores(self, xp: Any) -> Any:
        return _scores

    def block_loop(self, call: _spec.Call) -> BlockLoop:
        return _LOOP

    def caches_type(self, x: Any) -> bool:
        return type(x).__module__ != "numpy"  # JAX's float0 gradients are NumPy arrays

    def traced(self, x: Any) -> bool:
        return isinstance(x, jax.core.Tracer)


ADAPTER = JaxAdapter()
