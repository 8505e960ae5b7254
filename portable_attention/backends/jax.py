"""JAX: ``jax.nn.dot_product_attention`` as the fused path, dropout from a PRNG key,
which is required (JAX has no global RNG), and the blockwise path as a ``jax.custom_vjp``
whose forward and backward each loop with one ``lax.scan`` over the static list of
(query block, key block) pairs that ``causal``/``window`` leave: the program holds one
block's code whatever L is, and skipped blocks cost nothing."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from portable_attention import _blockwise, _core, _mods, _spec
from portable_attention._blockwise import Grads
from portable_attention._core import KeepMask
from portable_attention.backends._base import Adapter, Kernel

NAME = "JAX"
RNG = "a JAX PRNG key (`jax.random.key(0)` or `jax.random.PRNGKey(0)`)"
#: From this many query rows on, the native kernel splits the queries into blocks.
LONG_QUERIES = 512
#: Query rows per block of the native kernel (256 measured best of 128/256/512 at L=2048);
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
        allowed, is_causal = _core.kernel_mask(call, mask, bias)
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


def _native_reason(call: _spec.Call) -> str | None:
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
def _native_kernel(call: _spec.Call) -> Any:
    """The jitted blocked kernel of a call (a Call is hashable): traced afresh, the
    ``lax.map`` closure was compiled again on every eager call (540 ms against 7 ms)."""
    return jax.jit(functools.partial(_blocked, call))


def _run_native(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any
) -> tuple[Any, Any, Any]:
    """``_core.dense`` on blocks of ``_BLOCK_ROWS`` queries in a ``lax.map`` (then the
    remaining rows): same results, scores of one block at a time. jit/vmap/grad-safe;
    compiled once per call signature when called eagerly. No dropout reaches it."""
    return _native_kernel(call)(q, k, v, mask, bias)


def _blocked(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any
) -> tuple[Any, Any, Any]:
    """:func:`run_native`'s computation."""
    lq, rows = call.q_shape[-2], _BLOCK_ROWS
    # causal/window become one mask up front: a block's offset is traced inside the map.
    allowed = _core.allowed(call, mask)
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
# The blockwise path: one lax.scan over the static list of blocks, forward and backward.


def _pad_rows(x: Any, length: int, axis: int, value: float | bool) -> Any:
    """``x`` padded with ``value`` to ``length`` along ``axis`` (counted from the end)."""
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[x.ndim + axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _carry(shape: tuple[int, ...], dtype: Any, value: float, *like: Any) -> Any:
    """A scan carry of ``value``, typed as varying over every ``shard_map`` axis that one
    of ``like`` varies over: under ``check_vma`` a scan's carry must keep its type, and
    the steps make it vary as the inputs do. (A zero scalar ``zeros_like`` each input
    carries its type and reads none of its data.)"""
    x = jnp.full(shape, value, dtype)
    for a in like:
        if a is not None:
            x = x + jnp.zeros_like(a, dtype=dtype, shape=())
    return x


def _slice(x: Any, start: Any, size: int, axis: int) -> Any:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim + axis)


def _add_at(x: Any, update: Any, start: Any, axis: int) -> Any:
    """``x`` with ``update`` added to its rows ``start:start+len`` along ``axis``."""
    size = update.shape[axis]
    return jax.lax.dynamic_update_slice_in_dim(
        x, _slice(x, start, size, axis) + update, start, axis=x.ndim + axis
    )


@dataclass(frozen=True)
class _Grid:
    """The padded block grid of a call: ``size``-row blocks, ``nq x nk`` of them."""

    call: _spec.Call
    size: int

    @property
    def lq(self) -> int:
        return self.call.q_shape[-2]

    @property
    def lk(self) -> int:
        return self.call.k_shape[-2]

    @property
    def nq(self) -> int:
        return _blockwise.grid(self.call, self.size)[0]

    @property
    def nk(self) -> int:
        return _blockwise.grid(self.call, self.size)[1]

    def pairs(self, *, by_keys: bool) -> Any:
        """The blocks to compute as an int32 ``[n, 2]`` array of ``(qi, ki)``."""
        todo = _blockwise.pairs(self.call, self.size)
        if by_keys:
            todo = sorted(todo, key=lambda pair: (pair[1], pair[0]))
        return np.asarray(todo, dtype=np.int32).reshape(len(todo), 2)


