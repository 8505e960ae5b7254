"""JAX's kernels besides the blockwise path, imported when the planner first asks for
them: ``jax.nn.dot_product_attention`` as the fused path (cuDNN on an NVIDIA GPU where
it qualifies; rows with no key repaired to 0), and the tuned kernel of our own, the
portable dense path on query blocks under ``lax.map`` (JAX on CPU)."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from portable_attention import _band, _core, _mods, _spec
from portable_attention._block_loop import unstacked
from portable_attention.backends import adapter
from portable_attention.backends._base import Kernel

#: From this many query rows on, the tuned kernel splits the queries into blocks.
LONG_QUERIES = 512
#: Query rows per block of the tuned kernel (256 measured best of 128/256/512 at L=2048);
#: it runs from two blocks on.
_BLOCK_ROWS = LONG_QUERIES // 2


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
    call: _spec.Call, allow: Any, bias: Any, window: tuple[int, int] | None
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
        and allow is None
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
    wide = _band.widest(lq, lk)
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
        allow, is_causal = None, call.causal is not None
    else:
        allow, is_causal = _core.fused_mask(call, mask, bias)
    allow4 = None if allow is None else _scores_operand(allow, lead, batch)
    bias4 = None if bias is None else _scores_operand(bias, lead, batch)
    if bias4 is not None:
        # -inf bias entries join the mask: a row of -inf scores is NaN in jax.nn's softmax,
        # and its gradient stays NaN through the repair below (0 * NaN).
        finite = bias4 > -jnp.inf
        allow4 = finite if allow4 is None else (allow4 & finite)
        bias4 = jnp.where(finite, bias4, 0)
    out = jax.nn.dot_product_attention(
        _to_btnh(q, batch),
        _to_btnh(k, batch),
        _to_btnh(v, batch),
        bias=bias4,
        mask=allow4,
        scale=call.scale,
        is_causal=is_causal,
        local_window_size=window,
        implementation="cudnn" if _cudnn_qualifies(call, allow, bias, window) else None,
    )
    out = jnp.swapaxes(out, 1, 2)  # [B, H, Lq, Dv]
    if allow4 is not None:
        out = jnp.where(jnp.any(allow4, axis=-1, keepdims=True), out, 0)
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
    allow = _core.allow_mask(call, mask)
    blocks = lq // rows

    def dense_rows(qb: Any, start: Any, n: int, guarded: bool | None) -> tuple[Any, Any, Any]:
        return _core.dense(
            call,
            qb,
            k,
            v,
            _rows(allow, start, n, lq),
            _rows(bias, start, n, lq),
            scores=adapter("jax").scores(jnp),
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
        None if x is None else unstacked(jnp, x, axis)
        for x, axis in zip(mapped, (-3, -3, -2), strict=True)
    )
    if lq % rows:
        done = blocks * rows
        guarded = None if allow is None and bias is None else True
        tail = dense_rows(q[..., done:, :], done, lq - done, guarded)
        out, weights, lse = (
            None if x is None else jnp.concatenate([x, t], axis=axis + 1)
            for x, t, axis in zip((out, weights, lse), tail, (-3, -3, -2), strict=True)
        )
    return out, weights, lse


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


FUSED = DotProductAttention()
TUNED = QueryBlocks()
