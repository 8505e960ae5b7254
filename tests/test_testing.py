"""``portable_attention.testing``: conversions between frameworks, ``assert_backends_agree``,
``tolerance`` and the opt-in pytest plugin (run in pytester's inner sessions).

The backends are the selected ones (``PORTABLE_ATTENTION_BACKENDS``, see ``conftest.py``);
arrays are made with the conftest's own conversions and read back by :func:`read`, each
framework's own way to the host: both independent of the converter under test (the rest
of the suite reads arrays through the package's one conversion path, this file checks
it).

Also the tolerance table, the reference implementation (against ``tests/oracle.py`` and
cases computed by hand), ``check_attention`` (on ``attend``, torch SDPA, jax.nn and on
deliberately wrong functions) and ``selected_backends``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from typing import Any

import array_api_compat
import numpy as np
import pytest
from portable_attention import attend
from portable_attention.testing import (
    BACKEND_NAMES,
    CASES,
    TOLERANCES,
    ArrayBackend,
    Tolerance,
    assert_backends_agree,
    available_backends,
    check_attention,
    reference_attention,
    selected_backends,
    to_backend,
    to_numpy,
    tolerance,
)
from portable_attention.testing._convert import source_framework

import oracle
from conftest import BY_NAME, ENV_VAR, Backend, requires_backend
from helpers import rng_for

pytest_plugins = ["pytester"]

SELECTED: tuple[str, ...] = tuple(BY_NAME)
PAIRS = [pytest.param(s, d, id=f"{s}-to-{d}") for s in SELECTED for d in SELECTED]
DTYPES = ("float16", "bfloat16", "float32", "float64")
# array_api_strict has no 16-bit floats; NumPy has bfloat16 only through ml_dtypes (which
# comes with JAX: sessions without JAX may lack it).
HAS_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None
HAS_DTYPE = {
    "numpy": set(DTYPES) if HAS_ML_DTYPES else set(DTYPES) - {"bfloat16"},
    "torch": set(DTYPES),
    "jax": set(DTYPES),
    "array_api_strict": {"float32", "float64"},
}


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make(name: str, data: np.ndarray, dtype: str) -> Any:
    """``data`` as a ``name`` array of ``dtype``, made by the conftest (not by to_backend)."""
    if name == "numpy":
        return np.asarray(data).astype(numpy_dtype(dtype))
    return BY_NAME[name].asarray(data, dtype)


def read(name: str, x: Any) -> np.ndarray:
    """A ``name`` array's values as float64, read by the framework itself, not by the
    converter under test (TypeError if ``x`` is not a ``name`` array)."""
    backend: Backend = BY_NAME[name]
    backend._check_type(x)
    if name == "torch":
        import torch

        t = x.detach().cpu()
        a = (t.to(torch.float32) if t.dtype == torch.bfloat16 else t).numpy()
    elif name == "jax":
        import jax.numpy as jnp

        a = np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
    elif name == "array_api_strict":
        import array_api_strict as xs

        a = np.asarray(x.to_device(xs.Device("CPU_DEVICE")))
    else:
        a = np.asarray(x)
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def expected_dtype(name: str, dtype: str) -> Any:
    return numpy_dtype(dtype) if name == "numpy" else BY_NAME[name].dtypes[dtype]


def special_values(dtype: str) -> np.ndarray:
    """Random values plus the ones a lossy conversion gets wrong: nan, +-inf, -0.0, tiny;
    all exact in ``dtype`` (returned as float64)."""
    rng = rng_for("special", dtype)
    if dtype == "bfloat16":  # multiples of 1/8 up to 16 fit bfloat16's 8 significant bits
        tiny, values = 2.0**-126, rng.integers(-128, 128, 19) / 8
    else:
        tiny = float(np.finfo(np.float16).tiny) if dtype == "float16" else 1e-30
        values = rng.standard_normal(19)
    values = np.concatenate([values, [np.nan, np.inf, -np.inf, -0.0, tiny]])
    if dtype != "bfloat16":
        values = values.astype(dtype)
    return values.reshape(2, 3, 4).astype(np.float64)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(
        np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))
    )


# -- to_backend: round trips -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_round_trip_keeps_values_dtype_shape(src: str, dst: str, dtype: str) -> None:
    if dtype not in HAS_DTYPE[src]:
        pytest.skip(f"{src} has no {dtype}")
    data = special_values(dtype)
    x = make(src, data, dtype)
    if dtype not in HAS_DTYPE[dst]:
        lacks = "NumPy has only through the ml_dtypes" if dst == "numpy" else f"{dst} does not"
        with pytest.raises(TypeError, match=f"`x` has dtype {dtype}, which {lacks}"):
            to_backend(x, dst)
        return
    y = to_backend(x, dst)
    assert y.dtype == expected_dtype(dst, dtype)
    assert tuple(y.shape) == (2, 3, 4)
    assert same_bits(read(dst, y), data)  # read() fails unless y is a `dst` array
    back = to_backend(y, src)
    assert type(back) is type(x)
    assert back.dtype == x.dtype
    assert same_bits(read(src, back), data)
    if dtype in HAS_DTYPE["numpy"]:
        assert same_bits(to_numpy(y).astype(np.float64), data)
        assert to_numpy(y).dtype == numpy_dtype(dtype)


@pytest.mark.parametrize(("src", "dst"), PAIRS)
@pytest.mark.parametrize("shape", [(0,), (2, 0, 4), (), (1, 1, 1, 5)], ids=str)
def test_shapes_including_empty_and_scalar(src: str, dst: str, shape: tuple[int, ...]) -> None:
    data = np.arange(float(np.prod(shape))).reshape(shape) - 1.5
    y = to_backend(make(src, data, "float32"), dst)
    assert tuple(y.shape) == shape
    assert y.dtype == expected_dtype(dst, "float32")
    np.testing.assert_array_equal(read(dst, y), data.astype(np.float32))


NUMPY_VIEWS = {
    "reversed": lambda a: a[::-1],
    "stepped": lambda a: a[:, ::2],
    "transposed": lambda a: a.T,
    "reversed-last": lambda a: a[..., ::-2],
    "broadcast": lambda a: np.broadcast_to(a[:1], a.shape),  # stride 0, read-only
}


@pytest.mark.parametrize("view", NUMPY_VIEWS)
@pytest.mark.parametrize("dst", SELECTED)
def test_non_contiguous_numpy_views(dst: str, view: str) -> None:
    base = np.arange(24.0).reshape(2, 3, 4)
    v = NUMPY_VIEWS[view](base)
    assert not v.flags.c_contiguous
    y = to_backend(v, dst)
    assert tuple(y.shape) == v.shape
    assert y.dtype == expected_dtype(dst, "float64")
    np.testing.assert_array_equal(read(dst, y), v)
    np.testing.assert_array_equal(base, np.arange(24.0).reshape(2, 3, 4))  # input untouched


@requires_backend("torch")
@pytest.mark.parametrize("dst", SELECTED)
def test_non_contiguous_torch_views(dst: str) -> None:
    import torch

    base = torch.arange(24.0, dtype=torch.float64).reshape(2, 3, 4)
    for v in (base.transpose(0, 2), base[:, ::2], base[:1].expand(2, 3, 4), base.flip(0)):
        y = to_backend(v, dst)
        assert tuple(y.shape) == tuple(v.shape)
        np.testing.assert_array_equal(read(dst, y), v.numpy())


@requires_backend("array_api_strict")
@pytest.mark.parametrize("dst", SELECTED)
def test_reversed_strict_array(dst: str) -> None:
    """array_api_strict views wrap NumPy views: negative strides must reach torch as a copy."""
    import array_api_strict as xs

    x = xs.flip(xs.reshape(xs.arange(12.0), (3, 4)), axis=0)
    y = to_backend(x, dst)
    np.testing.assert_array_equal(read(dst, y), np.arange(12.0).reshape(3, 4)[::-1])


@requires_backend("torch")
def test_numpy_and_torch_share_memory() -> None:
    import torch

    a = np.zeros(4, dtype=np.float32)
    t = to_backend(a, "torch")
    t[1] = 7.0
    assert a[1] == 7.0  # DLPack: no copy
    back = to_numpy(t)
    back[2] = 5.0
    assert float(t[2]) == 5.0
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32


@requires_backend("torch")
@pytest.mark.parametrize("dst", SELECTED)
def test_tensor_requiring_grad_is_detached(dst: str) -> None:
    import torch

    leaf = torch.arange(6.0, requires_grad=True)
    x = (leaf * 2).reshape(2, 3)  # a non-leaf in a graph
    y = to_backend(x, dst)
    np.testing.assert_array_equal(read(dst, y), np.arange(6.0).reshape(2, 3) * 2)
    if dst == "torch":
        assert not y.requires_grad
        assert y.grad_fn is None
    assert x.requires_grad  # the input is not changed
    assert leaf.grad is None


@requires_backend("torch")
def test_torch_conjugate_view_resolves() -> None:
    import torch

    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
    a = to_numpy(z)
    assert a.dtype == np.complex64
    np.testing.assert_array_equal(a, np.array([1 - 2j, 3 + 1j], dtype=np.complex64))


@pytest.mark.parametrize("dst", SELECTED)
def test_bool_and_int_dtypes(dst: str) -> None:
    for data in (np.array([[True, False, True]]), np.array([-3, 0, 2**40], dtype=np.int64)):
        y = to_backend(data, dst)
        back = to_numpy(y)
        assert back.dtype == data.dtype
        np.testing.assert_array_equal(back, data)


def test_numpy_scalar_is_a_zero_d_array() -> None:
    out = to_numpy(np.float32(1.5))
    assert isinstance(out, np.ndarray) and out.shape == () and out.dtype == np.float32
    assert out == np.float32(1.5)


@pytest.mark.parametrize("dst", SELECTED)
def test_same_framework_returns_the_array(dst: str) -> None:
    x = make(dst, np.ones((2, 2)), "float32")
    assert to_backend(x, dst) is x or dst == "torch"  # torch: x.detach(), a view
    np.testing.assert_array_equal(read(dst, to_backend(x, dst)), np.ones((2, 2)))


# -- to_backend: devices and errors --------------------------------------------------------------


@pytest.mark.parametrize("dst", SELECTED)
def test_cpu_device(dst: str) -> None:
    y = to_backend(np.ones(3, dtype=np.float32), dst, device="cpu")
    dev = str(getattr(y, "device", "cpu")).lower()
    assert "cpu" in dev, dev
    np.testing.assert_array_equal(read(dst, y), np.ones(3))


@requires_backend("jax")
def test_jax_device_strings_map_to_jax_devices() -> None:
    import jax

    y = to_backend(np.ones(2, dtype=np.float32), "jax", device="cpu:0")
    assert y.devices() == {jax.devices("cpu")[0]}
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError, match=r"`device`='cuda:1' .*JAX has no 'gpu' devices"):
            to_backend(np.ones(2, dtype=np.float32), "jax", device="cuda:1")


@requires_backend("torch")
def test_torch_unusable_device_is_a_value_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the device is usable")
    with pytest.raises(ValueError, match=r"`device`='cuda:1' is not a device for name='torch'"):
        to_backend(np.ones(2), "torch", device="cuda:1")
    with pytest.raises(ValueError, match=r"`device`='tpu-ish'"):
        to_backend(np.ones(2), "torch", device="tpu-ish")


@pytest.mark.parametrize(
    ("device", "dst", "match"),
    [
        ("cuda", "numpy", "NumPy arrays live on the CPU"),
        ("cuda:0", "array_api_strict", "pass 'cpu' or an array_api_strict.Device"),
        ("cpu", "cupy", None),
    ],
)
def test_device_errors(device: str, dst: str, match: str | None) -> None:
    if dst not in available_backends():
        with pytest.raises(ValueError, match=f"`name`='{dst}', but {dst} does not import"):
            to_backend(np.ones(2), dst, device=device)
        return
    with pytest.raises(ValueError, match=f"`device`='{device}'.*{match or ''}"):
        to_backend(np.ones(2), dst, device=device)


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, (1, 2), None, "abc", {"a": 1}, object()])
def test_non_arrays_are_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match=r"`x` must be an array .*got builtins\."):
        to_backend(bad, "numpy")


@pytest.mark.parametrize("name", ["tensorflow", "Torch", "", None, 3])
def test_unknown_backend_names(name: object) -> None:
    with pytest.raises(ValueError, match=r"`name` must be one of 'numpy', 'torch'"):
        to_backend(np.ones(2), name)  # type: ignore[arg-type]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_uninstalled_framework_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"`name`='cupy', but cupy does not import .*install it"):
        to_backend(np.ones(2), "cupy")
    assert "cupy" not in available_backends()


@requires_backend("jax")
def test_float64_to_jax_without_x64_is_a_type_error() -> None:
    import jax

    with jax.enable_x64(False):
        with pytest.raises(TypeError, match=r"`x` has dtype float64, but JAX runs without 64"):
            to_backend(np.ones(2), "jax")
        y = to_backend(np.ones(2, dtype=np.complex64), "jax")  # 8 bytes, but 32-bit parts
        assert y.dtype == np.complex64


def test_no_framework_is_imported_to_find_out() -> None:
    code = (
        "import sys, numpy as np\n"
        "from portable_attention.testing import to_numpy, to_backend, assert_backends_agree\n"
        "from portable_attention.testing._convert import source_framework\n"
        "a = np.ones((2, 3), dtype=np.float32)\n"
        "assert source_framework(a) == 'numpy' and to_numpy(a) is a\n"
        "assert to_backend(a, 'numpy') is a\n"
        "assert_backends_agree(lambda x: x * 2, a, backends=['numpy'])\n"
        "names = ('torch', 'jax', 'cupy', 'array_api_strict')\n"
        "print(sorted(m for m in names if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class DLPackOnly:
    """An array of some other library: it offers DLPack and nothing else we know."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data
        self.dtype = data.dtype
        self.shape = data.shape

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._data.__dlpack_device__()


