"""The paths behind ``implementation="auto"``: which one plan() names and why, that each
agrees with the portable path and the oracle, and that decisions never depend on data."""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from typing import Any

import numpy as np
import pytest
from portable_attention import _core, attend, plan
from portable_attention._options import options
from portable_attention._spec import validate_call
from portable_attention.backends import numpy as numpy_backend

import oracle
from conftest import BY_NAME, Backend, requires_backend
from helpers import assert_close, assert_like, assert_same, randn, rng_for, run_python


def _qkv(backend: Backend, shape_q: tuple, shape_kv: tuple, dtype: str = "float32") -> tuple:
    rng = rng_for("paths", shape_q, shape_kv)
    return tuple(backend.asarray(randn(rng, s), dtype) for s in (shape_q, shape_kv, shape_kv))


# ------------------------------------------------------------------------------------------
# What plan() names, per framework


@requires_backend("torch")
@pytest.mark.parametrize(
    ("kwargs", "path", "reason"),
    [
        ({}, "fused:torch", "scaled_dot_product_attention"),
        ({"causal": True}, "fused:torch", "scaled_dot_product_attention"),
        ({"window": (2, 1)}, "fused:torch", "scaled_dot_product_attention"),
        ({"return_weights": True}, "portable:dense", "return_weights"),
        ({"return_lse": True}, "portable:dense", "return_lse"),
        ({"softcap": 2.0}, "portable:dense", "softcap"),
        ({"dropout": 0.1, "rng": "seeded"}, "portable:dense", "rng"),
        ({"dropout": 0.1}, "fused:torch", "scaled_dot_product_attention"),
        ({"chunk_size": 4}, "portable:blockwise", "chunk_size"),
    ],
)
def test_torch_plan(kwargs: dict, path: str, reason: str) -> None:
    import torch

    backend = BY_NAME["torch"]
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    if kwargs.get("rng") == "seeded":
        kwargs = {**kwargs, "rng": torch.Generator().manual_seed(0)}
    p = plan(q, k, v, **kwargs)
    assert p.path == path
    assert reason in p.reason


@requires_backend("jax")
def test_jax_plan_on_cpu_prefers_portable_by_measurement() -> None:
    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    auto = plan(q, k, v)
    assert auto.path == "portable:dense"
    assert "CPU" in auto.reason and "measured" in auto.reason
    assert plan(q, k, v, implementation="fused").path == "fused:jax"
    q64, k64, v64 = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8), "float64")
    with pytest.raises(ValueError, match="float64"):
        plan(q64, k64, v64, implementation="fused")
    qh, kh, vh = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8), "bfloat16")
    with pytest.raises(ValueError, match="bfloat16"):
        plan(qh, kh, vh, implementation="fused")


@requires_backend("numpy")
def test_numpy_plan_is_blockwise_from_64k_scores() -> None:
    """NumPy has no kernel of its own: ``auto`` runs the one blockwise kernel from 64K
    scores on (batch and heads included), the dense path below and for the weights (the
    whole score matrix)."""
    backend = BY_NAME["numpy"]
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    assert plan(q, k, v, causal=True).path == "portable:dense"
    assert plan(q, k, v, chunk_size=8).path == "portable:blockwise"
    assert numpy_backend.BLOCKWISE_MIN_SCORES == 8 * 8 * 1024  # the calls below
    q, kv = np.zeros((1, 8, 8, 64), np.float32), np.zeros((1, 8, 1024, 64), np.float32)
    p = plan(q, kv, kv, causal=True, softcap=3.0)
    assert p.path == "portable:blockwise"
    assert "no fused attention kernel" in p.reason and "in place" in p.reason
    assert plan(q, kv[..., :1023, :], kv[..., :1023, :]).path == "portable:dense"
    assert plan(q, kv, kv, return_weights=True).path == "portable:dense"
    assert plan(q, kv, kv, implementation="portable").path == "portable:dense"


def test_large_dense_scores_take_the_chunked_path(backend: Backend) -> None:
    """plan() only: 8 heads x 4096 x 4096 float64 scores would take 1 GiB."""
    q, k, v = _qkv(backend, (1, 8, 4096, 4), (1, 8, 4096, 4), "float64")
    p = plan(q, k, v, implementation="portable")
    assert p.path == "portable:blockwise"
    assert "MiB" in p.reason
    assert plan(q, k, v, implementation="portable", return_weights=True).path == "portable:dense"


def test_plan_depends_on_options_not_data(backend: Backend) -> None:
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    q2 = backend.asarray(-backend.to_numpy(q), "float32")
    first = plan(q, k, v, causal=True)
    assert plan(q2, k, v, causal=True) == first
    assert plan(q, k, v, causal=True, chunk_size=2) != first


