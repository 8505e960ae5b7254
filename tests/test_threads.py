"""Thread safety: concurrent ``attend`` calls give exactly the serial results.

Calls from several threads mix backends, shapes, options and paths (NumPy's threaded
query blocks included, torch SDPA, the portable dense and chunked paths, seeded
dropout), in shuffled order; the call memo is made small so that it evicts entries again
and again while other threads read it and insert.
Results are compared bit for bit with serial calls of the same arguments.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from portable_attention import _memo, attend, plan
from portable_attention.backends import numpy as numpy_backend
from portable_attention.backends import numpy_loop
from portable_attention.testing import tolerance

from conftest import BACKENDS, BY_NAME, Backend, requires_backend
from helpers import randn, rng_for, run_python

Job = tuple[str, Callable[[], Any]]


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return result if isinstance(result, tuple) else (result,)


def _jobs(backend: Backend, *, many_shapes: bool = False) -> list[Job]:
    """Calls of ``attend`` on ``backend`` with fixed arguments (a fresh generator per call
    where dropout draws, so that a call's result does not depend on call order)."""
    jobs: list[Job] = []
    lengths = [(1, 2), (3, 9), (8, 5)] if many_shapes else [(5, 7)]
    for lq, lk in lengths:
        rng = rng_for("threads", backend.name, lq, lk)
        q = backend.asarray(randn(rng, (2, 4, lq, 8)), "float32")
        k = backend.asarray(randn(rng, (2, 2, lk, 8)), "float32")
        v = backend.asarray(randn(rng, (2, 2, lk, 6)), "float32")
        mask = backend.asarray(rng.random((lq, lk)) < 0.7)
        bias_np = randn(rng, (4, lq, lk))
        bias_np[:, 0, :] = -np.inf
        bias = backend.asarray(bias_np, "float32")
        options: list[dict[str, Any]] = [
            {},
            {"causal": True},
            {"mask": mask, "return_lse": True},
            {"bias": bias, "window": (2, 1), "return_weights": True},
            {"softcap": 3.0, "scale": 0.3},
            {"chunk_size": 2, "causal": "upper_left", "return_lse": True},
            {"implementation": "portable", "mask": mask, "bias": bias},
        ]
        for kw in options:
            jobs.append((f"{backend.name}-{lq}x{lk}-{sorted(kw)}", _bind(q, k, v, kw)))
        jobs.append(
            (
                f"{backend.name}-{lq}x{lk}-dropout",
                lambda q=q, k=k, v=v: attend(
                    q, k, v, dropout=0.3, rng=backend.make_rng(7), return_weights=True
                ),
            )
        )
    return jobs


def _bind(q: Any, k: Any, v: Any, kw: dict[str, Any]) -> Callable[[], Any]:
    return lambda: attend(q, k, v, **kw)


def _numpy_threaded_jobs() -> list[Job]:
    """Calls big enough (4M scores) for NumPy's threaded query blocks."""
    rng = rng_for("threads", "numpy-big")
    q, k, v = (randn(rng, (2, 8, 512, 16)).astype(np.float32) for _ in range(3))
    mask = rng.random((512, 512)) < 0.8
    assert plan(q, k, v).path == "portable:blockwise"
    assert q.size // 16 * 512 >= numpy_backend.THREADS_MIN_SCORES  # threads, or no test
    return [
        ("numpy-big", lambda: attend(q, k, v)),
        ("numpy-big-mask-causal", lambda: attend(q, k, v, mask=mask, causal=True, return_lse=True)),
    ]


def _to_numpy(backend: Backend, result: Any) -> list[np.ndarray]:
    return [backend.to_numpy(r) for r in _as_tuple(result)]


def _assert_same(name: str, got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want), name
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)  # bit for bit (NaN == NaN)


