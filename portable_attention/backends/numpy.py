"""NumPy: a native kernel (NumPy has no fused attention) and dropout from a
``numpy.random.Generator`` (the generic adapter's RNG).

The kernel is the portable algorithm with NumPy-only tricks: the scale folded into q,
scores transformed in place (softcap, bias, mask, ``exp``), the row sums of the softmax
taken by the second matmul (V gets a column of ones) and its division done on
``[Lq, Dv]`` instead of ``[Lq, Lk]``, and query blocks sized to stay in cache.

Threads: when ``threadpoolctl`` is installed, query blocks run on all cores with the BLAS
pinned to one thread for the duration of the call (NumPy releases the GIL in matmul and
ufuncs, so the elementwise passes run in parallel too). Without it the BLAS's own threads
do the matmuls and the rest runs on one core: Python threads on top of a threaded
OpenBLAS oversubscribe the cores and were measured 10-100x slower here.

Only arrays it allocated itself are written: inputs are never modified.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from portable_attention import _core, _validate
from portable_attention.backends.generic import RNG, keep_mask

__all__ = ["NATIVE_PATH", "RNG", "keep_mask", "native_reason", "run_native"]

NATIVE_PATH = "native:numpy"
NATIVE_WHY = "the NumPy-native blocked kernel runs (in-place softmax, query blocks on all cores)"

#: Scores per query block, over all batch and head dims (16 MiB of float32): fewer, larger
#: blocks measured faster here (L=16384: 7.3 s at 4M scores per block, 15.4 s at 1M).
_BLOCK_ELEMENTS = 1 << 22
#: From this many query rows on, the row sums come from the second matmul (V gets a
#: column of ones); below, copying V costs more than summing the rows (decode: 160 us).
_SUM_BY_MATMUL_MIN_ROWS = 256
#: Below this many scores in all, threads cost more than they give.
_THREADS_MIN_ELEMENTS = 1 << 21
_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_blas: Any = None  # threadpoolctl.ThreadpoolController, False when not installed


def native_reason(call: _validate.Call) -> str | None:
    """Why the native kernel does not take ``call`` (None: it does)."""
    if call.chunk_size is not None:
        return "chunk_size asks for the portable chunked path"
    return None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="portable_attention")
    return _pool


def _blas_controller() -> Any:
    """threadpoolctl's controller of the loaded BLAS, or None without threadpoolctl."""
    global _blas
    if _blas is None:
        try:
            import threadpoolctl
        except ImportError:
            _blas = False
        else:
            _blas = threadpoolctl.ThreadpoolController()
    return _blas or None


_pin_lock = threading.Lock()
_pin_users = 0
_pin_limiter: Any = None


@contextlib.contextmanager
def _blas_pinned(blas: Any) -> Iterator[None]:
    """The BLAS on one thread while any call is in its threaded blocks.

    The limit is process-wide: with one ``blas.limit()`` per call, concurrent calls
    restored each other's limits out of order and left the BLAS on 1 thread for good.
    The first call in pins it, the last one out restores the original.
    """
    global _pin_users, _pin_limiter
    with _pin_lock:
        if _pin_users == 0:
            _pin_limiter = blas.limit(limits=1, user_api="blas")
        _pin_users += 1
    try:
        yield
    finally:
        with _pin_lock:
            _pin_users -= 1
            if _pin_users == 0:
                _pin_limiter.restore_original_limits()
                _pin_limiter = None


