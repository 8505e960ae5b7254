"""One prepared GPU check (run where an NVIDIA GPU exists; nothing here runs in CI).

    python3 benchmarks/gpu_check.py

For torch CUDA (float16/bfloat16/float32), JAX on GPU and CuPy: that ``plan()`` picks the
fused path (for torch in half precision, that SDPA runs with its math kernel disabled;
for JAX in float16/bfloat16, that the compiled program calls cuDNN's fused attention),
agreement of that path with the portable path (elementwise, within the package's one
tolerance table, :func:`gpu_tolerance`: float32 on a GPU gets float16's row for TF32),
rows with no key giving
exactly 0 and finite gradients, and the ratio of each anchor's time to ours (torch SDPA,
jax.nn with cudnn), as in ``python -m portable_attention bench``. Training (issue 16): the
blockwise path's gradients in each dtype (torch autograd, ``jax.grad``, CuPy's
``attend_backward``) as close to float32's as SDPA's or jax.nn's own gradients in that
dtype, and the training row's time ratio against SDPA. Sinks, segment ids and a
``mask_mod`` (issue 18) on the device, against the same call on the CPU in float64.
FlexAttention (issue 26, ``fused:torch-flex``): windows with softcap, segment ids, an
ALiBi score_mod, a block plan, rows with no key, sinks and ``return_lse`` (from Flex's
lse) in each dtype, forward and Flex's own backward against the CPU's float64, and its
time against SDPA's causal attention.

Each framework runs in a process of its own (``--section NAME``) under a time limit, so
that a crash or hang in one cannot take the others' results, and JAX never meets the
cuDNN torch loaded first (JAX then falls back to the CPU, and says so only in its log).
Each prints its versions and devices, then one line per check. Exits 0 when every check
passed, 1 on any failure (a section that raises, crashes or runs out of time fails,
and so does an installed framework that sees no GPU where another one does), 2 where no
check ran (no framework sees a GPU).

On the project's lent device machine (torch, jax, cupy and numpy installed, but not
array-api-compat), from the repository root, with the wheel downloaded here first
(``echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps
--only-binary=:all: --python-version 3.12 -d .whl array-api-compat``), ``.whl`` carried
and ``timeout_s=540``::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile
        --no-cache-dir --disable-pip-version-check --target /tmp/site
        .whl/array_api_compat-*.whl && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
        timeout 480 python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/gpu_check.log
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from portable_attention import attend, plan
from portable_attention.testing import Tolerance, to_numpy, tolerance

SHAPES: list[tuple[int, ...]] = [(1, 8, 128, 64), (4, 8, 512, 64), (1, 8, 2048, 64)]


def gpu_tolerance(dtype: str, on_gpu: bool) -> Tolerance:
    """The package's one table (:func:`portable_attention.testing.tolerance`), with one
    allowance: on a GPU, torch and XLA may run float32 matmuls in TF32 (float16's 10
    significand bits, float32's range) on one side of a comparison and not on the other,
    so float32 there is held to float16's row."""
    return tolerance("float16" if on_gpu and dtype == "float32" else dtype)


#: Seconds all sections may take together (compiles included), inside the command's own
#: ``timeout 480``: each section gets what the ones before it left, the slowest last.
TOTAL_TIMEOUT_S = 450
#: Exit status of a section whose framework sees no GPU.
NO_DEVICE = 3
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


def agree(name: str, got: Any, ref: Any, dtype: str, on_gpu: bool, extra: str = "") -> None:
    """``got`` within :func:`gpu_tolerance` of ``ref`` elementwise (any framework's arrays,
    compared as float64 NumPy on the host)."""
    a, r = to_numpy(got, dtype="float64"), to_numpy(ref, dtype="float64")
    rtol, atol = gpu_tolerance(dtype, on_gpu)
    if a.shape != r.shape:
        expect(name, False, f"shape {a.shape}, the portable path's {r.shape}")
        return
    diff = np.abs(a - r)
    err = float(np.max(diff)) if diff.size else 0.0
    ok = bool(np.all(diff <= atol + rtol * np.abs(r)))  # NaN fails
    bound = f"rtol {rtol:g}, atol {atol:g}"
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max abs err {err:.2e} ({bound}) {extra}")
    (passed if ok else failures).append(name)


def expect(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    (passed if ok else failures).append(name)


def section(name: str, fn: Callable[[], Any]) -> Any:
    """Run one backend's checks; an exception fails that section (None), not the script."""
    try:
        return fn()
    except Exception as err:  # report and go on: device time is scarce
        traceback.print_exc()
        print(f"FAIL {name}: {type(err).__name__}: {err}")
        failures.append(name)
        return None


def torch_cuda() -> bool:
    import torch

    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}, devices {torch.cuda.device_count()}"
    )
    if not torch.cuda.is_available():
        print("torch: no CUDA device")
        return False
    print(f"torch device 0: {torch.cuda.get_device_name(0)}")
    torch_checks("cuda", SHAPES, ("float16", "bfloat16", "float32"), torch.cuda.synchronize)
    torch_training("cuda", 1024, ("float16", "bfloat16", "float32"), torch.cuda.synchronize)
    section("torch training row", functools.partial(_torch_training_row, "cuda", 8192))
    torch_flex_checks("cuda", 2048, ("float16", "bfloat16", "float32"), torch.cuda.synchronize)
    return True


