"""Every documented error of attend() (and plan()), on every backend (checks of Python
option values, which run before any framework code, on the first selected backend).

Each message must name the offending argument in backticks (docs/api-decisions.md).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
from portable_attention import attend, plan

from conftest import BACKENDS, Backend, foreign_array
from helpers import randn, rng_for, run_python

ENTRY_POINTS = {"attend": attend, "plan": plan}


@pytest.fixture(params=list(ENTRY_POINTS))
def fn(request: pytest.FixtureRequest) -> Any:
    """attend() and plan() validate the same way."""
    return ENTRY_POINTS[request.param]


@pytest.fixture
def first_backend() -> Any:
    """The first selected backend, for checks of Python option values: they run before any
    framework code (the arrays are valid), so their messages cannot depend on the framework."""
    b = BACKENDS[0]
    with b.flags():
        yield b


def arg(name: str) -> str:
    """Regex: the argument's name in backticks."""
    return "`" + re.escape(name) + r"\b"


def qkv(backend: Backend, dtype: str = "float32", *, hq=4, hk=2, lq=3, lk=5, dk=4, dv=3, lead=(2,)):
    rng = rng_for("errors", hq, hk, lq, lk, dk, dv, lead)
    q = backend.asarray(randn(rng, (*lead, hq, lq, dk)), dtype)
    k = backend.asarray(randn(rng, (*lead, hk, lk, dk)), dtype)
    v = backend.asarray(randn(rng, (*lead, hk, lk, dv)), dtype)
    return q, k, v


def names_type(msg: str, x: Any) -> bool:
    """Whether ``msg`` names the type of ``x`` (``jax.Array`` is accepted for jax arrays)."""
    names = {type(x).__name__}
    if type(x).__module__.startswith(("jax", "jaxlib")):
        names.add("jax.Array")
    return any(n in msg for n in names)


# ------------------------------------------------------------------------------------------
# Non-arrays and mixed frameworks


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_mixed_frameworks(backend: Backend, fn: Any, which: str) -> None:
    arrays = dict(zip("qkv", qkv(backend), strict=True))
    mine = arrays[which]
    other = foreign_array(backend, backend.to_numpy(mine).astype(np.float32))
    if other is None:
        pytest.skip("no second framework importable")
    arrays[which] = other
    with pytest.raises(TypeError) as info:
        fn(**arrays)
    msg = str(info.value)
    assert names_type(msg, other), msg
    assert names_type(msg, arrays["k" if which == "q" else "q"]), msg


@pytest.mark.parametrize("which", ["mask", "bias"])
def test_mixed_frameworks_mask_bias(backend: Backend, fn: Any, which: str) -> None:
    q, k, v = qkv(backend)
    data = np.ones((3, 5), dtype=bool) if which == "mask" else np.zeros((3, 5), np.float32)
    other = foreign_array(backend, data)
    if other is None:
        pytest.skip("no second framework importable")
    with pytest.raises(TypeError, match=arg(which)) as info:
        fn(q, k, v, **{which: other})
    assert names_type(str(info.value), other), str(info.value)
    assert names_type(str(info.value), q), str(info.value)


def test_torch_q_numpy_k_names_both_types(fn: Any) -> None:
    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 3, 4)
    k = np.zeros((2, 3, 4), dtype=np.float32)
    with pytest.raises(TypeError) as info:
        fn(q, k, torch.zeros(2, 3, 4))
    assert "Tensor" in str(info.value)
    assert "ndarray" in str(info.value)


@pytest.mark.parametrize("which", ["q", "k", "v", "mask", "bias"])
@pytest.mark.parametrize("kind", ["list", "scalar"])
def test_non_array_inputs(backend: Backend, fn: Any, which: str, kind: str) -> None:
    q, k, v = qkv(backend)
    arrays: dict[str, Any] = {"q": q, "k": k, "v": v}
    scalar: Any = True if which == "mask" else 1.0
    if kind == "scalar":
        value = scalar
    elif which in ("q", "k", "v"):
        value = backend.to_numpy(arrays[which]).tolist()
    else:
        value = [[scalar] * 5] * 3  # would broadcast to the scores [2, 4, 3, 5]
    arrays[which] = value
    with pytest.raises(TypeError, match=arg(which)):
        fn(**arrays)


