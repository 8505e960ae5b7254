"""Numerical extremes against the float64 oracle, on every backend and every path.

Half inputs whose raw scores overflow float16, huge and tiny ``scale``, ``-inf`` bias as
a mask, ``softcap`` on scores of 1e30, a NaN query row, and 65536 keys on the chunked
path. Inputs are built from values every dtype holds exactly (300, halves), so the
oracle sees the very numbers the backend sees and only the computation can differ.

Paths: ``auto``, ``portable`` (dense), ``chunked`` (``chunk_size``) and ``fused``
(``implementation="fused"``; skipped, with plan()'s reason, where no fused kernel
takes the call, e.g. jax.nn off GPU for half inputs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import attend, plan

import oracle
from conftest import TOLERANCES, Backend
from helpers import assert_close, assert_like, check_against_oracle, rng_for

PATHS = ("auto", "portable", "chunked", "fused")
FP16_MAX = 65504.0


def _run(backend: Backend, path: str, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """``attend`` on ``path``; skips ``fused`` where plan() says no fused kernel applies."""
    if path == "fused":
        try:
            plan(q, k, v, implementation="fused", **kwargs)
        except ValueError as err:
            pytest.skip(f"{backend.name}: {err}")
        return attend(q, k, v, implementation="fused", **kwargs)
    if path == "chunked":
        return attend(q, k, v, chunk_size=3, **kwargs)
    return attend(q, k, v, implementation=path, **kwargs)


def _with_lse(backend: Backend, path: str, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """``(out, lse)`` where the path returns lse (fused kernels do not: lse is None)."""
    if path == "fused":
        return _run(backend, path, q, k, v, **kwargs), None
    return _run(backend, path, q, k, v, return_lse=True, **kwargs)


def _overflowing_qkv(shape_q: tuple, shape_k: tuple, seed: str) -> tuple[np.ndarray, ...]:
    """q and k whose feature 0 is 300 (and feature 1 +-300 with the same sign in q and
    k, per batch): every raw score holds 2 * 300**2 = 180000 > float16's 65504, while the other
    features (halves in [-1, 1], exact in every dtype) keep the softmax far from one-hot."""
    rng = rng_for("extremes", seed)
    q = rng.integers(-2, 3, shape_q) / 2.0
    k = rng.integers(-2, 3, shape_k) / 2.0
    v = rng.integers(-4, 5, shape_k) / 4.0
    sign = np.where(rng.random(shape_q[0]) < 0.5, -1.0, 1.0)[:, None, None]  # per batch
    q[..., 0], k[..., 0] = 300.0, 300.0
    q[..., 1], k[..., 1] = 300.0 * sign, 300.0 * sign
    return q, k, v


# ------------------------------------------------------------------------------------------
# Half precision: scores overflow the input dtype, never the result


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_half_scores_beyond_float16_range(
    backend: Backend, half_dtype: str, path: str, causal: bool
) -> None:
    """|q|, |k| ~ 300, D = 64: raw scores 180000 (scaled: 22500) are beyond float16, yet
    out is finite and matches the oracle (scores are computed in float32)."""
    qn, kn, vn = _overflowing_qkv((2, 4, 9, 64), (2, 2, 11, 64), "half")
    q, k, v = (backend.asarray(a, half_dtype) for a in (qn, kn, vn))
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    raw = np.abs(np.einsum("bhqd,bhkd->bhqk", qn[:, ::2], kn))
    assert raw.min() > FP16_MAX  # every raw score overflows float16
    out, lse = _with_lse(backend, path, q, k, v, causal=causal)
    ref = oracle.attention(qn, kn, vn, causal=causal)
    assert np.abs(np.diff(ref[1], axis=-1)).max() > 0.1  # the softmax is not one-hot
    check_against_oracle(backend, half_dtype, q, (out, None, lse), ref)


@pytest.mark.parametrize("path", PATHS)
def test_half_with_bias_and_mask_beyond_float16_range(
    backend: Backend, half_dtype: str, path: str
) -> None:
    """The same overflowing scores plus a float32 bias with -inf entries and a mask."""
    qn, kn, vn = _overflowing_qkv((1, 2, 6, 64), (1, 2, 8, 64), "half-bias")
    rng = rng_for("extremes", "half-bias-mask")
    q, k, v = (backend.asarray(a, half_dtype) for a in (qn, kn, vn))
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    bias_np = rng.integers(-8, 9, (6, 8)) / 4.0
    bias_np[rng.random((6, 8)) < 0.2] = -np.inf
    bias_np[2] = -np.inf  # a row with no key
    mask_np = rng.random((2, 6, 8)) < 0.8
    mask_np[1, 4] = False  # another, in one head only
    bias, mask = backend.asarray(bias_np, "float32"), backend.asarray(mask_np)
    out, lse = _with_lse(backend, path, q, k, v, bias=bias, mask=mask)
    ref = oracle.attention(qn, kn, vn, bias=bias_np, mask=mask_np)
    assert np.isneginf(ref[2][0, :, 2]).all() and np.isneginf(ref[2][0, 1, 4])
    check_against_oracle(backend, half_dtype, q, (out, None, lse), ref)


# ------------------------------------------------------------------------------------------
# Huge and tiny scale


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [1e6, 1e-6], ids=["scale_1e6", "scale_1e-6"])
def test_extreme_scale(backend: Backend, float_dtype: str, path: str, scale: float) -> None:
    """scale=1e6 makes the softmax one-hot (or an exact tie's average) with scores ~1e6;
    1e-6 makes it (nearly) uniform. Both finite and as the oracle, on every dtype and path.

    Inputs are halves, so ``scale * q @ k^T`` is exact in float32: at scale 1e6 a rounding
    error of one float32 ulp in a score of 1e11 (~1e4) would decide between tied keys, an
    ill-conditioned problem no float32 kernel can answer (measured: |q|, |k| ~ 300 flips
    ties at scale 1e6 on every backend), so the test keeps the scores exact instead."""
    rng = rng_for("extremes", "scale")
    qn = rng.integers(-2, 3, (2, 2, 5, 8)) / 2.0
    kn = rng.integers(-2, 3, (2, 2, 7, 8)) / 2.0
    vn = rng.integers(-4, 5, (2, 2, 7, 8)) / 4.0
    q, k, v = (backend.asarray(a, float_dtype) for a in (qn, kn, vn))
    out, lse = _with_lse(backend, path, q, k, v, scale=scale)
    ref = oracle.attention(qn, kn, vn, scale=scale)
    check_against_oracle(backend, float_dtype, q, (out, None, None), ref)
    if lse is not None:
        # lse ~ 1e6 at scale 1e6: compared relative to its size in the compute dtype
        lse_np = backend.to_numpy(lse)
        assert np.all(np.isfinite(lse_np))
        rtol = 1e-12 if float_dtype == "float64" else 1e-6
        np.testing.assert_allclose(lse_np, ref[2], rtol=rtol, atol=1e-5)


# ------------------------------------------------------------------------------------------
# -inf in bias is a mask


@pytest.mark.parametrize("path", PATHS)
def test_neginf_bias_acts_as_mask(backend: Backend, float_dtype: str, path: str) -> None:
    """-inf bias entries drop keys exactly like mask=False (same result as the boolean
    mask); a row whose bias is all -inf gives out 0 and lse -inf; no NaN anywhere."""
    rng = rng_for("extremes", "neginf-bias")
    qn, kn, vn = (rng.integers(-4, 5, s) / 4.0 for s in ((2, 4, 6, 8), (2, 2, 9, 8), (2, 2, 9, 8)))
    keep = rng.random((4, 6, 9)) < 0.6
    keep[:, 3] = False  # row 3 of every head has no key
    keep[1, 0] = False  # and row 0 of head 1
    bias_np = np.where(keep, 0.0, -np.inf)
    q, k, v = (backend.asarray(a, float_dtype) for a in (qn, kn, vn))
    bias = backend.asarray(bias_np, float_dtype)
    out, lse = _with_lse(backend, path, q, k, v, bias=bias)
    ref = oracle.attention(qn, kn, vn, bias=bias_np)
    assert np.isneginf(ref[2][:, :, 3]).all()
    check_against_oracle(backend, float_dtype, q, (out, None, lse), ref)
    by_mask = _run(backend, path, q, k, v, mask=backend.asarray(keep))
    rtol, atol = TOLERANCES[float_dtype]
    np.testing.assert_allclose(
        backend.to_numpy(out), backend.to_numpy(by_mask), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("path", PATHS)
def test_all_neginf_bias(backend: Backend, hp_dtype: str, path: str) -> None:
    """Every bias entry -inf: every row empty, out 0 everywhere, lse -inf, never NaN."""
    rng = rng_for("extremes", "all-neginf")
    q, k, v = (backend.asarray(rng.standard_normal((1, 2, 4, 8)), hp_dtype) for _ in range(3))
    bias = backend.asarray(np.full((4, 4), -np.inf), hp_dtype)
    out, lse = _with_lse(backend, path, q, k, v, bias=bias)
    assert_like(out, q, shape=(1, 2, 4, 8), dtype=q.dtype)
    assert np.all(backend.to_numpy(out) == 0.0)
    if lse is not None:
        assert np.all(np.isneginf(backend.to_numpy(lse)))


# ------------------------------------------------------------------------------------------
# softcap on huge scores


@pytest.mark.parametrize("path", ["auto", "portable", "chunked"])
@pytest.mark.parametrize("magnitude", [1e15, 1e20], ids=["scores_1e30", "scores_overflow"])
def test_softcap_on_huge_scores(backend: Backend, path: str, magnitude: float) -> None:
    """float32 scores of 1e30 (and scores that overflow float32 to +-inf) are capped to
    +-softcap: finite and as the oracle. Rows 1 and 3 are moderate, so the cap also
    passes ordinary scores through. (inf - inf never arises: q and k are positive where
    they are huge.)"""
    rng = rng_for("extremes", "softcap", magnitude)
    qn = rng.integers(1, 5, (1, 2, 4, 4)) / 2.0
    kn = rng.integers(-4, 5, (1, 2, 6, 4)) / 2.0
    vn = rng.standard_normal((1, 2, 6, 4))
    qn[:, :, [0, 2]] *= magnitude
    kn[:, :, :3] = np.abs(kn[:, :, :3]) * magnitude + magnitude  # positive where huge
    kn[:, :, 3:] = -np.abs(kn[:, :, 3:]) * magnitude - magnitude
    q, k, v = (backend.asarray(a, "float32") for a in (qn, kn, vn))
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    out, lse = _with_lse(backend, path, q, k, v, softcap=5.0)
    ref = oracle.attention(qn, kn, vn, softcap=5.0)
    check_against_oracle(backend, "float32", q, (out, None, lse), ref)


# ------------------------------------------------------------------------------------------
# NaN stays in its row


@pytest.mark.parametrize("path", PATHS)
def test_nan_query_row_stays_in_its_row(backend: Backend, hp_dtype: str, path: str) -> None:
    """A NaN in one query row makes that row NaN (out and lse: never a -inf that claims
    the row had no key); every other row, including those of the heads that share its
    K/V (grouped-query), is exactly as without the NaN. On ``fused:torch`` the NaN row
    itself is what torch SDPA gives, which the contract does not promise (see the test
    below): there only the other rows are asserted."""
    rng = rng_for("extremes", "nan-row")
    qn = rng.standard_normal((2, 4, 5, 8))
    kn, vn = rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 8))
    mask_np = rng.random((5, 7)) < 0.8
    mask_np[4] = False  # an empty row besides
    qn[1, 2, 3, 5] = np.nan  # batch 1, head 2 (KV head 1, shared with head 3), row 3
    q, k, v = (backend.asarray(a, hp_dtype) for a in (qn, kn, vn))
    mask = backend.asarray(mask_np)
    out, lse = _with_lse(backend, path, q, k, v, mask=mask, causal=True)
    out_np = backend.to_numpy(out)
    if not (backend.name == "torch" and path == "fused"):
        assert np.all(np.isnan(out_np[1, 2, 3])), out_np[1, 2, 3]
    nan_row = np.zeros(out_np.shape[:-1], dtype=bool)
    nan_row[1, 2, 3] = True
    assert np.all(np.isfinite(out_np[~nan_row]))
    ref_out, _, ref_lse = oracle.attention(
        np.where(np.isnan(qn), 0.0, qn), kn, vn, mask=mask_np, causal=True
    )
    assert_close(out_np[~nan_row], ref_out[~nan_row], hp_dtype)
    assert np.all(out_np[:, :, 4] == 0.0)  # the empty row
    if lse is not None:
        lse_np = backend.to_numpy(lse)
        assert np.isnan(lse_np[1, 2, 3]), lse_np[1, 2, 3]
        assert_close(lse_np[~nan_row], ref_lse[~nan_row], hp_dtype, what="lse")


@pytest.mark.parametrize("path", PATHS)
def test_nan_query_row_stays_in_its_row_without_masking(
    backend: Backend, hp_dtype: str, path: str
) -> None:
    """The same with nothing that masks, where the softmax runs without its empty-row
    guards: the NaN stays in its row (every other row exact, lse included) and, on every
    path but ``fused:torch``, that row is NaN.

    ``fused:torch`` returns what torch SDPA gives for the NaN row, which the contract does
    not promise (docs/contract.md: ask for ``implementation="portable"`` where NaN must
    surface); its CPU kernel gives 0 on some CPUs and NaN on others with the same torch,
    so there only the rows the NaN does not reach are asserted."""
    rng = rng_for("extremes", "nan-row-plain")
    qn = rng.standard_normal((2, 4, 5, 8))
    kn, vn = rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 8))
    qn[0, 1, 2, 0] = np.nan
    q, k, v = (backend.asarray(a, hp_dtype) for a in (qn, kn, vn))
    out, lse = _with_lse(backend, path, q, k, v)
    out_np = backend.to_numpy(out)
    nan_row = np.zeros(out_np.shape[:-1], dtype=bool)
    nan_row[0, 1, 2] = True
    sdpa = path == "fused" and plan(q, k, v, implementation="fused").path == "fused:torch"
    if not sdpa:  # ("auto" asks for lse: not SDPA)
        assert np.all(np.isnan(out_np[nan_row])), out_np[nan_row]
    assert np.all(np.isfinite(out_np[~nan_row]))
    ref_out, _, ref_lse = oracle.attention(np.where(np.isnan(qn), 0.0, qn), kn, vn)
    assert_close(out_np[~nan_row], ref_out[~nan_row], hp_dtype)
    if lse is not None:
        lse_np = backend.to_numpy(lse)
        assert np.isnan(lse_np[0, 1, 2]), lse_np[0, 1, 2]
        assert_close(lse_np[~nan_row], ref_lse[~nan_row], hp_dtype, what="lse")


# ------------------------------------------------------------------------------------------
# Long key sequences on the chunked path


@pytest.mark.parametrize("chunk_size", [1000, 4096])
def test_65536_keys_chunked(backend: Backend, chunk_size: int) -> None:
    """Lk = 65536 through the online softmax (1000: a partial last block): row 0's
    maximum arrives in the last blocks (key 65000 is 10 q[0]), a row's only key
    is the very last one, another row has none; float64 results as the oracle to 1e-10."""
    lq, lk, d = 4, 65536, 8
    rng = rng_for("extremes", "long")
    qn, kn = rng.standard_normal((lq, d)), rng.standard_normal((lk, d))
    vn = rng.standard_normal((lk, 4))
    kn[65000] = 10.0 * qn[0]  # row 0's winning key, far past the first blocks
    mask_np = np.ones((lq, lk), dtype=bool)
    mask_np[1, :-1] = False  # row 1 sees only the last key
    mask_np[2] = False  # row 2 sees nothing
    q, k, v = (backend.asarray(a, "float64") for a in (qn, kn, vn))
    mask = backend.asarray(mask_np)
    assert plan(q, k, v, mask=mask, chunk_size=chunk_size).path == "portable:blockwise"
    out, lse = attend(q, k, v, mask=mask, chunk_size=chunk_size, return_lse=True)
    ref = oracle.attention(qn, kn, vn, mask=mask_np)
    assert np.isneginf(ref[2][2])
    assert ref[1][0, 65000] > 0.5  # the late maximum dominates
    check_against_oracle(backend, "float64", q, (out, None, lse), ref)


@pytest.mark.parametrize("path", PATHS)
def test_finfo_min_bias_is_finite(backend: Backend, float_dtype: str, path: str) -> None:
    """The "most negative float" additive mask of many model codebases (``finfo.min`` of
    the dtype) is a finite bias, not -inf, and every path treats it as the oracle does:
    added in the compute dtype without overflowing to -inf, so a row whose bias is all
    ``finfo.min`` is never an empty row (out 0). Such a row is the scores shifted by a
    constant: unchanged attention where the shift keeps the scores (float16's -65504 in
    float32), uniform weights where it absorbs them (float32, float64, bfloat16 minima).
    Partially covered rows drop those keys. For empty rows pass -inf or a boolean mask."""
    rng = rng_for("extremes", "finfo-min")
    qn, kn, vn = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    q, k, v = (backend.asarray(a, float_dtype) for a in (qn, kn, vn))
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    fmin = float(backend.xp.finfo(backend.dtype(float_dtype)).min)
    bias_np = np.zeros((4, 4))
    bias_np[1] = fmin  # every key at finfo.min: uniform weights
    bias_np[2, :2] = fmin  # two keys pushed out
    bias = backend.asarray(bias_np, float_dtype)
    out, lse = _with_lse(backend, path, q, k, v, bias=bias)
    ref = oracle.attention(qn, kn, vn, bias=bias_np)
    assert np.all(np.isfinite(ref[2][0, :, 1]))  # row 1 has keys in the oracle too
    check_against_oracle(backend, float_dtype, q, (out, None, None), ref)
    if lse is not None:  # lse ~ finfo.min on row 1: relative comparison
        lse_np = backend.to_numpy(lse)
        assert np.all(np.isfinite(lse_np))
        np.testing.assert_allclose(lse_np, ref[2], rtol=1e-5)
