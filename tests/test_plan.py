"""plan(): which path attend() takes and why.

The portable path is always available (``implementation="portable"``); ``auto`` may pick a
framework's fused kernel (``fused:<framework>``) or a tuned kernel (``tuned:<framework>``)
where its result matches the contract; ``implementation="fused"`` raises a ValueError that
names `implementation` and gives the reason where no fused kernel applies. That every path
matches the oracle is tested in test_attend.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from portable_attention import Plan, attend, plan

import oracle
from conftest import Backend
from helpers import assert_close, randn, rng_for

PORTABLE_PATHS = ("portable:dense", "portable:blockwise")


def qkv(backend: Backend, dtype: str = "float32"):
    rng = rng_for("plan")
    return tuple(
        backend.asarray(randn(rng, s), dtype) for s in ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    )


def check_plan(backend: Backend, p: object) -> None:
    assert isinstance(p, Plan)
    assert isinstance(p.path, str)
    assert isinstance(p.reason, str)
    assert p.reason.strip()
    kind, _, where = p.path.partition(":")
    assert p.path in PORTABLE_PATHS or (kind in ("fused", "tuned", "per-chunk") and where), p.path
    if backend.name.startswith("array_api_strict"):
        # a generic array-API library has no fused or tuned kernel
        assert p.path in PORTABLE_PATHS, p


OPTIONS = [
    {},
    {"causal": True, "window": 2, "softcap": 3.0, "scale": 0.2},
    {"return_weights": True, "return_lse": True},
    {"return_lse": True, "causal": "upper_left"},
]
OPTION_IDS = ["default", "options", "weights_lse", "lse"]


@pytest.mark.parametrize("kwargs", OPTIONS, ids=OPTION_IDS)
def test_plan_auto(backend: Backend, float_dtype: str, kwargs: dict) -> None:
    q, k, v = qkv(backend, float_dtype)
    p = plan(q, k, v, **kwargs)
    check_plan(backend, p)
    assert plan(q, k, v, implementation="auto", **kwargs) == p
    assert plan(q, k, v, **kwargs) == p  # deterministic (cached or not)


@pytest.mark.parametrize("kwargs", OPTIONS, ids=OPTION_IDS)
def test_plan_portable_when_asked(backend: Backend, float_dtype: str, kwargs: dict) -> None:
    q, k, v = qkv(backend, float_dtype)
    p = plan(q, k, v, implementation="portable", **kwargs)
    check_plan(backend, p)
    assert p.path == "portable:dense"


def test_plan_with_mask_bias_and_dropout(backend: Backend) -> None:
    q, k, v = qkv(backend)
    mask = backend.asarray(np.tril(np.ones((3, 5), dtype=bool)))
    bias = backend.asarray(np.zeros((3, 5)), "float32")
    kwargs = {"mask": mask, "bias": bias, "dropout": 0.2, "rng": backend.make_rng(0)}
    check_plan(backend, plan(q, k, v, **kwargs))
    p = plan(q, k, v, implementation="portable", **kwargs)
    assert p.path == "portable:dense"


def test_plan_is_frozen(backend: Backend) -> None:
    p = plan(*qkv(backend))
    path = p.path
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        p.path = "something else"  # type: ignore[misc]
    assert p.path == path
    assert plan(*qkv(backend)).path == path


def test_plan_does_not_touch_inputs(backend: Backend) -> None:
    q, k, v = qkv(backend)
    before = [backend.to_numpy(a).copy() for a in (q, k, v)]
    p = plan(q, k, v, return_weights=True, return_lse=True)
    assert isinstance(p, Plan)
    for a, b in zip((q, k, v), before, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), b)


def _no_fused_cases(backend: Backend) -> list[dict]:
    """Calls where no fused kernel can apply on this backend."""
    cases = [{"return_weights": True}]  # fused kernels do not return the probabilities
    if backend.name in ("numpy",) or backend.name.startswith("array_api_strict"):
        cases.append({})  # no fused kernel at all
    return cases


def test_fused_raises_where_none_applies(backend: Backend) -> None:
    q, k, v = qkv(backend)
    for kwargs in _no_fused_cases(backend):
        auto = plan(q, k, v, **kwargs)
        assert not auto.path.startswith("fused"), auto
        with pytest.raises(ValueError, match=r"`implementation\b") as info:
            attend(q, k, v, implementation="fused", **kwargs)
        if auto.path in PORTABLE_PATHS:
            # the reason auto gives for not taking a fused kernel (its first clause; a
            # tuned kernel's may follow) is the error's reason
            assert auto.reason.split("; ")[0] in str(info.value)
        with pytest.raises(ValueError, match=r"`implementation\b"):
            plan(q, k, v, implementation="fused", **kwargs)


def test_fused_where_it_applies(backend: Backend, float_dtype: str) -> None:
    """Where a fused kernel applies, asking for it gives a fused plan (auto's, if auto picks
    one) and the oracle's result; where none does, auto does not claim one."""
    q, k, v = qkv(backend, float_dtype)
    auto = plan(q, k, v, causal=True)
    try:
        fused = plan(q, k, v, causal=True, implementation="fused")
    except ValueError:
        assert not auto.path.startswith("fused"), auto
        return
    assert fused.path.startswith("fused:"), fused
    if auto.path.startswith("fused"):
        assert fused == auto
    out = attend(q, k, v, causal=True, implementation="fused")
    ref = oracle.attention(*(backend.to_numpy(a) for a in (q, k, v)), causal=True)[0]
    assert_close(backend.to_numpy(out), ref, float_dtype)