def _padded_operands(g: _Grid, q: Any, k: Any, v: Any, mask: Any, bias: Any) -> Any:
    """``_core.operands`` padded to whole blocks: padded keys are masked below, padded
    query rows dropped at the end. A mask/bias axis of length 1 is left to broadcast."""
    ops = _core.operands(g.call, q, k, v, mask, bias, q_factor=_blockwise.q_factor(g.call))
    lqp, lkp = g.nq * g.size, g.nk * g.size

    def scores_operand(x: Any, value: float | bool) -> Any:
        if x is None:
            return None
        if x.shape[-2] != 1:
            x = _pad_rows(x, lqp, -2, value)
        if x.shape[-1] != 1:
            x = _pad_rows(x, lkp, -1, value)
        return x

    return _core.Operands(
        q=_pad_rows(ops.q, lqp, -2, 0.0),
        k=_pad_rows(ops.k, lkp, -2, 0.0),
        v=_pad_rows(ops.v, lkp, -2, 0.0),
        mask=scores_operand(ops.mask, False),
        bias=scores_operand(ops.bias, 0.0),
    )


def _operand_block(x: Any, r0: Any, c0: Any, size: int) -> Any:
    """The block at ``(r0, c0)`` of a padded mask/bias (axes of length 1 kept)."""
    if x is None:
        return None
    if x.shape[-2] != 1:
        x = _slice(x, r0, size, -2)
    if x.shape[-1] != 1:
        x = _slice(x, c0, size, -1)
    return x


@dataclass(frozen=True)
class _ScanMods:
    """A call's segment ids and mods as the scans take them: the ids (and positions)
    padded to whole blocks, and the ``score_mod`` closure-converted (``jax.closure_convert``)
    into ``score(s, b, h, q_idx, kv_idx, *consts)``, so that the arrays it captures are
    explicit inputs of the ``custom_vjp`` and get their gradients."""

    mods: _mods.Mods
    score: Any = None

    def with_consts(self, consts: Any) -> _mods.Mods:
        """The mods whose score_mod applies ``score`` with ``consts``."""
        if self.score is None:
            return self.mods
        score = self.score

        def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score(s, b, h, q_idx, kv_idx, *consts)

        m = self.mods
        return _mods.Mods(m.q_ids, m.kv_ids, m.q_pos, m.kv_pos, score_mod, m.mask_mod)


def _slice_ids(x: Any, span: tuple[Any, int]) -> Any:
    return _slice(x, span[0], span[1], -1)