@pytest.mark.parametrize("dst", SELECTED)
def test_any_dlpack_producer_converts(dst: str) -> None:
    data = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    for view in (data, data[::-1], data[:, ::2]):  # negative strides would abort torch
        x = DLPackOnly(view)
        assert source_framework(x) == "dlpack"
        y = to_backend(x, dst)
        assert y.dtype == expected_dtype(dst, "float32")
        np.testing.assert_array_equal(read(dst, y), view)


@requires_backend("torch")
def test_bfloat16_to_numpy_without_ml_dtypes_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['ml_dtypes'] = None  # as if not installed: importing it fails\n"
        "import torch\n"
        "from portable_attention.testing import to_numpy\n"
        "try:\n"
        "    to_numpy(torch.ones(2, dtype=torch.bfloat16))\n"
        "except TypeError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "`x` has dtype bfloat16, which NumPy has only through the ml_dtypes" in done.stdout
    assert "pip install ml_dtypes" in done.stdout


def test_available_backends() -> None:
    names = available_backends()
    assert isinstance(names, tuple)
    assert names[0] == "numpy"
    assert set(SELECTED) <= set(names)
    assert list(names) == [n for n in BACKEND_NAMES if n in names]  # the documented order
    for name in names:
        assert importlib.util.find_spec(name) is not None


# -- tolerance ---------------------------------------------------------------------------------