def test_portable_implementation_works(backend: Backend, hp_dtype: str) -> None:
    q, k, v = qkv(backend, hp_dtype)
    out = attend(q, k, v, implementation="portable", causal=True)
    ref = oracle.attention(*(backend.to_numpy(a) for a in (q, k, v)), causal=True)[0]
    assert_close(backend.to_numpy(out), ref, hp_dtype)


def test_plan_follows_shapes(backend: Backend) -> None:
    """A plan made for one shape is not reused for another shape with the same options:
    after calls with Dk == Dv, a call with Dk != Dv (or other Lq/Lk, heads, rank) still runs
    correctly or, for "fused", raises the documented ValueError."""
    rng = rng_for("plan-shapes")
    shapes = [
        ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 8)),
        ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6)),  # Dk != Dv
        ((2, 4, 6, 8), (2, 4, 2, 8), (2, 4, 2, 8)),  # Lq > Lk
        ((2, 4, 3, 8), (2, 1, 5, 8), (2, 1, 5, 8)),  # MQA
        ((3, 8), (5, 8), (5, 8)),  # 2-D
        ((3, 8), (5, 8), (5, 2)),  # 2-D, Dk != Dv
    ]
    for implementation in ("auto", "fused"):
        for qs, ks, vs in shapes:
            q, k, v = (backend.asarray(randn(rng, s), "float32") for s in (qs, ks, vs))
            try:
                p = plan(q, k, v, causal=True, implementation=implementation)
            except ValueError:
                assert implementation == "fused"
                with pytest.raises(ValueError, match=r"`implementation\b"):
                    attend(q, k, v, causal=True, implementation=implementation)
                continue
            check_plan(backend, p)
            out = attend(q, k, v, causal=True, implementation=implementation)
            ref = oracle.attention(*(backend.to_numpy(a) for a in (q, k, v)), causal=True)[0]
            assert_close(backend.to_numpy(out), ref, "float32")


def test_narrow_windows_take_the_blockwise_path() -> None:
    """A window that keeps few of the blockwise grid's blocks runs blockwise (which
    computes only those), on torch's CPU instead of SDPA with the band as a dense mask;
    a short sequence, a wide window and plain causal keep SDPA."""
    torch = pytest.importorskip("torch")
    from portable_attention.backends import torch_flex

    long = torch.zeros(1, 8, 4096, 64)
    narrow = plan(long, long, long, causal=True, window=(255, 0))
    # FlexAttention, where it compiles here, computes the band's blocks faster still
    # (tests/test_flex.py); the blockwise path where it does not.
    flex = torch_flex.unavailable("cpu") is None
    assert narrow.path == ("fused:torch-flex" if flex else "portable:blockwise")
    assert "SDPA takes the window as a dense mask" in narrow.reason
    assert "keeps 9% of the blocks" in narrow.reason
    assert plan(long, long, long, causal=True).path == "fused:torch"
    assert plan(long, long, long, window=(3000, 3000)).path == "fused:torch"  # most blocks
    short = torch.zeros(1, 8, 512, 64)
    assert plan(short, short, short, causal=True, window=(63, 0)).path == "fused:torch"
    # The same result either way (SDPA's, asked for, against auto's blockwise path).
    q, k, v = (torch.randn(1, 2, 2048, 16, dtype=torch.float64) for _ in range(3))
    assert plan(q, k, v, causal=True, window=(100, 0)).path == "portable:blockwise"
    fused = attend(q, k, v, causal=True, window=(100, 0), implementation="fused")
    torch.testing.assert_close(attend(q, k, v, causal=True, window=(100, 0)), fused)


def test_portable_narrow_window_is_blockwise_on_every_backend(backend: Backend) -> None:
    """``implementation="portable"`` with a window that keeps under a quarter of the
    blocks takes the blockwise path, where the dense scores would fit."""
    q = backend.asarray(np.zeros((1, 8, 2048, 64)), "float32")
    got = plan(q, q, q, causal=True, window=(63, 0), implementation="portable")
    assert got.path == "portable:blockwise"
    assert "the window keeps" in got.reason