def _block_scores(
    g: _Grid,
    ops: Any,
    qi: Any,
    ki: Any,
    mods: _mods.Mods | None = None,
    score_fn: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """``(s, tanh or None, k block, v block)`` of block ``(qi, ki)``: the masked scores
    (``causal``/``window`` and padded keys from the block's traced offsets; segment ids
    and ``mask_mod`` from ``mods``). ``score_fn(s, r0, c0)`` applies a score_mod (the
    backward passes one that records its vjp)."""
    call, size = g.call, g.size
    r0, c0 = qi * size, ki * size
    qb = _slice(ops.q, r0, size, -2)
    kb = _slice(ops.k, c0, size, -2)
    vb = _slice(ops.v, c0, size, -2)
    s = _scores(qb, kb)
    t = None
    if call.softcap is not None:  # q carries scale / softcap
        t = jnp.tanh(s)
        s = call.softcap * t
    if ops.bias is not None:
        s = s + _operand_block(ops.bias, r0, c0, size)
    if score_fn is not None:
        s = score_fn(s, r0, c0)
    allow = _operand_block(ops.mask, r0, c0, size)
    if mods is not None:
        spans = ((r0, size), (c0, size))
        extra = _mods.block_mask(call, mods, *spans, tuple(s.shape), slice_ids=_slice_ids)
        if extra is not None:
            allow = extra if allow is None else allow & extra
    rows = r0 + jnp.arange(size)[:, None]
    cols = c0 + jnp.arange(size)[None, :]
    band = None
    if not _core.band_keeps_all(call):
        left, right = _core.window_sides(call)
        offset = g.lk - g.lq if call.align == "lower_right" else 0
        distance = cols - (rows + offset)
        if left is not None:
            band = distance >= -min(left, g.lq + g.lk)
        if right is not None:
            upper = distance <= min(right, g.lq + g.lk)
            band = upper if band is None else band & upper
    if g.lk % size:
        real = cols < g.lk
        band = real if band is None else band & real
    if band is not None:
        allow = band if allow is None else allow & band
    if allow is not None:
        s = jnp.where(allow, s, -jnp.inf)
    return s, t, kb, vb


def _score_fn(g: _Grid, mods: _mods.Mods | None) -> Any:
    """``score_fn(s, r0, c0)`` of :func:`_block_scores` for ``mods``' score_mod, or None."""
    if mods is None or mods.score_mod is None:
        return None

    def score_fn(s: Any, r0: Any, c0: Any) -> Any:
        return _mods.apply_score_mod(g.call, mods, s, (r0, g.size), (c0, g.size))

    return score_fn


def _padded_mods(g: _Grid, mods: _mods.Mods | None) -> _mods.Mods | None:
    """``mods`` with ids and positions padded to whole blocks (padded keys are masked,
    padded rows dropped: the padding's value does not matter)."""
    if mods is None or mods.q_ids is None:
        return mods
    lqp, lkp = g.nq * g.size, g.nk * g.size

    def pad(x: Any, length: int) -> Any:
        return None if x is None else _pad_rows(x, length, -1, 0)

    return _mods.Mods(
        pad(mods.q_ids, lqp),
        pad(mods.kv_ids, lkp),
        pad(mods.q_pos, lqp),
        pad(mods.kv_pos, lkp),
        mods.score_mod,
        mods.mask_mod,
    )


def _scan_forward(
    g: _Grid,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    key: Any,
    mods: _mods.Mods | None = None,
) -> tuple[Any, Any]:
    """``(out, lse)`` of the blockwise forward: one scan over the blocks, the running max,
    sum and output of every query row in the carry."""
    call = g.call
    if g.lq == 0 or g.lk == 0:
        out, _, lse = _core._empty_keys(call, q, k, v)
        return out, lse
    ops = _padded_operands(g, q, k, v, mask, bias)
    mods = _padded_mods(g, mods)
    score_fn = _score_fn(g, mods)
    ct = call.compute_dtype
    lead = ops.q.shape[:-1]
    inputs = (ops.q, ops.k, ops.v, ops.mask, ops.bias)
    init = (
        _carry((*lead, call.v_shape[-1]), ct, 0.0, *inputs),
        _carry((*lead, 1), ct, -jnp.inf, *inputs),
        _carry((*lead, 1), ct, 0.0, *inputs),
    )

    def step(carry: Any, pair: Any) -> Any:
        acc, m, total = carry
        qi, ki = pair[0], pair[1]
        r0 = qi * g.size
        s, _, _, vb = _block_scores(g, ops, qi, ki, mods, score_fn)
        m_old = _slice(m, r0, g.size, -2)
        m_new = jnp.maximum(m_old, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        e = jnp.exp(s - m_safe)
        rescale = jnp.exp(m_old - m_safe)
        t_old = _slice(total, r0, g.size, -2)
        t_new = rescale * t_old + jnp.sum(e, axis=-1, keepdims=True)
        if key is not None:
            kept = _block_mask(key, call.dropout, _blockwise.block_number(qi, ki, g.nk), e.shape)
            e = _core.apply_keep(jnp, e, kept, call.dropout)
        a_new = rescale * _slice(acc, r0, g.size, -2) + jnp.einsum("...qk,...kd->...qd", e, vb)
        update = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=r0)
        return (
            update(acc, a_new, axis=acc.ndim - 2),
            update(m, m_new, axis=m.ndim - 2),
            update(total, t_new, axis=total.ndim - 2),
        ), None

    (acc, m, total), _ = jax.lax.scan(step, init, g.pairs(by_keys=False))
    acc, m, total = acc[..., : g.lq, :], m[..., : g.lq, :], total[..., : g.lq, :]
    total_safe, lse = _core.finish_rows(jnp, total, jnp.where(jnp.isfinite(m), m, 0.0))
    return _core._finish(call, acc / total_safe, lse[..., 0])


def _scan_backward(
    g: _Grid,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    mask: Any,
    bias: Any,
    key: Any,
    dlse: Any,
    scan: _ScanMods | None = None,
    consts: tuple[Any, ...] = (),
) -> tuple[Grads, tuple[Any, ...]]:
    """The blockwise backward: one scan over the blocks (key block by key block), dq, dk,
    dv (and dbias, and the gradients of a score_mod's ``consts``) in the carry. Returns
    ``(grads, dconsts)``."""
    call = g.call
    if g.lq == 0 or g.lk == 0:
        dbias0 = None if bias is None else jnp.zeros_like(bias)
        zeros = tuple(jnp.zeros_like(c) for c in consts)
        return Grads(jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), dbias0), zeros
    ops = _padded_operands(g, q, k, v, mask, bias)
    mods = _padded_mods(g, scan.mods) if scan is not None else None
    converted = scan.score if scan is not None else None
    lqp = g.nq * g.size
    dv_size = call.v_shape[-1]
    do = _pad_rows(_blockwise.grouped(call, dout, last=dv_size), lqp, -2, 0.0)
    delta = jnp.sum(do * _pad_rows(_blockwise.grouped(call, out, last=dv_size), lqp, -2, 0.0), -1)
    if dlse is not None:
        delta = delta - _pad_rows(_blockwise.grouped(call, dlse, last=None), lqp, -1, 0.0)
    lse_g = _blockwise.grouped(call, lse, last=None)
    lse_g = _pad_rows(jnp.where(lse_g == -jnp.inf, jnp.inf, lse_g), lqp, -1, jnp.inf)
    ct = call.compute_dtype
    inputs = (ops.q, ops.k, ops.v, ops.mask, ops.bias, do, delta, lse_g)
    init = [_carry(x.shape, ct, 0.0, *inputs) for x in (ops.q, ops.k, ops.v)]
    if ops.bias is not None:
        init.append(_carry(ops.bias.shape, ct, 0.0, *inputs))
    first_const = len(init)
    init.extend(_carry(c.shape, c.dtype, 0.0, *inputs, c) for c in consts)
    grouped = call.grouped

    def kv_grad(x: Any, y: Any) -> Any:
        """``x^T @ y`` summed over the query heads of each K/V head (``[..., Hk, 1, k, d]``)."""
        if not grouped:
            return jnp.einsum("...qk,...qd->...kd", x, y)
        return jnp.einsum("...gqk,...gqd->...kd", x, y)[..., None, :, :]

    def step(carry: Any, pair: Any) -> Any:
        qi, ki = pair[0], pair[1]
        r0, c0 = qi * g.size, ki * g.size
        pullback: list[Any] = []
        score_fn = None
        if converted is not None:

            def score_fn(s_pre: Any, r0: Any, c0: Any) -> Any:
                def modded(s_: Any, *c: Any) -> Any:
                    base = mods if mods is not None else _mods.Mods()
                    fn = _score_fn(g, _ScanMods(base, converted).with_consts(c))
                    return fn(s_, r0, c0)

                s_mod, pull = jax.vjp(modded, s_pre, *consts)
                pullback.append(pull)
                return s_mod

        s, t, kb, vb = _block_scores(g, ops, qi, ki, mods, score_fn)
        qb = _slice(ops.q, r0, g.size, -2)
        dob = _slice(do, r0, g.size, -2)
        p = jnp.exp(s - _slice(lse_g, r0, g.size, -1)[..., None])
        dp = jnp.einsum("...qd,...kd->...qk", dob, vb)
        p_used = p
        if key is not None:
            kept = _block_mask(key, call.dropout, _blockwise.block_number(qi, ki, g.nk), p.shape)
            p_used = _core.apply_keep(jnp, p, kept, call.dropout)
            dp = _core.apply_keep(jnp, dp, kept, call.dropout)
        ds = p * (dp - _slice(delta, r0, g.size, -1)[..., None])
        new = list(carry)
        if pullback:  # d score_mod: back to the scores before it, and to its consts
            ds, *dconsts = pullback[0](ds)
            for i, dc in enumerate(dconsts):
                new[first_const + i] = new[first_const + i] + dc
        if ops.bias is not None:
            shape = ops.bias.shape
            target = (
                *shape[:-2],
                g.size if shape[-2] != 1 else 1,
                g.size if shape[-1] != 1 else 1,
            )
            db = _blockwise._reduce_to(jnp, ds, target)
            dbias = new[3]
            if shape[-2] != 1:
                dbias = jax.lax.dynamic_update_slice_in_dim(
                    dbias,
                    _add_at(_slice(dbias, r0, g.size, -2), db, c0, -1)
                    if shape[-1] != 1
                    else _slice(dbias, r0, g.size, -2) + db,
                    r0,
                    axis=dbias.ndim - 2,
                )
            elif shape[-1] != 1:
                dbias = _add_at(dbias, db, c0, -1)
            else:
                dbias = dbias + db
            new[3] = dbias
        if t is not None:
            ds = ds * (1.0 - t * t)
        new[0] = _add_at(new[0], jnp.einsum("...qk,...kd->...qd", ds, kb), r0, -2)
        new[1] = _add_at(new[1], kv_grad(ds, qb), c0, -2)
        new[2] = _add_at(new[2], kv_grad(p_used, dob), c0, -2)
        return tuple(new), None

    carry, _ = jax.lax.scan(step, tuple(init), g.pairs(by_keys=True))
    dq = carry[0][..., : g.lq, :] * call.scale  # as in _blockwise.backward
    dk, dv = carry[1][..., : g.lk, :], carry[2][..., : g.lk, :]
    if call.softcap is not None:
        dk = dk * call.softcap
    dbias = None
    if bias is not None:
        dbias = carry[3]
        if dbias.shape[-2] != 1:
            dbias = dbias[..., : g.lq, :]
        if dbias.shape[-1] != 1:
            dbias = dbias[..., : g.lk]
        dbias = jnp.reshape(dbias, bias.shape).astype(bias.dtype)
    dq, dk, dv = (jnp.reshape(d, x.shape).astype(x.dtype) for d, x in ((dq, q), (dk, k), (dv, v)))
    return Grads(dq, dk, dv, dbias), tuple(carry[first_const:])


