"""One prepared GPU check (run where an NVIDIA GPU exists; nothing here runs in CI).

    python benchmarks/gpu_check.py

For torch CUDA (float16/bfloat16/float32), JAX on GPU and CuPy: that ``plan()`` picks the
fused path (and, for JAX in float16/bfloat16, that the compiled program calls cuDNN's
attention), agreement of that path with the portable path (max abs error), rows with no
key giving exactly 0, and the ratio of each anchor's time to ours (torch SDPA, jax.nn
with cudnn), as in ``python -m portable_attention bench``. Prints one line per check; a
section that raises is reported as a failure and the others still run. Exits 1 on any
failure, 2 where no check ran (no GPU found).

On the project's lent device machine (torch, jax, cupy and numpy installed, but not
array-api-compat), from the repository root, with the wheel downloaded here first
(``pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl
array-api-compat``) and ``.whl`` carried::

    set -o pipefail; pip install --no-deps .whl/array_api_compat-*.whl &&
        PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py 2>&1 |
        tee $OUT/gpu_check.log
"""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from portable_attention import attend, plan

SHAPES = [(1, 8, 128, 64), (4, 8, 512, 64), (1, 8, 2048, 64)]
TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 2e-3}
failures: list[str] = []
passed: list[str] = []


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
    (passed if ok else failures).append(name)


def expect(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    (passed if ok else failures).append(name)


def section(name: str, fn: Callable[[], None]) -> None:
    """Run one backend's checks; an exception fails that section, not the script."""
    try:
        fn()
    except Exception as err:  # report and go on: device time is scarce
        traceback.print_exc()
        print(f"FAIL {name}: {type(err).__name__}: {err}")
        failures.append(name)


def torch_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        print("torch: no CUDA device")
        return
    torch_checks("cuda", SHAPES, ("float16", "bfloat16", "float32"), torch.cuda.synchronize)


def torch_checks(
    device: str, shapes: list[tuple[int, ...]], dtypes: tuple[str, ...], sync: Callable[[], Any]
) -> None:
    """The torch checks on ``device`` (the tests run them on the CPU, small)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for shape in shapes:
            q, k, v = (
                torch.tensor(rng.standard_normal(shape), dtype=dt, device=device) for _ in range(3)
            )
            for kw in ({}, {"causal": True}):
                p = plan(q, k, v, **kw)
                expect(f"torch {dtype} {shape} {kw} path", p.path == "fused:torch", p.path)
                out = attend(q, k, v, **kw)
                ref = attend(q, k, v, implementation="portable", **kw)
                err = float((out.float() - ref.float()).abs().max())
                ours = timed(lambda: attend(q, k, v, **kw), sync)  # noqa: B023
                is_causal = bool(kw)
                anchor = timed(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),  # noqa: B023
                    sync,
                )
                check(
                    f"torch {dtype} {shape} {kw} [{p.path}]",
                    err,
                    TOL[dtype],
                    f"ratio {anchor / ours:.2f}",
                )
    mask = torch.zeros(4, 6, dtype=torch.bool, device=device)
    mask[0] = True
    q = torch.randn(1, 2, 4, 8, device=device, dtype=getattr(torch, dtypes[0]))
    out = attend(q, q[:, :, :1].expand(1, 2, 6, 8), q[:, :, :1].expand(1, 2, 6, 8), mask=mask)
    check("torch fully-masked rows are 0", float(out[:, :, 1:].abs().max()), 0.0)
    # Their gradients must be finite (0) too: a repair after SDPA must not pass NaN back.
    qg = q.detach().float().requires_grad_()
    kv = qg[:, :, :1].expand(1, 2, 6, 8)
    attend(qg, kv, kv, mask=mask).sum().backward()
    grad = qg.grad
    bad = float((~torch.isfinite(grad)).sum()) if grad is not None else float("inf")
    check("torch fully-masked rows: finite gradients", bad, 0.0)


def jax_gpu() -> None:
    import jax

    if jax.default_backend() != "gpu":
        print("jax: no GPU backend")
        return
    jax_checks(SHAPES, ("float16", "bfloat16", "float32"), "fused:jax")


def jax_checks(shapes: list[tuple[int, ...]], dtypes: tuple[str, ...], path: str) -> None:
    """The JAX checks on the default device, expecting ``path`` from ``plan()`` (the tests
    run them on the CPU, small); on a GPU, half precision must call cuDNN."""
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    # Options and jax.nn's own for them: plain, causal, and a causal sliding window (jax.nn's
    # local_window_size, which cuDNN takes together with causal).
    variants = (({}, {}), ({"causal": True, "window": (16, 0)}, {"is_causal": True}))
    for dtype in dtypes:
        for shape in shapes:
            q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(3))
            for kw, nn_kw in variants:
                if "window" in kw:
                    nn_kw = {**nn_kw, "local_window_size": kw["window"]}
                p = plan(q, k, v, **kw)
                expect(f"jax {dtype} {shape} {kw} path", p.path == path, p.path)
                ours_fn = jax.jit(lambda a, b, c, kw=kw: attend(a, b, c, **kw))
                if dtype != "float32" and on_gpu:  # cuDNN takes half precision only
                    hlo = ours_fn.lower(q, k, v).compile().as_text().lower()
                    expect(f"jax {dtype} {shape} {kw} cudnn", "cudnn" in hlo, "cuDNN in the HLO")
                ref = attend(q, k, v, implementation="portable", **kw)
                err = float(jnp.max(jnp.abs(ours_fn(q, k, v).astype(float) - ref.astype(float))))
                btnh = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
                impl = "cudnn" if dtype != "float32" and on_gpu else None
                anchor_fn = jax.jit(
                    lambda a, b, c, impl=impl, nn_kw=nn_kw: jax.nn.dot_product_attention(
                        a, b, c, implementation=impl, **nn_kw
                    )
                )
                ours = timed(lambda: ours_fn(q, k, v).block_until_ready(), lambda: None)  # noqa: B023
                anchor = timed(lambda: anchor_fn(*btnh).block_until_ready(), lambda: None)  # noqa: B023
                check(
                    f"jax {dtype} {shape} {kw} [{p.path}]",
                    err,
                    TOL[dtype],
                    f"ratio {anchor / ours:.2f}",
                )


def cupy_via_torch() -> None:
    import cupy

    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver
        devices = 0
    if not devices:
        print("cupy: no CUDA device")
        return
    rng = np.random.default_rng(0)
    q, k, v = (
        cupy.asarray(rng.standard_normal((2, 4, 64, 32)), dtype=cupy.float32) for _ in range(3)
    )
    p = plan(q, k, v, causal=True)
    expect("cupy path", p.path == "fused:cupy-via-torch", p.path)
    out = attend(q, k, v, causal=True)
    ref = attend(q, k, v, causal=True, implementation="portable")
    expect("cupy result type", isinstance(out, cupy.ndarray), type(out).__name__)
    check(f"cupy float32 [{p.path}]", float(cupy.abs(out - ref).max()), TOL["float32"])


def main() -> int:
    """Every section whose framework is installed; 1 on a failure, 2 if nothing ran."""
    for mod, fn in (("torch", torch_cuda), ("jax", jax_gpu), ("cupy", cupy_via_torch)):
        if importlib.util.find_spec(mod) is None:
            print(f"{mod}: not installed")
        else:
            section(mod, fn)
    if failures:
        print("FAILED: " + ", ".join(failures))
        return 1
    if not passed:
        print("no GPU check ran: no CUDA device, no JAX GPU backend, no CuPy")
        return 2
    print(f"all {len(passed)} GPU checks agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