def test_plan_cache_is_thread_safe(backend: Backend) -> None:
    """Concurrent first calls with many distinct options agree with serial ones."""
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    options = [{"chunk_size": c, "window": w} for c in range(1, 9) for w in range(3)]
    results: dict[int, list[Any]] = {i: [] for i in range(len(options))}
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        for i, kw in enumerate(options):
            results[i].append(plan(q, k, v, **kw))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, kw in enumerate(options):
        assert len({id(p) for p in results[i]}) == 1
        assert results[i][0] == plan(q, k, v, **kw)


# ------------------------------------------------------------------------------------------
# Agreement between paths on shapes where blocks, threads and skipping matter


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"causal": True},
        {"causal": "upper_left", "window": (5, None)},
        {"window": (3, 2), "softcap": 4.0},
    ],
    ids=["plain", "causal", "upper_left_window", "window_softcap"],
)
@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_agrees_with_dense_on_many_blocks(
    backend: Backend, kwargs: dict, chunk: int
) -> None:
    """Lq != Lk, several query and key blocks, blocks skipped by causal/window, GQA."""
    q, k, v = _qkv(backend, (1, 4, 45, 8), (1, 2, 70, 8), "float64")
    dense_out, dense_lse = attend(q, k, v, implementation="portable", return_lse=True, **kwargs)
    out, lse = attend(q, k, v, chunk_size=chunk, return_lse=True, **kwargs)
    assert_like(out, q, shape=(1, 4, 45, 8), dtype=q.dtype)
    assert_close(backend.to_numpy(out), backend.to_numpy(dense_out), "float64")
    d_lse, c_lse = backend.to_numpy(dense_lse), backend.to_numpy(lse)
    np.testing.assert_array_equal(np.isneginf(c_lse), np.isneginf(d_lse))
    finite = np.isfinite(d_lse)
    assert_close(c_lse[finite], d_lse[finite], "float64", what="lse")


