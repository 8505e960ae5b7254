"""The prepared GPU script (``benchmarks/gpu_check.py``) on the CPU: its torch and JAX
checks, small, must pass here, so that a session lent a GPU spends its scarce device
time on the GPU and not on the script's bugs; without a GPU it must say that nothing
ran, not that everything agreed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from portable_attention.testing import tolerance

from conftest import requires_backend

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_backend("torch")
def test_torch_checks_pass_on_cpu(gpu_check: ModuleType) -> None:
    gpu_check.torch_checks("cpu", [(1, 2, 8, 8)], ("float32", "bfloat16"), lambda: None)
    assert gpu_check.failures == []
    # Per dtype: path and agreement for 2 options; rows 0, finite and zero gradients.
    assert len(gpu_check.passed) == 2 * (2 * 2 + 3)


@requires_backend("jax")
def test_jax_checks_pass_on_cpu(gpu_check: ModuleType) -> None:
    gpu_check.jax_checks([(1, 2, 8, 8)], ("float32",), "portable:dense")
    assert gpu_check.failures == []
    # Path and agreement, plain and causal window; rows 0, finite and zero gradients.
    assert len(gpu_check.passed) == 2 * 2 + 3


@requires_backend("torch")
def test_torch_training_checks_pass_on_cpu(gpu_check: ModuleType) -> None:
    gpu_check.torch_training("cpu", 64, ("float32", "bfloat16"), lambda: None)
    gpu_check._torch_training_row("cpu", 64)
    assert gpu_check.failures == []
    # Per dtype: the path and 3 gradients; output and 4 gradients of the modern call; the row.
    assert len(gpu_check.passed) == 2 * 4 + 5 + 1


@requires_backend("torch")
@pytest.mark.compile
def test_torch_flex_checks_pass_on_cpu(gpu_check: ModuleType) -> None:
    from portable_attention.backends import torch_flex

    if torch_flex.unavailable("cpu") is not None:
        pytest.skip(f"Flex: {torch_flex.unavailable('cpu')}")
    gpu_check.torch_flex_checks("cpu", 256, ("float32",), lambda: None)
    assert gpu_check.failures == []
    # Five calls: path, output and speed each; rows with no key are 0.
    assert len(gpu_check.passed) == 5 * 3 + 1


@requires_backend("jax")
def test_jax_training_checks_pass_on_cpu(gpu_check: ModuleType) -> None:
    gpu_check._jax_blockwise_grads("jax float32 blockwise", "float32", 64)
    assert gpu_check.failures == []
    assert len(gpu_check.passed) == 4  # the path and 3 gradients


def test_array_backward_check_passes_on_numpy(gpu_check: ModuleType) -> None:
    """CuPy's attend_backward check, run on NumPy float32 against float64."""
    gpu_check._array_backward(np)
    assert gpu_check.failures == []
    assert len(gpu_check.passed) == 4  # the result type and 3 gradients


def test_tolerances_come_from_the_packages_table(gpu_check: ModuleType) -> None:
    """The package's one table; on a GPU float32 gets float16's row (TF32 matmuls)."""
    for dtype in ("float32", "float16", "bfloat16"):
        assert gpu_check.gpu_tolerance(dtype, on_gpu=False) == tolerance(dtype)
    assert gpu_check.gpu_tolerance("float32", on_gpu=True) == tolerance("float16")
    assert gpu_check.gpu_tolerance("bfloat16", on_gpu=True) == tolerance("bfloat16")
    assert not hasattr(gpu_check, "TOL")


def test_agreement_is_elementwise_within_the_table(gpu_check: ModuleType) -> None:
    ref = np.array([1.0, 100.0], dtype=np.float32)
    rtol, atol = tolerance("float32")
    gpu_check.agree("within", ref + 0.5 * (atol + rtol * ref), ref, "float32", False)
    gpu_check.agree("beyond", ref + np.float32(2 * (atol + rtol)), ref, "float32", False)
    gpu_check.agree("nan", np.array([np.nan, 100.0], np.float32), ref, "float32", False)
    gpu_check.agree("shape", ref[:1], ref, "float32", False)
    assert gpu_check.passed == ["within"]
    assert gpu_check.failures == ["beyond", "nan", "shape"]


def test_a_wrong_result_fails(gpu_check: ModuleType) -> None:
    gpu_check.check("made up", 1.0, 1e-3)
    gpu_check.expect("made up path", False, "portable")
    assert gpu_check.failures == ["made up", "made up path"]


def test_a_raising_section_fails_and_the_script_goes_on(gpu_check: ModuleType) -> None:
    def broken() -> None:
        msg = "no kernel image"
        raise RuntimeError(msg)

    gpu_check.section("broken", broken)
    gpu_check.expect("after", True, "runs")
    assert gpu_check.failures == ["broken"] and gpu_check.passed == ["after"]


@requires_backend("torch")
def test_torch_conformance_runs_on_cpu(gpu_check: ModuleType) -> None:
    """The conformance section's torch half on the CPU (SDPA's math backend, attend):
    attend agrees on every case, SDPA's report is printed, not judged."""
    cases = ["mask", "causal_lq_gt_lk", "grad_empty_rows", "sinks"]
    gpu_check.torch_conformance("cpu", "float32", ("MATH", "NO_SUCH_BACKEND"), cases)
    assert gpu_check.failures == []
    assert gpu_check.passed == ["conformance attend torch cpu float32"]


@requires_backend("jax")
def test_jax_conformance_runs_on_cpu(gpu_check: ModuleType) -> None:
    gpu_check.jax_conformance("float32", "xla", ["mask", "window", "grad_empty_rows"])
    assert gpu_check.failures == []
    assert gpu_check.passed == ["conformance attend jax float32"]


def test_without_a_gpu_nothing_is_claimed() -> None:
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is here: the script would run its checks")
    if importlib.util.find_spec("jax") is not None:
        import jax

        if jax.default_backend() == "gpu":
            pytest.skip("a JAX GPU backend is here")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no GPU check ran" in done.stdout


def test_verdict_fails_a_framework_without_gpu_where_another_has_one(
    gpu_check: ModuleType,
) -> None:
    """JAX falls back to the CPU quietly (say, when torch loaded an older cuDNN first):
    that must fail the run, not pass it with JAX unchecked."""
    no = gpu_check.NO_DEVICE
    assert gpu_check.verdict({"torch": 0, "jax": no}) == 1
    assert gpu_check.verdict({"torch": 0, "jax": 0, "cupy": -11}) == 1  # a crash
    assert gpu_check.verdict({"torch": 0, "jax": 0}) == 0
    assert gpu_check.verdict({"torch": no, "jax": no}) == 2
    assert gpu_check.verdict({}) == 2