def _run_concurrently(jobs: list[tuple[Backend, Job]], repeats: int, workers: int) -> None:
    """Serial results first, then every job ``repeats`` times in shuffled order from
    ``workers`` threads started together; each result must equal its serial one."""
    serial = {name: _to_numpy(b, fn()) for b, (name, fn) in jobs}
    order = [i for _ in range(repeats) for i in range(len(jobs))]
    rng_for("threads", "order", len(jobs)).shuffle(order)
    barrier = threading.Barrier(workers)

    def work(chunk: list[int]) -> list[tuple[str, list[np.ndarray]]]:
        barrier.wait()
        out = []
        for i in chunk:
            b, (name, fn) = jobs[i]
            out.append((name, _to_numpy(b, fn())))
        return out

    chunks = [order[w::workers] for w in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        results = [r for part in pool.map(work, chunks) for r in part]
    assert len(results) == len(order)
    for name, got in results:
        _assert_same(name, got, serial[name])


# ------------------------------------------------------------------------------------------


def test_concurrent_calls_match_serial_all_backends() -> None:
    """Every selected backend at once, several paths and options each, 6 threads
    (array_api_strict without its jit flags here: they are process-wide, and this test
    takes no ``backend`` fixture to hold them)."""
    jobs = [(b, job) for b in BACKENDS for job in _jobs(b)]
    if "numpy" in BY_NAME:
        jobs += [(BY_NAME["numpy"], job) for job in _numpy_threaded_jobs()]
    with _blas_on_one_thread():  # NumPy's worker threads run where it is
        _run_concurrently(jobs, repeats=3, workers=6)


def test_concurrent_calls_per_backend(backend: Backend) -> None:
    """One backend (array_api_strict's flags are process-wide: the worker threads run
    under them too), 3 shapes x 8 option sets, 4 threads."""
    jobs = [(backend, job) for job in _jobs(backend, many_shapes=True)]
    _run_concurrently(jobs, repeats=2, workers=4)


def test_memo_evicts_while_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call memo holds 5 calls per array type here, so with 3 shapes x 8 option sets
    in flight it evicts hundreds of times while other threads look up and insert. Results
    stay exact, the memo never outgrows its bound, and a memoised call gives what the same
    call gives after the memo is cleared."""
    monkeypatch.setattr(_memo, "MAX_ENTRIES", 5)
    monkeypatch.setattr(_memo, "_tables", {})
    jobs = [
        (b, job)
        for b in BACKENDS
        if b.name in ("numpy", "torch")
        for job in _jobs(b, many_shapes=True)
    ]
    if not jobs:
        b = BACKENDS[0]
        jobs = [(b, job) for job in _jobs(b, many_shapes=True)]
    sizes: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            sizes.extend(len(memo) for memo in list(_memo._tables.values()))
            time.sleep(1e-4)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        _run_concurrently(jobs, repeats=3, workers=6)
    finally:
        stop.set()
        watcher.join()
    assert max(sizes) <= 5 + 6  # the bound, plus at most one insert per thread in flight
    b = jobs[0][0]
    rng = rng_for("threads", "plan-check")
    q = b.asarray(randn(rng, (2, 4, 3, 8)), "float32")
    k = b.asarray(randn(rng, (2, 2, 5, 8)), "float32")
    memoised = attend(q, k, k, causal=True)
    assert plan(q, k, k, causal=True) == plan(q, k, k, causal=True)
    _memo.clear()
    np.testing.assert_array_equal(b.to_numpy(attend(q, k, k, causal=True)), b.to_numpy(memoised))


def _blas_threads() -> list[int]:
    """The BLAS libraries' thread counts, as threadpoolctl's public ``threadpool_info``
    reports them."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


def _blas_on_one_thread() -> Any:
    """threadpoolctl's limit of every BLAS to one thread (the user's opt-in to NumPy's
    worker threads), or nothing where threadpoolctl is not installed."""
    try:
        import threadpoolctl
    except ImportError:
        return contextlib.nullcontext()
    return threadpoolctl.threadpool_limits(1, user_api="blas")


@requires_backend("numpy")
def test_numpy_leaves_the_blas_thread_count_alone() -> None:
    """While big calls run on other threads (4M scores and more: the size that runs the
    loop's worker threads when the BLAS is on one), the BLAS thread count read from this
    thread stays what it was: the count is process-wide, and the kernel once pinned it to
    1 for the length of each call, slowing the BLAS work of the user's other threads."""
    before = _blas_threads()
    if not before or max(before) == 1:
        pytest.skip(f"no BLAS on more than one thread ({before})")
    stop = threading.Event()
    seen: list[list[int]] = []
    calls = [job for _, job in _numpy_threaded_jobs()]

    def loop() -> None:
        while not stop.is_set():
            for fn in calls:
                fn()

    workers = [threading.Thread(target=loop) for _ in range(2)]
    for t in workers:
        t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            seen.append(_blas_threads())
    finally:
        stop.set()
        for t in workers:
            t.join(60)
    assert seen and all(s == before for s in seen), {tuple(s) for s in seen}
    assert _blas_threads() == before


@requires_backend("numpy")
def test_numpy_threads_where_the_blas_is_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``threadpool_limits(1, "blas")`` a big call runs NumPy's worker threads,
    with the same numbers as the same call on this thread and a threaded BLAS (to the
    tolerance: a matrix product of other block sizes may round otherwise); it leaves the
    user's limit as it found it."""
    before = _blas_threads()
    if not before:
        pytest.skip("threadpoolctl finds no BLAS: the loop runs no threads of its own")
    (_, big), (_, masked) = _numpy_threaded_jobs()
    want = [big(), *masked()]
    pools: list[Any] = []
    executor = numpy_loop._executor

    def counted() -> Any:  # the loop's pool, counted each time a call takes it
        pools.append(executor())
        return pools[-1]

    monkeypatch.setattr(numpy_loop, "_executor", counted)
    big()
    assert pools == [] or max(before) == 1  # a threaded BLAS: the call ran on this thread
    with _blas_on_one_thread():
        got = [big(), *masked()]
        assert len(pools) >= 1 or numpy_loop.WORKERS == 1
        assert max(_blas_threads()) == 1
    rtol, atol = tolerance("float32")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


_FORKED = """
import os, threading
import numpy as np
import threadpoolctl
from portable_attention import attend
from portable_attention.backends import numpy as nb

q = np.random.default_rng(0).standard_normal((1, 8, 1024, 32), dtype=np.float32)
assert q.shape[1] * q.shape[2] ** 2 >= nb.THREADS_MIN_SCORES  # the threaded loop
with threadpoolctl.threadpool_limits(1, user_api="blas"):  # its own threads, in both
    want = attend(q, q, q)  # the parent starts the pool
    assert any(t.name.startswith("portable_attention") for t in threading.enumerate())
    pid = os.fork()
    if pid == 0:
        os._exit(0 if np.array_equal(attend(q, q, q), want) else 3)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


_NESTED = """
import os, threading
import numpy as np
import threadpoolctl
import portable_attention as pa

q = np.random.default_rng(0).standard_normal((1, 8, 1024, 32), dtype=np.float32)
inner = []


def score_mod(s, b, h, q_idx, kv_idx):
    if threading.current_thread().name.startswith("portable_attention") and not inner:
        inner.append(pa.attend(q, q, q))  # a big call from a pool thread
    return s


with threadpoolctl.threadpool_limits(1, user_api="blas"):
    done = []
    t = threading.Thread(target=lambda: done.append(pa.attend(q, q, q, score_mod=score_mod)))
    t.start()
    t.join(60)
    ok = not t.is_alive() and np.allclose(done[0], pa.attend(q, q, q), atol=1e-5) and bool(inner)
    print("ok" if ok else ("hung" if t.is_alive() else "wrong"), flush=True)
os._exit(0)
"""


@requires_backend("numpy")
def test_threaded_call_inside_a_pool_thread() -> None:
    """A ``score_mod`` that makes a big NumPy call of its own while it runs on one of the
    loop's pool threads: the inner call runs on that thread (its helpers would queue
    behind it), and neither call waits for the other forever."""
    _blas_threads()
    assert run_python(_NESTED, timeout=120).strip() == "ok"


@requires_backend("numpy")
def test_threaded_kernel_in_a_forked_child() -> None:
    """A child forked after the parent's threaded call (multiprocessing's default on Linux
    before Python 3.14) inherits the pool without its threads: the call must not wait for
    them forever, and gives the parent's result."""
    _blas_threads()
    assert run_python(_FORKED, timeout=120).strip() == "child exit 0"


_FIRST_CALLS = """
import threading
import numpy as np
import portable_attention as pa

q = np.ones((1, 2, 8, 4))
barrier = threading.Barrier(8)
errors = []

def first_call():
    barrier.wait()  # all at once: the adapter's module is imported by one of them
    try:
        pa.attend(q, q, q)
    except Exception as err:
        errors.append(repr(err))

threads = [threading.Thread(target=first_call) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(errors), errors[:1])
"""


def test_first_calls_from_several_threads_at_once() -> None:
    """The first calls of a process, made by 8 threads at once (a dask or thread-pool
    worker's first tasks), all run: a thread that finds the adapter's module still being
    imported by another waits for it (before, 6-7 of 8 raised AttributeError: partially
    initialized module 'portable_attention.backends.numpy')."""
    for _ in range(3):
        assert run_python(_FIRST_CALLS, timeout=120).strip() == "0 []"