@requires_backend("numpy")
def test_numpy_threaded_kernel_matches_oracle() -> None:
    """Big enough for NumPy's worker threads (4M scores) and several query blocks, run
    with the BLAS on one thread (where the loop's threads run), causal with a mask and a
    fully masked row."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = rng_for("threads")
    q, k, v = (randn(rng, (2, 8, 512, 16)).astype(np.float32) for _ in range(3))
    assert numpy_backend.THREADS_MIN_SCORES <= 2 * 8 * 512 * 512  # threads, or no test
    mask = rng.random((512, 512)) < 0.9
    mask[7] = False
    assert plan(q, k, v, mask=mask).path == "portable:blockwise"
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        out, lse = attend(q, k, v, mask=mask, causal=True, return_lse=True)
    ref_out, _, ref_lse = oracle.attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask=mask, causal=True
    )
    assert_close(out.astype(np.float64), ref_out, "float32")
    assert np.all(out[:, :, 7] == 0) and np.all(np.isneginf(lse[:, :, 7]))
    assert_close(lse[:, :, 8:].astype(np.float64), ref_lse[:, :, 8:], "float32", what="lse")


#: Per-row offsets of the scores (a bias constant along each row leaves the softmax as it
#: is and adds itself to lse). "fast": every row's sum of exp(scores) stays in the range
#: where the NumPy kernel skips its max pass; "beyond": rows whose exps overflow, or
#: underflow to subnormals or zero, so that the kernel must subtract the max.
_OFFSETS = {
    "float32": {
        "fast": [-40.0, 0.0, 40.0, 80.0],
        "beyond": [-200.0, -100.0, 0.0, 95.0, 300.0],
        "under": [-200.0, -100.0],  # only the row sums' lower bound sees these
        "subnormal": [-100.0, -95.0],  # sums of exps among the subnormals, none 0
    },
    "float64": {
        "fast": [-600.0, 0.0, 600.0],
        "beyond": [-1000.0, 0.0, 720.0, 2000.0],
        "under": [-1000.0, -800.0],
        "subnormal": [-740.0, -720.0],
    },
}


@requires_backend("numpy")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["fast", "beyond", "under", "subnormal", "huge_v"])
@pytest.mark.parametrize("lq", [40, 300], ids=["one_block", "blocks"])
@pytest.mark.parametrize("offset_by", ["bias", "q"])
@pytest.mark.parametrize("chunk_size", [64, 256], ids=["chunk64", "one_key_block"])
def test_numpy_softmax_without_max_pass_or_with_it(
    dtype: str, case: str, lq: int, offset_by: str, chunk_size: int | None
) -> None:
    """NumPy's softmax skips the row max where the row sums allow it, and falls back where
    they do not, in the blockwise kernel's first try (``Adapter.unshifted_exp``; square
    blocks of 64, or blocks of 256: all 50 keys in one): every row matches
    the oracle either way, lse included, and NumPy warns of nothing (the overflow of a
    first try is not the caller's). With ``lq=300`` rows up to 150 are offset, so some
    query blocks mix both kinds of row.
    "huge_v": sums in range but ``exp(scores) @ V`` overflows before its division.

    The row offsets come from a bias, or from one more feature of q and k (q holds the
    offset, k holds 1, scale=1): float32 without a bias takes the kernel's ``exp2``
    path (``BlockMath.base2``), with one its ``exp`` path."""
    rng = rng_for("no-max-pass", dtype, case, lq)
    q, k, v = (randn(rng, (1, 4, n, 16)).astype(dtype) for n in (lq, 50, 50))
    offsets = _OFFSETS[dtype]["fast" if case == "huge_v" else case]
    v_scale = 1.0
    if case == "huge_v":
        offsets = [offsets[-1]] * 3
        v_scale = 1e30 if dtype == "float32" else 1e300
        v = v * v_scale
    row_offset = np.resize(np.asarray(offsets, dtype=dtype), lq)[:, None]  # [Lq, 1]
    bias = np.broadcast_to(row_offset, (lq, 50)).astype(dtype)
    if lq == 300:  # offset rows up to 150, so some blocks mix both kinds
        bias = np.where(np.arange(lq)[:, None] < 150, bias, np.zeros_like(bias))
        row_offset = bias[:, :1]
    if offset_by == "bias":
        args: dict[str, Any] = {"q": q, "k": k, "v": v, "bias": bias}
    else:  # scores = (q / 4) @ k^T + offset, as the default scale 1/sqrt(16) gives with bias
        q_off = np.concatenate([q / 4, np.broadcast_to(row_offset, (1, 4, lq, 1))], axis=-1)
        k_one = np.concatenate([k, np.ones((1, 4, 50, 1), dtype=dtype)], axis=-1)
        args = {"q": q_off.astype(dtype), "k": k_one, "v": v, "scale": 1.0}
    args.update(chunk_size=chunk_size)
    assert plan(**args).path == "portable:blockwise"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attend(**args, return_lse=True)
    ref_out, _, ref_lse = oracle.attention(q, k, v)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert_close(out.astype(np.float64) / v_scale, ref_out / v_scale, dtype)
    assert_close(
        lse.astype(np.float64), ref_lse + row_offset.astype(np.float64)[:, 0], dtype, what="lse"
    )


@requires_backend("numpy")
@pytest.mark.parametrize("scale", [2.5e38, 3.4e38])
def test_numpy_kernel_scale_near_the_float32_max(scale: float) -> None:
    """A scale whose ``scale * log2(e)`` passes float32's max: the kernel keeps ``exp``
    (``_blockwise.base2_scores``: the factor, cast to float32, would be inf and every score
    NaN) and matches the oracle."""
    rng = rng_for("huge scale", scale)
    q, k, v = (randn(rng, (1, 2, n, 4)).astype(np.float32) * 1e-38 for n in (3, 5, 5))
    v = v * 1e38
    out, lse = attend(q, k, v, scale=scale, return_lse=True)
    ref_out, _, ref_lse = oracle.attention(q, k, v, scale=scale)
    assert_close(out.astype(np.float64) * 1e-38, ref_out * 1e-38, "float32")
    assert_close(lse.astype(np.float64), ref_lse, "float32", what="lse")


@requires_backend("numpy")
@pytest.mark.parametrize("chunk_size", [4, 16], ids=["chunk4", "one_block"])
def test_numpy_kernel_takes_longdouble(chunk_size: int) -> None:
    """NumPy's extended precision (not an array-API dtype, but a NumPy array) runs the
    kernel in that precision, large row offsets included: -12000 puts every exp of its
    row below longdouble's smallest normal number (whose square root the first try
    without the max checks the row sums against: 0 as a Python float)."""
    rng = rng_for("longdouble")
    q, k, v = (randn(rng, (1, 2, n, 8)).astype(np.longdouble) for n in (6, 9, 9))
    bias = np.asarray([[0.0], [900.0], [-12000.0], [0.0], [20000.0], [0.0]], dtype=np.longdouble)
    args: dict[str, Any] = {"bias": np.broadcast_to(bias, (6, 9)).copy()}
    args.update(chunk_size=chunk_size)
    assert plan(q, k, v, **args).path == "portable:blockwise"
    out, lse = attend(q, k, v, return_lse=True, **args)
    assert out.dtype == lse.dtype == np.longdouble
    ref_out, _, ref_lse = oracle.attention(q, k, v)
    assert_close(out.astype(np.float64), ref_out, "float64")
    assert_close(
        lse.astype(np.float64) - bias[:, 0].astype(np.float64), ref_lse, "float64", what="lse"
    )


@requires_backend("torch")
def test_torch_fused_gqa_lower_right_and_empty_rows() -> None:
    """SDPA with enable_gqa, lower-right causal for Lq > Lk (first rows see no key)."""
    backend = BY_NAME["torch"]
    q, k, v = _qkv(backend, (2, 8, 9, 8), (2, 2, 5, 8), "float64")
    assert plan(q, k, v, causal=True).path == "fused:torch"
    out = attend(q, k, v, causal=True)
    ref = oracle.attention(*(backend.to_numpy(a) for a in (q, k, v)), causal=True)[0]
    assert_close(backend.to_numpy(out), ref, "float64")
    assert np.all(backend.to_numpy(out)[:, :, :4] == 0)


@requires_backend("torch")
def test_torch_sdpa_rows_repaired_where_its_cpu_zeros_are_not_verified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before torch 2.5 SDPA's CPU kernels gave NaN on a row with no key; there the adapter
    sets such rows to 0 itself, as on other devices. This torch gives 0 anyway, so the
    test shows that the repair, forced here, keeps every row right (rows with no key
    through lower-right causal with Lq > Lk and through an all-False mask row)."""
    from portable_attention.backends import torch_sdpa

    monkeypatch.setattr(torch_sdpa, "_CPU_EMPTY_ROWS_ZERO", False)
    backend = BY_NAME["torch"]
    q, k, v = _qkv(backend, (2, 4, 9, 8), (2, 2, 5, 8), "float64")
    mask = np.ones((9, 5), dtype=bool)
    mask[6] = False
    arrays = [backend.to_numpy(a) for a in (q, k, v)]
    for kwargs, ref in (
        ({"causal": True}, {"causal": True}),
        ({"mask": backend.asarray(mask, "bool")}, {"mask": mask}),
    ):
        assert plan(q, k, v, **kwargs).path == "fused:torch"
        out = backend.to_numpy(attend(q, k, v, **kwargs))
        assert_close(out, oracle.attention(*arrays, **ref)[0], "float64")
        assert not np.isnan(out).any()


