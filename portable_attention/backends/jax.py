"""JAX: ``jax.nn.dot_product_attention`` as the fused path, dropout from a PRNG key,
which is required (JAX has no global RNG), and the blockwise path as a ``jax.custom_vjp``
over :mod:`portable_attention._blockwise`'s forward and backward, the kernel every
framework runs, with compiled loops (:class:`ScanLoop`): a ``lax.scan`` over query (or
key) blocks and a ``lax.fori_loop`` over the blocks that ``causal``/``window`` leave to
each, so the program holds one block's code whatever L is, and skipped blocks cost
nothing."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from portable_attention import _block_grid, _blockwise, _core, _mods, _spec
from portable_attention._block_loop import BlockLoop
from portable_attention._blockwise import Grads
from portable_attention._core import KeepMask
from portable_attention.backends._base import Adapter, Kernel

NAME = "JAX"
RNG = "a JAX PRNG key (`jax.random.key(0)` or `jax.random.PRNGKey(0)`)"
#: From this many query rows on, the tuned kernel splits the queries into blocks.
LONG_QUERIES = 512
#: Query rows per block of the tuned kernel (256 measured best of 128/256/512 at L=2048);
#: it runs from two blocks on.
_BLOCK_ROWS = LONG_QUERIES // 2


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


def _platform(call: _spec.Call) -> str:
    """The platform the arrays live on (the default backend for traced arrays)."""
    device = call.device
    platform = getattr(device, "platform", None)
    return platform if isinstance(platform, str) else jax.default_backend()


def _fused_reason(call: _spec.Call) -> str | None:
    """Why ``jax.nn.dot_product_attention`` cannot give the contract's answer (None: it can)."""
    modded = _mods.unsupported(call, "jax.nn.dot_product_attention")
    if modded is not None:
        return modded
    if call.return_weights:
        return "return_weights needs the probabilities, which jax.nn does not return"
    if call.return_lse:
        return "return_lse: the portable path returns the exact logsumexp"
    if call.softcap is not None:
        return "jax.nn.dot_product_attention has no softcap"
    if call.dropout > 0:
        return "jax.nn.dot_product_attention has no dropout"
    if call.q_shape[-1] != call.v_shape[-1]:
        return "jax.nn.dot_product_attention needs Dk == Dv"
    if call.dtype == jnp.float64:
        return (
            "jax.nn.dot_product_attention loses float64 precision (measured errors of "
            "2e-7 against the float64 portable path)"
        )
    if call.dtype != call.compute_dtype and _platform(call) != "gpu":
        return (
            "off GPU, jax.nn.dot_product_attention rounds the softmax weights to bfloat16 "
            "before multiplying V (errors of 2.8e-2 measured on CPU, against 1.6e-2 on the "
            "portable path), and float16 fails there (XLA's CPU dot has no F16 x F16 -> F32)"
        )
    return None


def _portable_preferred(call: _spec.Call) -> str | None:
    """Why ``auto`` takes the portable path although jax.nn could run (None: it does not)."""
    if _platform(call) == "cpu":
        return (
            "on CPU, XLA's lowering of jax.nn.dot_product_attention measured 1.7-3x slower "
            "under jit than the portable path (python -m portable_attention bench)"
        )
    return None


def _cudnn_qualifies(
    call: _spec.Call, allowed: Any, bias: Any, window: tuple[int, int] | None
) -> bool:
    """cuDNN's fused kernel: half precision on an NVIDIA GPU, head size a multiple of 8 up
    to 128, no mask or bias to pass, keys and queries present, and a window only with
    causal (cuDNN's sliding window is a left window; jax.nn refuses a right one)."""
    d = call.q_shape[-1]
    half = call.compute_dtype != call.dtype
    return (
        _platform(call) == "gpu"
        and half
        and d % 8 == 0
        and d <= 128
        and allowed is None
        and bias is None
        and min(call.q_shape[-2], call.k_shape[-2]) > 0
        and (window is None or call.causal is not None)
    )


def _local_window(call: _spec.Call, mask: Any, bias: Any) -> tuple[int, int] | None:
    """``window`` as jax.nn's ``local_window_size`` where that alone is exact (else None:
    the window goes into the boolean mask).

    jax.nn's window, like its ``is_causal``, is upper-left aligned: ours agrees when
    ``Lq == Lk`` or ``causal="upper_left"``. With ``Lq <= Lk`` every query keeps its
    aligned key, so no row is empty (jax.nn would give it mean(V)); with no mask or bias
    no other mask needs the repair. Unbounded sides, and sides of ``Lq + Lk`` or more
    (jax.nn's window arithmetic overflowed from ``2**31 - 1``), become ``Lq + Lk``.
    """
    if call.window is None or mask is not None or bias is not None:
        return None
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    if _core.band_keeps_all(call) or not (lq == lk or (call.align == "upper_left" and lq <= lk)):
        return None
    left, right = _core.window_sides(call)
    wide = lq + lk
    return (wide if left is None else min(left, wide), wide if right is None else min(right, wide))