def test_tolerance_table() -> None:
    """The one table (``testing.TOLERANCES``) that the report, the suite, the GPU script
    and assert_backends_agree share; its values and where they come from are in
    ``portable_attention/testing/_tolerance.py``."""
    assert tolerance("float64") == (1e-10, 1e-12)
    assert tolerance(np.float32) == (1e-4, 1e-5)
    assert tolerance(np.dtype("float16")) == (5e-3, 5e-3)
    assert tolerance("bfloat16") == (3e-2, 4e-2)
    assert tolerance("complex64") == tolerance("float32")
    assert tolerance(np.int64) == (0.0, 0.0)
    assert tolerance(np.bool_) == (0.0, 0.0)
    for name in SELECTED:
        if name == "numpy":
            continue
        for dtype_name, dtype in BY_NAME[name].dtypes.items():
            assert tolerance(dtype) == tolerance(dtype_name), (name, dtype)
    with pytest.raises(ValueError, match=r"`dtype` .*has no default tolerance"):
        tolerance(np.dtype("U3"))
    # Per output: the lse of 16-bit inputs is float32 (the contract), so near float32's.
    assert set(TOLERANCES) == {"float64", "float32", "float16", "bfloat16"}
    for name, row in TOLERANCES.items():
        assert set(row) == {"out", "weights", "lse"}
        assert row["weights"] == row["out"] == tolerance(name) == tolerance(name, "out")
        assert tolerance(name, "lse") == row["lse"]
        assert isinstance(row["lse"], Tolerance) and row["lse"].rtol <= row["out"].rtol
    assert tolerance("float16", "lse") == tolerance("bfloat16", "lse") == (1e-4, 1e-4)
    assert tolerance("float32").atol == 1e-5 and tolerance("float32").rtol == 1e-4
    with pytest.raises(ValueError, match=r"`what` must be one of 'out', 'weights', 'lse'"):
        tolerance("float32", "grad")
    with pytest.raises(TypeError):
        TOLERANCES["float32"] = {}  # type: ignore[index]  # read-only


def test_every_tool_uses_the_one_table() -> None:
    """The report, the demo, the suite's helpers and the GPU script read their tolerances
    from ``testing.tolerance`` (no table of their own)."""
    from portable_attention import __main__ as cli
    from portable_attention import _report

    import conftest

    for name in ("float32", "float16", "bfloat16"):
        assert _report.TOLERANCES[name] == tolerance(name, "out")
    assert tolerance("float32") == (cli.RTOL, cli.ATOL)
    for name in ("float64", "float32", "float16", "bfloat16"):
        assert conftest.TOLERANCES[name] == tolerance(name, "out")
        assert conftest.LSE_TOLERANCES[name] == tolerance(name, "lse")


# -- assert_backends_agree ------------------------------------------------------------------------


def qkv(dtype: str = "float32", shape: tuple[int, ...] = (2, 3, 5, 8)) -> list[np.ndarray]:
    rng = rng_for("agree", dtype, shape)
    return [rng.standard_normal(shape).astype(numpy_dtype(dtype)) for _ in range(3)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attend_agrees_across_backends(dtype: str) -> None:
    q, k, v = qkv(dtype)
    mask = np.tril(np.ones((5, 5), dtype=bool))
    outs = assert_backends_agree(attend, q, k, v, mask=mask, return_weights=True, backends=SELECTED)
    assert list(outs) == list(SELECTED)
    for name, (out, weights) in outs.items():
        assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype), name
        assert out.shape == (2, 3, 5, 8) and weights.shape == (2, 3, 5, 5), name
        assert weights.dtype == np.dtype(dtype)
    ref = outs[SELECTED[0]]
    np.testing.assert_allclose(outs[SELECTED[-1]][0], ref[0], rtol=1e-5, atol=1e-6)
    assert np.all(ref[1][..., 0, 1:] == 0)  # the mask held


def test_default_backends_are_the_available_ones() -> None:
    q, k, v = qkv("float32", (4, 8))
    outs = assert_backends_agree(attend, q, k, v, causal=True)
    assert tuple(outs) == available_backends()
    for out in outs.values():
        assert out.dtype == np.float32 and out.shape == (4, 8)


@pytest.mark.parametrize("pair", [("torch", "jax")])
def test_bfloat16_on_torch_and_jax(pair: tuple[str, str]) -> None:
    if not set(pair) <= set(SELECTED):
        pytest.skip(f"needs {pair} selected")
    import torch

    q, k, v = (torch.from_numpy(a).to(torch.bfloat16) for a in qkv("float32"))
    outs = assert_backends_agree(attend, q, k, v, causal=True, backends=pair)
    assert outs["torch"].dtype == numpy_dtype("bfloat16")
    assert outs["jax"].dtype == numpy_dtype("bfloat16")


def _comparable() -> tuple[str, ...]:
    """Backends to exercise the comparison with: the selected ones, and where only one is
    selected, NumPy or array_api_strict besides (light, and in every test environment)."""
    if len(SELECTED) >= 2:
        return SELECTED
    for extra in ("numpy", "array_api_strict"):
        if extra not in SELECTED and importlib.util.find_spec(extra) is not None:
            return (*SELECTED, extra)
    return SELECTED


COMPARE = _comparable()
needs_two = pytest.mark.skipif(len(COMPARE) < 2, reason="needs two backends to compare")


def perturb_on(name: str, out: Any, delta: float, at: tuple[int, ...] = (1, 2, 3, 4)) -> Any:
    """``out`` with ``delta`` added at index ``at`` when it is a ``name`` array; else ``out``."""
    if source_framework(out) != name:
        return out
    a = np.array(to_numpy(out), copy=True)
    a[at] += delta
    return to_backend(a, name)


@needs_two
def test_a_perturbed_backend_fails_with_the_details() -> None:
    bad = COMPARE[-1]
    q, k, v = qkv()

    def fn(q: Any, k: Any, v: Any) -> Any:
        out, lse = attend(q, k, v, return_lse=True)
        return out, perturb_on(bad, lse, delta=0.5, at=(1, 2, 3))

    with pytest.raises(AssertionError) as info:
        assert_backends_agree(fn, q, k, v, backends=COMPARE)
    msg = str(info.value)
    assert f"backend {bad!r} disagrees with {COMPARE[0]!r} on output[1]:" in msg
    assert "1 of 30 elements differ beyond rtol=0.0001, atol=1e-05 (dtype float32)" in msg
    ref = to_numpy(attend(*(to_backend(a, COMPARE[0]) for a in (q, k, v)), return_lse=True)[1])
    rel = 0.5 / abs(float(ref[1, 2, 3]))
    assert f"max abs error 0.5 at index (1, 2, 3), max relative error {rel:.3g} at index" in msg
    assert "at index (1, 2, 3); furthest beyond the tolerance at index (1, 2, 3): got " in msg
    assert f"reference {float(ref[1, 2, 3])!r}" in msg


@needs_two
def test_explicit_tolerances_accept_a_small_perturbation() -> None:
    bad = COMPARE[1]
    q, k, v = qkv()

    def fn(q: Any, k: Any, v: Any) -> Any:
        return perturb_on(bad, attend(q, k, v), delta=1e-3)

    with pytest.raises(AssertionError, match=r"rtol=0.0001, atol=1e-05"):
        assert_backends_agree(fn, q, k, v, backends=COMPARE)
    assert_backends_agree(fn, q, k, v, backends=COMPARE, atol=2e-3)
    with pytest.raises(AssertionError, match=r"rtol=0.0001, atol=1e-06"):
        assert_backends_agree(fn, q, k, v, backends=COMPARE, rtol=1e-4, atol=1e-6)


@needs_two
def test_nested_outputs_report_the_key_path() -> None:
    bad = COMPARE[-1]
    q, k, v = qkv()

    def fn(q: Any, k: Any, v: Any) -> Any:
        out, w = attend(q, k, v, return_weights=True)
        return {"attn": (out, [perturb_on(bad, w, delta=-0.1, at=(0, 1, 2, 3))]), "n": 3}

    with pytest.raises(AssertionError) as info:
        assert_backends_agree(fn, q, k, v, backends=COMPARE)
    msg = str(info.value)
    assert f"backend {bad!r} disagrees with {COMPARE[0]!r} on output['attn'][1][0]:" in msg
    assert "index (0, 1, 2, 3)" in msg
    good = assert_backends_agree(lambda q: {"x": [q, (q,)], "n": 3}, q, backends=COMPARE)
    for name in COMPARE:
        assert good[name]["n"] == 3
        assert isinstance(good[name]["x"], list) and isinstance(good[name]["x"][1], tuple)
        np.testing.assert_array_equal(good[name]["x"][1][0], q)


