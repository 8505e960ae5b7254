"""Dropout on attention weights with each framework's own RNG."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import attend

import oracle
from conftest import BY_NAME, Backend, requires_backend
from helpers import assert_close, assert_like, assert_same, randn, rng_for

P = 0.3


def small(backend: Backend, dtype: str, *, lead: tuple[int, ...] = (2,), lq=4, lk=6, dv=3):
    rng = rng_for("dropout", lq, lk, dv)
    qn, kn, vn = randn(rng, (2, lq, 4)), randn(rng, (2, lk, 4)), randn(rng, (2, lk, dv))
    qn, kn, vn = (np.broadcast_to(a, lead + a.shape).copy() for a in (qn, kn, vn))
    return tuple(backend.asarray(a, dtype) for a in (qn, kn, vn))


def test_p_zero_is_identity(backend: Backend, float_dtype: str) -> None:
    q, k, v = small(backend, float_dtype)
    plain = attend(q, k, v, return_weights=True, return_lse=True)
    for kwargs in ({"dropout": 0.0}, {"dropout": 0.0, "rng": backend.make_rng(3)}, {"dropout": 0}):
        res = attend(q, k, v, return_weights=True, return_lse=True, **kwargs)
        for a, b in zip(res, plain, strict=True):
            assert_same(a, b)


def test_jax_p_zero_needs_no_rng() -> None:
    if "jax" not in BY_NAME:
        pytest.skip("jax not selected")
    q, k, v = small(BY_NAME["jax"], "float32")
    assert_same(attend(q, k, v, dropout=0.0), attend(q, k, v))


def test_same_seed_same_output(backend: Backend, hp_dtype: str) -> None:
    q, k, v = small(backend, hp_dtype)
    a = attend(q, k, v, dropout=P, rng=backend.make_rng(7))
    b = attend(q, k, v, dropout=P, rng=backend.make_rng(7))
    c = attend(q, k, v, dropout=P, rng=backend.make_rng(8))
    assert_like(a, q, shape=(2, 2, 4, 3), dtype=backend.dtype(hp_dtype))
    assert_same(a, b)
    assert not np.array_equal(backend.to_numpy(a), backend.to_numpy(c)), "seed has no effect"
    plain = attend(q, k, v)
    assert not np.allclose(backend.to_numpy(a), backend.to_numpy(plain)), "no dropout applied"


def test_half_dtypes_same_seed(backend: Backend, float_dtype: str) -> None:
    q, k, v = small(backend, float_dtype)
    a, wa = attend(q, k, v, dropout=P, rng=backend.make_rng(1), return_weights=True)
    b, wb = attend(q, k, v, dropout=P, rng=backend.make_rng(1), return_weights=True)
    assert_like(a, q, shape=(2, 2, 4, 3), dtype=backend.dtype(float_dtype))
    assert_like(wa, q, shape=(2, 2, 4, 6), dtype=backend.dtype(float_dtype))
    assert_same(a, b)
    assert_same(wa, wb)


def test_stateful_generator_advances(backend: Backend) -> None:
    if backend.name == "jax":
        pytest.skip("jax keys are values, not stateful generators")
    q, k, v = small(backend, "float64")
    gen = backend.make_rng(5)
    a = attend(q, k, v, dropout=P, rng=gen)
    b = attend(q, k, v, dropout=P, rng=gen)
    assert not np.array_equal(backend.to_numpy(a), backend.to_numpy(b))


@requires_backend("jax")
def test_jax_legacy_prngkey() -> None:
    import jax

    q, k, v = small(BY_NAME["jax"], "float64")
    a = attend(q, k, v, dropout=P, rng=jax.random.PRNGKey(11))
    b = attend(q, k, v, dropout=P, rng=jax.random.PRNGKey(11))
    c = attend(q, k, v, dropout=P, rng=jax.random.PRNGKey(12))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@requires_backend("torch")
def test_torch_global_rng_when_none() -> None:
    import torch

    q, k, v = small(BY_NAME["torch"], "float64")
    torch.manual_seed(123)
    a = attend(q, k, v, dropout=P)
    torch.manual_seed(123)
    b = attend(q, k, v, dropout=P)
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_rng_none_without_seed_runs(backend: Backend) -> None:
    q, k, v = small(backend, "float64")
    if backend.name == "jax":  # jax has no global RNG: a key is required
        with pytest.raises(ValueError, match=r"`rng\b"):
            attend(q, k, v, dropout=P)
        return
    out = attend(q, k, v, dropout=P)
    assert_like(out, q, shape=(2, 2, 4, 3), dtype=backend.dtype("float64"))
    assert np.all(np.isfinite(backend.to_numpy(out)))


def test_dropped_weights_structure(backend: Backend, hp_dtype: str) -> None:
    """With v = identity, out is the dropped weight matrix: each entry is 0 or w / (1 - p),
    and the fraction of zeroed entries is about p. Weights returned are before dropout."""
    lq, lk, n = 8, 8, 16
    rng = rng_for("structure")
    qn, kn = randn(rng, (n, 2, lq, 4)), randn(rng, (n, 2, lk, 4))
    vn = np.broadcast_to(np.eye(lk), (n, 2, lk, lk)).copy()
    mask_np = rng.random((lq, lk)) < 0.8
    mask_np[3] = False  # an empty row stays exactly 0
    q, k, v = (backend.asarray(a, hp_dtype) for a in (qn, kn, vn))
    p = 0.4
    out, w, lse = attend(
        q,
        k,
        v,
        mask=backend.asarray(mask_np),
        dropout=p,
        rng=backend.make_rng(0),
        return_weights=True,
        return_lse=True,
    )
    _, ref_w, ref_lse = oracle.attention(*(backend.to_numpy(a) for a in (q, k, v)), mask=mask_np)
    # weights and lse: the no-dropout values
    assert_close(backend.to_numpy(w), ref_w, hp_dtype, what="weights")
    assert_close(backend.to_numpy(lse), ref_lse, hp_dtype, what="lse")

    dropped = backend.to_numpy(out)
    assert np.all(dropped[..., 3, :] == 0.0)
    live = ref_w > 0
    zero = dropped == 0.0
    kept = live & ~zero
    assert not np.any(dropped[~live]), "a masked position got weight after dropout"
    np.testing.assert_allclose(dropped[kept], ref_w[kept] / (1 - p), rtol=1e-4, atol=1e-6)
    frac = zero[live].mean()
    n_live = live.sum()
    assert abs(frac - p) < 6 * np.sqrt(p * (1 - p) / n_live) + 1e-3, (frac, n_live)


def test_mean_over_keys_approximates_no_dropout(backend: Backend) -> None:
    dtype = "float64"
    n_batch, n_keys, p = 256, 8, 0.5
    q, k, v = small(backend, dtype, lead=(n_batch,))
    ref_out, ref_w, _ = oracle.attention(*(backend.to_numpy(a)[0] for a in (q, k, v)))
    total = np.zeros_like(ref_out)
    for seed in range(n_keys):
        total += backend.to_numpy(attend(q, k, v, dropout=p, rng=backend.make_rng(seed))).sum(0)
    m = n_batch * n_keys
    mean = total / m
    vn = backend.to_numpy(v)[0]
    # std of one sample's out entry: sqrt(p/(1-p) * sum_j w_ij^2 v_jd^2)
    sigma = np.sqrt(p / (1 - p) * np.einsum("hqk,hkd->hqd", ref_w**2, vn**2) / m)
    err = np.abs(mean - ref_out)
    assert np.all(err <= 6 * sigma + 1e-9), (err.max(), sigma.max())


@requires_backend("jax")
def test_jax_dropout_under_jit_matches_eager() -> None:
    import jax

    q, k, v = small(BY_NAME["jax"], "float64")

    def f(q: Any, k: Any, v: Any, key: Any) -> Any:
        return attend(q, k, v, dropout=P, rng=key)

    key = jax.random.key(4)
    eager = np.asarray(f(q, k, v, key))
    jitted = np.asarray(jax.jit(f)(q, k, v, key))
    np.testing.assert_allclose(jitted, eager, rtol=1e-12, atol=1e-12)
    assert np.array_equal(jitted == 0, eager == 0)


@requires_backend("jax")
def test_jax_dropout_without_rng_is_value_error() -> None:
    q, k, v = small(BY_NAME["jax"], "float32")
    with pytest.raises(ValueError, match=r"`rng\b"):
        attend(q, k, v, dropout=0.1)


# --------------------------------------------------------------------------------------------
# mha.dropout: the same draws for a Transformer layer's other dropouts


def test_mha_dropout_keeps_and_scales(backend: Backend, hp_dtype: str) -> None:
    """Each entry is 0 or ``x / (1 - p)``, about ``p`` of them 0 (a binomial count over
    4000 entries: 5.4 standard deviations of slack), the same for the same seed, other
    draws for another; dtype, shape and framework kept."""
    from portable_attention import mha

    xn = rng_for("mha-dropout").uniform(1.0, 2.0, (40, 100))
    x = backend.asarray(xn, hp_dtype)
    a = mha.dropout(x, P, rng=backend.make_rng(5))
    assert_like(a, x, shape=(40, 100), dtype=backend.dtype(hp_dtype))
    got, want = backend.to_numpy(a).astype(np.float64), backend.to_numpy(x).astype(np.float64)
    kept = got != 0
    np.testing.assert_allclose(
        got[kept], want[kept] / (1 - P), rtol=1e-2 if hp_dtype != "float64" else 1e-12
    )
    assert abs((~kept).mean() - P) < 5.4 * np.sqrt(P * (1 - P) / kept.size)
    again = backend.to_numpy(mha.dropout(x, P, rng=backend.make_rng(5)))
    other = backend.to_numpy(mha.dropout(x, P, rng=backend.make_rng(6)))
    np.testing.assert_array_equal(backend.to_numpy(a), again)
    assert not np.array_equal(again, other)
    assert mha.dropout(x, 0.0) is x and mha.dropout(x, 0, rng=backend.make_rng(1)) is x


def test_mha_dropout_errors(backend: Backend) -> None:
    from portable_attention import mha

    x = backend.asarray(np.ones((2, 3)), "float32")
    with pytest.raises(TypeError, match="`rng`"):
        mha.dropout(x, P, rng=backend.wrong_rng())
    with pytest.raises(ValueError, match=r"`p` must be in \[0, 1\)"):
        mha.dropout(x, 1.0, rng=backend.make_rng(0))
    with pytest.raises(TypeError, match="`x` must have a real floating dtype"):
        mha.dropout(backend.asarray(np.ones(3, dtype=np.int32)), P, rng=backend.make_rng(0))


@requires_backend("jax")
def test_mha_dropout_under_jit_and_grad() -> None:
    """On JAX: a key is required, and the draw works under jit with the gradient of a
    kept entry ``1 / (1 - p)``, of a dropped one 0."""
    import jax
    import jax.numpy as jnp
    from portable_attention import mha

    x = jnp.ones((8, 16))
    with pytest.raises(ValueError, match="`rng=`"):
        mha.dropout(x, P)
    key = jax.random.key(0)
    out = jax.jit(lambda a, k: mha.dropout(a, P, rng=k))(x, key)
    grad = jax.grad(lambda a: jnp.sum(mha.dropout(a, P, rng=key)))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(out))  # x = 1: out is the grad
    assert set(np.unique(np.asarray(out)).round(5)) == {0.0, round(1 / (1 - P), 5)}


def test_chunked_blocks_draw_their_own_keep_masks(backend: Backend) -> None:
    """The chunked path draws a keep mask per block: the blocks' patterns must differ
    (JAX reused its key for every block: all 16 blocks alike). With q = 0 every weight is
    1/Lk and V = I, so the output is the keep mask itself, scaled."""
    lk = 8
    q = backend.asarray(np.zeros((1, 1, lk, 4)), "float32")
    k = backend.asarray(rng_for("chunk-keep").standard_normal((1, 1, lk, 4)), "float32")
    v = backend.asarray(np.eye(lk)[None, None], "float32")
    out = attend(q, k, v, dropout=0.5, rng=backend.make_rng(0), chunk_size=2)
    keep = backend.to_numpy(out)[0, 0] != 0
    np.testing.assert_allclose(backend.to_numpy(out)[0, 0][keep], 1 / lk / 0.5, rtol=1e-6)
    blocks = {
        keep[i : i + 2, j : j + 2].tobytes() for i in range(0, lk, 2) for j in range(0, lk, 2)
    }
    assert len(blocks) > 4, f"{len(blocks)} distinct keep patterns among 16 blocks"
