"""NumPy's loop of the blockwise path for large calls (:class:`NumpyLoop`): the
array-API loops, with the forward's query blocks on worker threads where the user has put
the BLAS on one thread. :meth:`~portable_attention.backends.numpy.NumpyAdapter.block_loop`
imports it for calls of 4M scores and more without dropout.

Threads: for those calls, when ``threadpoolctl`` is installed and shows every BLAS
library on one thread already (``OPENBLAS_NUM_THREADS=1``, or the caller's
``threadpoolctl.threadpool_limits(1, "blas")``), the forward's query blocks
run on up to 4 threads (this thread and a pool, no more than the cores); NumPy releases
the GIL in matmul and ufuncs, so the elementwise steps run in parallel too, each thread
on its own buffers (:mod:`~portable_attention.backends.numpy_math`). Otherwise a call
runs on this thread with the BLAS's own threads. The loop never changes the BLAS's thread
count: it is process-wide, and pinning it for a call slowed the BLAS work of the user's
other threads while the call ran. Python threads on top of a threaded OpenBLAS
oversubscribe the cores (measured 10-100x slower), and below 4M scores waking a pool
thread cost more than it gave (at ``[1, 8, 512, 512]`` scores, 8.2 ms threaded against
5.7 ms).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from portable_attention._block_loop import BlockLoop, Body, joined

#: This thread and ``WORKERS - 1`` in the pool: at most 4, no more than the cores this
#: process may run on.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
WORKERS = max(1, min(4, _CORES or 1))
_PREFIX = "portable_attention"
_pool: ThreadPoolExecutor | None = None
_blas: Any = None  # threadpoolctl's BLAS controllers, False when it is not installed


class NumpyLoop(BlockLoop):
    """The array-API loops, the forward's query blocks on :data:`WORKERS` threads where
    the module docstring says."""

    def each(self, body: Body, indices: Sequence[int], axes: tuple[int, ...]) -> tuple[Any, ...]:
        if len(indices) < 2 or not _threaded():
            return super().each(body, indices, axes)
        results: dict[int, tuple[Any, ...]] = {}
        todo, lock, failed = iter(indices), threading.Lock(), threading.Event()

        def drain() -> None:  # takes blocks until none is left or one failed
            while not failed.is_set():
                with lock:
                    index = next(todo, None)
                if index is None:
                    return
                try:
                    results[index] = body((), index)[1]
                except BaseException:
                    failed.set()
                    raise

        helpers = [_executor().submit(drain) for _ in range(min(WORKERS, len(indices)) - 1)]
        try:
            drain()  # this thread works too: one thread fewer to wake
        finally:
            # A helper still queued (the pool busy with other calls' blocks) is not waited
            # for: this thread did its share. No started one may still be writing when the
            # call ends; an error here wins.
            for helper in helpers:
                helper.cancel()
            futures.wait(helpers)
        for helper in helpers:
            if not helper.cancelled():
                helper.result()
        return joined(self.xp, [results[i] for i in indices], axes)


def _threaded() -> bool:
    """Whether the forward's query blocks run on threads (the module docstring): not on
    a pool thread itself (a ``score_mod`` that calls ``attend``: its helpers would queue
    behind it)."""
    if WORKERS < 2 or threading.current_thread().name.startswith(_PREFIX):
        return False
    return blas_on_one_thread(_blas_controller())


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS - 1, thread_name_prefix=_PREFIX)
    return _pool


def _blas_controller() -> Any:
    """The BLAS libraries' threadpoolctl controllers (a tuple, empty when threadpoolctl
    finds none: then the loop runs no threads of its own), or None without it."""
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


def blas_on_one_thread(blas: Any) -> bool:
    """Whether every BLAS library is on one thread already: then the loop's own threads
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