def torch_checks(
    device: str, shapes: list[tuple[int, ...]], dtypes: tuple[str, ...], sync: Callable[[], Any]
) -> None:
    """The torch checks on ``device`` (the tests run them on the CPU, small); each case in
    a section of its own, so that one that raises costs only its own checks."""
    import torch

    rng = np.random.default_rng(0)
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for shape in shapes:
            q, k, v = (
                torch.tensor(rng.standard_normal(shape), dtype=dt, device=device) for _ in range(3)
            )
            for kw in ({}, {"causal": True}):
                name = f"torch {dtype} {shape} {kw}"
                section(name, functools.partial(_torch_case, name, q, k, v, kw, dtype, sync))
        section(
            f"torch {dtype} masked rows",
            functools.partial(_torch_masked_rows, device, dt, dtype, sync),
        )


def _torch_case(
    name: str, q: Any, k: Any, v: Any, kw: dict[str, Any], dtype: str, sync: Callable[[], Any]
) -> None:
    import torch.nn.functional as F

    p = plan(q, k, v, **kw)
    expect(f"{name} path", p.path == "fused:torch", p.path)
    out = attend(q, k, v, **kw)
    ref = attend(q, k, v, implementation="portable", **kw)
    ours = timed(lambda: attend(q, k, v, **kw), sync)
    is_causal = bool(kw)
    anchor = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), sync)
    on_gpu = q.device.type == "cuda"
    agree(f"{name} [{p.path}]", out, ref, dtype, on_gpu, f"ratio {anchor / ours:.2f}")
    if q.device.type == "cuda" and dtype != "float32":
        _torch_without_math(q, k, v, kw, name)


def _torch_without_math(q: Any, k: Any, v: Any, kw: dict[str, Any], name: str) -> None:
    """SDPA's flash, memory-efficient or cuDNN kernel takes the call: with the math
    kernel disabled, a call SDPA could only run there raises."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    fast += [SDPBackend.CUDNN_ATTENTION] if hasattr(SDPBackend, "CUDNN_ATTENTION") else []
    with sdpa_kernel(fast):
        attend(q, k, v, **kw)
    expect(f"{name} fused kernel", True, "ran with SDPA's math kernel disabled")


def _torch_masked_rows(device: str, dt: Any, dtype: str, sync: Callable[[], Any]) -> None:
    """Rows with no key: outputs exactly 0 and finite gradients, in ``dt``, at Lq = 192
    (a partial 128-row tile) with a mask (cuDNN's backward was reported to give NaN there)."""
    import torch

    lq, lk = 192, 200
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    mask[1::3] = False  # every third query row sees no key
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, n, 64, device=device, generator=gen).to(dt).requires_grad_()
        for n in (lq, lk, lk)
    )
    out = attend(q, k, v, mask=mask)
    rows = float(out.detach()[:, :, 1::3].abs().max())
    check(f"torch {dtype} fully-masked rows are 0", rows, 0.0)
    out.float().sum().backward()
    sync()
    bad = sum(float((~torch.isfinite(x.grad)).sum()) for x in (q, k, v) if x.grad is not None)
    missing = sum(x.grad is None for x in (q, k, v))
    check(f"torch {dtype} fully-masked rows: finite gradients", bad + missing, 0.0)
    dq = q.grad if q.grad is not None else torch.full_like(q, float("nan"))
    check(f"torch {dtype} fully-masked rows: zero dq", float(dq[:, :, 1::3].abs().max()), 0.0)


def relative_error(got: Any, ref: Any) -> float:
    """``max |got - ref| / max |ref|`` on the host in float64 (NaN where either has one)."""
    a, r = to_numpy(got, dtype="float64"), to_numpy(ref, dtype="float64")
    scale = float(np.max(np.abs(r))) or 1.0
    return float(np.max(np.abs(a - r))) / scale


