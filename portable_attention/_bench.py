"""``python -m portable_attention bench``: our time against each framework's anchor.

For each installed backend and shape it prints our time (``attend`` with
``implementation="auto"``, the path ``plan()`` names), the anchor's time on the same
arrays in the same run, the throughput ratio ``anchor_time / our_time`` (>= 1 means we
are faster), GFLOP/s and the process's peak RSS so far. Times are medians of 15 samples
after warm-up, alternating ours and the anchor, each sample the median of a batch of
calls timed one by one; the ratio is the median of the ratios of samples taken side by
side. Anchors: torch SDPA called directly, ``jax.nn.dot_product_attention`` under
``jax.jit``, and for NumPy the seed-style formula (matmul, divide by sqrt(d), subtract
max, exp, divide by sum, matmul) and torch SDPA. The NumPy rows pause before each sample
(``SETTLE_S``): each thread pool's workers spin after its calls and would otherwise slow
the other down; untimed calls (``WARM_S``) follow each pause.

``--memory`` runs NumPy at ``B=1, H=8, L=16384, D=64`` float32 in a subprocess and
reports its peak RSS (``VmHWM``: ``ru_maxrss`` would carry the parent's peak over exec).

``--fast-paths`` runs only the rows of call classes torch's SDPA cannot take whole (a
window, packed sequences, a score_mod) at long context, for each of ``--backends``, at
``--lengths`` for ``--passes`` (``fwd``, ``fwd+bwd``) in ``--rounds`` interleaved rounds:
:mod:`portable_attention._bench_paths`.

``--training`` adds the training rows (:func:`training_rows`): forward + backward at long
context, each measurement in a fresh subprocess (its peak RSS is that call's), ours and the
anchor's subprocesses alternating so that drift in the machine's speed hits both alike:
torch ``attend(causal=True, softcap=30.0)`` (the blockwise ``autograd.Function``) against
SDPA ``is_causal=True``; JAX ``jit(grad)`` of ``attend(causal=True)`` against ``jit(grad)``
of ``jax.nn.dot_product_attention(is_causal=True)``, with compile times and the compiled
programs' ``memory_analysis()`` temporaries; NumPy ``attend_backward`` (peak RSS), and the
causal forward against the unmasked one (blocks that causal masks are skipped).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from portable_attention import attend, plan

SHAPES = [(1, 8, 128, 64), (4, 8, 512, 64), (1, 8, 2048, 64)]
#: The path column of a control row: the anchor timed against itself.
CONTROL = "control: SDPA itself"
DECODE = ((1, 8, 1, 64), (1, 8, 512, 64))  # one query against a 512-key cache


def _calibrate(fn: Callable[[], Any], budget: float, repeats: int) -> int:
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(10_000, int(budget / repeats / once)))


#: Pause before each sample when ours and the anchor run on different thread pools:
#: OpenBLAS's and torch's OpenMP worker threads spin for a while after a call, taking the
#: other's cores (SDPA ran 2-3x slower right after NumPy calls here). OpenBLAS's workers
#: spin for 2**28 TSC cycles by default, 0.12 s at this machine's 2.3 GHz: with a 0.15 s
#: pause, SDPA still read 0.31-0.36 ms instead of 0.21 in 2 of 9 runs.
SETTLE_S = 0.3
#: Untimed calls for this long after each pause: after 0.3 s idle, this VM's host woke
#: torch's threads slowly for many calls (SDPA at 128 read 0.25-1.7 ms instead of 0.22,
#: and at decode 0.12-1.1 ms instead of 0.04, in a third of runs); one untimed call did
#: not cure it, 0.05 s of calls did in every run tried.
WARM_S = 0.05


def _medians(
    ours: Callable[[], Any],
    anchor: Callable[[], Any],
    *,
    budget: float = 1.0,
    repeats: int = 15,
    settle: float = 0.0,
    warm: float = 0.0,
) -> Timing:
    """Median seconds per call of ``ours`` and ``anchor`` after warm-up, and the median
    of the ratios of the samples taken side by side.

    Samples alternate between the two (ours, anchor, anchor, ours, ours, ...) so that
    drift in the machine's speed hits both alike and neither always runs first; each
    sample times a batch of calls one by one and takes their median. Where ``settle`` is
    given, each sample starts with a pause of that many seconds, then ``warm`` seconds
    of untimed calls (at least one). After an idle pause this VM's host stalls single
    calls by 4-14 ms (SDPA at 128: 0.22 ms calls, one of 5,000-15,000 us in the first
    few of a batch), and a batch's mean made SDPA read 0.25-1.7 ms in a third of runs.
    The ratio pairs each sample of ours with the anchor's next to it in time: the
    machine's speed drifts by tens of percent within a minute here, and a ratio of two
    medians keeps part of that drift where the pairs cancel it.
    """
    n_ours = _calibrate(ours, budget / 2, repeats)
    n_anchor = _calibrate(anchor, budget / 2, repeats)
    samples: tuple[list[float], list[float]] = ([], [])
    pair = ((ours, n_ours, samples[0]), (anchor, n_anchor, samples[1]))
    for i in range(repeats):
        for fn, n, out in pair if i % 2 == 0 else pair[::-1]:  # neither always goes first
            if settle:
                time.sleep(settle)
                end = time.perf_counter() + warm
                fn()
                while time.perf_counter() < end:
                    fn()
            times = []
            for _ in range(n):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out.append(statistics.median(times))
    ratios = [theirs / mine for mine, theirs in zip(*samples, strict=True)]
    return Timing(
        statistics.median(samples[0]), statistics.median(samples[1]), statistics.median(ratios)
    )


class Timing(NamedTuple):
    ours: float  # seconds per call, median
    anchor: float
    ratio: float  # anchor / ours, median over pairs of samples taken side by side


def _peak_rss_mib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 1024 / 1024


def seed_formula(q: Any, k: Any, v: Any) -> Any:
    """The seed's NumPy attention, the anchor for NumPy, in the inputs' dtype.

    The seed divides by ``np.sqrt(d_k)``, a float64 NumPy scalar: under NumPy 1 float32
    scores stayed float32, under NumPy 2 (NEP 50) they become float64, and every later
    pass runs at half speed (2.2-2.8x slower in all at these shapes). The anchor divides
    by a Python float, so it computes in float32 as the seed meant, not in float64.
    """
    scores = np.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
    weights = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return np.matmul(weights, v)


def _inputs(q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal(q_shape, dtype=np.float32)
    k = rng.standard_normal(kv_shape, dtype=np.float32)
    v = rng.standard_normal(kv_shape, dtype=np.float32)
    return q, k, v


def _cases() -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    cases: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = [(str(s), s, s) for s in SHAPES]
    cases.append(("decode " + str(DECODE[1]), *DECODE))
    return cases


def _row(
    backend: str, name: str, path: str, timing: Timing, anchor: str, flops: float
) -> dict[str, Any]:
    return {
        "backend": backend,
        "shape": name,
        "path": path,
        "ours_ms": timing.ours * 1e3,
        "anchor": anchor,
        "anchor_ms": timing.anchor * 1e3,
        "ratio": timing.ratio,
        "gflops": flops / timing.ours / 1e9,
        "peak_rss_mib": _peak_rss_mib(),
    }


def _bench_numpy(rows: list[dict[str, Any]], budget: float) -> None:
    """Against the seed formula, then (all NumPy rows done first, so that torch's threads
    never run between NumPy samples) against torch SDPA, with a pause before each sample."""
    cases = []
    for name, qs, kvs in _cases():
        q, k, v = _inputs(qs, kvs)
        cases.append((name, (q, k, v), plan(q, k, v).path, _flops(qs, kvs)))
    pause, warm = (x * min(1.0, budget) for x in (SETTLE_S, WARM_S))  # tests: shorter
    for name, (q, k, v), path, flops in cases:
        timing = _medians(
            lambda: attend(q, k, v),  # noqa: B023
            lambda: seed_formula(q, k, v),  # noqa: B023
            budget=budget,
            settle=pause,  # between our calls and the BLAS-threaded formula
            warm=warm,
        )
        rows.append(_row("numpy", name, path, timing, "seed formula", flops))
    if importlib.util.find_spec("torch") is None:
        return
    import torch
    import torch.nn.functional as F

    for name, (q, k, v), path, flops in cases:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        timing = _medians(
            lambda: attend(q, k, v),  # noqa: B023
            lambda: F.scaled_dot_product_attention(tq, tk, tv),  # noqa: B023
            budget=budget,
            settle=pause,
            warm=warm,
        )
        rows.append(_row("numpy", name, path, timing, "torch SDPA", flops))


def _flops(q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> float:
    """Multiply-adds of the two matmuls, counted as 2 FLOPs each."""
    return 4.0 * math.prod(q_shape[:-1]) * kv_shape[-2] * q_shape[-1]


def _bench_torch(rows: list[dict[str, Any]], budget: float) -> None:
    """Each shape against SDPA, then SDPA against itself: the control row's distance from
    1.00 is the harness's noise on this machine, in the same run."""
    import torch
    import torch.nn.functional as F

    for name, qs, kvs in _cases():
        q, k, v = (torch.from_numpy(x) for x in _inputs(qs, kvs))
        flops = _flops(qs, kvs)
        with torch.inference_mode():
            path = plan(q, k, v).path
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: B023, E731
            timing = _medians(lambda: attend(q, k, v), sdpa, budget=budget)  # noqa: B023
            control = _medians(sdpa, sdpa, budget=budget)
        rows.append(_row("torch", name, path, timing, "torch SDPA", flops))
        rows.append(_row("torch", name, CONTROL, control, "torch SDPA", flops))