def _block_size(call: _spec.Call) -> int:
    """The scan's block length: ``chunk_size``, else the core's (1M scores per block over
    batch and heads), 4x that where ``causal``/``window`` skip nothing. XLA fuses each
    block's elementwise work, so the blocks pay for themselves in steps of the scan, not in
    passes over memory: unmasked, ``[1, 8, 2048, 64]`` float32 took 104 ms forward and
    449 ms under ``jit(grad)`` with blocks of 512, 119 and 493 ms with blocks of 256
    (native:jax: 112 and 684 ms); causal, blocks of 256 or less measured fastest."""
    if call.blocks is not None:  # its pairs are blocks of its size
        return int(call.blocks.block_size)
    if call.chunk_size is not None:
        size = call.chunk_size
    elif _core.band_keeps_all(call):
        size = _core.auto_chunk(call, 4 * _core.CHUNK_BUDGET)
    else:
        size = _core.auto_chunk(call)
    # Never longer than the call needs: every call is padded to whole blocks (a ring
    # step's 8 x 8 block padded to 1024 x 1024 took 0.8 s).
    longest = max(call.q_shape[-2], call.k_shape[-2], 1)
    return min(size, max(16, 1 << (longest - 1).bit_length()))


@functools.lru_cache(maxsize=64)
def _blockwise_fn(call: _spec.Call) -> Any:
    """The blockwise path of a call as a jitted ``custom_vjp`` of
    ``(q, k, v, mask, bias, key) -> (out, lse)`` (cached: a Call is hashable)."""
    g = _Grid(call, _block_size(call))

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any) -> Any:
        return _scan_forward(g, q, k, v, mask, bias, key)

    def fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any) -> Any:
        out, lse = _scan_forward(g, q, k, v, mask, bias, key)
        return (out, lse), (q, k, v, mask, bias, key, out, lse)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, mask, bias, key, out, lse = res
        dout, dlse = cotangents
        grads, _ = _scan_backward(g, dout, q, k, v, out, lse, mask, bias, key, dlse)
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None

    run.defvjp(fwd, bwd)
    return jax.jit(run)