@needs_two
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("length", r"on the output: returned a tuple of 3 items, the reference a tuple of 2 items"),
        (
            "keys",
            r"on the output: returned a dict with keys \['a', 'c'\], "
            r"the reference a dict with keys \['a', 'b'\]",
        ),
        ("shape", r"on output\[0\]: shape \(2, 3\), the reference \(3, 2\)"),
        ("dtype", r"on output\[0\]: dtype float64, the reference float32"),
        ("type", r"on output\[1\]: returned 1.0 \(float\), the reference 1 \(int\)"),
        ("nan", r"on output\[0\]: 1 of 6 elements differ .*max abs error inf at index \(0, 1\)"),
    ],
)
def test_structure_shape_dtype_mismatches_fail(kind: str, message: str) -> None:
    bad = COMPARE[1]

    def fn(x: Any) -> Any:
        a = to_numpy(x)
        other = source_framework(x) == bad
        if kind == "length":
            return (a, a, a) if other else (a, a)
        if kind == "keys":
            return {"a": a, "c": a} if other else {"a": a, "b": a}
        if kind == "shape":
            return (a.reshape(2, 3) if other else a.reshape(3, 2),)
        if kind == "dtype":
            return (a.astype(np.float64) if other else a,)
        if kind == "type":
            return (a, 1.0 if other else 1)
        b = a.copy()
        if other:
            b[0, 1] = np.nan
        return (b,)

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with pytest.raises(AssertionError, match=message):
        assert_backends_agree(fn, x, backends=COMPARE)


@needs_two
def test_same_nans_and_infs_agree() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -1.0], dtype=np.float32)
    outs = assert_backends_agree(lambda a: a * 1, x, backends=COMPARE)
    for name in COMPARE:
        np.testing.assert_array_equal(outs[name], x)


@needs_two
@pytest.mark.parametrize(
    ("reference", "other"),
    [(np.nan, 1.0), (np.inf, 2.0), (-np.inf, 3.0), (-np.inf, np.inf), (1.0, np.nan)],
)
def test_a_nan_or_infinite_reference_agrees_only_with_its_equal(
    reference: float, other: float
) -> None:
    """A NaN or infinite reference has no finite tolerance bound, so no finite distance
    may be taken for agreement (an lse of -inf against a finite lse must fail)."""
    first = COMPARE[0]

    def fn(a: Any) -> Any:
        value = reference if source_framework(a) == first else other
        return a * 0 + value

    x = np.zeros(3, dtype=np.float64)
    with pytest.raises(AssertionError, match="3 of 3 elements differ"):
        assert_backends_agree(fn, x, backends=COMPARE)


@needs_two
def test_numpy_float64_scalars_are_arrays() -> None:
    """``numpy.float64`` subclasses ``float`` but is a NumPy scalar: a 0-d array, as
    ``numpy.float32`` is, as input and as output (NumPy's reductions return it)."""
    x = np.arange(4, dtype=np.float64)

    def total(a: Any) -> Any:
        return array_api_compat.array_namespace(a).sum(a * a)

    outs = assert_backends_agree(total, x, backends=COMPARE)
    assert all(float(np.asarray(o)) == 14.0 for o in outs.values())
    for scalar in (np.float64(1.5), np.complex128(1j)):
        out = to_numpy(to_backend(scalar, COMPARE[1]))
        assert out.shape == () and out.dtype == np.asarray(scalar).dtype and out == scalar


@requires_backend("torch")
def test_read_only_numpy_array_is_copied_for_torch() -> None:
    """torch ignores DLPack's read-only flag: sharing would let the tensor write into an
    array its owner made read-only (a NumPy view of a JAX array, for one)."""
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    t = to_backend(a, "torch")
    t += 100
    np.testing.assert_array_equal(a, np.arange(4, dtype=np.float32))


@needs_two
def test_integers_strings_and_float8_outputs() -> None:
    bad = COMPARE[1]
    big = np.array([2**53, 7], dtype=np.int64)  # 2**53 + 1 rounds to 2**53 in float64

    def ints(x: Any) -> Any:
        return big + 1 if source_framework(x) == bad else big

    with pytest.raises(
        AssertionError, match=r"output: 2 of 2 elements differ beyond rtol=0, atol=0"
    ):
        assert_backends_agree(ints, np.ones(1), backends=COMPARE)

    def off_by_one_ulp(x: Any) -> Any:
        return np.array([2**53 + (source_framework(x) == bad)], dtype=np.int64)

    with pytest.raises(AssertionError, match=r"1 of 1 elements differ .*\(dtype int64\)"):
        assert_backends_agree(off_by_one_ulp, np.ones(1), backends=COMPARE)

    def words(x: Any) -> Any:
        return np.array(["a", "b" if source_framework(x) == bad else "c"])

    with pytest.raises(AssertionError, match=r"compared exactly\); the first at index \(1,\)"):
        assert_backends_agree(words, np.ones(1), backends=COMPARE)


@needs_two
def test_float8_outputs_need_explicit_tolerances() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bad = COMPARE[1]
    e4m3 = np.array([1.0, 2.0], dtype=ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"no default tolerance"):
        assert_backends_agree(lambda x: e4m3, np.ones(1), backends=COMPARE)
    outs = assert_backends_agree(lambda x: e4m3, np.ones(1), backends=COMPARE, rtol=0, atol=0)
    assert outs[bad].dtype == e4m3.dtype


@pytest.mark.parametrize("dst", SELECTED)
def test_big_endian_numpy_input(dst: str) -> None:
    a = np.arange(5, dtype=">f4")
    y = to_backend(a, dst)
    assert tuple(y.shape) == (5,)
    np.testing.assert_array_equal(read(dst, y), np.arange(5.0))
    assert to_numpy(y).dtype == (a.dtype if dst == "numpy" else np.dtype("float32"))


@pytest.mark.parametrize("dst", [n for n in SELECTED if n != "numpy"])
def test_string_array_to_a_framework_is_a_type_error(dst: str) -> None:
    match = (
        rf"(`x` has dtype str32, which {dst} does not have|"
        rf"cannot convert `x` \(numpy array of dtype str32, shape \(2,\)\) to {dst}: )"
    )
    with pytest.raises(TypeError, match=match):
        to_backend(np.array(["a", "b"]), dst)


def test_inputs_are_converted_fresh_and_nested() -> None:
    seen: list[tuple[str, float]] = []
    x = np.arange(4, dtype=np.float32)

    def fn(a: Any, *, pack: dict[str, Any], label: str, n: int) -> Any:
        name = source_framework(a)
        inner = pack["list"][0]
        assert source_framework(inner) == name and source_framework(pack["tuple"][1]) == name
        assert pack["tuple"][0] == "keep" and label == "L" and n == 2
        seen.append((name, float(to_numpy(a)[0])))
        if name == "numpy":
            a[0] = 100.0  # in place: must not reach the other backends or the caller
        return inner

    outs = assert_backends_agree(
        fn,
        x,
        pack={"list": [x], "tuple": ("keep", x)},
        label="L",
        n=2,
        backends=SELECTED,
    )
    assert seen == [(name, 0.0) for name in SELECTED]
    assert x[0] == 0.0
    for name in SELECTED:
        assert outs[name].dtype == np.float32
        np.testing.assert_array_equal(outs[name], np.arange(4, dtype=np.float32))


def test_errors_of_fn_propagate_with_the_backend() -> None:
    def fn(x: Any) -> Any:
        msg = "boom"
        raise KeyError(msg)

    with pytest.raises(KeyError, match="boom") as info:
        assert_backends_agree(fn, np.ones(2), backends=["numpy"])
    if sys.version_info >= (3, 11):
        assert "(raised by `fn` on backend 'numpy')" in info.value.__notes__