def _bench_jax(rows: list[dict[str, Any]], budget: float) -> None:
    import jax
    import jax.numpy as jnp

    ours_fn = jax.jit(lambda q, k, v: attend(q, k, v))
    anchor_fn = jax.jit(
        lambda q, k, v: jnp.swapaxes(
            jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v))), 1, 2
        )
    )
    for name, qs, kvs in _cases():
        q, k, v = (jnp.asarray(x) for x in _inputs(qs, kvs))
        flops = _flops(qs, kvs)
        path = plan(q, k, v).path
        timing = _medians(
            lambda: ours_fn(q, k, v).block_until_ready(),  # noqa: B023
            lambda: anchor_fn(q, k, v).block_until_ready(),  # noqa: B023
            budget=budget,
        )
        rows.append(_row("jax", name, path + " (jit)", timing, "jax.nn (jit)", flops))


BENCHES = {"numpy": _bench_numpy, "torch": _bench_torch, "jax": _bench_jax}


def _memory_case() -> dict[str, Any]:
    code = (
        "import numpy as np, time\n"
        "from portable_attention import attend, plan\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v = (rng.standard_normal((1, 8, 16384, 64), dtype=np.float32) for _ in range(3))\n"
        "t = time.perf_counter(); out = attend(q, k, v); t = time.perf_counter() - t\n"
        "hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
        "print(plan(q, k, v).path, t, hwm)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return {"path": done[0], "seconds": float(done[1]), "peak_rss_mib": int(done[2]) / 1024}


# ------------------------------------------------------------------------------------------
# Training rows: forward + backward at long context, each measurement in its own process

#: ``[B, H, L, D]`` of the training rows, float32: (torch L, JAX L, JAX L for compile and
#: memory only, NumPy L).
TRAINING_SHAPES = {"torch": (8192,), "jax": (4096,), "jax-compile": (16384,), "numpy": (16384,)}
TRAINING_HEADS, TRAINING_DIM = 8, 64
#: Subprocess pairs (ours, anchor) per timed row; each process times its call after one
#: untimed call.
TRAINING_PAIRS = 3


def _vm_hwm_mib() -> float:
    """This process's peak RSS (``VmHWM``) in MiB."""
    with open("/proc/self/status") as fh:
        return int(fh.read().split("VmHWM:")[1].split()[0]) / 1024


def _training_inputs(length: int) -> tuple[Any, Any, Any]:
    return _inputs(*((1, TRAINING_HEADS, length, TRAINING_DIM),) * 2)


def worker(kind: str, length: int) -> None:
    """One measurement, run in a fresh process: prints one JSON line (seconds of the
    fastest timed call after an untimed one, peak RSS, and for JAX compile seconds and the
    compiled program's temporaries). ``kind``: ``torch-ours``, ``torch-sdpa``,
    ``jax-ours``, ``jax-nn``, ``jax-ours-compile``, ``jax-nn-compile``,
    ``numpy-backward``, ``numpy-causal``, ``numpy-unmasked``."""
    result: dict[str, Any] = {"kind": kind, "length": length}
    framework = kind.split("-")[0]
    run = {"torch": _worker_torch, "jax": _worker_jax, "numpy": _worker_numpy}[framework]
    run(kind, length, result)
    result["peak_rss_mib"] = _vm_hwm_mib()
    print(json.dumps(result))


def _timed(fn: Callable[[], Any], result: dict[str, Any], repeats: int = 2) -> None:
    """Seconds of the fastest of ``repeats`` calls after an untimed one (first-call costs:
    allocator, threads, caches). The fastest: on this shared machine other processes
    only ever slow a call down."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    result["seconds"] = min(times)


def _worker_torch(kind: str, length: int, result: dict[str, Any]) -> None:
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _training_inputs(length))
    if kind == "torch-ours":
        result["path"] = plan(q, k, v, causal=True, softcap=30.0).path

        def forward() -> Any:
            return attend(q, k, v, causal=True, softcap=30.0)
    else:
        result["path"] = "SDPA is_causal=True"

        def forward() -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step() -> None:
        out = forward()
        out.backward(torch.ones_like(out))
        for x in (q, k, v):
            x.grad = None

    _timed(step, result)


def _worker_jax(kind: str, length: int, result: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in _training_inputs(length))
    if kind.startswith("jax-ours"):
        result["path"] = plan(q, k, v, causal=True).path + " (jit(grad))"

        def loss(q: Any, k: Any, v: Any) -> Any:
            return attend(q, k, v, causal=True).sum()
    else:
        result["path"] = "jax.nn is_causal=True (jit(grad))"

        def loss(q: Any, k: Any, v: Any) -> Any:
            btnh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
            return jax.nn.dot_product_attention(*btnh, is_causal=True).sum()

    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    result["compile_s"] = time.perf_counter() - start
    memory = compiled.memory_analysis()
    result["temp_mib"] = None if memory is None else memory.temp_size_in_bytes / 2**20
    if not kind.endswith("-compile"):
        _timed(lambda: jax.block_until_ready(compiled(q, k, v)), result)


def _worker_numpy(kind: str, length: int, result: dict[str, Any]) -> None:
    from portable_attention import attend_backward

    q, k, v = _training_inputs(length)
    if kind == "numpy-backward":
        out, lse = attend(q, k, v, causal=True, return_lse=True)
        dout = np.ones_like(out)
        result["path"] = "attend_backward (blockwise)"
        _timed(lambda: attend_backward(dout, q, k, v, out, lse, causal=True), result, 1)
    else:
        causal = kind == "numpy-causal"
        result["path"] = plan(q, k, v, causal=causal).path
        _timed(lambda: attend(q, k, v, causal=causal), result, 1)


def _measure(kind: str, length: int) -> dict[str, Any]:
    code = f"from portable_attention import _bench; _bench.worker({kind!r}, {length})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        msg = f"bench worker {kind} L={length} failed:\n{done.stderr[-3000:]}"
        raise RuntimeError(msg)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _pairs(ours: str, anchor: str, length: int, pairs: int) -> tuple[list[dict], list[dict]]:
    """``pairs`` alternating subprocess measurements of ``ours`` and ``anchor``."""
    mine: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for i in range(pairs):
        order = ((ours, mine), (anchor, theirs)) if i % 2 == 0 else ((anchor, theirs), (ours, mine))
        for kind, into in order:
            into.append(_measure(kind, length))
    return mine, theirs


def _training_row(
    backend: str,
    call: str,
    length: int,
    mine: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
    anchor: str,
) -> dict[str, Any]:
    """A row from measurements of ours and the anchor: median seconds, the median of the
    paired time ratios (anchor / ours), peak RSS (median) and its ratio (ours / anchor)."""

    def median(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    row: dict[str, Any] = {
        "backend": backend,
        "call": call,
        "shape": str((1, TRAINING_HEADS, length, TRAINING_DIM)),
        "path": mine[0]["path"],
        "anchor": anchor,
        "ours_s": median(mine, "seconds"),
        "anchor_s": median(theirs, "seconds"),
        "ours_rss_mib": median(mine, "peak_rss_mib"),
        "anchor_rss_mib": median(theirs, "peak_rss_mib"),
        "ours_compile_s": median(mine, "compile_s"),
        "anchor_compile_s": median(theirs, "compile_s"),
        "ours_temp_mib": median(mine, "temp_mib"),
        "anchor_temp_mib": median(theirs, "temp_mib"),
    }
    paired = [
        t["seconds"] / m["seconds"]
        for m, t in zip(mine, theirs, strict=True)
        if m.get("seconds") and t.get("seconds")
    ]
    row["time_ratio"] = statistics.median(paired) if paired else None
    if row["ours_rss_mib"] and row["anchor_rss_mib"]:
        row["rss_ratio"] = row["ours_rss_mib"] / row["anchor_rss_mib"]
    else:
        row["rss_ratio"] = None
    return row


def training_rows(backends: list[str], pairs: int = TRAINING_PAIRS) -> list[dict[str, Any]]:
    """The training rows of the installed ``backends`` (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    if "torch" in backends:
        for length in TRAINING_SHAPES["torch"]:
            mine, theirs = _pairs("torch-ours", "torch-sdpa", length, pairs)
            rows.append(
                _training_row(
                    "torch", "fwd+bwd causal softcap=30", length, mine, theirs, "SDPA causal"
                )
            )
    if "jax" in backends:
        for length in TRAINING_SHAPES["jax"]:
            mine, theirs = _pairs("jax-ours", "jax-nn", length, pairs)
            rows.append(
                _training_row("jax", "jit(grad) causal", length, mine, theirs, "jax.nn causal")
            )
        for length in TRAINING_SHAPES["jax-compile"]:
            mine, theirs = _pairs("jax-ours-compile", "jax-nn-compile", length, 1)
            rows.append(
                _training_row(
                    "jax", "jit(grad) causal, compile", length, mine, theirs, "jax.nn causal"
                )
            )
    if "numpy" in backends:
        for length in TRAINING_SHAPES["numpy"]:
            mine = [_measure("numpy-backward", length)]
            rows.append(_training_row("numpy", "attend_backward causal", length, mine, [{}], "-"))
            mine, theirs = _pairs("numpy-causal", "numpy-unmasked", length, pairs)
            rows.append(
                _training_row("numpy", "forward causal", length, mine, theirs, "forward unmasked")
            )
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_training(rows: list[dict[str, Any]]) -> None:
    """The training rows as a table (times in seconds, memory in MiB)."""
    print(
        f"\n{'backend':<7} {'call':<27} {'L':>6} {'path':<33} {'ours s':>7} {'anchor':<17} "
        f"{'anchor s':>8} {'speed':>6} {'RSS':>6} {'anch RSS':>8} {'RSS x':>6} "
        f"{'compile':>8} {'anch cmp':>8} {'temp':>6} {'anch tmp':>8}"
    )
    for r in rows:
        length = r["shape"].split(", ")[2]
        print(
            f"{r['backend']:<7} {r['call']:<27} {length:>6} {r['path']:<33} "
            f"{_fmt(r['ours_s'], '7.2f')} {r['anchor']:<17} {_fmt(r['anchor_s'], '8.2f')} "
            f"{_fmt(r['time_ratio'], '6.2f')} {_fmt(r['ours_rss_mib'], '6.0f')} "
            f"{_fmt(r['anchor_rss_mib'], '8.0f')} {_fmt(r['rss_ratio'], '6.2f')} "
            f"{_fmt(r['ours_compile_s'], '8.1f')} {_fmt(r['anchor_compile_s'], '8.1f')} "
            f"{_fmt(r['ours_temp_mib'], '6.0f')} {_fmt(r['anchor_temp_mib'], '8.0f')}"
        )
    print(
        "speed = anchor time / our time (>= 1: attend is at least as fast); RSS x = our peak "
        "RSS / the anchor's (each its own process); compile s and temp MiB (JAX "
        "memory_analysis temporaries) of jit(grad); B=1, H=8, D=64, float32"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(prog="python -m portable_attention bench")
    parser.add_argument("--backends", default=",".join(BENCHES), help="comma-separated")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per timing")
    parser.add_argument("--memory", action="store_true", help="NumPy L=16384 peak RSS")
    parser.add_argument(
        "--training",
        action="store_true",
        help="also forward + backward at long context, peak RSS and compile (minutes)",
    )
    parser.add_argument("--training-only", action="store_true", help="only the training rows")
    parser.add_argument(
        "--fast-paths",
        action="store_true",
        help="only the window, packed and score_mod rows of --backends at long context, "
        "every package path against the framework's causal kernel and Flex (minutes)",
    )
    parser.add_argument(
        "--lengths", help="with --fast-paths: comma-separated lengths (default 4096,8192)"
    )
    parser.add_argument(
        "--passes", default="fwd,fwd+bwd", help="with --fast-paths: fwd, fwd+bwd or both"
    )
    parser.add_argument(
        "--rounds", type=int, help="with --fast-paths: timed rounds per row (default 3)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.fast_paths:
        return _fast_paths(parser, args)
    rows: list[dict[str, Any]] = []
    installed = []
    for backend in args.backends.split(","):
        if backend not in BENCHES:
            parser.error(f"unknown backend {backend!r}; choose from {', '.join(BENCHES)}")
        if importlib.util.find_spec(backend) is None:
            print(f"{backend}: not installed, skipped", file=sys.stderr)
            continue
        installed.append(backend)
        if args.training_only:
            continue
        print(f"{backend}: measuring ...", file=sys.stderr, flush=True)
        BENCHES[backend](rows, args.budget)
    result: dict[str, Any] = {"rows": rows}
    if rows:
        _print_rows(rows)
    if args.training or args.training_only:
        print("training rows: measuring (a process per measurement) ...", file=sys.stderr)
        result["training"] = training_rows(installed)
        print_training(result["training"])
    if args.memory:
        mem = _memory_case()
        result["memory"] = mem
        print(
            f"numpy B=1 H=8 L=16384 D=64 float32: path {mem['path']}, "
            f"{mem['seconds']:.2f} s, peak RSS {mem['peak_rss_mib']:.0f} MiB"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


def _fast_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--fast-paths``: :mod:`portable_attention._bench_paths`' rows of the installed
    ``--backends``, alone."""
    from portable_attention import _bench_paths

    backends = []
    for backend in args.backends.split(","):
        if backend not in _bench_paths.BACKENDS:
            parser.error(f"unknown backend {backend!r}; choose from {', '.join(BENCHES)}")
        if importlib.util.find_spec(backend) is None:
            print(f"{backend}: not installed, skipped", file=sys.stderr)
        else:
            backends.append(backend)
    passes = tuple(args.passes.split(","))
    if not set(passes) <= set(_bench_paths.PASSES):
        parser.error(f"--passes takes {', '.join(_bench_paths.PASSES)}, got {args.passes!r}")
    lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
    print("fast-path rows: measuring (minutes) ...", file=sys.stderr)
    table = _bench_paths.rows(tuple(backends), lengths, passes, args.rounds)
    _bench_paths.print_rows(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"fast_paths": table}, fh, indent=2)
    return 0


def _print_rows(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'backend':<7} {'shape':<26} {'path':<20} {'ours ms':>9} {'anchor':<13} "
        f"{'anchor ms':>9} {'ratio':>6} {'GFLOP/s':>8} {'peak RSS MiB':>12}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['backend']:<7} {r['shape']:<26} {r['path']:<20} {r['ours_ms']:>9.3f} "
            f"{r['anchor']:<13} {r['anchor_ms']:>9.3f} {r['ratio']:>6.2f} "
            f"{r['gflops']:>8.1f} {r['peak_rss_mib']:>12.0f}"
        )
    print("ratio = anchor time / our time (>= 1: attend is at least as fast)")
    if any(r["path"] == CONTROL for r in rows):
        print(f"{CONTROL!r} rows time SDPA against itself: their distance from 1 is the noise")
