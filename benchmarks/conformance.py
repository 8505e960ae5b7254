"""The ecosystem's attention kernels against the contract: ``docs/conformance.md``.

Runs :func:`portable_attention.testing.check_attention` on every attention kernel that
installs here, each declared with its documented conventions (layout, mask keyword and
polarity, causal flag and alignment, window and sinks keywords), and writes the table:
kernel x case, each cell agrees / departs (with the size and the reason) / skipped (with
the reason), the versions it was made with. A departure that a kernel documents (an
upper-left causal flag, a head-dim limit written into its docstring) reads
``convention``, not ``DEPARTS``. A kernel that does not install or does not run on this
machine is listed as skipped with the reason, never dropped.

Keras picks its backend from ``KERAS_BACKEND`` when first imported, so each Keras
backend runs in its own subprocess (``--kernel keras-jax --json``). CUDA kernels
(flash-attn, cuDNN through jax.nn, SDPA's CUDA backends, CuPy) are listed as skipped
here; ``benchmarks/gpu_check.py``'s ``conformance`` section runs them on a GPU.

Usage::

    JAX_PLATFORMS=cpu python benchmarks/conformance.py            # print the table
    JAX_PLATFORMS=cpu python benchmarks/conformance.py --write    # docs/conformance.md
    python benchmarks/conformance.py --kernel torch-sdpa-math      # one kernel's report
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from portable_attention.testing import CASES, check_attention

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "conformance.md"

Built = tuple[Callable[..., Any], dict[str, Any]]  # (fn, check_attention's keywords)


class Unavailable(Exception):
    """The kernel does not install or does not run here: the reason."""


def _need(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as err:  # ImportError, or a framework failing at import
        msg = f"`{module}` does not import here ({type(err).__name__}: {err})"
        raise Unavailable(msg) from None


# -- the kernels ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """One attention kernel and how to call it with its documented conventions.

    Attributes
    ----------
    key : str
        Its short name (``--kernel``).
    name : str
        What the table calls it.
    packages : tuple of str
        The distributions whose versions the table lists for it.
    build : callable
        ``() -> (fn, check_attention keywords)``; raises :class:`Unavailable`.
    documented : mapping of str to str
        Case -> the documented behaviour that explains its departure there (the cell
        then reads ``convention``).
    env : mapping of str to str
        Environment of a subprocess to run it in (Keras's backend); empty: in process.
    gpu : str
        Non-empty for a CUDA kernel: why it is not run here.
    """

    key: str
    name: str
    packages: tuple[str, ...]
    build: Callable[[], Built]
    documented: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    gpu: str = ""


UPPER_LEFT = "upper_left"
TORCH_SDPA = {
    "backend": "torch",
    "mask": "attn_mask",
    "causal": "is_causal",
    "causal_alignment": UPPER_LEFT,
    "options": {"enable_gqa": True},
}


def _sdpa(backend_name: str) -> Built:
    torch = _need("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    fn = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        with sdpa_kernel([backend]):
            return fn(q, k, v, **kwargs)

    x = torch.zeros(1, 1, 4, 8)
    try:  # does this backend run on the CPU at all (the plain case's inputs)?
        sdpa(x, x, x)
    except RuntimeError as err:
        text = str(err).splitlines()[0][:160]
        msg = f"SDPBackend.{backend_name} does not run on the CPU here ({text})"
        raise Unavailable(msg) from None
    sdpa.__qualname__ = f"sdpa[{backend_name}]"
    return sdpa, dict(TORCH_SDPA)


def _flex(compiled: bool = False) -> Built:
    torch = _need("torch")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attention = flex_attention
    if compiled:
        # One compiled function for every case's shapes: past torch.compile's recompile
        # limit (8) it would fall back to eager Flex without a word.
        torch._dynamo.config.recompile_limit = 64
        attention = torch.compile(flex_attention, dynamic=False)

    def flex(q: Any, k: Any, v: Any, *, mask: Any = None) -> Any:
        block_mask = None
        if mask is not None:
            full = mask.expand(q.shape[0], 1, q.shape[-2], k.shape[-2])

            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return full[b, 0, q_idx, kv_idx]

            block_mask = create_block_mask(
                mask_mod, q.shape[0], None, q.shape[-2], k.shape[-2], device="cpu"
            )
        return attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    flex.__qualname__ = "flex_attention" + ("[compiled]" if compiled else "")
    # No causal flag: causal is a mask_mod the caller writes (alignment is theirs).
    return flex, {"backend": "torch", "mask": "mask", "causal": None}


def _jax_nn() -> Built:
    jax = _need("jax")
    fn = jax.jit(
        jax.nn.dot_product_attention,
        static_argnames=("is_causal", "local_window_size", "implementation"),
    )
    return functools.partial(fn, implementation="xla"), {
        "backend": "jax",
        "layout": "blhd",
        "mask": "mask",
        "causal": "is_causal",
        "causal_alignment": UPPER_LEFT,
        "window": "local_window_size",
    }


def _flax_nnx() -> Built:
    jax = _need("jax")
    nnx = _need("flax.nnx")
    fn = jax.jit(nnx.dot_product_attention, static_argnames=("is_causal",))
    return fn, {
        "backend": "jax",
        "layout": "blhd",
        "mask": "mask",
        "causal": "is_causal",
        "causal_alignment": UPPER_LEFT,
    }


def _keras() -> Built:
    backend = os.environ.get("KERAS_BACKEND", "")
    keras = _need("keras")
    if keras.backend.backend() != backend:
        msg = f"Keras runs on {keras.backend.backend()!r}, not {backend!r}"
        raise Unavailable(msg)
    # Keras takes numpy arrays on every backend and returns its backend's arrays: give it
    # the backend's own arrays, so what it returns is judged as that framework's.
    kit_backend = {"jax": "jax", "torch": "torch", "numpy": "numpy"}[backend]
    fn = keras.ops.dot_product_attention
    return fn, {
        "backend": kit_backend,
        "layout": "blhd",
        "mask": "mask",
        "causal": "is_causal",
        "causal_alignment": UPPER_LEFT,
    }


def _mlx() -> Built:
    mx = _need("mlx.core")

    def mlx_sdpa(
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        *,
        mask: Any = None,
        causal: bool = False,
        sinks: Any = None,
    ) -> np.ndarray:
        arrays = [mx.array(a) for a in (q, k, v)]
        m = "causal" if causal else (None if mask is None else mx.array(mask))
        s = None if sinks is None else mx.array(sinks)
        out = mx.fast.scaled_dot_product_attention(
            *arrays, scale=1.0 / math.sqrt(q.shape[-1]), mask=m, sinks=s
        )
        return np.array(out)

    # Through NumPy: MLX arrays are not among the kit's backends (its autodiff, mx.vjp,
    # is not used: the gradient cases are skipped as NumPy's).
    return mlx_sdpa, {
        "backend": "numpy",
        "mask": "mask",
        "causal": "causal",
        "causal_alignment": "lower_right",
        "sinks": "sinks",
    }


def _onnxruntime() -> Built:
    onnx = _need("onnx")
    ort = _need("onnxruntime")
    from onnx import TensorProto, helper

    @functools.lru_cache(maxsize=64)
    def session(shapes: tuple[tuple[int, ...], ...], dtype: str, masked: bool, causal: bool) -> Any:
        elem = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
        names = ["Q", "K", "V"] + (["attn_mask"] if masked else [])
        inputs = [
            helper.make_tensor_value_info(n, elem, s)
            for n, s in zip("QKV", shapes[:3], strict=True)
        ]
        if masked:
            inputs.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL, shapes[3]))
        node = helper.make_node("Attention", names, ["Y"], is_causal=int(causal))
        out = helper.make_tensor_value_info("Y", elem, None)
        graph = helper.make_graph([node], "attention", inputs, [out])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        model.ir_version = 10
        options = ort.SessionOptions()
        options.log_severity_level = 4  # its errors come back as exceptions
        return ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    def ort_attention(
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        *,
        attn_mask: Any = None,
        is_causal: bool = False,
    ) -> np.ndarray:
        feeds = {"Q": q, "K": k, "V": v}
        shapes = [q.shape, k.shape, v.shape]
        if attn_mask is not None:
            feeds["attn_mask"] = attn_mask
            shapes.append(attn_mask.shape)
        sess = session(tuple(map(tuple, shapes)), str(q.dtype), attn_mask is not None, is_causal)
        return sess.run(["Y"], feeds)[0]

    _ = onnx
    return ort_attention, {
        "backend": "numpy",
        "mask": "attn_mask",
        "causal": "is_causal",
        # ONNX's Attention-23: is_causal is offset by the cached keys (past_key) only;
        # without a cache, query i sees keys j <= i (upper-left when Lq != Lk).
        "causal_alignment": UPPER_LEFT,
    }


def _hf_module(q: Any, k: Any) -> Any:
    torch = sys.modules["torch"]
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    module.is_causal = False
    module.training = False
    return module


def _transformers_sdpa() -> Built:
    torch = _need("torch")
    _need("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def hf_sdpa(q: Any, k: Any, v: Any, *, attention_mask: Any = None) -> Any:
        out, _ = sdpa_attention_forward(_hf_module(q, k), q, k, v, attention_mask)
        return out.transpose(1, 2)  # it returns [B, L, H, D]

    _ = torch
    # Causal is in its masks (masking_utils) or in module.is_causal: with a mask or one
    # query it is dropped, so the kit passes no causal flag. Masks: bool, True = attend.
    return hf_sdpa, {"backend": "torch", "mask": "attention_mask", "causal": None}


def _transformers_eager() -> Built:
    torch = _need("torch")
    _need("transformers")
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def hf_eager(q: Any, k: Any, v: Any, *, attention_mask: Any = None) -> Any:
        additive = None
        if attention_mask is not None:  # its masks are additive: 0 or finfo(dtype).min
            low = torch.finfo(q.dtype).min
            additive = torch.where(attention_mask, 0.0, low).to(q.dtype)
        scaling = q.shape[-1] ** -0.5
        out, _ = eager_attention_forward(_hf_module(q, k), q, k, v, additive, scaling)
        return out.transpose(1, 2)

    return hf_eager, {"backend": "torch", "mask": "attention_mask", "causal": None}


def _sharded(method: str) -> Callable[[], Built]:
    """``sharded_attend`` over 2 simulated CPU devices (``XLA_FLAGS``), jitted."""

    def build() -> Built:
        jax = _need("jax")
        from portable_attention.parallel import sharded_attend

        if len(jax.devices()) < 2:
            msg = f"JAX sees {len(jax.devices())} device; XLA_FLAGS asks for 2"
            raise Unavailable(msg)
        mesh = jax.make_mesh((2,), ("seq",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def fn(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
            # The kit's arrays are committed to device 0, which sharded_attend does not
            # reshard (a ValueError from jit, found here): put them on the mesh first.
            q, k, v = (jax.device_put(a, replicated) for a in (q, k, v))
            kwargs = {
                n: jax.device_put(a, replicated) if isinstance(a, jax.Array) else a
                for n, a in kwargs.items()
            }
            return sharded_attend(
                q,
                k,
                v,
                mesh=mesh,
                axis="seq",
                method=method,
                layout="contiguous",
                return_lse=True,
                **kwargs,
            )

        fn.__qualname__ = f"sharded_attend[{method}]"
        return fn, {
            "backend": "jax",
            "mask": "mask" if method == "ulysses" else None,
            "window": "window",
            "sinks": "sinks",
            "returns": ("out", "lse"),
        }

    return build


SHARDS = (
    "the sequence must split evenly over the shards (2 here; docs/scaling-out.md): "
    "Lq = 3 and Lq = 1 do not"
)
SIMULATED = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


def _transformers_gpt_oss() -> Built:
    torch = _need("torch")
    _need("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    def gpt_oss_eager(
        q: Any, k: Any, v: Any, *, attention_mask: Any = None, sinks: Any = None
    ) -> Any:
        module = _hf_module(q, k)
        # module.sinks is a parameter of every gpt-oss layer; -inf where the kit passes
        # none (no sink: the other cases run as plain attention).
        none = torch.full((q.shape[1],), -torch.inf, dtype=q.dtype)
        module.sinks = none if sinks is None else sinks
        additive = None
        if attention_mask is not None:
            low = torch.finfo(q.dtype).min
            additive = torch.where(attention_mask, 0.0, low).to(q.dtype)
        out, _ = eager_attention_forward(module, q, k, v, additive, q.shape[-1] ** -0.5)
        return out.transpose(1, 2)

    return gpt_oss_eager, {
        "backend": "torch",
        "mask": "attention_mask",
        "causal": None,
        "sinks": "sinks",
    }


def _attend(backend: str, lse: bool = True, **options: Any) -> Callable[[], Built]:
    """``attend`` on ``backend`` with path ``options``, its lse returned (``lse``) or not
    (torch's auto path then takes SDPA); ``chunk_size=None`` stands for 8 on the kit's
    short cases (several blocks) and 128 past 64 keys (the batch case's ``L = 1024``,
    where blocks of 8 would take minutes)."""

    def build() -> Built:
        _need(backend)
        from portable_attention import attend

        run: Callable[..., Any] = attend
        if backend == "jax":  # jitted: one compile per case instead of eager op by op
            jax = sys.modules["jax"]
            statics = ("causal", "window", "return_lse", "chunk_size", "implementation")
            run = jax.jit(attend, static_argnames=statics)
        chunked = "chunk_size" in options and options["chunk_size"] is None
        fixed = {k: v for k, v in options.items() if k != "chunk_size" or not chunked}

        def fn(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
            if chunked:
                kwargs["chunk_size"] = 8 if k.shape[-2] <= 64 else 128
            return run(q, k, v, return_lse=lse, **fixed, **kwargs)

        fn.__qualname__ = "attend"
        returns = {"returns": ("out", "lse")} if lse else {}
        return fn, {"backend": backend, "window": "window", "sinks": "sinks", **returns}

    return build


def _cuda(reason: str) -> Callable[[], Built]:
    def build() -> Built:
        raise Unavailable(reason)

    return build


GPU = "needs a CUDA GPU: benchmarks/gpu_check.py's conformance section runs it there"
MEAN_V = (
    "its masks are additive, 0 or finfo(dtype).min (transformers.masking_utils.eager_mask), "
    "so a row with no key is a softmax over equal scores: mean(V)"
)
ORT_F16 = (
    "ONNX Attention computes in the inputs' precision (softmax_precision defaults to the "
    "input type): float16 scores past 65504 overflow"
)
JAX_DV = "its docstring: value should have the same shape as key (no Dv != Dk)"

KERNELS: tuple[Kernel, ...] = (
    Kernel("attend-numpy", "attend, NumPy, auto", ("numpy",), _attend("numpy")),
    Kernel(
        "attend-numpy-portable",
        'attend, NumPy, implementation="portable"',
        ("numpy",),
        _attend("numpy", implementation="portable"),
    ),
    Kernel(
        "attend-numpy-chunked",
        "attend, NumPy, chunk_size=8 (128 past 64 keys)",
        ("numpy",),
        _attend("numpy", chunk_size=None),
    ),
    Kernel(
        "attend-torch",
        "attend, torch, auto, out only (SDPA where it covers the call)",
        ("torch",),
        _attend("torch", lse=False),
    ),
    Kernel(
        "attend-torch-lse",
        "attend, torch, auto, return_lse=True",
        ("torch",),
        _attend("torch"),
    ),
    Kernel(
        "attend-torch-portable",
        'attend, torch, implementation="portable"',
        ("torch",),
        _attend("torch", implementation="portable"),
    ),
    Kernel(
        "attend-torch-chunked",
        "attend, torch, chunk_size=8 (128 past 64 keys)",
        ("torch",),
        _attend("torch", chunk_size=None),
    ),
    Kernel("attend-jax", "attend, JAX (jit), auto", ("jax", "jaxlib"), _attend("jax")),
    Kernel(
        "attend-jax-chunked",
        "attend, JAX (jit), chunk_size=8 (128 past 64 keys)",
        ("jax", "jaxlib"),
        _attend("jax", chunk_size=None),
    ),
    Kernel(
        "attend-jax-ring",
        'sharded_attend(method="ring"), JAX, 2 simulated CPU devices',
        ("jax", "jaxlib"),
        _sharded("ring"),
        documented={"half_overflow": SHARDS, "decode": SHARDS},
        env=SIMULATED,
    ),
    Kernel(
        "attend-jax-ulysses",
        'sharded_attend(method="ulysses"), JAX, 2 simulated CPU devices',
        ("jax", "jaxlib"),
        _sharded("ulysses"),
        documented={"half_overflow": SHARDS, "decode": SHARDS},
        env=SIMULATED,
    ),
    Kernel(
        "torch-sdpa-math",
        "torch SDPA, sdpa_kernel(MATH)",
        ("torch",),
        functools.partial(_sdpa, "MATH"),
    ),
    Kernel(
        "torch-sdpa-flash",
        "torch SDPA, sdpa_kernel(FLASH_ATTENTION) (CPU flash)",
        ("torch",),
        functools.partial(_sdpa, "FLASH_ATTENTION"),
    ),
    Kernel(
        "torch-sdpa-efficient",
        "torch SDPA, sdpa_kernel(EFFICIENT_ATTENTION)",
        ("torch",),
        functools.partial(_sdpa, "EFFICIENT_ATTENTION"),
    ),
    Kernel("torch-flex", "torch flex_attention (eager)", ("torch",), _flex),
    Kernel(
        "torch-flex-compiled",
        "torch flex_attention (torch.compile, inductor's CPU kernel)",
        ("torch",),
        functools.partial(_flex, compiled=True),
    ),
    Kernel(
        "jax-nn",
        'jax.nn.dot_product_attention(implementation="xla") (jit)',
        ("jax", "jaxlib"),
        _jax_nn,
        documented={"dv_ne_dk": JAX_DV},
    ),
    Kernel(
        "flax-nnx",
        "flax.nnx.dot_product_attention (jit)",
        ("flax", "jax"),
        _flax_nnx,
    ),
    Kernel(
        "keras-jax",
        "keras.ops.dot_product_attention, KERAS_BACKEND=jax",
        ("keras", "jax"),
        _keras,
        env={"KERAS_BACKEND": "jax"},
    ),
    Kernel(
        "keras-torch",
        "keras.ops.dot_product_attention, KERAS_BACKEND=torch",
        ("keras", "torch"),
        _keras,
        env={"KERAS_BACKEND": "torch"},
    ),
    Kernel(
        "keras-numpy",
        "keras.ops.dot_product_attention, KERAS_BACKEND=numpy",
        ("keras", "numpy"),
        _keras,
        env={"KERAS_BACKEND": "numpy"},
    ),
    Kernel(
        "mlx",
        "mlx.core.fast.scaled_dot_product_attention (CPU build)",
        ("mlx", "mlx-cpu"),
        _mlx,
    ),
    Kernel(
        "onnxruntime",
        "onnxruntime, ONNX Attention (opset 23), CPU",
        ("onnxruntime", "onnx"),
        _onnxruntime,
        documented={"half_overflow": ORT_F16},
    ),
    Kernel(
        "transformers-sdpa",
        "transformers sdpa_attention_forward",
        ("transformers", "torch"),
        _transformers_sdpa,
    ),
    Kernel(
        "transformers-eager",
        "transformers (llama) eager_attention_forward",
        ("transformers", "torch"),
        _transformers_eager,
        documented={"empty_rows": MEAN_V, "padding": MEAN_V, "grad_empty_rows": MEAN_V},
    ),
    Kernel(
        "transformers-gpt-oss-eager",
        "transformers (gpt-oss) eager_attention_forward, sinks as module.sinks",
        ("transformers", "torch"),
        _transformers_gpt_oss,
        documented={
            "empty_rows": MEAN_V,
            "padding": MEAN_V,
            "grad_empty_rows": MEAN_V,
            "sinks": MEAN_V + " (on the head whose sink is -inf; a finite sink gives 0)",
            "grad_sinks": MEAN_V + " (on the head whose sink is -inf)",
        },
    ),
    Kernel("flash-attn", "flash_attn_func (flash-attn)", ("flash-attn",), _cuda(GPU), gpu=GPU),
    Kernel(
        "jax-nn-cudnn",
        'jax.nn.dot_product_attention(implementation="cudnn")',
        ("jax",),
        _cuda(GPU),
        gpu=GPU,
    ),
    Kernel(
        "torch-sdpa-cuda",
        "torch SDPA's CUDA backends (flash, efficient, cuDNN)",
        ("torch",),
        _cuda(GPU),
        gpu=GPU,
    ),
    Kernel("attend-cupy", "attend, CuPy", ("cupy",), _cuda(GPU), gpu=GPU),
)
"""Every kernel of the table, in its order."""

BY_KEY = {k.key: k for k in KERNELS}


# -- running and classifying ---------------------------------------------------------------


@dataclass
class KernelResult:
    """One kernel's row: ``skipped`` (why) or one ``(verdict, cell, details)`` per case."""

    key: str
    name: str
    conventions: str = ""
    skipped: str = ""
    cases: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)


#: Cases whose agreement under a declared upper-left alignment is that convention.
ALIGNED = ("causal_lq_gt_lk", "causal_lq_lt_lk", "window", "window_causal")


def classify(kernel: Kernel, keywords: Mapping[str, Any], name: str, verdict: str) -> str:
    """The table's cell for one case: ``ok``, ``convention``, ``DEPARTS``, ``ERROR``,
    ``skipped``."""
    if verdict == "skipped":
        return "skipped"
    if verdict == "ok":
        upper = keywords.get("causal_alignment") == UPPER_LEFT and keywords.get("causal")
        windowed = name.startswith("window")
        if name in ALIGNED and upper and not (windowed and not keywords.get("window")):
            return "ok (upper-left)"
        return "ok"
    return "convention" if name in kernel.documented else verdict.upper()


def run_kernel(kernel: Kernel, cases: Sequence[str] | None = None) -> KernelResult:
    """Run ``kernel`` (in a subprocess where it sets an environment) and classify."""
    result = KernelResult(kernel.key, kernel.name)
    if any(os.environ.get(name) != value for name, value in kernel.env.items()):
        return _in_subprocess(kernel, cases)
    try:
        fn, keywords = kernel.build()
    except Unavailable as err:
        result.skipped = str(err)
        return result
    report = check_attention(fn, cases=cases, **keywords)
    result.conventions = report.conventions
    for case in report:
        details = list(case.details)
        if case.name in kernel.documented and not case.ok:
            details = [kernel.documented[case.name], *details]
        cell = classify(kernel, keywords, case.name, case.verdict)
        if case.name == "batch_invariance" and case.verdict == "ok":
            bitwise = details[-1].endswith("bitwise equal")
            cell = "ok (bitwise)" if bitwise else f"ok (not bitwise: {details[-1].split()[-1]})"
        result.cases[case.name] = (case.verdict, cell, details)
    return result


def _in_subprocess(kernel: Kernel, cases: Sequence[str] | None) -> KernelResult:
    argv = [sys.executable, str(Path(__file__).resolve()), "--kernel", kernel.key, "--json"]
    if cases:
        argv += ["--cases", *cases]
    env = {**os.environ, **kernel.env, "PYTHONPATH": _pythonpath()}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return KernelResult(kernel.key, kernel.name, skipped=f"its subprocess failed: {tail}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    data["cases"] = {k: tuple(v) for k, v in data["cases"].items()}
    return KernelResult(**data)


def _pythonpath() -> str:
    parts = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


# -- the page ---------------------------------------------------------------------------------


def versions(kernels: Sequence[Kernel]) -> dict[str, str]:
    """Installed version of every distribution the kernels name (``not installed``)."""
    names = sorted({"portable-attention", *(p for k in kernels for p in k.packages)})
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(results: Sequence[KernelResult], kernels: Sequence[Kernel]) -> str:
    """The markdown page."""
    names = list(CASES)
    lines = [
        "# Conformance: attention kernels against one contract",
        "",
        "<!-- Generated by `JAX_PLATFORMS=cpu python benchmarks/conformance.py --write`; "
        "do not edit by hand. -->",
        "",
        "Every kernel below ran `portable_attention.testing.check_attention` (see "
        "[Testing](testing.md)) with the conventions its documentation states: the layout, "
        "the mask's keyword and polarity, the causal flag and its alignment, the window and "
        "sinks keywords where it takes them. Each case is judged against the float64 "
        "`reference_attention` within the package's tolerance table.",
        "",
        "- **ok**: agrees with the contract.",
        "- **ok (upper-left)**: agrees once declared with its documented upper-left causal "
        "alignment (query `i` sees keys `j <= i`), which departs from the contract's "
        "lower-right one when `Lq != Lk`: a convention, not a bug.",
        "- **convention**: departs the way its documentation says it does (the reason is "
        "in the details).",
        "- **DEPARTS**: departs from the contract, with the size and the likely cause in the "
        "details; **ERROR**: it raised.",
        "- `batch_invariance` says whether one sequence alone and the same sequence in a batch "
        "of 4 came out **bitwise** equal, or the largest difference (within tolerance: ok).",
        "- **skipped**: the kernel takes no argument for the case (no mask, no window, "
        "no sinks, no autodiff here), with the reason in the details.",
        "",
        f"Made on {platform.machine()} {platform.system()}, Python "
        f"{platform.python_version()}, float32 inputs (the `half_overflow` case: float16).",
        "",
        "| package | version |",
        "| ------- | ------- |",
        *(f"| {n} | {v} |" for n, v in versions(kernels).items()),
        "",
        "## The table",
        "",
        "| kernel | " + " | ".join(f"`{n}`" for n in names) + " |",
        "| ------ | " + " | ".join("---" for _ in names) + " |",
    ]
    for r in results:
        if r.skipped:
            cells = ["skipped"] * len(names)
        else:
            cells = [r.cases[n][1] if n in r.cases else "" for n in names]
        shown = [f"**{c}**" if c in ("DEPARTS", "ERROR") else c for c in cells]
        lines.append(f"| {_cell(r.name)} | " + " | ".join(shown) + " |")
    lines += ["", "## The cases", "", "| case | what it checks |", "| ---- | -------------- |"]
    lines += [f"| `{n}` | {_cell(about)} |" for n, about in CASES.items()]
    lines += ["", "## Details per kernel", ""]
    for r in results:
        lines.append(f"### {r.name}")
        lines.append("")
        if r.skipped:
            lines += [f"Skipped: {r.skipped}.", ""]
            continue
        lines += [f"Declared: {r.conventions}.", ""]
        for n in names:
            if n not in r.cases:
                continue
            verdict, cell, details = r.cases[n]
            if verdict == "ok" and cell == "ok":
                continue
            text = "; ".join(details)
            lines.append(f"- `{n}` ({cell}): {text}")
        oks = [n for n in names if n in r.cases and r.cases[n][1] == "ok"]
        lines += [f"- agrees: {', '.join(f'`{n}`' for n in oks)}", ""]
    return "\n".join(lines).rstrip() + "\n"


# -- batch invariance of this package's own paths --------------------------------------------

#: ``(label, backend, attend's path options)``: the paths docs/contract.md reports on.
PATHS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("NumPy, auto", "numpy", {}),
    ("NumPy, implementation='portable'", "numpy", {"implementation": "portable"}),
    ("NumPy, chunk_size=128", "numpy", {"chunk_size": 128}),
    ("torch, auto", "torch", {}),
    ("torch, implementation='portable'", "torch", {"implementation": "portable"}),
    ("torch, chunk_size=128", "torch", {"chunk_size": 128}),
    ("JAX (jit), auto", "jax", {}),
    ("JAX (jit), implementation='portable'", "jax", {"implementation": "portable"}),
    ("JAX (jit), chunk_size=128", "jax", {"chunk_size": 128}),
)


def batch_invariance(shape: tuple[int, int, int, int] = (4, 8, 1024, 64)) -> list[str]:
    """Markdown rows: per path of ``attend``, sequence 2 alone against the same sequence in
    the batch (float32, causal), the largest difference (0: bitwise) and ``plan()``'s
    path, and whether two runs of the batch are bitwise equal."""
    from portable_attention import attend, plan
    from portable_attention.testing import to_backend, to_numpy

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    rows = ["| path | plan() | alone vs in the batch | run to run |", "| --- | --- | --- | --- |"]
    for label, backend, options in PATHS:
        try:
            _need(backend)
        except Unavailable as err:
            rows.append(f"| {label} | | skipped: {err} | |")
            continue
        run: Callable[..., Any] = functools.partial(attend, causal=True, **options)
        if backend == "jax":
            run = sys.modules["jax"].jit(run)

        def out(*arrays: np.ndarray, run: Callable[..., Any] = run, backend: str = backend) -> Any:
            return to_numpy(run(*(to_backend(a, backend) for a in arrays)))

        batch = out(q, k, v)
        alone = out(q[2:3], k[2:3], v[2:3])
        again = out(q, k, v)
        diff = float(np.max(np.abs(batch[2:3] - alone)))
        path = plan(*(to_backend(a, backend) for a in (q, k, v)), causal=True, **options).path
        shown = "bitwise equal" if diff == 0 else f"{diff:.2g}"
        repeat = "bitwise equal" if np.array_equal(batch, again) else "differs"
        rows.append(f"| {label} | `{path}` | {shown} | {repeat} |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", nargs="*", help="only these kernels (keys)")
    parser.add_argument("--cases", nargs="*", help="only these cases")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    parser.add_argument("--json", action="store_true", help="one JSON line per kernel")
    parser.add_argument(
        "--batch-invariance",
        action="store_true",
        help="print attend's paths, alone vs in a batch of 4 ([4, 8, 1024, 64] causal)",
    )
    args = parser.parse_args(argv)
    if args.batch_invariance:
        print("\n".join(batch_invariance()))
        return 0
    unknown = [k for k in args.kernel or () if k not in BY_KEY]
    if unknown:
        parser.error(f"unknown kernels {unknown}; known: {', '.join(BY_KEY)}")
    kernels = [BY_KEY[k] for k in args.kernel] if args.kernel else list(KERNELS)
    results = []
    for kernel in kernels:
        result = run_kernel(kernel, args.cases)
        results.append(result)
        if args.json:
            print(json.dumps(asdict(result)))
        else:
            print(f"{kernel.key}: {result.skipped or 'ran'}", file=sys.stderr)
    if args.json:
        return 0
    page = render(results, kernels)
    if args.write:
        DOC.write_text(page, encoding="utf-8")
        print(f"wrote {DOC}", file=sys.stderr)
    else:
        print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