@requires_backend("torch")
@pytest.mark.compile
def test_torch_compile_fullgraph() -> None:
    import torch

    backend = BY_NAME["torch"]
    q, k, v = _qkv(backend, (2, 4, 6, 8), (2, 2, 6, 8))
    compiled = torch.compile(lambda a, b, c: attend(a, b, c, causal=True), fullgraph=True)
    expected = attend(q, k, v, causal=True)
    torch.testing.assert_close(compiled(q, k, v), expected)


_COMPILE_DYNAMIC = """
import torch
from portable_attention import attend

q, k, v = (torch.randn(2, h, n, 8) for h, n in ((4, 5), (2, 7), (2, 7)))
compiled = torch.compile(lambda a, b, c: attend(a, b, c, causal=True), fullgraph=True, dynamic=True)
torch.testing.assert_close(compiled(q, k, v), attend(q, k, v, causal=True))


class Options(torch.nn.Module):  # float options read from a module: symbolic under dynamic
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, a, b, c):
        return attend(a, b, c, **self.options)


for options in ({"scale": 0.3}, {"softcap": 2.0}, {"scale": 0.5, "softcap": 1.5}):
    module = torch.compile(Options(**options), fullgraph=True, dynamic=True)
    torch.testing.assert_close(module(q, k, v), attend(q, k, v, **options))
# Without dynamic=True, a float that changes between calls turns symbolic on the second.
varying = torch.compile(lambda a, b, c, s: attend(a, b, c, scale=s), fullgraph=True)
for s in (0.25, 0.5, 0.75):
    torch.testing.assert_close(varying(q, k, v, s), attend(q, k, v, scale=s))
print("ok")
"""


@requires_backend("torch")
@pytest.mark.compile
def test_torch_compile_fullgraph_dynamic() -> None:
    """``dynamic=True`` makes the float options symbolic (``dropout=0.0`` by default, and
    ``scale``/``softcap`` read from a module or changing between calls): validation must
    take them without tracing a ``getattr`` or ``math.isfinite`` on them. In a fresh
    interpreter: after other compiled calls in this process the trace did not fail."""
    assert run_python(_COMPILE_DYNAMIC).strip() == "ok"


@requires_backend("torch")
@pytest.mark.compile
def test_torch_compile_fullgraph_after_numpy_calls() -> None:
    """The call memo holding NumPy calls does not break a fullgraph trace of a torch
    call. Windows 8 and 2**64 have the same hash: dynamo then compares the two keys,
    and cannot compare the NumPy dtypes in them (seen after the hostile-input tests)."""
    import torch

    nq, nk, nv = _qkv(BY_NAME["numpy"], (1, 2, 5, 4), (1, 2, 5, 4), dtype="float64")
    for window in (8, 2**64):
        attend(nq, nk, nv, window=(None, window))
        attend(nq, nk, nv, window=(None, window))  # memoised now
    q, k, v = _qkv(BY_NAME["torch"], (1, 2, 5, 4), (1, 2, 5, 4))
    torch._dynamo.reset()  # a fresh trace, not one cached by an earlier test
    compiled = torch.compile(lambda a, b, c: attend(a, b, c, window=2), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v, window=2))