@pytest.mark.parametrize(
    ("backends", "error", "match"),
    [
        ("torch", TypeError, r"`backends` must be a sequence of backend names"),
        ([], ValueError, r"`backends` is empty"),
        (["numpy", "tensorflow"], ValueError, r"`backends` has 'tensorflow': `name` must be"),
    ],
)
def test_bad_backends(backends: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        assert_backends_agree(lambda x: x, np.ones(2), backends=backends)


@requires_backend("array_api_strict")
def test_unrepresentable_input_dtype_names_the_backend() -> None:
    with pytest.raises(TypeError, match=r"float16, which array_api_strict does not have") as info:
        assert_backends_agree(
            lambda x: x, np.ones(2, dtype=np.float16), backends=["numpy", "array_api_strict"]
        )
    if sys.version_info >= (3, 11):
        assert "(converting the inputs to backend 'array_api_strict')" in info.value.__notes__


# -- ArrayBackend and the pytest plugin --------------------------------------------------------


@pytest.mark.parametrize("name", SELECTED)
def test_array_backend_handle(name: str) -> None:
    b = ArrayBackend(name)
    assert str(b) == name
    x = b.asarray([[1.0, 2.0]], dtype="float32")
    assert x.dtype == expected_dtype(name, "float32")
    np.testing.assert_array_equal(read(name, x), [[1.0, 2.0]])
    assert float(b.xp.sum(x)) == 3.0
    np.testing.assert_array_equal(b.to_numpy(b.asarray(np.arange(3))), np.arange(3))
    with pytest.raises(ValueError, match="`name` must be one of"):
        ArrayBackend("tf")


PLUGIN_CONFTEST = 'pytest_plugins = ["portable_attention.testing.pytest_plugin"]\n'
PLUGIN_TESTS = """
import numpy as np
import pytest
from portable_attention.testing._convert import source_framework
from portable_attention.testing import ArrayBackend, to_numpy


def test_backend(array_backend):
    assert isinstance(array_backend, ArrayBackend)
    x = array_backend.asarray(np.arange(3.0, dtype=np.float32))
    assert source_framework(x) == array_backend.name
    assert to_numpy(x).tolist() == [0.0, 1.0, 2.0]
    assert to_numpy(x).dtype == np.float32


@pytest.mark.parametrize("array_backend", ["numpy"], indirect=True)
def test_own_choice(array_backend):
    assert array_backend.name == "numpy"
"""


@pytest.fixture
def plugin_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv(ENV_VAR, raising=False)
    pytester.makeconftest(PLUGIN_CONFTEST)
    pytester.makepyfile(test_user=PLUGIN_TESTS)
    return pytester


def test_plugin_default_is_every_available_backend(plugin_project: pytest.Pytester) -> None:
    result = plugin_project.runpytest("-v")
    names = available_backends()
    result.assert_outcomes(passed=len(names) + 1)
    result.stdout.fnmatch_lines([f"array backends (array_backend fixture): {', '.join(names)}"])
    for name in names:
        result.stdout.fnmatch_lines([f"*test_backend?{name}? PASSED*"])
    result.stdout.fnmatch_lines(["*test_own_choice?numpy? PASSED*"])


def test_plugin_option_restricts(plugin_project: pytest.Pytester) -> None:
    chosen = SELECTED[-1]
    result = plugin_project.runpytest("-v", f"--array-backends=numpy,{chosen}")
    result.assert_outcomes(passed=len({"numpy", chosen}) + 1)
    result.stdout.fnmatch_lines([f"*test_backend?{chosen}? PASSED*"])
    others = [n for n in available_backends() if n not in ("numpy", chosen)]
    for name in others:
        result.stdout.no_fnmatch_line(f"*test_backend?{name}?*")


def test_plugin_loads_with_dash_p(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    pytester.makepyfile(test_user=PLUGIN_TESTS)  # no conftest: the plugin comes from -p
    plugin = "portable_attention.testing.pytest_plugin"
    result = pytester.runpytest("-p", plugin, "--array-backends=numpy", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_backend?numpy? PASSED*"])
    without = pytester.runpytest("-v")
    without.assert_outcomes(errors=2)  # no plugin: fixture 'array_backend' not found
    without.stdout.fnmatch_lines(["*fixture 'array_backend' not found*"])


def test_plugin_env_var_restricts_and_option_wins(
    plugin_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "numpy")
    result = plugin_project.runpytest("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_backend?numpy? PASSED*"])
    monkeypatch.setenv(ENV_VAR, "not-a-backend")
    result = plugin_project.runpytest("-v", "--array-backends=numpy")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("numpy,tensorflow", "*requests backend 'tensorflow', which is not usable*"),
        (" , ", "*names no backend*"),
    ],
)
def test_plugin_bad_request_fails_the_run(
    plugin_project: pytest.Pytester, option: str, message: str
) -> None:
    result = plugin_project.runpytest(f"--array-backends={option}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    result.stdout.no_fnmatch_line("*passed*")  # nothing ran
    result.stdout.no_fnmatch_line("*skipped*")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_plugin_uninstalled_backend_fails_not_skips(
    plugin_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "numpy,cupy")
    result = plugin_project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{ENV_VAR}='numpy,cupy' requests backend 'cupy'*install*"])


# -- to_numpy(x, dtype=...) and the converter's own errors ---------------------------------------


@pytest.mark.parametrize("name", SELECTED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_to_numpy_as_float64_is_exact(name: str, dtype: str) -> None:
    if dtype not in HAS_DTYPE[name]:
        pytest.skip(f"{name} has no {dtype}")
    data = special_values(dtype)
    out = to_numpy(make(name, data, dtype), dtype="float64")
    assert out.dtype == np.float64 and out.shape == data.shape
    assert same_bits(out, data)


@requires_backend("torch")
def test_bfloat16_as_float64_needs_no_ml_dtypes() -> None:
    """The report and the suite read bfloat16 results without ml_dtypes: to_numpy with a
    dtype widens them to float32 in torch first (exactly)."""
    code = (
        "import sys\n"
        "sys.modules['ml_dtypes'] = None  # as if not installed: importing it fails\n"
        "import torch\n"
        "from portable_attention.testing import to_numpy\n"
        "x = torch.tensor([1.0, -2.5, 3.140625, 1e30], dtype=torch.bfloat16)\n"
        "a = to_numpy(x, dtype='float64')\n"
        "print(a.dtype, a.tolist() == x.double().tolist())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["float64", "True"]


@requires_backend("array_api_strict")
def test_the_converters_own_errors_pass_through_by_type() -> None:
    """A refusal of the converter itself (its message says what to do) is a
    ConversionError, a TypeError, and reaches the caller unwrapped."""
    from portable_attention.testing._convert import ConversionError

    with pytest.raises(ConversionError, match=r"^`x` has dtype float16, which array_api_strict"):
        to_backend(np.ones(2, dtype=np.float16), "array_api_strict")
    assert issubclass(ConversionError, TypeError)


# -- selected_backends: the one reader of PORTABLE_ATTENTION_BACKENDS ---------------------------


def test_selected_backends_reads_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert selected_backends() == available_backends()
    assert selected_backends(known=("array_api_strict", "numpy")) == tuple(
        n for n in ("array_api_strict", "numpy") if n in available_backends()
    )
    monkeypatch.setenv(ENV_VAR, "  ")  # blank: unset
    assert selected_backends() == available_backends()
    monkeypatch.setenv(ENV_VAR, f"{SELECTED[-1]}, numpy,{SELECTED[-1]}")
    assert selected_backends() == tuple(dict.fromkeys((SELECTED[-1], "numpy")))
    assert selected_backends("numpy") == ("numpy",)  # an explicit request wins


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        ("numpy,tensorflow", r"^X='numpy,tensorflow' requests backend 'tensorflow', which is not"),
        (" , ", r"^X=' , ' names no backend; known: numpy, torch"),
        ("cupy", r"^X='cupy' requests backend 'cupy', which is not usable: "),
    ],
)
def test_selected_backends_fails_a_request_it_cannot_honour(request_: str, match: str) -> None:
    if request_ == "cupy" and "cupy" in available_backends():
        pytest.skip("cupy is usable here")
    with pytest.raises(ValueError, match=match):
        selected_backends(request_, source="X")


def test_the_suite_uses_the_packages_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conftest's backends are what selected_backends gives for the suite's names."""
    import conftest

    assert selected_backends(known=conftest.KNOWN) == conftest.BACKEND_NAMES


# -- reference_attention ------------------------------------------------------------------------


REFERENCE_CASES: list[dict[str, Any]] = [
    {},
    {"causal": True},
    {"causal": "upper_left"},
    {"causal": "lower_right", "window": 2},
    {"window": (1, None)},
    {"causal": "upper_left", "window": (None, 0)},
    {"window": (0, 2), "scale": 0.3},
    {"softcap": 1.5, "scale": 2.0},
]


@pytest.mark.parametrize("options", REFERENCE_CASES, ids=repr)
@pytest.mark.parametrize(("lq", "lk"), [(5, 5), (7, 4), (3, 9)], ids=str)
def test_reference_matches_the_suites_oracle(options: dict[str, Any], lq: int, lk: int) -> None:
    rng = rng_for("reference", repr(options), lq, lk)
    q = rng.standard_normal((2, 4, lq, 6))
    k, v = rng.standard_normal((2, 2, lk, 6)), rng.standard_normal((2, 2, lk, 3))
    mask = rng.random((2, 1, lq, lk)) < 0.7
    mask[1, 0, 0] = False  # a row with no key
    bias = rng.standard_normal((4, 1, lk))
    bias[2, 0, 1] = -np.inf
    for extra in ({}, {"mask": mask}, {"bias": bias}, {"mask": mask, "bias": bias}):
        ref = reference_attention(q, k, v, **extra, **options)
        want = oracle.attention(q, k, v, **extra, **options)
        for got, expected, name in zip(ref, want, ("out", "weights", "lse"), strict=True):
            assert got.dtype == np.float64, name
            np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-14, err_msg=name)


def test_reference_by_hand() -> None:
    """Cases small enough to compute on paper: q = 0 gives uniform weights over the keys a
    row may see, so out is their mean of V and lse is log(how many)."""
    v = np.arange(8.0).reshape(1, 4, 2)  # keys 0..3, values [0, 1], [2, 3], ...
    q, k = np.zeros((1, 3, 2)), np.ones((1, 4, 2))
    lower = reference_attention(q, k, v, causal=True)  # query i sees keys j <= i + 1
    np.testing.assert_allclose(lower.out[0], [[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]])
    np.testing.assert_allclose(lower.lse[0], np.log([2.0, 3.0, 4.0]))
    upper = reference_attention(q, k, v, causal="upper_left")  # j <= i
    np.testing.assert_allclose(upper.out[0], [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]])
    np.testing.assert_allclose(upper.weights[0, 0], [1.0, 0.0, 0.0, 0.0])
    band = reference_attention(q, k, v, window=(0, 1))  # lower-right, itself and one after
    np.testing.assert_allclose(band.out[0], [[3.0, 4.0], [5.0, 6.0], [6.0, 7.0]])

    # Lq > Lk, lower-right: query 0 of 3 on 2 keys sees none: 0, 0 and -inf, exactly.
    short = reference_attention(q, k[:, :2], v[:, :2], causal=True)
    assert short.out[0, 0].tolist() == [0.0, 0.0] and short.weights[0, 0].tolist() == [0, 0]
    assert short.lse[0, 0] == -np.inf and np.isfinite(short.lse[0, 1:]).all()

    # One decode query (Lq = 1) sees every key lower-right, only key 0 upper-left.
    one = np.zeros((1, 1, 2))
    assert reference_attention(one, k, v, causal=True).out.tolist() == [[[3.0, 4.0]]]
    assert reference_attention(one, k, v, causal="upper_left").out.tolist() == [[[0.0, 1.0]]]

    # Two keys, scores 0 and s, softcapped: lse = log(1 + exp(c * tanh(s / c))).
    qs, ks = np.array([[[1.0, 0.0]]]), np.array([[[0.0, 0.0], [3.0, 0.0]]])
    capped = reference_attention(qs, ks, ks, scale=1.0, softcap=2.0)
    np.testing.assert_allclose(capped.lse, [[np.log1p(np.exp(2.0 * np.tanh(1.5)))]], rtol=1e-15)

    # A bias of -inf masks; a row of them has no key.
    bias = np.zeros((1, 3, 4))
    bias[0, 1] = -np.inf
    bias[0, 2, :3] = -np.inf
    biased = reference_attention(q, k, v, bias=bias)
    assert biased.out[0, 1].tolist() == [0.0, 0.0] and biased.lse[0, 1] == -np.inf
    assert biased.out[0, 2].tolist() == [6.0, 7.0] and biased.lse[0, 2] == 0.0

    # Grouped-query heads: query head h reads key/value head h // 2 (not h % 2).
    vh = np.stack([np.full((4, 2), 10.0), np.full((4, 2), 20.0)])[None]  # [1, 2, 4, 2]
    heads = reference_attention(np.zeros((1, 4, 3, 2)), np.ones((1, 2, 4, 2)), vh)
    assert heads.out[0, :, 0, 0].tolist() == [10.0, 10.0, 20.0, 20.0]


@pytest.mark.parametrize("name", SELECTED)
def test_reference_takes_any_frameworks_arrays(name: str) -> None:
    rng = rng_for("reference-frameworks")
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = np.tril(np.ones((3, 3), dtype=bool))
    want = reference_attention(q, k, v, mask=mask)
    got = reference_attention(
        *(make(name, a, "float32") for a in (q, k, v)), mask=make_bool(name, mask)
    )
    for a, b in zip(got, want, strict=True):
        assert isinstance(a, np.ndarray) and a.dtype == np.float64
        np.testing.assert_array_equal(a, b)
    if name == "torch":  # bfloat16 inputs: their exact values, in float64
        import torch

        t = [torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v)]
        exact = reference_attention(*(x.double().numpy() for x in t))
        np.testing.assert_array_equal(reference_attention(*t).out, exact.out)


def make_bool(name: str, mask: np.ndarray) -> Any:
    return mask if name == "numpy" else to_backend(mask, name)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"causal": "lower-right"}, ValueError, r"`causal` must be False, True, 'lower_right'"),
        ({"causal": 1}, ValueError, r"`causal` must be"),
        ({"window": (1, -1)}, ValueError, r"`window` sides must be ints >= 0 or None"),
        ({"window": "3"}, ValueError, r"`window` must be an int, \(left, right\) or None"),
        ({"mask": np.ones((3, 3))}, ValueError, r"`mask` must be boolean .*float64"),
        ({"bias": np.ones((5, 3))}, ValueError, r"`bias` of shape \(5, 3\) does not broadcast"),
    ],
)
def test_reference_rejects_bad_options(kwargs: dict[str, Any], error: type, match: str) -> None:
    q = np.zeros((2, 3, 4))
    with pytest.raises(error, match=match):
        reference_attention(q, q, q, **kwargs)


def test_reference_rejects_shapes_that_do_not_fit() -> None:
    q = np.zeros((1, 3, 5, 4))
    with pytest.raises(ValueError, match=r"Hq % Hk == 0\), got q \(1, 3, 5, 4\), k \(1, 2"):
        reference_attention(q, np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 4)))
    with pytest.raises(ValueError, match=r"one Dk"):
        reference_attention(q, np.zeros((1, 3, 5, 2)), np.zeros((1, 3, 5, 4)))
    with pytest.raises(ValueError, match=r"one rank >= 2"):
        reference_attention(np.zeros(4), np.zeros(4), np.zeros(4))


def test_reference_shares_no_code_with_the_kernels() -> None:
    """Its only import from the package is the array conversion: no _core, no masks, no
    backend (so a bug of theirs cannot agree with itself in the report)."""
    import ast
    from pathlib import Path

    import portable_attention.testing._reference as module

    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    ours = {name for name in imported if name and name.startswith("portable_attention")}
    assert ours == {"portable_attention.testing._convert"}, ours


# -- check_attention ------------------------------------------------------------------------


def with_lse(**kwargs: Any) -> dict[str, Any]:
    return {"options": {"return_lse": True, **kwargs}, "returns": ("out", "lse")}


@pytest.mark.parametrize("name", SELECTED)
def test_check_attention_passes_attend(name: str) -> None:
    fn: Any = attend
    if name == "jax":  # jitted: one compile per case instead of eager op by op
        import jax

        fn = jax.jit(attend, static_argnames=("causal", "window", "return_lse"))
    report = check_attention(fn, backend=name, window="window", sinks="sinks", **with_lse())
    assert report.ok, str(report)
    assert [c.name for c in report] == list(CASES)
    grads = ("grad_empty_rows", "grad_sinks")
    for case in report:
        if case.verdict == "skipped":  # array_api_strict has no float16; autodiff: torch, jax
            if case.name in grads:
                assert name not in ("torch", "jax"), str(report)
                assert case.details == (
                    f"{name} arrays have no autodiff here (differentiable: torch, jax)",
                )
            else:
                assert (name, case.name) == ("array_api_strict", "half_overflow"), str(report)
                assert case.details == ("array_api_strict has no float16",)
        elif case.name in grads:
            assert case.verdict == "ok" and case.details[0].startswith("max abs err dq ")
        elif case.name == "batch_invariance":  # bitwise or not: measured in docs/contract.md
            assert case.verdict == "ok" and case.details[0].startswith("alone vs in a batch")
        elif case.name == "determinism":
            assert case.details == ("3 calls bitwise equal",), str(report)
        else:
            assert case.verdict == "ok" and case.details[0].startswith("max abs err out ")
    text = str(report)
    assert text.splitlines()[0].startswith(f"check_attention(attend): {name} float32, layout bhld")
    assert text.splitlines()[-1].startswith("all ")


@requires_backend("torch")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_check_attention_in_half_precision_with_weights(dtype: str) -> None:
    report = check_attention(
        attend,
        backend="torch",
        dtype=dtype,
        options={"return_lse": True, "return_weights": True},
        returns=("out", "weights", "lse"),
    )
    assert report.ok, str(report)


@requires_backend("torch")
def test_check_attention_on_torch_sdpa_where_it_meets_the_contract() -> None:
    """torch SDPA with its documented conventions: [B, H, L, D], a boolean attn_mask with
    True = take part, is_causal upper-left (tril of ones(L, S)), GQA by enable_gqa. Its
    rows with no key and float16 past 65504 are not documented: not asserted here."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    documented = ["plain", "mask", "causal", "causal_lq_gt_lk", "causal_lq_lt_lk", "gqa", "mqa"]
    conventions: dict[str, Any] = {
        "backend": "torch",
        "mask": "attn_mask",
        "causal": "is_causal",
        "options": {"enable_gqa": True},
    }
    report = check_attention(
        sdpa, causal_alignment="upper_left", cases=[*documented, "decode"], **conventions
    )
    assert report.ok, str(report)
    # Taken for the contract's lower-right causal, its Lq != Lk cases depart, and say why.
    wrong = check_attention(sdpa, cases=documented, **conventions)
    assert [c.name for c in wrong.departures] == ["causal_lq_gt_lk", "causal_lq_lt_lk"]
    for case in wrong.departures:
        assert case.details[-1] == "it matches causal_alignment='upper_left'", str(wrong)
    assert wrong["causal"].ok  # Lq == Lk: the alignments agree


def upper_left_as_lower_right(
    q: Any, k: Any, v: Any, *, mask: Any = None, causal: bool = False
) -> Any:
    return attend(q, k, v, mask=mask, causal="upper_left" if causal else False)


def textbook(q: Any, k: Any, v: Any, *, mask: Any = None, fill: float = -1e9) -> Any:
    """The textbook formula: masked scores filled with a large negative number."""
    scores = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1 / np.sqrt(q.shape[-1]))
    if mask is not None:
        scores = np.where(mask, scores, q.dtype.type(fill))
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def test_check_attention_flags_upper_left_causal_passed_as_lower_right() -> None:
    report = check_attention(upper_left_as_lower_right)
    assert not report.ok
    assert [c.name for c in report.departures] == ["causal_lq_gt_lk", "causal_lq_lt_lk", "decode"]
    gt = report["causal_lq_gt_lk"]
    assert gt.verdict == "departs"
    # every one of the 16 rows without a key is counted; the largest |out| is data
    assert re.fullmatch(
        r"out is not 0 on 16 rows of the 16 with no key \(max \|out\| \d+\.\d+\); "
        r"the contract: 0",
        gt.details[0],
    ), gt.details[0]
    assert gt.details[-1] == "it matches causal_alignment='upper_left'"
    assert report["decode"].details[-1] == "Lq=1: it matches causal_alignment='upper_left'"
    assert report["causal"].ok and report["empty_rows"].ok
    text = str(report)
    assert "  causal_lq_gt_lk   DEPARTS  " in text
    assert text.splitlines()[-1] == "3 of 16 cases depart (5 skipped)."
    # Declared as what it is, it passes.
    assert check_attention(upper_left_as_lower_right, causal_alignment="upper_left").ok


