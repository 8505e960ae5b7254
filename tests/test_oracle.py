"""The oracle itself: hand-computed values, and agreement with torch's SDPA where both are
defined. If the oracle were wrong, every other test would be measuring against it."""

from __future__ import annotations

import math

import numpy as np
import pytest

import oracle
from helpers import randn, rng_for

T, F = True, False


def test_two_keys_by_hand() -> None:
    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[2.0, 0.0], [0.0, 4.0]])
    out, w, lse = oracle.attention(q, k, v, scale=1.0)
    e = math.e
    np.testing.assert_allclose(w, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-15)
    np.testing.assert_allclose(out, [[2 * e / (e + 1), 4 / (e + 1)]], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(e + 1)], rtol=1e-15)


def test_default_scale_softcap_and_bias_by_hand() -> None:
    q = np.array([[2.0, 2.0, 2.0, 2.0]])
    k = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    v = np.array([[1.0], [0.0]])
    # s = [8 / sqrt(4), 0] = [4, 0]; softcap 2: 2 tanh(s / 2); then + bias
    bias = np.array([0.5, -1.0])
    _, w, lse = oracle.attention(q, k, v, softcap=2.0, bias=bias)
    s = np.array([2 * math.tanh(2.0) + 0.5, 0.0 - 1.0])
    np.testing.assert_allclose(lse, [math.log(np.exp(s).sum())], rtol=1e-15)
    np.testing.assert_allclose(w[0], np.exp(s) / np.exp(s).sum(), rtol=1e-15)


def test_single_key_and_empty_rows() -> None:
    q = np.array([[1.0, 2.0], [3.0, 4.0]])
    k = np.array([[0.5, 0.5]])
    v = np.array([[7.0, -1.0, 3.0]])
    out, w, lse = oracle.attention(q, k, v, mask=np.array([[T], [F]]))
    np.testing.assert_array_equal(out, [[7.0, -1.0, 3.0], [0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(w, [[1.0], [0.0]])
    assert lse[0] == pytest.approx(1.5 / math.sqrt(2))
    assert lse[1] == -np.inf


def test_neginf_bias_row_is_empty() -> None:
    q, k, v = np.ones((2, 3)), np.ones((4, 3)), np.ones((4, 2))
    bias = np.zeros((2, 4))
    bias[1] = -np.inf
    bias[0, 2] = -np.inf
    out, w, lse = oracle.attention(q, k, v, bias=bias)
    np.testing.assert_array_equal(w, [[1 / 3, 1 / 3, 0, 1 / 3], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out[1], [0, 0])
    assert np.isneginf(lse[1])
    assert np.isfinite(lse[0])


@pytest.mark.parametrize(
    ("lq", "lk", "kwargs", "expected"),
    [
        (2, 4, {"causal": True}, [[T, T, T, F], [T, T, T, T]]),
        (2, 4, {"causal": "lower_right"}, [[T, T, T, F], [T, T, T, T]]),
        (2, 4, {"causal": "upper_left"}, [[T, F, F, F], [T, T, F, F]]),
        (3, 2, {"causal": True}, [[F, F], [T, F], [T, T]]),
        (3, 3, {"window": 0}, [[T, F, F], [F, T, F], [F, F, T]]),
        (2, 4, {"window": (1, 0)}, [[F, T, T, F], [F, F, T, T]]),
        (2, 4, {"window": (0, 1), "causal": "upper_left"}, [[T, F, F, F], [F, T, F, F]]),
        (2, 4, {"window": (None, 1), "causal": "upper_left"}, [[T, F, F, F], [T, T, F, F]]),
        (2, 4, {"window": (0, None)}, [[F, F, T, T], [F, F, F, T]]),
        (2, 4, {"window": (1, None), "causal": True}, [[F, T, T, F], [F, F, T, T]]),
    ],
)
def test_allowed_positions_by_hand(lq: int, lk: int, kwargs: dict, expected: list) -> None:
    np.testing.assert_array_equal(oracle.allowed_positions(lq, lk, **kwargs), expected)


def test_gqa_head_mapping() -> None:
    """Query head h reads KV head h // (Hq // Hk): with V constant per KV head, the output of
    each query head is that constant."""
    rng = rng_for("oracle-gqa")
    q, k = randn(rng, (6, 3, 2)), randn(rng, (2, 4, 2))
    v = np.stack([np.full((4, 1), 10.0), np.full((4, 1), 20.0)])
    out, _, _ = oracle.attention(q, k, v)
    np.testing.assert_allclose(out[:3], 10.0)
    np.testing.assert_allclose(out[3:], 20.0)


def test_agrees_with_torch_sdpa() -> None:
    torch = pytest.importorskip("torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rng = rng_for("oracle-sdpa")
    q, k, v = randn(rng, (2, 4, 5, 3)), randn(rng, (2, 2, 5, 3)), randn(rng, (2, 2, 5, 4))
    mask = rng.random((5, 5)) < 0.7
    np.fill_diagonal(mask, True)  # no empty rows: SDPA's behaviour there is not the contract
    bias = randn(rng, (2, 1, 5, 5))
    t = {n: torch.from_numpy(a) for n, a in {"q": q, "k": k, "v": v}.items()}
    for kwargs, torch_kwargs in (
        ({}, {}),
        ({"causal": True}, {"is_causal": True}),
        ({"scale": 0.3}, {"scale": 0.3}),
        ({"mask": mask}, {"attn_mask": torch.from_numpy(mask)}),
        ({"bias": bias}, {"attn_mask": torch.from_numpy(bias)}),
    ):
        ref = sdpa(t["q"], t["k"], t["v"], enable_gqa=True, **torch_kwargs).numpy()
        np.testing.assert_allclose(oracle.attention(q, k, v, **kwargs)[0], ref, rtol=1e-12)


def test_numerical_grad_of_a_quadratic() -> None:
    x = np.array([1.0, -2.0, 3.0])
    g = oracle.numerical_grad(lambda: float((x**2).sum()), x)
    np.testing.assert_allclose(g, 2 * np.array([1.0, -2.0, 3.0]), rtol=1e-8)
    np.testing.assert_array_equal(x, [1.0, -2.0, 3.0])