def test_all_lists(fn: Any) -> None:
    x = [[0.0, 1.0], [1.0, 0.0]]
    with pytest.raises(TypeError, match=arg("q")):
        fn(x, x, x)


# ------------------------------------------------------------------------------------------
# Ranks and shapes


def test_rank_below_two(backend: Backend, fn: Any) -> None:
    x = backend.asarray(np.ones(4), "float32")
    with pytest.raises(ValueError, match=arg("q")):
        fn(x, x, x)


def test_rank_mismatch(backend: Backend, fn: Any) -> None:
    q, k, v = qkv(backend)
    k3 = k[0, ...]
    with pytest.raises(ValueError, match=f"{arg('q')}|{arg('k')}"):
        fn(q, k3, v)
    with pytest.raises(ValueError, match=f"{arg('v')}|{arg('q')}"):
        fn(q, k, v[0, ...])


def test_leading_dims_differ(backend: Backend, fn: Any) -> None:
    q, _, _ = qkv(backend, lead=(2,))
    _, k, v = qkv(backend, lead=(3,))
    with pytest.raises(ValueError, match=f"{arg('q')}|{arg('k')}"):
        fn(q, k, v)


def test_heads_not_divisible(backend: Backend, fn: Any) -> None:
    q, k, v = qkv(backend, hq=3, hk=2)
    with pytest.raises(ValueError, match=f"{arg('q')}|{arg('k')}") as info:
        fn(q, k, v)
    assert "3" in str(info.value)
    assert "2" in str(info.value)


def test_dk_mismatch(backend: Backend, fn: Any) -> None:
    q, _, _ = qkv(backend, dk=4)
    _, k, v = qkv(backend, dk=5)
    with pytest.raises(ValueError, match=f"{arg('q')}|{arg('k')}"):
        fn(q, k, v)


def test_lk_mismatch(backend: Backend, fn: Any) -> None:
    q, k, _ = qkv(backend, lk=5)
    _, _, v = qkv(backend, lk=6)
    with pytest.raises(ValueError, match=f"{arg('k')}|{arg('v')}"):
        fn(q, k, v)


@pytest.mark.parametrize(
    "shape",
    [(3, 4), (4, 5), (3, 3, 5), (3, 1, 1, 5), (1, 1, 1, 3, 5)],
    ids=["lk_wrong", "lq_wrong", "heads_wrong", "batch_wrong", "too_many_dims"],
)
@pytest.mark.parametrize("which", ["mask", "bias"])
def test_mask_bias_not_broadcasting(backend: Backend, fn: Any, which: str, shape: tuple) -> None:
    q, k, v = qkv(backend)  # scores [2, 4, 3, 5]
    if which == "mask":
        value = backend.asarray(np.ones(shape, dtype=bool))
    else:
        value = backend.asarray(np.zeros(shape), "float32")
    with pytest.raises(ValueError, match=arg(which)):
        fn(q, k, v, **{which: value})


# ------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("dtype_kind", ["int", "bool", "complex"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_real_floating_inputs(backend: Backend, fn: Any, which: str, dtype_kind: str) -> None:
    arrays = dict(zip("qkv", qkv(backend, "float64"), strict=True))
    data = np.ones(tuple(arrays[which].shape))
    dt = {
        "int": backend.int_dtype,
        "bool": backend.bool_dtype,
        "complex": backend.complex_dtype,
    }[dtype_kind]
    arrays[which] = backend.asarray(data, dt)
    with pytest.raises(TypeError, match=arg(which)):
        fn(**arrays)


def test_all_int_inputs(backend: Backend, fn: Any) -> None:
    x = backend.asarray(np.ones((2, 3, 4), dtype=np.int64))
    with pytest.raises(TypeError, match=arg("q")):
        fn(x, x, x)