def _modded_blockwise(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, mods: _mods.Mods
) -> tuple[Any, Any]:
    """The blockwise path of a call with segment ids or mods: a ``custom_vjp`` built for
    this call (the mods are functions: it is traced again each call outside ``jit``), its
    ids and a score_mod's captured arrays passed explicitly."""
    g = _Grid(call, _block_size(call))
    converted: Any = None
    consts: Any = ()
    if mods.score_mod is not None:
        example_s = jnp.zeros(_mods.user_shape(call, g.size, g.size), call.compute_dtype)
        example = _mods.indices(call, (0, g.size), (0, g.size))
        converted, consts = jax.closure_convert(mods.score_mod, example_s, *example)
    arrays = (mods.q_ids, mods.kv_ids, mods.q_pos, mods.kv_pos)

    def scan_mods(ids: Any) -> _ScanMods:
        q_ids, kv_ids, q_pos, kv_pos = ids
        plain = _mods.Mods(q_ids, kv_ids, q_pos, kv_pos, None, mods.mask_mod)
        return _ScanMods(plain, converted)

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, ids: Any, c: Any) -> Any:
        return _scan_forward(g, q, k, v, mask, bias, key, scan_mods(ids).with_consts(c))

    def fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, key: Any, ids: Any, c: Any) -> Any:
        out, lse = _scan_forward(g, q, k, v, mask, bias, key, scan_mods(ids).with_consts(c))
        return (out, lse), (q, k, v, mask, bias, key, ids, c, out, lse)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, mask, bias, key, ids, c, out, lse = res
        dout, dlse = cotangents
        grads, dc = _scan_backward(
            g, dout, q, k, v, out, lse, mask, bias, key, dlse, scan_mods(ids), tuple(c)
        )
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None, None, tuple(dc)

    run.defvjp(fwd, bwd)
    out, lse = run(q, k, v, mask, bias, key, arrays, tuple(consts))
    return out, lse