def _to_btnh(x: Any, batch: int) -> Any:
    """``[..., H, L, D] -> [B, L, H, D]`` (a reshape and an axis swap XLA fuses away)."""
    h, length, d = x.shape[-3:] if x.ndim >= 3 else (1, *x.shape)
    return jnp.swapaxes(jnp.reshape(x, (batch, h, length, d)), 1, 2)


def _scores_operand(x: Any, lead: tuple[int, ...], batch: int) -> Any:
    """A mask/bias broadcastable to ``[..., H, Lq, Lk]`` as 4-D ``[B|1, H|1, Lq|1, Lk|1]``."""
    tail = x.shape[-3:] if x.ndim >= 3 else (1,) * (3 - x.ndim) + tuple(x.shape)
    x = jnp.reshape(x, (1,) * max(len(lead) + 3 - x.ndim, 0) + tuple(x.shape))
    if math.prod(x.shape[: len(lead)]) == 1:
        return jnp.reshape(x, (1, *tail))
    return jnp.reshape(jnp.broadcast_to(x, (*lead, *tail)), (batch, *tail))


def _run_fused(call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any) -> Any:
    """``out`` from jax.nn; rows with no key give 0 (jax.nn's mean(V) is replaced)."""
    lead = call.q_shape[:-3]
    batch = math.prod(lead)
    window = _local_window(call, mask, bias)
    if window is not None:
        allowed, is_causal = None, call.causal is not None
    else:
        allowed, is_causal = _core.fused_mask(call, mask, bias)
    allowed4 = None if allowed is None else _scores_operand(allowed, lead, batch)
    bias4 = None if bias is None else _scores_operand(bias, lead, batch)
    if bias4 is not None:
        # -inf bias entries join the mask: a row of -inf scores is NaN in jax.nn's softmax,
        # and its gradient stays NaN through the repair below (0 * NaN).
        finite = bias4 > -jnp.inf
        allowed4 = finite if allowed4 is None else (allowed4 & finite)
        bias4 = jnp.where(finite, bias4, 0)
    out = jax.nn.dot_product_attention(
        _to_btnh(q, batch),
        _to_btnh(k, batch),
        _to_btnh(v, batch),
        bias=bias4,
        mask=allowed4,
        scale=call.scale,
        is_causal=is_causal,
        local_window_size=window,
        implementation="cudnn" if _cudnn_qualifies(call, allowed, bias, window) else None,
    )
    out = jnp.swapaxes(out, 1, 2)  # [B, H, Lq, Dv]
    if allowed4 is not None:
        out = jnp.where(jnp.any(allowed4, axis=-1, keepdims=True), out, 0)
    return jnp.reshape(out, (*call.q_shape[:-1], call.v_shape[-1]))


def _tuned_reason(call: _spec.Call) -> str | None:
    """Why the query-blocked kernel does not take ``call`` (None: it does)."""
    if call.modded:
        return "segment ids and score/mask mods run on the blockwise or dense path"
    if _platform(call) != "cpu":
        return "query blocking in a lax.map is measured faster on CPU only"
    if call.dropout > 0:
        return "dropout draws one keep mask for the whole score matrix"
    if call.q_shape[-2] < LONG_QUERIES or call.k_shape[-2] == 0:
        return f"under {LONG_QUERIES} queries (or no keys) blocks do not pay"
    if _core.dense_bytes(call) > _core.SAVED_LIMIT_BYTES:
        return (
            f"over {_core.SAVED_LIMIT_BYTES >> 20} MiB of dense scores, whose probabilities "
            "autodiff would save for backward"
        )
    return None


def _rows(x: Any, start: Any, size: int, lq: int) -> Any:
    """Rows ``start:start+size`` of a scores operand whose query axis is ``lq`` (or 1)."""
    if x is None or x.ndim < 2 or x.shape[-2] != lq:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 2)


@functools.lru_cache(maxsize=64)
def _tuned_kernel(call: _spec.Call) -> Any:
    """The jitted blocked kernel of a call (a Call is hashable): traced afresh, the
    ``lax.map`` closure was compiled again on every eager call (540 ms against 7 ms)."""
    return jax.jit(functools.partial(_blocked, call))