def run_native(
    call: _validate.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any
) -> tuple[Any, Any, Any]:
    """``(out, weights or None, lse or None)`` with the contract of ``_core.dense``."""
    if call.k_shape[-2] == 0:
        return _core.dense(call, q, k, v)
    ops = _core.operands(call, np.asarray(q), np.asarray(k), np.asarray(v), mask, bias)
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    v_sum = None
    if keep is None and lq >= _SUM_BY_MATMUL_MIN_ROWS:
        ones = np.ones((*ops.v.shape[:-1], 1), dtype=ops.v.dtype)
        v_sum = np.concatenate([ops.v, ones], axis=-1)  # e @ [V | 1] = [e @ V | row sums]
    lead = ops.q.shape[:-2]
    ct = call.compute_dtype
    out = np.empty((*lead, lq, call.v_shape[-1]), dtype=ct)
    lse = np.empty((*lead, lq), dtype=ct) if call.return_lse else None
    weights = np.empty((*lead, lq, lk), dtype=ct) if call.return_weights else None
    scores = math.prod(lead) * lq * lk
    big = scores >= _THREADS_MIN_ELEMENTS and keep is None and _WORKERS > 1
    blas = _blas_controller() if big else None
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, math.prod(lead) * lk))
    if blas is not None:
        rows_per_block = min(rows_per_block, -(-lq // _WORKERS))  # work for every thread
    if rows_per_block >= lq:  # one block (decode, short sequences): no list, no closure
        _block(call, ops, v_sum, (0, lq), keep, out, weights, lse)
    else:
        blocks = [(q0, min(q0 + rows_per_block, lq)) for q0 in range(0, lq, rows_per_block)]

        def run(rows: tuple[int, int]) -> None:
            _block(call, ops, v_sum, rows, keep, out, weights, lse)

        if blas is not None:
            with _blas_pinned(blas):
                list(_executor().map(run, blocks))
        else:
            for rows in blocks:
                run(rows)
    out_final = out.reshape(*call.q_shape[:-1], call.v_shape[-1]).astype(call.dtype, copy=False)
    if weights is not None:
        weights = weights.reshape(*call.q_shape[:-1], lk).astype(call.dtype, copy=False)
    if lse is not None:
        lse = lse.reshape(call.q_shape[:-1])
    return out_final, weights, lse


def _block(
    call: _validate.Call,
    ops: Any,
    v_sum: Any | None,
    rows: tuple[int, int],
    keep: Any,
    out: Any,
    weights: Any,
    lse: Any,
) -> None:
    """One query block, written into the preallocated ``out`` / ``weights`` / ``lse``."""
    lk = call.k_shape[-2]
    cols = (0, lk)
    r = slice(*rows)
    qb = ops.q if rows[1] - rows[0] == call.q_shape[-2] else ops.q[..., r, :]
    s = np.matmul(qb, np.swapaxes(ops.k, -1, -2))  # a fresh block: ours to edit
    if call.softcap is not None:
        np.multiply(s, 1.0 / call.softcap, out=s)
        np.tanh(s, out=s)
        np.multiply(s, call.softcap, out=s)
    if ops.bias is not None:
        np.add(s, _core.block_of(ops.bias, rows, cols), out=s)
    allowed = _core.structural_mask(call, rows=rows, cols=cols)
    if ops.mask is not None:
        user = _core.block_of(ops.mask, rows, cols)
        allowed = user if allowed is None else (user & allowed)
    if allowed is not None:
        np.copyto(s, -np.inf, where=~np.broadcast_to(allowed, s.shape))
    # fmax skips NaN (those scores still make their row NaN through exp and the sum):
    # without NaN checks the row max runs about 1.7x faster than s.max.
    m = np.fmax.reduce(s, axis=-1, keepdims=True)
    guarded = _core.rows_may_be_empty(call)
    if guarded:  # rows with no key (max -inf) subtract a finite number: their exps are 0
        np.maximum(m, np.finfo(m.dtype).min, out=m)
    np.subtract(s, m, out=s)
    np.exp(s, out=s)
    if v_sum is not None:
        both = np.matmul(s, v_sum)
        block_sum, total = both[..., :-1], both[..., -1:]
    else:
        total = s.sum(axis=-1, keepdims=True)
    has_key = total != 0 if guarded else None  # NaN rows keep NaN (lse too), as in _core
    if has_key is not None:
        total[~has_key] = 1.0
    if weights is not None:
        np.divide(s, total, out=weights[..., r, :])
    if keep is not None:
        np.multiply(s, keep(s.shape), out=s)
        np.multiply(s, 1.0 / (1.0 - call.dropout), out=s)
    if v_sum is None:
        block_sum = np.matmul(s, ops.v)
    np.divide(block_sum, total, out=out[..., r, :])
    if lse is not None:
        block_lse = np.log(total) + m
        if has_key is not None:
            block_lse[~has_key] = -np.inf
        lse[..., r] = block_lse[..., 0]