@pytest.mark.parametrize("which", ["k", "v"])
def test_qkv_dtype_mismatch(backend: Backend, fn: Any, which: str) -> None:
    arrays = dict(zip("qkv", qkv(backend, "float32"), strict=True))
    arrays[which] = backend.asarray(backend.to_numpy(arrays[which]), "float64")
    with pytest.raises(TypeError, match=f"{arg(which)}|{arg('q')}") as info:
        fn(**arrays)
    assert "float32" in str(info.value)
    assert "float64" in str(info.value)


def test_half_dtype_mismatch(backend: Backend, half_dtype: str, fn: Any) -> None:
    q, k, v = qkv(backend, half_dtype)
    v32 = backend.asarray(backend.to_numpy(v), "float32")
    with pytest.raises(TypeError, match=f"{arg('v')}|{arg('q')}"):
        fn(q, k, v32)


@pytest.mark.parametrize("dtype_kind", ["float32", "float64", "int", "complex"])
def test_mask_not_bool(backend: Backend, fn: Any, dtype_kind: str) -> None:
    """A non-boolean mask is a TypeError that points to `bias=` (a float mask is the common
    mistake: additive masks go to `bias`)."""
    q, k, v = qkv(backend)
    dt = {"int": backend.int_dtype, "complex": backend.complex_dtype}.get(dtype_kind, dtype_kind)
    mask = backend.asarray(np.ones((3, 5)), dt)
    with pytest.raises(TypeError, match=arg("mask")) as info:
        fn(q, k, v, mask=mask)
    assert "bias" in str(info.value)


@pytest.mark.parametrize("bias_dtype", ["int", "bool", "complex", "float64"])
def test_bias_wrong_dtype(backend: Backend, fn: Any, bias_dtype: str) -> None:
    q, k, v = qkv(backend, "float32")
    data = np.zeros((3, 5))
    if bias_dtype == "float64":
        bias = backend.asarray(data, "float64")  # neither q's dtype nor the compute dtype
    else:
        dt = {"int": backend.int_dtype, "bool": backend.bool_dtype}.get(
            bias_dtype, backend.complex_dtype
        )
        bias = backend.asarray(data, dt)
    with pytest.raises(TypeError, match=arg("bias")):
        fn(q, k, v, bias=bias)


def test_half_bias_wrong_dtype(backend: Backend, half_dtype: str, fn: Any) -> None:
    """For half inputs bias may be q's dtype or float32, nothing else."""
    q, k, v = qkv(backend, half_dtype)
    bias = backend.asarray(np.zeros((3, 5)), "float64")
    with pytest.raises(TypeError, match=arg("bias")):
        fn(q, k, v, bias=bias)
    other = [d for d in ("float16", "bfloat16") if d in backend.dtypes and d != half_dtype]
    for name in other:
        with pytest.raises(TypeError, match=arg("bias")):
            fn(q, k, v, bias=backend.asarray(np.zeros((3, 5)), name))


# ------------------------------------------------------------------------------------------
# Option values


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan])
def test_dropout_out_of_range(first_backend: Backend, fn: Any, p: float) -> None:
    q, k, v = qkv(first_backend)
    with pytest.raises(ValueError, match=arg("dropout")):
        fn(q, k, v, dropout=p, rng=first_backend.make_rng(0))


@pytest.mark.parametrize("softcap", [0.0, -1.0, math.inf, math.nan])
def test_softcap_invalid(first_backend: Backend, fn: Any, softcap: float) -> None:
    q, k, v = qkv(first_backend)
    with pytest.raises(ValueError, match=arg("softcap")):
        fn(q, k, v, softcap=softcap)


@pytest.mark.parametrize("causal", ["lower_left", "upper-left", "", "True"])
def test_causal_unknown_string(first_backend: Backend, fn: Any, causal: str) -> None:
    q, k, v = qkv(first_backend)
    with pytest.raises(ValueError, match=arg("causal")) as info:
        fn(q, k, v, causal=causal)
    assert repr(causal) in str(info.value) or causal in str(info.value)