def test_check_attention_flags_mean_v_and_nan_on_rows_with_no_key() -> None:
    report = check_attention(textbook, causal=None, cases=["plain", "mask", "empty_rows", "gqa"])
    assert report["plain"].ok and report["mask"].ok, str(report)
    (empty,) = report["empty_rows"].details
    assert empty.startswith("out is mean(V) on rows with no key (4 rows)")
    assert empty.endswith("the contract: 0")
    assert report["gqa"].verdict == "error"  # no GQA: the matmul cannot broadcast Hq over Hk
    assert report["gqa"].details[0].startswith("ValueError: ")
    skipped = check_attention(textbook, causal=None, cases=["causal", "decode"])
    assert skipped["causal"].verdict == "skipped" and skipped.ok
    assert skipped["causal"].details == ("the function takes no causal flag (causal=None)",)
    with np.errstate(invalid="ignore"):  # -inf - -inf: the NaN this case is about
        nan = check_attention(
            functools.partial(textbook, fill=-np.inf), causal=None, cases=["empty_rows"]
        )
    assert nan["empty_rows"].details == (
        "out is NaN on rows with no key (4 rows); the contract: 0",
    )
    assert (
        check_attention(textbook, mask=None, causal=None, cases=["mask"])["mask"].verdict
        == "skipped"
    )


