"""One prepared GPU check (run where an NVIDIA GPU exists; nothing here runs in CI).

    python benchmarks/gpu_check.py

For torch CUDA (float16/bfloat16/float32), JAX on GPU and CuPy: which path ``plan()``
picks, agreement of that path with the portable path (max abs error), rows with no key
giving exactly 0, and the ratio of our time to each anchor (torch SDPA, jax.nn with
cudnn). Prints one line per check and exits 1 on any disagreement.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from portable_attention import attend, plan

SHAPES = [(1, 8, 128, 64), (4, 8, 512, 64), (1, 8, 2048, 64)]
TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 2e-3}
failures: list[str] = []


def timed(fn: Callable[[], Any], sync: Callable[[], Any], repeats: int = 20) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def check(name: str, err: float, tol: float, extra: str = "") -> None:
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max abs err {err:.2e} (tol {tol}) {extra}")
    if not ok:
        failures.append(name)


def torch_cuda() -> None:
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("torch: no CUDA device")
        return
    rng = np.random.default_rng(0)
    for dtype in ("float16", "bfloat16", "float32"):
        dt = getattr(torch, dtype)
        for shape in SHAPES:
            q, k, v = (
                torch.tensor(rng.standard_normal(shape), dtype=dt, device="cuda") for _ in range(3)
            )
            for kw in ({}, {"causal": True}):
                p = plan(q, k, v, **kw)
                out = attend(q, k, v, **kw)
                ref = attend(q, k, v, implementation="portable", **kw)
                err = float((out.float() - ref.float()).abs().max())
                ours = timed(lambda: attend(q, k, v, **kw), torch.cuda.synchronize)  # noqa: B023
                is_causal = bool(kw)
                anchor = timed(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),  # noqa: B023
                    torch.cuda.synchronize,
                )
                check(
                    f"torch {dtype} {shape} {kw} [{p.path}]",
                    err,
                    TOL[dtype],
                    f"ratio {anchor / ours:.2f}",
                )
    mask = torch.zeros(4, 6, dtype=torch.bool, device="cuda")
    mask[0] = True
    q = torch.randn(1, 2, 4, 8, device="cuda", dtype=torch.float16)
    out = attend(q, q[:, :, :1].expand(1, 2, 6, 8), q[:, :, :1].expand(1, 2, 6, 8), mask=mask)
    check("torch fully-masked rows are 0", float(out[:, :, 1:].abs().max()), 0.0)


def jax_gpu() -> None:
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        print("jax: no GPU backend")
        return
    rng = np.random.default_rng(0)
    for dtype in ("float16", "bfloat16", "float32"):
        for shape in SHAPES:
            q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(3))
            p = plan(q, k, v)
            ours_fn = jax.jit(lambda a, b, c: attend(a, b, c))
            ref = attend(q, k, v, implementation="portable")
            err = float(jnp.max(jnp.abs(ours_fn(q, k, v).astype(float) - ref.astype(float))))
            btnh = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
            impl = "cudnn" if dtype != "float32" else None
            anchor_fn = jax.jit(
                lambda a, b, c, impl=impl: jax.nn.dot_product_attention(
                    a, b, c, implementation=impl
                )
            )
            ours = timed(lambda: ours_fn(q, k, v).block_until_ready(), lambda: None)  # noqa: B023
            anchor = timed(lambda: anchor_fn(*btnh).block_until_ready(), lambda: None)  # noqa: B023
            check(f"jax {dtype} {shape} [{p.path}]", err, TOL[dtype], f"ratio {anchor / ours:.2f}")


def cupy_via_torch() -> None:
    import cupy

    rng = np.random.default_rng(0)
    q, k, v = (
        cupy.asarray(rng.standard_normal((2, 4, 64, 32)), dtype=cupy.float32) for _ in range(3)
    )
    p = plan(q, k, v, causal=True)
    out = attend(q, k, v, causal=True)
    ref = attend(q, k, v, causal=True, implementation="portable")
    assert isinstance(out, cupy.ndarray)
    check(f"cupy float32 [{p.path}]", float(cupy.abs(out - ref).max()), TOL["float32"])


if __name__ == "__main__":
    for mod, fn in (("torch", torch_cuda), ("jax", jax_gpu), ("cupy", cupy_via_torch)):
        if importlib.util.find_spec(mod) is None:
            print(f"{mod}: not installed")
        else:
            fn()
    print("FAILED: " + ", ".join(failures) if failures else "all GPU checks agree")
    sys.exit(1 if failures else 0)