def torch_training(
    device: str, length: int, dtypes: tuple[str, ...], sync: Callable[[], Any]
) -> None:
    """The blockwise path's gradients in each dtype against SDPA's, and sinks, segment
    ids and a ``mask_mod`` against the CPU in float64 (the tests run them on the CPU)."""
    for dtype in dtypes:
        name = f"torch {dtype} blockwise gradients L={length}"
        section(name, functools.partial(_torch_blockwise_grads, name, device, dtype, length))
    section("torch sinks, segment ids, mask_mod", functools.partial(_torch_modern, device))


def _torch_blockwise_grads(name: str, device: str, dtype: str, length: int) -> None:
    """``attend(causal=True, chunk_size=length // 4)`` (the blockwise path) in ``dtype``:
    each gradient within twice SDPA's own distance, in ``dtype``, from SDPA's float64
    gradients (or the dtype's tolerance, where SDPA's distance is smaller). The reference is
    float64 so that in float32 too SDPA's distance measures its rounding (a float32
    reference would be SDPA's float32 result itself, at distance 0)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cpu").manual_seed(0)
    base = [torch.randn(1, 8, length, 64, generator=gen).to(device) for _ in range(4)]
    weight = base[3]

    def grads(fn: Callable[..., Any], dt: Any) -> list[Any]:
        xs = [x.to(dt).detach().requires_grad_() for x in base[:3]]
        (fn(*xs).float() * weight).sum().backward()
        return [x.grad for x in xs]

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    dt = getattr(torch, dtype)
    chunk = max(length // 4, 1)
    p = plan(*(x.to(dt) for x in base[:3]), causal=True, chunk_size=chunk)
    expect(f"{name} path", p.path == "portable:blockwise", p.path)
    ref = grads(sdpa, torch.float64)
    theirs = grads(sdpa, dt)
    ours = grads(lambda q, k, v: attend(q, k, v, causal=True, chunk_size=chunk), dt)
    floor = gpu_tolerance(dtype, device != "cpu").rtol
    for label, mine, other, exact in zip(("dq", "dk", "dv"), ours, theirs, ref, strict=True):
        bound = max(2 * relative_error(other, exact), floor)
        check(f"{name} {label}", relative_error(mine, exact), bound, "(relative to max |g|)")


def _torch_modern(device: str) -> None:
    """Sinks, segment ids (three packed sequences) and a sliding ``mask_mod`` with causal,
    float32 on ``device``: output and gradients against the same call in float64 on the
    CPU."""
    import torch

    from portable_attention import masks

    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(2, 4, 96, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    ids = masks.segment_ids_from_lengths(torch.tensor([[40, 30, 26], [96, 0, 0]]), 96)

    def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx - kv_idx < 24

    def run(dev: str, dt: Any) -> tuple[Any, list[Any]]:
        xs = [x.to(device=dev, dtype=dt).detach().requires_grad_() for x in (q, k, v, sinks)]
        out = attend(
            *xs[:3], causal=True, sinks=xs[3], segment_ids=ids.to(dev), mask_mod=window,
            chunk_size=32,
        )  # fmt: skip
        out.sum().backward()
        return out, [x.grad for x in xs]

    out, grads = run(device, torch.float32)
    ref_out, ref_grads = run("cpu", torch.float64)
    tol = 10 * gpu_tolerance("float32", device != "cpu").rtol
    rel = "(relative to max |x|)"
    check("torch sinks/segments/mask_mod output", relative_error(out, ref_out), tol, rel)
    for label, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        check(f"torch sinks/segments/mask_mod {label}", relative_error(g, r), tol, rel)


def torch_flex_checks(
    device: str, length: int, dtypes: tuple[str, ...], sync: Callable[[], Any]
) -> None:
    """FlexAttention (``fused:torch-flex``, issue 26) on ``device``: each call SDPA cannot
    take, asked for with ``implementation="fused"``, in each dtype, ``[1, 8, L, 64]`` (4
    K/V heads: grouped), forward (and on CUDA backward, Flex's own) against the same call
    in float64 on the CPU (the portable path), rows with no key, and its time against
    SDPA's plain causal attention. On the CPU (the tests) forward only: Flex has no CPU
    backward, lse or sinks there."""
    for dtype in dtypes:
        for label, options in _flex_calls(device, length):
            name = f"torch flex {dtype} L={length} {label}"
            case = functools.partial(_torch_flex_case, name, device, length, dtype, options, sync)
            section(name, case)


def _flex_calls(device: str, length: int) -> list[tuple[str, dict[str, Any]]]:
    """The calls of :func:`torch_flex_checks` (factories of their torch arguments)."""
    import torch

    from portable_attention import masks

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        slopes = torch.linspace(0.02, 0.3, 8, device=score.device)
        return score - slopes[h] * (q_idx - kv_idx).abs().to(score.dtype)

    def sliding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

    def late(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= 64) & (q_idx >= kv_idx)  # rows before 64 see no key

    ids = torch.arange(length) * 7 // length  # 7 packed sequences
    calls: list[tuple[str, dict[str, Any]]] = [
        ("window+softcap", {"causal": True, "window": (255, 0), "softcap": 30.0}),
        ("segment ids, causal", {"segment_ids": ids, "causal": True}),
        ("ALiBi score_mod, causal", {"score_mod": alibi, "causal": True}),
        ("block plan", {"mask_mod": masks.block_plan(sliding, length, length)}),
        ("rows with no key", {"mask_mod": late}),
    ]
    if device != "cpu":  # ... and their lse -inf (from Flex's lse)
        calls[-1][1]["return_lse"] = True
    if device != "cpu":  # Flex returns lse on CUDA: sinks merged from it, return_lse
        calls.append(("sinks, window", {"sinks": "sinks", "causal": True, "window": (127, 0)}))
        calls.append(("return_lse, segment ids", {"segment_ids": ids, "return_lse": True}))
    return calls


def _torch_flex_case(
    name: str,
    device: str,
    length: int,
    dtype: str,
    options: dict[str, Any],
    sync: Callable[[], Any],
) -> None:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cpu").manual_seed(2)
    base = [torch.randn(1, h, length, 64, generator=gen, dtype=torch.float64) for h in (8, 4, 4)]
    sinks = torch.randn(8, generator=gen, dtype=torch.float64)
    weight = torch.randn(1, 8, length, 64, generator=gen, dtype=torch.float64)

    def args(dev: str, dt: Any, grad: bool) -> tuple[list[Any], dict[str, Any]]:
        xs = [x.to(device=dev, dtype=dt).requires_grad_(grad) for x in base]
        opts = {
            key: (value.to(dev) if isinstance(value, torch.Tensor) else value)
            for key, value in options.items()
        }
        if opts.get("sinks") == "sinks":
            opts["sinks"] = sinks.to(device=dev, dtype=dt).requires_grad_(grad)
            xs.append(opts["sinks"])
        return xs, opts

    def loss(result: Any) -> Any:
        out, lse = result if isinstance(result, tuple) else (result, None)
        total = (out.double() * weight.to(out.device)).sum()
        return total + (lse.double().sum() if lse is not None else 0)

    dt = getattr(torch, dtype)
    xs, opts = args(device, dt, False)
    with torch.no_grad():  # (on the CPU, a score_mod in grad mode needs a backward)
        p = plan(*xs[:3], implementation="fused", **opts)
        expect(f"{name} path", p.path == "fused:torch-flex", p.path)
        got = attend(*xs[:3], implementation="fused", **opts)
    ref_xs, ref_opts = args("cpu", torch.float64, True)
    expected = attend(*ref_xs[:3], implementation="portable", **ref_opts)
    out, ref = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
    rtol = gpu_tolerance(dtype, device != "cpu").rtol
    rel = "(relative to max |x|)"
    check(f"{name} output", relative_error(out, ref.detach()), 2 * rtol, rel)
    if isinstance(got, tuple):
        check(f"{name} lse", relative_error(got[1], expected[1].detach()), 2 * rtol, rel)
    if name.endswith("rows with no key"):
        check(f"{name}: rows are 0", float(out[:, :, :64].abs().max()), 0.0)
        if isinstance(got, tuple):
            lse_ok = bool(torch.all(got[1][:, :, :64] == -torch.inf))
            expect(f"{name}: their lse is -inf", lse_ok, f"lse {got[1][0, 0, :3].tolist()}")
    if device != "cpu":  # Flex's own backward
        xs, opts = args(device, dt, True)
        loss(attend(*xs[:3], implementation="fused", **opts)).backward()
        loss(expected).backward()
        for label, g, r in zip(("dq", "dk", "dv", "dsinks"), xs, ref_xs, strict=False):
            check(f"{name} {label}", relative_error(g.grad, r.grad), 10 * rtol, rel)
    fq, fk, fv = (x.detach() for x in xs[:3])
    opts = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    with torch.no_grad():
        ours = timed(lambda: attend(fq, fk, fv, implementation="fused", **opts), sync, repeats=5)
        anchor = timed(
            lambda: F.scaled_dot_product_attention(fq, fk, fv, is_causal=True, enable_gqa=True),
            sync,
            repeats=5,
        )
    expect(
        f"{name} speed",
        True,
        f"Flex {ours * 1e3:.2f} ms, SDPA causal {anchor * 1e3:.2f} ms, ratio {anchor / ours:.2f}",
    )


def _torch_training_row(device: str, length: int) -> None:
    """The training row of ``python -m portable_attention bench``: ``[1, 8, L, 64]``
    float32, ``causal=True, softcap=30.0`` forward + backward, against SDPA's causal."""
    import torch
    import torch.nn.functional as F

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(1, 8, length, 64, generator=gen).to(device).requires_grad_() for _ in range(3)
    )

    def step(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            fn().sum().backward()
            for x in (q, k, v):
                x.grad = None

        return run

    path = plan(q, k, v, causal=True, softcap=30.0).path
    ours = timed(step(lambda: attend(q, k, v, causal=True, softcap=30.0)), sync, repeats=3)
    anchor = timed(
        step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), sync, repeats=3
    )
    expect(
        f"torch training row L={length} [{path}]",
        True,
        f"ours {ours * 1e3:.1f} ms, SDPA causal {anchor * 1e3:.1f} ms, speed {anchor / ours:.2f}",
    )