@requires_backend("jax")
def test_jax_fused_under_jit_vmap_grad() -> None:
    import jax
    import jax.numpy as jnp

    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (2, 4, 6, 8), (2, 2, 9, 8))
    mask = jnp.asarray(rng_for("jaxmask").random((6, 9)) < 0.6).at[2].set(False)

    def loss(impl: str) -> Any:
        return lambda a: jnp.sum(attend(a, k, v, mask=mask, implementation=impl) ** 2)

    fused = jax.jit(lambda a: attend(a, k, v, mask=mask, implementation="fused"))(q)
    portable = attend(q, k, v, mask=mask, implementation="portable")
    assert_close(backend.to_numpy(fused), backend.to_numpy(portable), "float32")
    assert np.all(backend.to_numpy(fused)[:, :, 2] == 0)
    g_fused = jax.grad(loss("fused"))(q)
    g_portable = jax.grad(loss("portable"))(q)
    assert bool(jnp.all(jnp.isfinite(g_fused)))
    assert_close(backend.to_numpy(g_fused), backend.to_numpy(g_portable), "float32")
    batched = jax.vmap(lambda a: attend(a, k[0], v[0], implementation="fused"))(q)
    assert batched.shape == (2, 4, 6, 8)


_JAX_WINDOWS = [
    # (Lq, Lk, causal, window, jax.nn's local_window_size or None: the window is a mask)
    (7, 7, False, 2, (2, 2)),
    (7, 7, True, (3, None), (3, 0)),
    (7, 7, False, (None, 1), (14, 1)),
    (5, 9, "upper_left", (2, 4), (2, 0)),
    (5, 9, False, (1, 2), None),  # lower-right, Lq != Lk: jax.nn's alignment differs
    (9, 5, "upper_left", 1, None),  # the last queries keep no key: jax.nn would give mean(V)
    (7, 7, True, (10, 3), (10, 0)),  # causal caps the right side
    (1, 6, True, 2, None),  # one query, lower-right: the key band is a mask (Lq != Lk)
    # Sides past Lq + Lk are capped: jax.nn gave wrong results from 2**31 - 1 (int32
    # arithmetic) and raised OverflowError from 2**31.
    (7, 7, False, (2**31 - 1, 1), (14, 1)),
    (7, 7, True, 2**40, (14, 0)),
    (7, 7, False, (0, 2**31), (0, 14)),
]


