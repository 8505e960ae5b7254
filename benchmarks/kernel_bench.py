"""The blockwise kernel's measures: how much of a call runs per-framework code, and what
one kernel costs on each framework against that framework's own fused attention.

    python benchmarks/kernel_bench.py lines           # lines executed, per framework
    python benchmarks/kernel_bench.py jax-compile     # jit(grad) causal L=16384: compile, temps
    python benchmarks/kernel_bench.py jax-grad        # jit(grad) causal L=4096 against jax.nn's
    python benchmarks/kernel_bench.py torch-ours      # causal+softcap L=8192 fwd+bwd: time, RSS
    python benchmarks/kernel_bench.py torch-sdpa      # the same shape through SDPA (causal)
    python benchmarks/kernel_bench.py numpy           # NumPy's auto and square blocks

Each measure prints one line. Peak RSS is the process's, so ``torch-ours`` and
``torch-sdpa`` run in processes of their own; to compare two versions of the package, run
each measure with one version and then the other, alternating, several times (the
machine's speed drifts within minutes: only figures measured side by side compare).

- ``lines``: one cold ``attend(q, k, v, causal=True, softcap=20.0, chunk_size=64)``
  forward and backward on ``[1, 2, 256, 16]`` float32, traced with ``sys.settrace``:
  torch through autograd (``out.sum().backward()``), JAX as ``jax.jit(jax.grad(...))``,
  NumPy as ``attend(..., return_lse=True)`` then ``attend_backward``; each framework in
  a fresh process of its own (cold: its imports, the package's caches empty). Prints, per
  framework, the distinct lines of the package executed inside ``backends/`` (cold: the
  adapter's import counts, its module and class bodies; and of those, the lines inside
  functions, what the call itself runs) and the share
  of the lines outside ``backends/`` that torch's call executes which this call executes
  too.
- ``jax-compile``: ``jax.jit(jax.grad(loss))`` of the blockwise path, causal, ``[1, 8,
  16384, 64]`` float32: seconds to lower and compile, and XLA's temporaries (MiB).
- ``jax-grad``: warm ``jit(grad)`` of the portable blockwise path against
  ``jax.nn.dot_product_attention``'s, causal, ``[1, 8, 4096, 64]`` float32, best of 5.
- ``torch-ours`` / ``torch-sdpa``: forward + backward of ``sum(out)``, ``[1, 8, 8192, 64]``
  float32, best of 3, and the process's peak RSS; ours ``causal=True, softcap=20.0``
  (the blockwise path), SDPA ``is_causal=True`` (no softcap: the anchor).
- ``numpy``: forward of ``[1, 8, L, 64]`` float32 at L=512, 2048 and a decode step (one
  query, 4096 keys), best of 5: ``attend``'s default (the blockwise kernel with NumPy's
  loop: runs of key blocks, worker threads) and the same kernel in square blocks
  (``implementation="portable", chunk_size=256``), each as a ratio to
  the seed document's formula (``softmax(q k^T / sqrt(d)) v`` in NumPy).
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import portable_attention

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(portable_attention.__file__)))


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _traced(fn: Callable[[], Any]) -> set[tuple[str, int, bool]]:
    """The ``(file, line, in a function)`` triples of the package that ``fn()`` executes;
    the flag is False for the lines of module and class bodies (definitions, run once
    when a module is imported)."""
    root = os.path.join(PACKAGE, "portable_attention")
    seen: set[tuple[str, int, bool]] = set()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return None
        if event == "line":
            in_function = bool(frame.f_code.co_flags & inspect.CO_OPTIMIZED)
            seen.add((os.path.relpath(path, root), frame.f_lineno, in_function))
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen


def _lines_run(name: str) -> None:
    """One framework's traced call (:func:`lines`), in this fresh process: prints the
    ``(file, line, in a function)`` triples as JSON."""
    from portable_attention import attend, attend_backward

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 2, 256, 16), dtype=np.float32) for _ in range(3)]
    options = {"causal": True, "softcap": 20.0, "chunk_size": 64}

    def torch_run() -> None:
        import torch

        q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays)
        attend(q, k, v, **options).sum().backward()

    def jax_run() -> None:
        import jax
        import jax.numpy as jnp

        q, k, v = (jnp.asarray(a) for a in arrays)
        grad = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v, **options).sum(), (0, 1, 2)))
        jax.block_until_ready(grad(q, k, v))

    def numpy_run() -> None:
        q, k, v = arrays
        out, lse = attend(q, k, v, return_lse=True, **options)
        attend_backward(np.ones_like(out), q, k, v, out, lse, **options)

    if name == "torch":
        import torch  # noqa: F401  (the framework's own import is not the call)
    elif name == "jax":
        import jax  # noqa: F401
    run = {"torch": torch_run, "jax": jax_run, "numpy": numpy_run}[name]
    print(json.dumps(sorted(_traced(run))))


def lines() -> None:
    seen: dict[str, set[tuple[str, int, bool]]] = {}
    for name in ("torch", "jax", "numpy"):
        # A process each: every call cold (its imports, the package's caches empty).
        done = subprocess.run(
            [sys.executable, __file__, "lines-run", name],
            check=True, stdout=subprocess.PIPE, text=True,  # (its errors shown)
        )  # fmt: skip
        seen[name] = {tuple(x) for x in json.loads(done.stdout.splitlines()[-1])}  # type: ignore[misc]
    outside = {
        name: {x[:2] for x in s if not x[0].startswith("backends")} for name, s in seen.items()
    }
    for name, s in seen.items():
        inside = [x for x in s if x[0].startswith("backends")]
        in_calls = sum(1 for x in inside if x[2])
        share = len(outside[name] & outside["torch"]) / len(outside["torch"])
        print(
            f"lines {name}: {len(inside)} inside backends/ ({in_calls} in functions, "
            f"{len(inside) - in_calls} of definitions at import), {share:.1%} of torch's outside"
        )


def _jax_loss(length: int, impl: str) -> tuple[Any, tuple[Any, ...]]:
    import jax
    import jax.numpy as jnp

    from portable_attention import attend

    key = jax.random.key(0)
    shape = (1, 8, length, 64)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), shape) for i in range(3))
    if impl == "ours":

        def loss(q: Any, k: Any, v: Any) -> Any:
            return attend(q, k, v, causal=True, implementation="portable", chunk_size=256).sum()

    else:

        def loss(q: Any, k: Any, v: Any) -> Any:
            t = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
            return jax.nn.dot_product_attention(*t, is_causal=True).sum()

    return jax.jit(jax.grad(loss, (0, 1, 2))), (q, k, v)


def jax_compile() -> None:
    grad, args = _jax_loss(16384, "ours")
    start = time.perf_counter()
    compiled = grad.lower(*args).compile()
    seconds = time.perf_counter() - start
    temps = compiled.memory_analysis().temp_size_in_bytes / 2**20
    print(f"jax-compile L=16384: {seconds:.2f} s, temporaries {temps:.0f} MiB")


def jax_grad() -> None:
    import jax

    times = {}
    for impl in ("ours", "jax.nn"):
        grad, args = _jax_loss(4096, impl)
        times[impl] = _best(lambda grad=grad, args=args: jax.block_until_ready(grad(*args)), 5)
    ratio = times["ours"] / times["jax.nn"]
    ours, theirs = times["ours"] * 1e3, times["jax.nn"] * 1e3
    print(f"jax-grad L=4096: ours {ours:.0f} ms, jax.nn {theirs:.0f} ms, {ratio:.2f}x")


def _torch(impl: str) -> None:
    import torch

    from portable_attention import attend

    torch.manual_seed(0)
    shape = (1, 8, 8192, 64)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))

    def run() -> None:
        if impl == "ours":
            out = attend(q, k, v, causal=True, softcap=20.0)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    seconds = _best(run, 3)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch-{impl} L=8192: {seconds * 1e3:.0f} ms, peak RSS {rss:.0f} MiB")


def numpy_paths() -> None:
    from portable_attention import attend, plan

    rng = np.random.default_rng(0)
    for name, lq, lk in (("L=512", 512, 512), ("L=2048", 2048, 2048), ("decode", 1, 4096)):
        q = rng.standard_normal((1, 8, lq, 64), dtype=np.float32)
        k, v = (rng.standard_normal((1, 8, lk, 64), dtype=np.float32) for _ in range(2))

        def seed(q: Any = q, k: Any = k, v: Any = v) -> Any:
            s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            return (e / e.sum(axis=-1, keepdims=True)) @ v

        def auto(q: Any = q, k: Any = k, v: Any = v) -> Any:
            return attend(q, k, v)

        def blockwise(q: Any = q, k: Any = k, v: Any = v) -> Any:
            return attend(q, k, v, implementation="portable", chunk_size=256)

        times = {f.__name__: _best(f, 5) for f in (seed, auto, blockwise)}
        paths = plan(q, k, v).path, plan(q, k, v, implementation="portable", chunk_size=256).path
        print(
            f"numpy {name}: seed {times['seed'] * 1e3:.2f} ms, {paths[0]} "
            f"{times['auto'] / times['seed']:.2f}x, {paths[1]} (blocks of 256) "
            f"{times['blockwise'] / times['seed']:.2f}x of the seed formula"
        )


MEASURES: dict[str, Callable[[], None]] = {
    "numpy": numpy_paths,
    "lines": lines,
    "jax-compile": jax_compile,
    "jax-grad": jax_grad,
    "torch-ours": lambda: _torch("ours"),
    "torch-sdpa": lambda: _torch("sdpa"),
}

if __name__ == "__main__":
    if sys.argv[1:2] == ["lines-run"]:
        _lines_run(sys.argv[2])
        sys.exit()
    names = sys.argv[1:] or list(MEASURES)
    for name in names:
        MEASURES[name]()