def jax_gpu() -> bool:
    import jax

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    if jax.default_backend() != "gpu":
        print("jax: no GPU backend")
        return False
    jax_checks(SHAPES, ("float16", "bfloat16", "float32"), "fused:jax")
    for dtype in ("float16", "bfloat16", "float32"):
        name = f"jax {dtype} blockwise gradients L=1024"
        section(name, functools.partial(_jax_blockwise_grads, name, dtype, 1024))
    return True


def jax_checks(shapes: list[tuple[int, ...]], dtypes: tuple[str, ...], path: str) -> None:
    """The JAX checks on the default device, expecting ``path`` from ``plan()`` (the tests
    run them on the CPU, small); on a GPU, half precision must call cuDNN."""
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    # Options and jax.nn's own for them: plain, causal, and a causal sliding window (jax.nn's
    # local_window_size, which cuDNN takes together with causal).
    variants: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
        ({}, {}),
        ({"causal": True, "window": (16, 0)}, {"is_causal": True}),
    )
    for dtype in dtypes:
        for shape in shapes:
            q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype=dtype) for _ in range(3))
            for kw, nn_kw in variants:
                name = f"jax {dtype} {shape} {kw}"
                case = functools.partial(_jax_case, name, q, k, v, kw, nn_kw, dtype, path, on_gpu)
                section(name, case)
        section(f"jax {dtype} masked rows", functools.partial(_jax_masked_rows, dtype))