@requires_backend("jax")
@pytest.mark.parametrize(("lq", "lk", "causal", "window", "native"), _JAX_WINDOWS)
def test_jax_fused_window(
    lq: int, lk: int, causal: Any, window: Any, native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows reach jax.nn as ``local_window_size`` where its upper-left window alone is
    exact, else as a mask; either way the result matches the oracle (rows with no key
    give 0), under jit and through grad."""
    import jax
    import jax.numpy as jnp

    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (2, 4, lq, 8), (2, 2, lk, 8))
    seen: list[dict] = []
    real = jax.nn.dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> Any:  # the real jax.nn, its options noted
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    options = {"causal": causal, "window": window, "implementation": "fused"}
    out = jax.jit(lambda a, b, c: attend(a, b, c, **options))(q, k, v)
    ref, _, _ = oracle.attention(
        *(backend.to_numpy(x) for x in (q, k, v)), causal=causal, window=window
    )
    assert_close(backend.to_numpy(out), ref, "float32")
    assert seen and seen[-1]["local_window_size"] == native
    assert (seen[-1]["mask"] is None) == (native is not None)
    # under jit: one compilation each, where eager grad compiles every operation (3x slower)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(attend(a, k, v, **options) ** 2)))(q)
    want = jax.jit(jax.grad(lambda a: jnp.sum(attend(a, k, v, causal=causal, window=window) ** 2)))(
        q
    )
    assert_close(backend.to_numpy(grad), backend.to_numpy(want), "float32")


@requires_backend("jax")
@pytest.mark.parametrize(("lq", "lk"), [(0, 5), (5, 0), (0, 0)])
def test_jax_fused_empty_sequences(lq: int, lk: int) -> None:
    """jax.nn takes empty sequences: ``fused`` runs them (no key: zeros)."""
    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (2, 4, lq, 8), (2, 2, lk, 8))
    assert plan(q, k, v, implementation="fused").path == "fused:jax"
    out = attend(q, k, v, implementation="fused")
    assert out.shape == (2, 4, lq, 8)
    np.testing.assert_array_equal(backend.to_numpy(out), np.zeros((2, 4, lq, 8)))


def test_cupy_via_torch() -> None:
    """Runs only where CuPy and a CUDA GPU exist; skips cleanly elsewhere."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    rng = rng_for("cupy")
    q, k, v = (cupy.asarray(randn(rng, (2, 4, 16, 8)), dtype=cupy.float32) for _ in range(3))
    out = attend(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray)
    ref = oracle.attention(*(cupy.asnumpy(a).astype(np.float64) for a in (q, k, v)), causal=True)
    assert_close(cupy.asnumpy(out).astype(np.float64), ref[0], "float32")


def test_repeated_calls_revalidate_option_types(backend: Backend) -> None:
    """The memo of validated calls keys options by type: after causal=True and
    window=(2, 1) succeed, causal=1 and window=(2, True) still raise."""
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    for _ in range(2):
        attend(q, k, v, causal=True, window=(2, 1))
    with pytest.raises(TypeError, match="`causal`"):
        attend(q, k, v, causal=1, window=(2, 1))
    with pytest.raises(ValueError, match="`window`"):
        attend(q, k, v, causal=True, window=(2, True))


def test_unhashable_options_are_validated_each_call(backend: Backend) -> None:
    """A list as ``window`` cannot key the memo: the lookup fails (after memoised calls
    of the same arrays) and the call is validated and run in full, every time."""
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    expected = backend.to_numpy(attend(q, k, v, window=(2, 1)))
    attend(q, k, v, window=(2, 1))  # memoised now
    for _ in range(2):
        out = attend(q, k, v, window=[2, 1])
        np.testing.assert_array_equal(backend.to_numpy(out), expected)
    with pytest.raises(ValueError, match="`window`"):
        attend(q, k, v, window=[2, -1])


def test_repeated_calls_see_new_shapes_and_dtypes(backend: Backend) -> None:
    q, k, v = _qkv(backend, (2, 4, 5, 8), (2, 2, 7, 8))
    for _ in range(2):
        attend(q, k, v)
    k_bad, _, _ = _qkv(backend, (2, 2, 7, 6), (2, 2, 7, 6))
    with pytest.raises(ValueError, match="Dk"):
        attend(q, k_bad, v)
    q64 = backend.asarray(backend.to_numpy(q), "float64")
    with pytest.raises(TypeError, match="dtype"):
        attend(q64, k, v)


# ------------------------------------------------------------------------------------------
# Found in review: each of these once gave a wrong number or a backend traceback.


@requires_backend("jax")
@pytest.mark.parametrize("empty_by", ["mask", "bias"])
def test_jax_fused_causal_plus_mask_empty_row_is_zero(empty_by: str) -> None:
    """causal=True with a mask/bias that empties row 0 together with causal: jax.nn's
    is_causal must not hide the causal part from the empty-row repair."""
    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (1, 2, 4, 8), (1, 2, 4, 8))
    m = np.ones((4, 4), dtype=bool)
    m[0] = False
    m[0, 3] = True  # only a key that causal hides
    b = np.where(m, 0.0, -np.inf)
    kw = (
        {"mask": backend.asarray(m)}
        if empty_by == "mask"
        else {"bias": backend.asarray(b, "float32")}
    )
    out = attend(q, k, v, causal=True, implementation="fused", **kw)
    ref = oracle.attention(
        *(backend.to_numpy(a) for a in (q, k, v)),
        causal=True,
        mask=m if empty_by == "mask" else None,
        bias=None if empty_by == "mask" else b,
    )[0]
    assert np.all(backend.to_numpy(out)[:, :, 0] == 0)
    assert_close(backend.to_numpy(out), ref, "float32")


def test_chunked_with_no_queries(backend: Backend) -> None:
    q, k, v = _qkv(backend, (2, 0, 8), (2, 5, 8))
    out, lse = attend(q, k, v, chunk_size=4, return_lse=True)
    assert tuple(out.shape) == (2, 0, 8) and tuple(lse.shape) == (2, 0)


@requires_backend("torch")
def test_tensor_options_are_not_memoised_by_identity() -> None:
    import torch

    backend = BY_NAME["torch"]
    q, k, v = _qkv(backend, (1, 2, 4, 8), (1, 2, 4, 8))
    attend(q, k, v)
    t = torch.tensor(0.1)
    first = attend(q, k, v, scale=t)
    t.fill_(5.0)
    torch.testing.assert_close(attend(q, k, v, scale=t), attend(q, k, v, scale=5.0))
    assert not torch.allclose(first, attend(q, k, v, scale=5.0))
    with pytest.raises(TypeError, match=r"`scale`.*requires grad"):
        attend(q, k, v, scale=torch.tensor(1.0, requires_grad=True))


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"scale": True}, TypeError, "scale"),
        ({"scale": "0.5"}, TypeError, "scale"),
        ({"softcap": True}, TypeError, "softcap"),
        ({"dropout": "0.1"}, TypeError, "dropout"),
        ({"rng": "seed"}, TypeError, "rng"),
    ],
)
def test_options_of_the_wrong_type(backend: Backend, kwargs: dict, error: type, name: str) -> None:
    q, k, v = _qkv(backend, (1, 2, 4, 8), (1, 2, 4, 8))
    with pytest.raises(error, match=f"`{name}`"):
        attend(q, k, v, **kwargs)