def test_check_attention_window_and_sinks_cases_name_the_slip() -> None:
    def swapped(q: Any, k: Any, v: Any, *, window: Any = None, **kw: Any) -> Any:
        return attend(q, k, v, window=window[::-1], **kw)

    report = check_attention(swapped, window="window", cases=["window"])
    assert report["window"].details[-1] == "it matches left and right swapped: window=(1, 3)"

    def causal_dropped(q: Any, k: Any, v: Any, *, causal: bool = False, **kw: Any) -> Any:
        return attend(q, k, v, causal=causal and kw.get("window") is None, **kw)

    report = check_attention(causal_dropped, window="window", cases=["window_causal", "causal"])
    assert report["causal"].ok
    assert report["window_causal"].verdict == "departs"
    assert report["window_causal"].details[-1] == (
        "it matches causal ignored where a window is given (window=(3, 2) alone)"
    )
    assert check_attention(attend, window="window", cases=["window_causal"]).ok

    def no_sinks(q: Any, k: Any, v: Any, *, sinks: Any = None, **kw: Any) -> Any:
        return attend(q, k, v, **kw)

    report = check_attention(no_sinks, sinks="sinks", cases=["sinks", "window"])
    assert report["sinks"].details[-1] == "it matches no sinks at all (the sinks ignored)"
    assert report["window"].details == ("the function takes no window (window=None)",)
    assert "sinks='sinks'" in report.conventions