def _jax_case(
    name: str,
    q: Any,
    k: Any,
    v: Any,
    kw: dict[str, Any],
    nn_kw: dict[str, Any],
    dtype: str,
    path: str,
    on_gpu: bool,
) -> None:
    import jax
    import jax.numpy as jnp

    if "window" in kw:
        nn_kw = {**nn_kw, "local_window_size": kw["window"]}
    p = plan(q, k, v, **kw)
    expect(f"{name} path", p.path == path, p.path)
    ours_fn = jax.jit(lambda a, b, c: attend(a, b, c, **kw)).lower(q, k, v).compile()
    if dtype != "float32" and on_gpu:  # cuDNN takes half precision only
        found = "__cudnn$fmha" in (ours_fn.as_text() or "")
        expect(f"{name} cudnn", found, "cuDNN's fused attention in the compiled program")
    ref = jax.jit(lambda a, b, c: attend(a, b, c, implementation="portable", **kw))(q, k, v)
    out = ours_fn(q, k, v)
    btnh = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
    impl: Literal["cudnn"] | None = "cudnn" if dtype != "float32" and on_gpu else None
    anchor_fn = jax.jit(
        lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation=impl, **nn_kw)
    )
    ours = timed(lambda: ours_fn(q, k, v).block_until_ready(), lambda: None)
    anchor = timed(lambda: anchor_fn(*btnh).block_until_ready(), lambda: None)
    agree(f"{name} [{p.path}]", out, ref, dtype, on_gpu, f"ratio {anchor / ours:.2f}")