@requires_backend("jax")
def test_jax_batch_of_keys_is_refused() -> None:
    import jax

    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (1, 2, 4, 8), (1, 2, 4, 8))
    with pytest.raises(TypeError, match="`rng`"):
        attend(q, k, v, dropout=0.1, rng=jax.random.split(jax.random.key(0), 2))


def test_key_padding_mask_small_integer_lengths(backend: Backend) -> None:
    from portable_attention import masks

    dtype = backend.xp.uint8 if hasattr(backend.xp, "uint8") else backend.int_dtype
    lengths = backend.xp.asarray(np.array([200, 3]), dtype=dtype)
    got = backend.to_numpy(masks.key_padding_mask(lengths, 300))
    assert got.reshape(2, 300).sum(axis=1).tolist() == [200, 3]


def test_mask_builders_name_bad_arguments() -> None:
    from portable_attention import masks

    with pytest.raises(TypeError, match="`xp`"):
        masks.causal_mask(4, xp="numpy")
    with pytest.raises(ValueError, match="`q_segments`"):
        masks.segment_mask(np.array(1))


@requires_backend("jax")
@pytest.mark.parametrize(
    ("shape_q", "shape_kv", "kwargs"),
    [
        ((1, 4, 600, 16), (1, 2, 700, 16), {"causal": True}),  # GQA, Lq != Lk, tail rows
        ((2, 2, 512, 8), (2, 2, 512, 8), {"window": (30, 5)}),  # exactly two blocks
        ((600, 8), (640, 8), {"causal": "upper_left"}),  # 2-D inputs
        ((1, 4, 520, 16), (1, 4, 520, 16), {"mask": "rows", "bias": "heads"}),
        ((1, 2, 512, 8), (1, 2, 512, 8), {"mask": "keys", "softcap": 3.0}),
    ],
    ids=["gqa_causal_tail", "window_two_blocks", "two_d_upper_left", "mask_bias", "pad_softcap"],
)
def test_jax_native_query_blocks(shape_q: tuple, shape_kv: tuple, kwargs: dict) -> None:
    """The query-blocked JAX kernel (CPU, Lq >= 512): oracle values and exact empty rows,
    weights and lse too, the same under jit, and gradients equal to the dense path's."""
    import jax
    import jax.numpy as jnp

    backend = BY_NAME["jax"]
    rng = rng_for("jax-native", shape_q, shape_kv)
    q64, k64, v64 = (randn(rng, s) for s in (shape_q, shape_kv, shape_kv))
    lq, lk = shape_q[-2], shape_kv[-2]
    np_kwargs = dict(kwargs)
    if kwargs.get("mask") == "rows":
        np_kwargs["mask"] = rng.random((lq, lk)) < 0.5
        np_kwargs["mask"][[3, 517]] = False  # empty rows in a block and in the tail
    if kwargs.get("mask") == "keys":
        np_kwargs["mask"] = np.arange(lk) < lk - 100  # key padding, [Lk]
    if kwargs.get("bias") == "heads":
        np_kwargs["bias"] = randn(rng, (shape_q[-3], lq, lk)).astype(np.float32)
    j_kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in np_kwargs.items()}
    q, k, v = (backend.asarray(x, "float32") for x in (q64, k64, v64))

    assert plan(q, k, v, **j_kwargs).path == "tuned:jax"
    out, weights, lse = attend(q, k, v, return_weights=True, return_lse=True, **j_kwargs)
    ref_out, ref_w, ref_lse = oracle.attention(q64, k64, v64, **np_kwargs)
    assert_like(out, q, shape=ref_out.shape, dtype=jnp.float32, name="out")
    assert_close(backend.to_numpy(out), ref_out, "float32")
    assert_close(backend.to_numpy(weights), ref_w, "float32", what="weights")
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(backend.to_numpy(lse)), empty)
    assert np.all(backend.to_numpy(out)[empty] == 0)
    assert_close(backend.to_numpy(lse)[~empty], ref_lse[~empty], "float32", what="lse")

    jitted = jax.jit(lambda a, b, c: attend(a, b, c, **j_kwargs))(q, k, v)
    assert_close(backend.to_numpy(jitted), ref_out, "float32")

    def loss(impl: str) -> Any:
        return lambda a: jnp.sum(attend(a, k, v, implementation=impl, **j_kwargs) ** 2)

    g_native = jax.jit(jax.grad(loss("auto")))(q)
    g_dense = jax.jit(jax.grad(loss("portable")))(q)
    assert bool(jnp.all(jnp.isfinite(g_native)))
    np.testing.assert_allclose(
        backend.to_numpy(g_native), backend.to_numpy(g_dense), rtol=1e-4, atol=1e-5
    )