def test_check_attention_determinism_and_batch_invariance() -> None:
    noise = np.random.default_rng(5)

    def jittery(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        out = attend(q, k, v, **kw)
        return out + np.float32(1e-7) * noise.standard_normal(out.shape).astype(np.float32)

    report = check_attention(jittery, cases=["determinism", "batch_invariance"])
    assert report["determinism"].verdict == "departs"
    assert report["determinism"].details[0].endswith(": not deterministic")
    assert report["batch_invariance"].verdict == "ok"  # within tolerance
    assert (
        report["batch_invariance"]
        .details[0]
        .startswith("alone vs in a batch of 4: not bitwise, max diff ")
    )

    def by_batch(q: Any, k: Any, v: Any, **kw: Any) -> Any:
        return attend(q, k, v, **kw) + np.float32(0.01 * q.shape[0])

    batch = check_attention(by_batch, cases=["batch_invariance"])["batch_invariance"]
    assert batch.verdict == "departs"
    assert batch.details[0].startswith("alone vs in a batch of 4: differs by 0.03")


@requires_backend("torch")
def test_check_attention_gradients_on_rows_with_no_key() -> None:
    """A large negative fill: out is mean(V) on a row with no key, and its dv carries that
    row's gradient; dq there is 0 (the fill is a constant)."""
    import torch

    def filled(q: Any, k: Any, v: Any, *, mask: Any = None) -> Any:
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = torch.where(mask, scores, torch.tensor(-1e9, dtype=scores.dtype))
        return torch.softmax(scores, dim=-1) @ v

    report = check_attention(filled, backend="torch", causal=None, cases=["grad_empty_rows"])
    (case,) = report
    assert case.verdict == "departs"
    assert any(d.startswith("dv: ") for d in case.details), case.details
    assert not any(d.startswith("dq") for d in case.details), case.details
    numpy = check_attention(textbook, causal=None, cases=["grad_empty_rows"])
    assert numpy["grad_empty_rows"].details == (
        "numpy arrays have no autodiff here (differentiable: torch, jax)",
    )


def test_check_attention_flags_lse_on_rows_with_no_key() -> None:
    def plus_inf(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        out, lse = attend(q, k, v, return_lse=True, **kwargs)
        return out, np.where(np.isneginf(lse), np.inf, lse)

    def finite(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        out, lse = attend(q, k, v, return_lse=True, **kwargs)
        return out, np.where(np.isneginf(lse), np.float32(-1e30), lse)

    cases = ["empty_rows", "causal_lq_gt_lk"]
    report = check_attention(plus_inf, returns=("out", "lse"), cases=cases)
    rows = {"empty_rows": 4, "causal_lq_gt_lk": 16}
    for case in report:
        n = rows[case.name]
        assert case.details == (f"lse is +inf on rows with no key ({n} rows); the contract: -inf",)
    report = check_attention(finite, returns=("out", "lse"), cases=cases)
    assert report["empty_rows"].details[0].startswith("lse is finite (up to -1e+30) on rows")


def test_check_attention_flags_the_head_mapping_polarity_and_layout() -> None:
    def tiled(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:  # KV head h % Hk, not h // g
        reps = (1, q.shape[-3] // k.shape[-3], 1, 1)
        return attend(q, np.tile(k, reps), np.tile(v, reps), **kwargs)

    report = check_attention(tiled, cases=["gqa", "mqa"])
    assert report["mqa"].ok  # one KV head: the mappings agree
    assert report["gqa"].details[-1] == "it matches query head h reading key/value head h % Hk"

    report = check_attention(attend, mask_polarity="drop", cases=["mask", "empty_rows"])
    assert report["mask"].details[-1] == "it matches the inverted mask (mask_polarity='keep')"
    assert report["empty_rows"].verdict == "departs"

    report = check_attention(attend, layout="blhd", cases=["plain"])
    assert report["plain"].details[-1] == "it matches layout='bhld'"


def test_check_attention_flags_float16_overflow_decode_and_dtypes() -> None:
    def half_scores(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:  # scores in the input dtype
        s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1 / np.sqrt(q.shape[-1]))
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        return ((w / w.sum(axis=-1, keepdims=True)) @ v).astype(q.dtype)

    with np.errstate(all="ignore"):
        report = check_attention(
            half_scores, mask=None, causal=None, cases=["plain", "half_overflow"]
        )
    assert report["plain"].ok
    assert report["half_overflow"].details == ("out has NaN on rows that have keys",)

    def decode_bug(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:  # Lq = 1 drops the last key
        if q.shape[-2] == 1:
            return attend(q, k[..., :-1, :], v[..., :-1, :], **kwargs)
        return attend(q, k, v, **kwargs)

    report = check_attention(decode_bug, cases=["decode", "plain"])
    assert report["plain"].ok and report["decode"].verdict == "departs"
    assert report["decode"].details[0].startswith("Lq=1: out: ")

    def upcast(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        return attend(q, k, v, **kwargs).astype(np.float64)

    report = check_attention(upcast, cases=["plain"])
    assert report["plain"].details == (
        "out has dtype float64; the contract: float32 for float32 inputs",
    )


def test_check_attention_report_and_arguments() -> None:
    def raises(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        msg = "no kernel for this shape"
        raise RuntimeError(msg)

    report = check_attention(raises, cases=["plain"])
    assert report["plain"].verdict == "error" and not report.ok
    assert report["plain"].details == ("RuntimeError: no kernel for this shape",)
    with pytest.raises(AssertionError, match=r"(?s)check_attention\(.*raises\).*plain +ERROR"):
        check_attention(raises, cases=["plain"], raise_on_departure=True)
    check_attention(attend, cases=["plain"], raise_on_departure=True)  # no departure: no raise

    report = check_attention(attend, returns=("out", "lse"), cases=["plain"])  # returns out only
    assert report["plain"].details == (
        "returned ndarray, not the 2 items of returns=('out', 'lse')",
    )
    with pytest.raises(KeyError, match=r"no case 'gpa' in this report; it has: plain"):
        report["gpa"]
    assert report.function == "attend" and "layout bhld" in report.conventions

    bad: list[tuple[dict[str, Any], type, str]] = [
        ({"layout": "bshd"}, ValueError, r"`layout` must be one of 'bhld', 'blhd'"),
        ({"mask_polarity": True}, ValueError, r"`mask_polarity` must be one of 'keep', 'drop'"),
        ({"causal_alignment": "top_left"}, ValueError, r"`causal_alignment` must be one of"),
        ({"dtype": "int8"}, ValueError, r"`dtype` must be one of 'float32'"),
        ({"mask": True}, TypeError, r"`mask` must be the keyword `fn` takes it by"),
        ({"returns": ("lse",)}, ValueError, r"`returns` must name the output \('out'\)"),
        ({"returns": ("out", "out")}, ValueError, r"`returns` may name each of"),
        ({"returns": "lse"}, TypeError, r"`returns` must be 'out' or a sequence"),
        ({"cases": ["plain", "nope"]}, ValueError, r"`cases` has unknown names \['nope'\]"),
        ({"cases": "plain"}, TypeError, r"`cases` must be a sequence of case names"),
        ({"backend": "tf"}, ValueError, r"`name` must be one of 'numpy'"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            check_attention(attend, **kwargs)


def test_reference_keeps_nan_in_its_row() -> None:
    """A NaN score is not a masked one: the reference's NaN row stays NaN (as attend's),
    the other rows are untouched, and a -inf bias still masks."""
    q = np.ones((1, 3, 4))
    kv = np.ones((1, 3, 4))
    q[0, 1, 0] = np.nan
    ref = reference_attention(q, kv, kv)
    assert np.isnan(ref.out[0, 1]).all() and np.isnan(ref.lse[0, 1])
    assert np.isfinite(ref.out[0, [0, 2]]).all()
    bias = np.zeros((1, 3, 3))
    bias[0, 0] = -np.inf
    masked = reference_attention(np.ones((1, 3, 4)), kv, kv, bias=bias)
    assert (masked.out[0, 0] == 0).all() and np.isneginf(masked.lse[0, 0])


def test_to_numpy_names_a_bad_dtype() -> None:
    with pytest.raises(TypeError, match=r"`dtype`"):
        to_numpy(np.ones(3), dtype="bogus")