def _jax_blockwise_grads(name: str, dtype: str, length: int) -> None:
    """``jit(grad)`` of ``attend(causal=True, chunk_size=length // 4)`` (the blockwise
    ``custom_vjp``) in ``dtype``: each gradient within twice jax.nn's own distance, in
    ``dtype``, from jax.nn's float64 gradients (64-bit types on for that call alone), or
    the dtype's tolerance."""
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    keys = jax.random.split(jax.random.key(0), 4)
    base = [jax.random.normal(key, (1, 8, length, 64)) for key in keys]
    chunk = max(length // 4, 1)

    def grads(fn: Callable[..., Any], dt: str) -> Any:
        def loss(q: Any, k: Any, v: Any) -> Any:
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * base[3])

        return jax.jit(jax.grad(loss, (0, 1, 2)))(*(x.astype(dt) for x in base[:3]))

    def nn(q: Any, k: Any, v: Any) -> Any:
        btnh = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        return jnp.swapaxes(jax.nn.dot_product_attention(*btnh, is_causal=True), 1, 2)

    p = plan(*(x.astype(dtype) for x in base[:3]), causal=True, chunk_size=chunk)
    expect(f"{name} path", p.path == "portable:blockwise", p.path)
    x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64
    with x64(True):  # (older JAX: jax.experimental.enable_x64)
        ref = grads(nn, "float64")
    theirs = grads(nn, dtype)
    ours = grads(lambda q, k, v: attend(q, k, v, causal=True, chunk_size=chunk), dtype)
    floor = gpu_tolerance(dtype, on_gpu).rtol
    for label, mine, other, exact in zip(("dq", "dk", "dv"), ours, theirs, ref, strict=True):
        bound = max(2 * relative_error(other, exact), floor)
        check(f"{name} {label}", relative_error(mine, exact), bound, "(relative to max |g|)")


def _jax_masked_rows(dtype: str) -> None:
    """Rows with no key under jit: outputs exactly 0 and finite, zero gradients (jax.nn
    gives the mean of V there; the adapter must restore zeros)."""
    import jax
    import jax.numpy as jnp

    lq, lk = 192, 200
    mask = jnp.ones((lq, lk), dtype=bool).at[1::3].set(False)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (
        jax.random.normal(key, (1, 2, n, 64)).astype(dtype)
        for key, n in zip(keys, (lq, lk, lk), strict=True)
    )
    fn = jax.jit(lambda a, b, c: attend(a, b, c, mask=mask))
    out = fn(q, k, v)
    check(f"jax {dtype} fully-masked rows are 0", float(jnp.max(jnp.abs(out[:, :, 1::3]))), 0.0)
    grads = jax.jit(jax.grad(lambda a, b, c: fn(a, b, c).astype(float).sum(), (0, 1, 2)))(q, k, v)
    bad = sum(float(jnp.sum(~jnp.isfinite(g))) for g in grads)
    check(f"jax {dtype} fully-masked rows: finite gradients", bad, 0.0)
    check(
        f"jax {dtype} fully-masked rows: zero dq",
        float(jnp.max(jnp.abs(grads[0][:, :, 1::3]))),
        0.0,
    )


def cupy_via_torch() -> bool:
    import cupy

    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver
        devices = 0
    print(f"cupy {cupy.__version__}, devices {devices}")
    if not devices:
        print("cupy: no CUDA device")
        return False
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float16"):
        q, k, v = (cupy.asarray(rng.standard_normal((2, 4, 64, 32)), dtype=dtype) for _ in range(3))
        p = plan(q, k, v, causal=True)
        expect(f"cupy {dtype} path", p.path == "fused:cupy-via-torch", p.path)
        out = attend(q, k, v, causal=True)
        ref = attend(q, k, v, causal=True, implementation="portable")
        expect(f"cupy {dtype} result type", isinstance(out, cupy.ndarray), type(out).__name__)
        agree(f"cupy {dtype} [{p.path}]", out, ref, dtype, on_gpu=True)
    # Reversed (negative-stride) keys: DLPack to torch takes no negative strides.
    flipped = k[:, :, ::-1]
    out, ref = attend(q, flipped, v), attend(q, flipped, v, implementation="portable")
    agree("cupy negative strides", out, ref, "float16", on_gpu=True)
    mask = cupy.ones((64, 64), dtype=bool)
    mask[1::3] = False
    out = attend(q, k, v, mask=mask)
    check("cupy fully-masked rows are 0", float(cupy.abs(out[:, :, 1::3]).max()), 0.0)
    section("cupy attend_backward", functools.partial(_array_backward, cupy))
    return True