@pytest.mark.parametrize("causal", [1, 0.0, None, [True]])
def test_causal_wrong_type(first_backend: Backend, fn: Any, causal: Any) -> None:
    q, k, v = qkv(first_backend)
    with pytest.raises(TypeError, match=arg("causal")):
        fn(q, k, v, causal=causal)


@pytest.mark.parametrize("implementation", ["fast", "Portable", "", "flash"])
def test_implementation_unknown(first_backend: Backend, fn: Any, implementation: str) -> None:
    q, k, v = qkv(first_backend)
    with pytest.raises(ValueError, match=arg("implementation")):
        fn(q, k, v, implementation=implementation)


@pytest.mark.parametrize(
    "window",
    [-1, (-1, 2), (2, -1), (-3, None), (1, 2, 3), (1,), "2", (1.5, 2), 1.5],
    ids=str,
)
def test_window_invalid(first_backend: Backend, fn: Any, window: Any) -> None:
    q, k, v = qkv(first_backend)
    with pytest.raises(ValueError, match=arg("window")):
        fn(q, k, v, window=window)


def test_flash_attn_conventions_name_the_fix(first_backend: Backend, fn: Any) -> None:
    """flash-attn's -1 (an unbounded window side) and softcap=0.0 (off) are refused with
    the spelling here."""
    q, k, v = qkv(first_backend)
    with pytest.raises(ValueError, match=re.escape("pass window=(None, 0)")):
        fn(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match=re.escape("pass window=(None, None)")):
        fn(q, k, v, window=(-1, -1))
    with pytest.raises(ValueError, match=r"flash-attn's 'off'.*`softcap=None`"):
        fn(q, k, v, softcap=0.0)


def test_mod_returning_another_frameworks_array(first_backend: Backend) -> None:
    """A mod written with another framework's operations: the message names the
    framework it returned, not only a dtype."""
    torch = pytest.importorskip("torch")
    if first_backend.name == "torch":
        pytest.skip("needs a backend other than torch")
    q, k, v = qkv(first_backend)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.ones((1, 1), dtype=torch.bool)

    def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.zeros(tuple(s.shape))

    with pytest.raises(TypeError, match=r"`mask_mod` returned a torch.Tensor, but its inputs"):
        attend(q, k, v, mask_mod=mask_mod)

    def uint8_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:  # the issue's: torch ops
        return torch.tril(torch.ones((q_idx.shape[0], kv_idx.shape[-1]), dtype=torch.uint8))

    with pytest.raises(TypeError, match=r"`mask_mod` returned a torch.Tensor, but its inputs"):
        attend(q, k, v, mask_mod=uint8_mod)
    with pytest.raises(TypeError, match=r"`score_mod` returned a torch.Tensor, but its inputs"):
        attend(q, k, v, score_mod=score_mod)


def test_rng_wrong_type(backend: Backend, fn: Any) -> None:
    q, k, v = qkv(backend)
    for bad in (backend.wrong_rng(), "seed"):
        with pytest.raises(TypeError, match=arg("rng")):
            fn(q, k, v, dropout=0.5, rng=bad)


def test_jax_dropout_needs_rng(fn: Any) -> None:
    from conftest import BY_NAME

    if "jax" not in BY_NAME:
        pytest.skip("jax not selected")
    q, k, v = qkv(BY_NAME["jax"])
    with pytest.raises(ValueError, match=arg("rng")):
        fn(q, k, v, dropout=0.1)


def test_different_devices(fn: Any) -> None:
    from conftest import BY_NAME

    if "array_api_strict" not in BY_NAME:
        pytest.skip("array_api_strict not selected")
    import array_api_strict as xs

    rng = rng_for("devices")
    q = xs.asarray(randn(rng, (2, 3, 4)))
    k = xs.asarray(randn(rng, (2, 3, 4)), device=xs.Device("device1"))
    v = xs.asarray(randn(rng, (2, 3, 4)))
    with pytest.raises(ValueError, match=f"{arg('k')}|{arg('q')}"):
        fn(q, k, v)
    mask = xs.asarray(np.ones((3, 3), dtype=bool), device=xs.Device("device1"))
    with pytest.raises(ValueError, match=arg("mask")):
        fn(q, q, q, mask=mask)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("which", ["q", "mask", "bias"])
