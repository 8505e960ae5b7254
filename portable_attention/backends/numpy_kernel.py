"""NumPy's tuned kernel (``tuned:numpy``; NumPy has no fused attention), imported by
:class:`portable_attention.backends.numpy.BlockedKernel` when it first runs.

It is the portable algorithm with NumPy-only tricks: the scale folded into q
(times ``log2(e)`` for ``exp2`` in float32 without a bias), scores transformed in
place (softcap, bias, mask, the exponential) in a per-thread work array,
the softmax's max pass skipped where the row sums show it was not needed (see
:func:`_block`), the row sums taken by a matrix-vector product, the division done on
``[Lq, Dv]`` instead of ``[Lq, Lk]``, and query blocks of bounded size.

Threads: for calls of 4M scores and more without dropout, when ``threadpoolctl`` is
installed and shows every BLAS library on one thread already (``OPENBLAS_NUM_THREADS=1``,
or the caller's ``threadpoolctl.threadpool_limits(1, "blas")``), query blocks run on up to
4 threads (this thread and a pool, no more than the cores); NumPy releases the GIL in
matmul and ufuncs, so the elementwise passes run in parallel too. Otherwise a call runs
on this thread with the BLAS's own threads. The kernel never changes the BLAS's thread
count: it is process-wide, and pinning it for a call slowed the BLAS work of the user's
other threads while the call ran. Python threads on top of a threaded OpenBLAS
oversubscribe the cores (measured 10-100x slower), and below 4M scores waking a pool
thread cost more than it gave (at ``[1, 8, 512, 512]`` scores, 8.2 ms threaded against
5.7 ms).

Only arrays it allocated itself are written: inputs are never modified.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from portable_attention import _core, _mods, _spec

#: Scores per query block, over all batch and head dims (16 MiB of float32): fewer, larger
#: blocks measured faster here (L=16384: 7.3 s at 4M scores per block, 15.4 s at 1M).
_BLOCK_ELEMENTS = 1 << 22
#: Below this many scores in all, threads cost more than they give.
_THREADS_MIN_ELEMENTS = 1 << 22
_WORKERS = max(1, min(4, os.cpu_count() or 1))  # this thread and _WORKERS - 1 in the pool
_pool: ThreadPoolExecutor | None = None
_blas: Any = None  # threadpoolctl's BLAS controllers, False when it is not installed


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_WORKERS - 1, thread_name_prefix="portable_attention")
    return _pool


def _blas_controller() -> Any:
    """The BLAS libraries' threadpoolctl controllers (a tuple, empty when threadpoolctl
    finds none: then the kernel runs no threads of its own), or None without it."""
    global _blas
    if _blas is None:
        try:
            import threadpoolctl
        except ImportError:
            _blas = False
        else:
            controllers = threadpoolctl.ThreadpoolController().lib_controllers
            _blas = tuple(c for c in controllers if c.user_api == "blas")
    return _blas if _blas is not False else None


def _blas_on_one_thread(blas: Any) -> bool:
    """Whether every BLAS library is on one thread already: then the kernel's own threads
    are the only parallelism and cannot oversubscribe the cores. The count is the user's
    (``OPENBLAS_NUM_THREADS=1``, ``threadpoolctl.threadpool_limits(1, "blas")``); this
    module never changes it, since it is process-wide (OpenBLAS's pthreads build has no
    per-thread count: its ``openblas_set_num_threads_local`` sets the global one)."""
    return bool(blas) and all(c.get_num_threads() == 1 for c in blas)


def _after_fork_in_child() -> None:
    """A forked child (multiprocessing's default on Linux before Python 3.14) has none of
    the pool's threads: a threaded call would wait forever for its helpers."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def run_tuned(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any, mods: Any = None
) -> tuple[Any, Any, Any]:
    """``(out, weights or None, lse or None)`` with the contract of ``_core.dense``
    (``lse`` also where sinks need it). ``mods``: the call's segment ids, whose key span
    each query block narrows to."""
    if call.k_shape[-2] == 0:
        return _core.dense(call, q, k, v)
    q_factor = call.scale * _LOG2E if _base2(call) else None
    ops = _core.operands(
        call, np.asarray(q), np.asarray(k), np.asarray(v), mask, bias, q_factor=q_factor
    )
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    lead = ops.q.shape[:-2]
    ct = call.compute_dtype
    out = np.empty((*lead, lq, call.v_shape[-1]), dtype=ct)
    wants_lse = call.return_lse or call.sinks_shape is not None
    lse = np.empty((*lead, lq), dtype=ct) if wants_lse else None
    weights = np.empty((*lead, lq, lk), dtype=ct) if call.return_weights else None
    scores = math.prod(lead) * lq * lk
    big = scores >= _THREADS_MIN_ELEMENTS and keep is None and _WORKERS > 1
    threaded = big and _blas_on_one_thread(_blas_controller())
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, math.prod(lead) * lk))
    if threaded:
        rows_per_block = min(rows_per_block, -(-lq // _WORKERS))  # work for every thread
    if rows_per_block >= lq:  # one block (decode, short sequences): no list, no closure
        _block(call, ops, (0, lq), keep, out, weights, lse, mods)
    else:
        blocks = iter([(q0, min(q0 + rows_per_block, lq)) for q0 in range(0, lq, rows_per_block)])

        def drain() -> None:  # takes blocks until none is left (next() holds the GIL)
            for rows in blocks:
                _block(call, ops, rows, keep, out, weights, lse, mods)

        helpers = [_executor().submit(drain) for _ in range(_WORKERS - 1)] if threaded else []
        try:
            drain()  # this thread works too: one thread fewer to wake
        finally:  # no helper may still be writing when the call ends; an error here wins
            futures.wait(helpers)
        for helper in helpers:
            helper.result()
    out_final = out.reshape(*call.q_shape[:-1], call.v_shape[-1]).astype(call.dtype, copy=False)
    if weights is not None:
        weights = weights.reshape(*call.q_shape[:-1], lk).astype(call.dtype, copy=False)
    if lse is not None:
        lse = lse.reshape(call.q_shape[:-1])
    return out_final, weights, lse


def _block(
    call: _spec.Call,
    ops: Any,
    rows: tuple[int, int],
    keep: Any,
    out: Any,
    weights: Any,
    lse: Any,
    mods: Any = None,
    *,
    row_max: bool = False,
) -> None:
    """One query block, written into the preallocated ``out`` / ``weights`` / ``lse``.

    Without ``row_max`` the softmax skips its max pass: ``exp(s) / sum(exp(s))`` is the
    softmax whenever no ``exp`` overflows and no row sum is too small for its terms to
    keep their precision. The row sums (and the output) say whether that held; a block
    where it did not (large logits, empty or NaN rows, non-finite values) is computed
    again with the max subtracted, so every row gets the guarded result of ``_core``.
    Blocks whose mask leaves a row empty, and dropout (a second try would draw its
    keep-mask twice), subtract the max from the start.
    """
    r = slice(*rows)
    # Only the keys causal/window leave to these rows (all of them with dropout: the
    # keep-mask is drawn for the whole row, as on the dense path).
    cols = (0, call.k_shape[-2]) if keep is not None else _core.key_span(call, rows)
    if mods is not None and keep is None:
        cols = _segment_span(mods, rows, cols)
    lk = cols[1] - cols[0]
    if lk == 0:  # no row of the block has a key
        _empty_rows(out, weights, lse, r)
        return
    narrow = lk != call.k_shape[-2]
    kb = ops.k[..., cols[0] : cols[1], :] if narrow else ops.k
    vb = ops.v[..., cols[0] : cols[1], :] if narrow else ops.v
    qb = ops.q if rows[1] - rows[0] == call.q_shape[-2] else ops.q[..., r, :]
    dtype = qb.dtype
    s = np.matmul(qb, np.swapaxes(kb, -1, -2), out=_scratch(0, (*qb.shape[:-1], lk), dtype))
    base2 = _base2(call)
    if call.softcap is not None:  # tanh of the scores in natural units, then back to s's
        np.multiply(s, (_LN2 if base2 else 1.0) / call.softcap, out=s)
        np.tanh(s, out=s)
        np.multiply(s, call.softcap * (_LOG2E if base2 else 1.0), out=s)
    if ops.bias is not None:
        np.add(s, _core.block_of(ops.bias, rows, cols), out=s)
    if ops.mask is None and mods is None:
        row_max = _mask_band(call, s, rows, cols) or row_max
    else:
        allow = _core.allow_mask(call, _core.block_of(ops.mask, rows, cols), rows=rows, cols=cols)
        if mods is not None:
            spans = ((rows[0], rows[1] - rows[0]), (cols[0], lk))
            segments = _mods.block_mask(call, mods, *spans, tuple(s.shape))
            allow = segments if allow is None else allow & segments
        if allow is not None:
            np.copyto(s, -np.inf, where=~np.broadcast_to(allow, s.shape))
            # A row with no key would fail the row sums' check: go straight to the max
            # pass (a pass over the booleans, against a second pass over the scores).
            row_max = row_max or not allow.any(axis=-1).all()
    guarded = _core.rows_may_be_empty(call)
    m = None
    if row_max or keep is not None:
        # fmax skips NaN (those scores still make their row NaN through exp and the sum):
        # without NaN checks the row max runs about 1.7x faster than s.max.
        m = np.fmax.reduce(s, axis=-1, keepdims=True)
        if guarded:  # rows with no key (max -inf) subtract a finite number: exps are 0
            np.maximum(m, np.finfo(dtype).min, out=m)
        np.subtract(s, m, out=s)
    # Without the max pass, exp may overflow: the check below catches it, and NumPy's
    # warnings about it would only alarm (the block is redone with the max subtracted).
    with np.errstate(over="ignore", invalid="ignore") if m is None else contextlib.nullcontext():
        (np.exp2 if base2 else np.exp)(s, out=s)
        # Row sums as a matrix-vector product: 11 us for [8, 128, 128], s.sum(-1) took 41.
        total = np.matmul(s, _ones(lk, dtype))
        if keep is None:
            sum_shape = (*s.shape[:-1], vb.shape[-1])
            block_sum = np.matmul(s, vb, out=_scratch(1, sum_shape, dtype))
    if m is None and not _sums_in_range(total, block_sum):
        _block(call, ops, rows, keep, out, weights, lse, mods, row_max=True)
        return
    block_lse = None
    if lse is not None or guarded:  # (else every row has a key: the sums divide as they are)
        shift = None if m is None else (m * _LN2 if base2 else m)
        total, block_lse = _core.row_denominators(np, total, shift)  # [..., rows, 1]: small
    if weights is not None:
        if narrow:
            weights[..., r, : cols[0]] = 0
            weights[..., r, cols[1] :] = 0
        np.divide(s, total, out=weights[..., r, cols[0] : cols[1]])
    if keep is not None:
        np.multiply(s, keep(s.shape), out=s)
        np.multiply(s, 1.0 / (1.0 - call.dropout), out=s)
        block_sum = np.matmul(s, vb)
    np.divide(block_sum, total, out=out[..., r, :])
    if lse is not None and block_lse is not None:
        lse[..., r] = block_lse[..., 0]


def _mask_band(call: _spec.Call, s: Any, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
    """``-inf`` where ``causal``/``window`` drop a score of the block ``s`` (keys
    ``cols``), written only in the columns the band cuts: those it keeps for every row of
    the block are left alone (at L=16384 causal, most of each row's key span). Returns
    whether a row of the block may have no key (then the softmax takes its max pass)."""
    full = _core.full_columns(call, rows, cols)
    if full == cols:
        return False
    edges = [cols] if full[0] >= full[1] else [(cols[0], full[0]), (full[1], cols[1])]
    empty = False
    for edge in edges:
        if edge[0] >= edge[1]:
            continue
        keep = _core.allow_mask(call, None, rows=rows, cols=edge)
        if keep is None:
            continue
        part = s[..., edge[0] - cols[0] : edge[1] - cols[0]]
        np.copyto(part, -np.inf, where=~np.broadcast_to(keep, part.shape))
        if full[0] >= full[1]:  # no column kept for every row: a row may be empty
            empty = not keep.any(axis=-1).all()
    return empty


def _segment_span(mods: Any, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[int, int]:
    """The keys of ``cols`` whose segment id lies within the ids of the query ``rows``:
    every key outside has no query of the block in its segment (``start == stop``: none)."""
    q_ids = np.asarray(mods.q_ids)[..., rows[0] : rows[1]]
    kv_ids = np.asarray(mods.kv_ids)[..., cols[0] : cols[1]]
    if q_ids.size == 0 or kv_ids.size == 0:
        return cols
    inside = (kv_ids >= q_ids.min()) & (kv_ids <= q_ids.max())
    found = np.flatnonzero(inside.reshape(-1, inside.shape[-1]).any(axis=0))
    if found.size == 0:
        return cols[0], cols[0]
    return cols[0] + int(found[0]), cols[0] + int(found[-1]) + 1


def _empty_rows(out: Any, weights: Any, lse: Any, r: slice) -> None:
    """Rows with no key: out 0, weights 0, lse -inf (the contract's empty rows)."""
    out[..., r, :] = 0
    if weights is not None:
        weights[..., r, :] = 0
    if lse is not None:
        lse[..., r] = -np.inf


_LOG2E = 1.0 / math.log(2.0)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_LN2 = math.log(2.0)


def _base2(call: _spec.Call) -> bool:
    """Whether the kernel takes scores in units of log2: ``scale * log2(e)`` folded into
    q, then ``exp2``, which took 37 us where ``exp`` took 59 at [8, 128, 128] float32.

    float32 without a bias only. A bias is in natural units and would need a pass of its
    own. In float64, ``exp2`` was only 11% faster, and there the factor would cost exact
    inputs their exactness: at ``scale=1e6``, keys whose scores tie exactly got weights
    1.6e-10 apart (a float64 test asks for 1e-10).
    """
    return (
        call.bias_shape is None
        and call.compute_dtype == np.float32
        and call.scale * _LOG2E <= _FLOAT32_MAX  # scale itself is at most float32's max
    )


def _sums_in_range(total: Any, block_sum: Any) -> bool:
    """Whether ``exp`` without the max pass gave the softmax to the dtype's resolution,
    relative to each row's largest weight (weights far below it, under ``1e-19`` of it in
    float32, may keep fewer digits than with the max subtracted).

    Every row sum must be finite (no ``exp`` overflowed, no NaN) and at least the square
    root of the smallest normal number: then the row's largest term is at least that over
    ``Lk``, and the terms that ``exp`` rounded to subnormals or zero weigh less than
    ``Lk * sqrt(tiny)`` (1e-19 for float32) relative to it, below the dtype's resolution,
    as with the max subtracted. The unnormalised output must be finite too: it can
    overflow where the row sums are large and V is. (NaN fails every comparison.)
    """
    low, high = _range(total.dtype)
    if total.size and not (total.min() >= low and total.max() <= high):
        return False
    return bool(np.isfinite(block_sum).all())


@functools.lru_cache(maxsize=16)
def _range(dtype: Any) -> tuple[Any, Any]:
    """``(sqrt(tiny), max)`` of a floating dtype, as scalars of that dtype (longdouble's
    tiny is 0 as a Python float)."""
    info = np.finfo(dtype)
    return np.sqrt(info.tiny), info.max


_local = threading.local()
_SCRATCH_MAX_BYTES = 1 << 22


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: Any) -> Any:
    """A read-only ``[n, 1]`` column of ones (cached: decode calls ask for it each step)."""
    ones = np.ones((n, 1), dtype=dtype)
    ones.flags.writeable = False
    return ones


def _scratch(slot: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A work array of ``shape`` for this thread, reused from call to call up to 4 MiB.

    Fresh arrays cost page faults and, when freed, TLB shootdowns on every core that
    runs one of the process's threads (a BLAS or OpenMP thread spinning after its call):
    allocating and freeing 768 KiB took 27 us here, and 180-230 us with OpenBLAS's
    threads awake, next to a 400 us call. Larger arrays are allocated for the call and
    not kept, so a thread holds at most 4 MiB per slot.
    """
    size = math.prod(shape)
    dtype = np.dtype(dtype)
    if size * dtype.itemsize > _SCRATCH_MAX_BYTES:
        return np.empty(shape, dtype=dtype)
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get((slot, dtype))
    if buf is None or buf.size < size:
        buf = bufs[slot, dtype] = np.empty(size, dtype=dtype)
    return buf[:size].reshape(shape)