def _array_backward(xp: Any) -> None:
    """``attend_backward`` (causal, softcap, segment ids, chunks of 32) on ``xp``'s float32
    arrays against NumPy's float64: the result in ``xp``'s arrays, each gradient within 10x
    float32's tolerance (relative to its largest entry). The tests run it on NumPy."""
    from portable_attention import attend_backward

    rng = np.random.default_rng(2)
    host = [rng.standard_normal((2, 4, 80, 32)) for _ in range(4)]
    ids = np.repeat(np.array([[0, 1]]), 40, axis=1)
    kw: dict[str, Any] = {"causal": True, "softcap": 20.0, "chunk_size": 32}

    def run(arrays: list[Any], seg: Any) -> Any:
        q, k, v, dout = arrays
        out, lse = attend(q, k, v, segment_ids=seg, return_lse=True, **kw)
        return attend_backward(dout, q, k, v, out, lse, segment_ids=seg, **kw)

    got = run([xp.asarray(x, dtype=xp.float32) for x in host], xp.asarray(ids))
    ref = run(host, ids)
    expect(
        f"{xp.__name__} attend_backward result type",
        type(got.dq) is type(xp.asarray(0.0)),
        type(got.dq).__name__,
    )
    tol = 10 * gpu_tolerance("float32", xp is not np).rtol
    for label in ("dq", "dk", "dv"):
        err = relative_error(getattr(got, label), getattr(ref, label))
        check(f"{xp.__name__} attend_backward {label}", err, tol, "(relative to max |g|)")


# -- conformance (issue 27): the kit on the CUDA kernels ---------------------------------

#: torch SDPA's documented conventions (as benchmarks/conformance.py declares them).
TORCH_SDPA: dict[str, Any] = {
    "backend": "torch",
    "mask": "attn_mask",
    "causal": "is_causal",
    "causal_alignment": "upper_left",
    "options": {"enable_gqa": True},
}
#: attend's own keywords (its lse returned), on any backend.
ATTEND: dict[str, Any] = {
    "window": "window",
    "sinks": "sinks",
    "options": {"return_lse": True},
    "returns": ("out", "lse"),
}


def conformance(name: str, fn: Callable[..., Any], own: bool, **keywords: Any) -> None:
    """Run the kit on ``fn`` and print its report; the package's own paths (``own``)
    must agree on every case, another kernel's departures are printed as information."""
    from portable_attention.testing import check_attention

    report = check_attention(fn, **keywords)
    print(f"conformance {name}:")
    print(report)
    if own:
        expect(f"conformance {name}", report.ok, f"{len(report.departures)} cases depart")
    else:
        departs = ", ".join(f"{c.name} ({c.verdict})" for c in report.departures)
        print(f"info conformance {name}: " + (departs or "every case that ran agrees"))


def torch_conformance(
    device: str, dtype: str, backends: tuple[str, ...], cases: list[str] | None = None
) -> None:
    """SDPA under each of ``backends`` (``SDPBackend`` names), flash-attn where it imports
    (CUDA, 16-bit only), and ``attend`` on ``device``; ``cases``: all, or only these."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in backends:
        chosen = getattr(SDPBackend, backend, None)
        if chosen is None:
            print(f"info conformance sdpa[{backend}]: this torch has no such backend")
            continue

        def sdpa(q: Any, k: Any, v: Any, chosen: Any = chosen, **kwargs: Any) -> Any:
            with sdpa_kernel([chosen]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

        section(
            f"conformance sdpa[{backend}]",
            functools.partial(
                conformance,
                f"sdpa[{backend}] {device} {dtype}",
                sdpa,
                False,
                device=device,
                dtype=dtype,
                cases=cases,
                **TORCH_SDPA,
            ),
        )
    if device != "cpu" and dtype in ("float16", "bfloat16"):
        if importlib.util.find_spec("flash_attn") is None:
            print("info conformance flash_attn_func: flash-attn not installed")
        else:
            from flash_attn import flash_attn_func

            section(
                "conformance flash_attn_func",
                functools.partial(
                    conformance,
                    f"flash_attn_func {device} {dtype}",
                    flash_attn_func,
                    False,
                    backend="torch",
                    device=device,
                    dtype=dtype,
                    layout="blhd",
                    mask=None,
                    causal="causal",
                    window="window_size",
                    returns=("out", "lse", None),
                    options={"return_attn_probs": True},
                ),
            )
    section(
        f"conformance attend torch {device}",
        functools.partial(
            conformance,
            f"attend torch {device} {dtype}",
            attend,
            True,
            backend="torch",
            device=device,
            dtype=dtype,
            cases=cases,
            **ATTEND,
        ),
    )


def jax_conformance(dtype: str, implementation: str | None, cases: list[str] | None = None) -> None:
    """``jax.nn.dot_product_attention`` with ``implementation`` (jitted) and ``attend``
    on JAX's default device; ``cases``: all, or only these."""
    import jax

    nn = jax.jit(
        functools.partial(jax.nn.dot_product_attention, implementation=implementation),
        static_argnames=("is_causal", "local_window_size"),
    )
    section(
        f"conformance jax.nn[{implementation}]",
        functools.partial(
            conformance,
            f"jax.nn[{implementation}] {dtype}",
            nn,
            False,
            backend="jax",
            dtype=dtype,
            layout="blhd",
            mask="mask",
            causal="is_causal",
            causal_alignment="upper_left",
            window="local_window_size",
            cases=cases,
        ),
    )
    statics = ("causal", "window", "return_lse")
    section(
        "conformance attend jax",
        functools.partial(
            conformance,
            f"attend jax {dtype}",
            jax.jit(attend, static_argnames=statics),
            True,
            backend="jax",
            dtype=dtype,
            cases=cases,
            **ATTEND,
        ),
    )