def test_numpy_dtypes_outside_the_standard(fn: Any, dtype_name: str, which: str) -> None:
    """ml_dtypes' bfloat16 (what ``to_backend(x, "numpy")`` gives for a torch or JAX
    bfloat16 array) and float8 are no array-API dtypes of NumPy: NumPy's ``isdtype``
    refuses them with a TypeError that names no argument; ours names it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    odd = np.dtype(getattr(ml_dtypes, dtype_name))
    q, k, v = (np.asarray(randn(rng_for("odd dtypes", n), (2, 3, 4)), np.float32) for n in "qkv")
    if which == "q":
        q, k, v = (x.astype(odd) for x in (q, k, v))
        with pytest.raises(TypeError, match=arg("q") + ".*" + re.escape("q.astype(numpy.float32)")):
            fn(q, k, v)
    else:
        with pytest.raises(TypeError, match=arg(which) + ".*" + dtype_name):
            fn(q, k, v, **{which: np.zeros((3, 3), odd)})


def test_jax_key_array_as_input(fn: Any) -> None:
    from conftest import BY_NAME

    if "jax" not in BY_NAME:
        pytest.skip("jax not selected")
    import jax

    q, k, v = qkv(BY_NAME["jax"], lead=(), hq=2, hk=2)
    keys = jax.random.split(jax.random.key(0), (3, 5))
    with pytest.raises(TypeError, match=arg("q") + ".*key"):
        fn(keys[None], k, v)
    with pytest.raises(TypeError, match=arg("mask") + ".*key"):
        fn(q, k, v, mask=keys)


# XLA gives the CPU two devices only when told so before JAX starts: a fresh interpreter.
_SHARDED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import oracle
from portable_attention import attend

mesh = Mesh(np.array(jax.devices()), ("b",))
by_batch, replicated = NamedSharding(mesh, P("b")), NamedSharding(mesh, P())
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 3, n, 4)).astype(np.float32) for n in (5, 7, 7))
jq = jax.device_put(q, by_batch)
jk, jv = (jax.device_put(x, replicated) for x in (k, v))
for kw, chunk in (({}, None), ({"causal": True}, None), ({"window": 2}, None), ({}, 2)):
    out, lse = attend(jq, jk, jv, return_lse=True, chunk_size=chunk, **kw)
    want, _, want_lse = oracle.attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5)
    assert out.sharding.device_set == jq.sharding.device_set, out.sharding
one = jax.device_put(k, jax.devices()[1])
try:
    attend(jq, one, jv)
except ValueError as e:
    print("refused:", e)
"""


def test_jax_arrays_sharded_over_the_same_devices() -> None:
    """q sharded by batch, k and v replicated over the same two devices: one place (JAX
    computes on them as they are), so attend runs, masks included; an array on another
    set of devices is still a ValueError that names it."""
    from conftest import BY_NAME

    if "jax" not in BY_NAME:
        pytest.skip("jax not selected")
    out = run_python(_SHARDED)
    assert out.startswith("refused: `k` is on device"), out


def test_errors_leave_inputs_unmodified(backend: Backend) -> None:
    q, k, v = qkv(backend)
    before = [backend.to_numpy(a).copy() for a in (q, k, v)]
    with pytest.raises(ValueError):
        attend(q, k, v, softcap=-1.0)
    for a, b in zip((q, k, v), before, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), b)


def test_plan_names_an_unknown_keyword() -> None:
    """``plan`` takes attend's keywords: a misspelt one is a TypeError naming it, as
    ``attend`` itself gives (not a silent default)."""
    q = np.ones((1, 2, 4, 8))
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        attend(q, q, q, casual=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="plan\\(\\) got an unexpected keyword argument 'casual'"):
        plan(q, q, q, casual=True)
    assert plan(q, q, q, causal=True, sinks=np.zeros(2)).path.startswith(("portable:", "tuned:"))