@functools.lru_cache(maxsize=64)
def _backward_fn(call: _spec.Call) -> Any:
    """``attend_backward`` of a call, jitted (cached: a Call is hashable)."""
    g = _Grid(call, _block_size(call))

    def backward(*args: Any) -> Grads:
        return _scan_backward(g, *args)[0]

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

    path = "native:jax"
    why = (
        f"the portable dense path runs on blocks of {_BLOCK_ROWS} queries in a lax.map, so "
        "each block's scores stay in cache (on CPU, measured about 2x the unblocked dense "
        "path at L=2048)"
    )

    def reason(self, call: _spec.Call) -> str | None:
        return _native_reason(call)

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
        return _run_native(call, q, k, v, mask, bias, keep)


class JaxAdapter(Adapter):
    """JAX: jax.nn's kernel, query blocks on CPU, an einsum for the scores, PRNG keys."""

    name = NAME
    rng = RNG
    fused = DotProductAttention()
    native = QueryBlocks()
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
        key = _key_of(keep)
        if mods is None:
            grads: Grads = _backward_fn(call)(dout, q, k, v, out, lse, mask, bias, key, dlse)
        else:
            g = _Grid(call, _block_size(call))
            scan = _ScanMods(mods)
            grads = _scan_backward(g, dout, q, k, v, out, lse, mask, bias, key, dlse, scan)[0]
        if sinks is not None:
            dsinks = _core.sinks_grad_from(call, sinks, dout, out, lse, dlse)
            grads = grads._replace(dsinks=dsinks)
        return grads

    def scores(self, xp: Any) -> Any:
        return _scores


ADAPTER = JaxAdapter()