def conformance_torch() -> bool:
    """The conformance section for torch's CUDA kernels and CuPy (its own process, as
    every section: JAX never meets the cuDNN torch loads)."""
    import torch

    if not torch.cuda.is_available():
        print("conformance-torch: no CUDA device")
        return False
    backends = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
    for dtype in ("float16", "float32"):
        torch_conformance("cuda", dtype, backends)
    if importlib.util.find_spec("cupy") is not None:
        section(
            "conformance attend cupy",
            functools.partial(
                conformance, "attend cupy float32", attend, True, backend="cupy", **ATTEND
            ),
        )
    return True


def conformance_jax() -> bool:
    """The conformance section for ``jax.nn`` with cuDNN and ``attend`` on a JAX GPU."""
    import jax

    if jax.default_backend() != "gpu":
        print(f"conformance-jax: JAX runs on {jax.default_backend()}, no GPU")
        return False
    jax_conformance("float16", "cudnn")  # cuDNN's fused attention takes 16-bit inputs
    jax_conformance("float32", "xla")
    return True


SECTIONS: dict[str, Callable[[], bool]] = {  # in running order: JAX compiles the most
    "torch": torch_cuda,
    "cupy": cupy_via_torch,
    "conformance-torch": conformance_torch,
    "jax": jax_gpu,
    "conformance-jax": conformance_jax,
}
#: The module a section needs (its own name where not listed).
SECTION_NEEDS = {"conformance-torch": "torch", "conformance-jax": "jax"}


def run_section(name: str) -> int:
    """This process's one section: 0 passed, 1 failed, ``NO_DEVICE`` without a GPU."""
    found = section(name, SECTIONS[name])
    if failures:
        print(f"{name}: FAILED: " + ", ".join(failures))
        return 1
    if not found:
        return NO_DEVICE
    print(f"{name}: all {len(passed)} checks agree")
    return 0


def verdict(status: dict[str, int]) -> int:
    """The script's exit status from each section's: ``NO_DEVICE`` everywhere (or no
    section) is 2; any other status but 0 is 1: a failure, a crash, or an installed
    framework that sees no GPU where another one does."""
    found = [n for n, rc in status.items() if rc != NO_DEVICE]
    if not found:
        print("no GPU check ran: no CUDA device, no JAX GPU backend, no CuPy")
        return 2
    failed = [n for n, rc in status.items() if rc != 0]
    if failed:
        print("FAILED sections: " + ", ".join(f"{n} (exit {status[n]})" for n in failed))
        return 1
    print(f"all GPU checks agree ({', '.join(found)})")
    return 0


def main(argv: list[str]) -> int:
    """Every installed framework's section in a process of its own; 1 on a failure, 2
    if no framework sees a GPU."""
    # Line by line, also without PYTHONUNBUFFERED: a section stopped by its time limit
    # keeps what it printed, and the parent's lines come before the sections'.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if argv[:1] == ["--section"]:
        return run_section(argv[1])
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    deadline = time.monotonic() + TOTAL_TIMEOUT_S
    status: dict[str, int] = {}
    for name in SECTIONS:
        if importlib.util.find_spec(SECTION_NEEDS.get(name, name)) is None:
            print(f"{name}: not installed")
            continue
        left = deadline - time.monotonic()
        try:
            done = subprocess.run([sys.executable, __file__, "--section", name], timeout=left)
            status[name] = done.returncode
        except subprocess.TimeoutExpired:
            print(f"FAIL {name}: no result within the {TOTAL_TIMEOUT_S} s of all sections")
            status[name] = 1
    return verdict(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