def _run_tuned(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any
) -> tuple[Any, Any, Any]:
    """``_core.dense`` on blocks of ``_BLOCK_ROWS`` queries in a ``lax.map`` (then the
    remaining rows): same results, scores of one block at a time. jit/vmap/grad-safe;
    compiled once per call signature when called eagerly. No dropout reaches it."""
    return _tuned_kernel(call)(q, k, v, mask, bias)


def _blocked(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any
) -> tuple[Any, Any, Any]:
    """:func:`_run_tuned`'s computation."""
    lq, rows = call.q_shape[-2], _BLOCK_ROWS
    # causal/window become one mask up front: a block's offset is traced inside the map.
    allowed = _core.allow_mask(call, mask)
    blocks = lq // rows

    def dense_rows(qb: Any, start: Any, n: int, guarded: bool | None) -> tuple[Any, Any, Any]:
        return _core.dense(
            call,
            qb,
            k,
            v,
            _rows(allowed, start, n, lq),
            _rows(bias, start, n, lq),
            scores=_scores,
            guarded=guarded,
            band=False,
        )

    def one(i: Any) -> tuple[Any, Any, Any]:
        start = i * rows
        qb = jax.lax.dynamic_slice_in_dim(q, start, rows, axis=q.ndim - 2)
        # The guarded softmax measured faster inside the map on XLA's CPU backend,
        # [4, 8, 512, 64]: 32 ms vs 40 ms without the guards (jax 0.10).
        return dense_rows(qb, start, rows, True)

    mapped = jax.lax.map(one, jnp.arange(blocks))
    # [blocks, ..., rows, X] -> [..., blocks * rows, X]; lse [blocks, ..., rows] likewise.
    out, weights, lse = (
        None if x is None else _unblock(x, axis)
        for x, axis in zip(mapped, (-3, -3, -2), strict=True)
    )
    if lq % rows:
        done = blocks * rows
        guarded = None if allowed is None and bias is None else True
        tail = dense_rows(q[..., done:, :], done, lq - done, guarded)
        out, weights, lse = (
            None if x is None else jnp.concatenate([x, t], axis=axis + 1)
            for x, t, axis in zip((out, weights, lse), tail, (-3, -3, -2), strict=True)
        )
    return out, weights, lse


def _unblock(x: Any, axis: int) -> Any:
    """Move the leading block axis to ``axis`` and merge it with the rows after it."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape
    return jnp.reshape(
        x, (*shape[: x.ndim + axis], shape[axis] * shape[axis + 1], *shape[x.ndim + axis + 2 :])
    )


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
        return carry, tuple(_unblock(x, axis - 1) for x, axis in zip(stacked, axes, strict=True))

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
    return _blockwise.forward(
        call, q, k, v, mask, bias, _keyed(call, key), scores=_scores, mods=mods, loop=_LOOP
    )


def _backward(
    call: _spec.Call, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any,
    bias: Any, key: Any, dlse: Any, mods: Any = None, score_grad: Any = None,
    sinks: Any = None,
) -> tuple[Grads, tuple[Any, ...]]:  # fmt: skip
    return _blockwise.backward_and_consts(
        call, dout, q, k, v, out, lse, mask, bias, _keyed(call, key), dlse=dlse,
        scores=_scores, mods=mods, loop=_LOOP, score_grad=score_grad, sinks=sinks,
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


class DotProductAttention(Kernel):
    """``jax.nn.dot_product_attention`` (cuDNN on GPU where it qualifies)."""

    path = "fused:jax"
    why = "jax.nn.dot_product_attention covers every option of this call"

    def reason(self, call: _spec.Call) -> str | None:
        return _fused_reason(call)

    def auto_reason(self, call: _spec.Call) -> str | None:
        return _portable_preferred(call)

    def run(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        mods: Any = None,
    ) -> tuple[Any, Any, Any]:
        return _run_fused(call, q, k, v, mask, bias), None, None


class QueryBlocks(Kernel):
    """The portable dense path on query blocks under ``lax.map`` (JAX on CPU)."""

    path = "tuned:jax"
    why = (
        f"the portable dense path runs on blocks of {_BLOCK_ROWS} queries in a lax.map, so "
        "each block's scores stay in cache (on CPU, measured about 2x the unblocked dense "
        "path at L=2048)"
    )

    def reason(self, call: _spec.Call) -> str | None:
        return _tuned_reason(call)

    def run(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        mods: Any = None,
    ) -> tuple[Any, Any, Any]:
        return _run_tuned(call, q, k, v, mask, bias, keep)


class JaxAdapter(Adapter):
    """JAX: jax.nn's kernel, query blocks on CPU, an einsum for the scores, PRNG keys."""

    name = NAME
    rng = RNG
    fused = DotProductAttention()
    tuned = QueryBlocks()
    autodiff = True

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