@requires_backend("jax")
def test_jax_native_under_vmap_and_below_two_blocks() -> None:
    import jax

    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (3, 2, 512, 8), (3, 2, 512, 8))
    batched = jax.vmap(lambda a, b, c: attend(a, b, c, causal=True))(q, k, v)
    assert_close(
        backend.to_numpy(batched),
        backend.to_numpy(attend(q, k, v, causal=True, implementation="portable")),
        "float32",
    )
    short = _qkv(backend, (1, 2, 511, 8), (1, 2, 511, 8))
    assert plan(*short).path == "portable:dense"
    assert "512 queries" in plan(*short).reason
    assert plan(q, k, v, dropout=0.1, rng=jax.random.key(0)).path == "portable:dense"


_WINDOWS = [None, 0, 1, 2, (None, 0), (1, None), (0, 3), (3, 0), (None, None)]


@pytest.mark.parametrize("causal", [False, True, "upper_left"])
@pytest.mark.parametrize("window", _WINDOWS)
def test_band_that_keeps_every_score_builds_no_mask(causal: Any, window: Any) -> None:
    """``causal``/``window`` build no mask exactly where the oracle's band keeps every
    score (lower-right causal with one query, the decode step, among them), so the fused
    kernels keep their mask-free path; a band that drops a score always gets its mask."""
    for lq, lk in itertools.product(range(1, 5), repeat=2):
        q, k = np.zeros((2, lq, 3)), np.zeros((2, lk, 3))
        call = validate_call(q, k, k, options(causal=causal, window=window))
        keeps_all = bool(oracle.allowed_positions(lq, lk, causal=causal, window=window).all())
        assert _core.band_keeps_all(call) == keeps_all, (lq, lk)
        assert (_core.band_mask(call) is None) == keeps_all, (lq, lk)


@requires_backend("torch")
def test_torch_decode_step_with_causal_runs_sdpa_without_a_mask() -> None:
    """``causal=True`` with one query sees every key: SDPA runs with neither mask nor
    flag (a mask of all True cost the decode step 2-3x here)."""
    backend = BY_NAME["torch"]
    q, k, v = _qkv(backend, (1, 8, 1, 16), (1, 8, 40, 16), "float32")
    call = validate_call(q, k, v, options(causal=True))
    assert _core.fused_mask(call, None, None) == (None, False)
    ref_out, _, _ = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), causal=True)
    assert_close(backend.to_numpy(attend(q, k, v, causal=True)), ref_out, "float32")


@requires_backend("jax")
def test_jax_native_compiles_once_when_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Eager calls on ``tuned:jax`` (CPU, >= 512 queries) reuse one compiled program:
    the ``lax.map`` over a new closure compiled again on every call (540 ms against 7).
    Seen through ``jax.log_compiles()``, JAX's public switch that logs every trace and
    compilation: the repeated calls log none."""
    import jax

    backend = BY_NAME["jax"]
    q, k, v = _qkv(backend, (1, 2, 512, 16), (1, 2, 512, 16))
    assert plan(q, k, v).path == "tuned:jax"
    first = attend(q, k, v, causal=True)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="jax"), jax.log_compiles():
        for _ in range(3):
            again = jax.block_until_ready(attend(q, k, v, causal=True))
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("jax")]
        # the switch works: a new shape logs its compilation
        attend(q[..., :256, :], k, v, causal=True)
        fresh = [r for r in caplog.records if r.name.startswith("jax")]
    assert logged == []
    assert fresh
    assert_same(again, first)


class _UnhashableDevice:
    """A device like CuPy's ``cupy.cuda.Device``: compared by ``==``, no ``__hash__``."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _UnhashableDevice) and other.n == self.n

    def __repr__(self) -> str:
        return f"<Device {self.n}>"


def test_calls_and_memo_keys_on_a_device_type_that_is_not_hashable() -> None:
    """Plans are cached by the whole call and the memo keys arrays by their device: a
    device type without ``__hash__`` (CuPy's) enters both by its repr, equal devices
    alike, other devices apart. (CuPy itself cannot run here.)"""
    import dataclasses

    from portable_attention import _memo, _plan

    q = np.ones((1, 2, 4, 8), dtype=np.float32)
    call = validate_call(q, q, q, options(implementation="portable"))
    on = [dataclasses.replace(call, device=_UnhashableDevice(n)) for n in (0, 0, 1)]
    assert hash(on[0]) == hash(on[1]) and on[0] == on[1] and on[0] != on[2]
    assert _plan.choose(on[0]).path == "portable:dense"
    key = _memo._generic_key(lambda x: _UnhashableDevice(0))
    assert hash(key(q)) == hash(key(q))
