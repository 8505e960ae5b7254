"""The blockwise training path: ``attend_backward`` on every backend, torch's
``autograd.Function`` and JAX's ``custom_vjp`` against finite differences of the float64
oracle, on every feature of the contract; dropout replay; what plan() says; errors.

Memory, speed and compile-time figures come from ``python -m portable_attention bench
--training``, never from tests; the tests check the structure those figures rest on
(nothing of the scores' size is saved for backward, the JAX program does not grow with L).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from portable_attention import Grads, attend, attend_backward, plan

import oracle
from conftest import TOLERANCES, Backend, requires_backend
from helpers import assert_close, assert_like, randn, rng_for, run_python

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


@dataclass(frozen=True)
class Case:
    """One call: shapes, options, and the block length (``chunk_size``) of the path."""

    id: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    chunk: int = 3
    mask: Any = None  # callable(rng) -> np bool array
    bias: Any = None  # callable(rng) -> np float array
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make(self) -> dict[str, Any]:
        rng = rng_for("blockwise", self.id)
        d = {n: randn(rng, getattr(self, n)) for n in "qkv"}
        d["mask"] = None if self.mask is None else self.mask(rng)
        d["bias"] = None if self.bias is None else self.bias(rng)
        d["w_out"] = randn(rng, (*self.q[:-1], self.v[-1]))
        d["w_lse"] = randn(rng, self.q[:-1])
        return d


def _mask_empty_rows(rng: np.random.Generator) -> np.ndarray:
    m = rng.random((7, 8)) < 0.6
    m[2] = False
    m[5] = False
    m[:, 0] |= ~m.any(axis=1)
    m[2] = m[5] = False  # two rows with no key
    return m


def _bias_full(rng: np.random.Generator) -> np.ndarray:
    b = randn(rng, (4, 5, 7))
    b[0, 1, 2] = -np.inf
    b[1, 3] = -np.inf  # a row with no key
    return b


def _bias_keys(rng: np.random.Generator) -> np.ndarray:
    return randn(rng, (1, 7))  # broadcast over heads and queries (an ALiBi-like row)


def _bias_rows(rng: np.random.Generator) -> np.ndarray:
    return randn(rng, (4, 5, 1))  # per head and query, broadcast over keys


CASES = [
    Case("plain", (1, 2, 5, 3), (1, 2, 7, 3), (1, 2, 7, 2)),
    Case("causal_lq_lt_lk", (1, 2, 5, 3), (1, 2, 8, 3), (1, 2, 8, 2), kwargs={"causal": True}),
    Case("causal_lq_gt_lk", (1, 2, 8, 3), (1, 2, 5, 3), (1, 2, 5, 2), kwargs={"causal": True}),
    Case(
        "causal_upper_left",
        (1, 2, 5, 3),
        (1, 2, 8, 3),
        (1, 2, 8, 2),
        chunk=2,
        kwargs={"causal": "upper_left"},
    ),
    Case("window", (1, 1, 9, 3), (1, 1, 9, 3), (1, 1, 9, 2), chunk=2, kwargs={"window": (2, 1)}),
    Case(
        "window_causal_upper_left",
        (2, 1, 7, 3),
        (2, 1, 9, 3),
        (2, 1, 9, 2),
        kwargs={"window": (3, None), "causal": "upper_left"},
    ),
    Case("gqa_causal", (1, 4, 7, 3), (1, 2, 7, 3), (1, 2, 7, 4), kwargs={"causal": True}),
    Case("mqa_window", (2, 3, 6, 3), (2, 1, 8, 3), (2, 1, 8, 2), chunk=4, kwargs={"window": 2}),
    Case("mask_empty_rows", (1, 2, 7, 3), (1, 2, 8, 3), (1, 2, 8, 2), mask=_mask_empty_rows),
    Case("bias_full_neginf", (1, 4, 5, 3), (1, 2, 7, 3), (1, 2, 7, 2), bias=_bias_full),
    Case(
        "bias_keys_causal",
        (1, 4, 5, 3),
        (1, 2, 7, 3),
        (1, 2, 7, 2),
        bias=_bias_keys,
        kwargs={"causal": True},
    ),
    Case("bias_rows_gqa", (1, 4, 5, 3), (1, 2, 7, 3), (1, 2, 7, 2), bias=_bias_rows),
    Case(
        "softcap_scale",
        (1, 2, 6, 3),
        (1, 2, 7, 3),
        (1, 2, 7, 2),
        chunk=4,
        kwargs={"softcap": 1.5, "scale": 0.8, "causal": True},
    ),
    Case(
        # A bias of the scores' own shape: each block's dbias is ds itself, before
        # softcap's derivative (which an in-place step must not write into it).
        "bias_softcap",
        (1, 2, 6, 3),
        (1, 2, 7, 3),
        (1, 2, 7, 2),
        bias=lambda rng: randn(rng, (1, 2, 6, 7)),
        kwargs={"softcap": 2.0, "causal": True},
    ),
    Case("two_d", (5, 3), (7, 3), (7, 4), chunk=2, kwargs={"window": (None, 1)}),
    Case("one_block", (1, 2, 5, 3), (1, 2, 7, 3), (1, 2, 7, 2), chunk=64),
]
BY_ID = {c.id: c for c in CASES}
EMPTY = ("causal_lq_gt_lk", "mask_empty_rows", "bias_full_neginf")
#: JAX compiles each case's scans (about 3 s): attend_backward, the custom_vjp's backward
#: scan, runs these there; test_jax_grad_matches_oracle runs every case through it.
JAX_BACKWARD = ("causal_lq_gt_lk", "mask_empty_rows", "bias_full_neginf", "bias_rows_gqa", "two_d")

_ORACLE: dict[str, dict[str, np.ndarray]] = {}


def oracle_grads(case: Case) -> dict[str, np.ndarray]:
    """Finite differences of the oracle's loss ``sum(out * w_out) + sum(lse * w_lse)``
    (``lse`` where finite); cached per case."""
    if case.id not in _ORACLE:
        d = case.make()
        _ORACLE[case.id] = oracle.loss_grads_with_bias(
            d["q"],
            d["k"],
            d["v"],
            d["w_out"],
            d["w_lse"],
            bias=d["bias"],
            mask=d["mask"],
            **case.kwargs,
        )
    return _ORACLE[case.id]


def oracle_forward(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = case.make()
    return oracle.attention(d["q"], d["k"], d["v"], mask=d["mask"], bias=d["bias"], **case.kwargs)


def check_grads(case: Case, got: dict[str, np.ndarray]) -> None:
    """Finite, within tolerance of the oracle, and exactly 0 for rows with no key."""
    want = oracle_grads(case)
    assert set(got) == set(want)
    for name, g in got.items():
        assert np.all(np.isfinite(g)), f"d{name} not finite"
        np.testing.assert_allclose(g, want[name], err_msg=f"d{name}", **GRAD_TOL)
    empty = np.isneginf(oracle_forward(case)[2])
    assert np.all(got["q"][empty] == 0.0), "dq not exactly 0 on rows with no key"


def test_cases_cover_the_contract() -> None:
    for name in EMPTY:
        assert np.isneginf(oracle_forward(BY_ID[name])[2]).any(), name
    for c in CASES:  # block lengths that do not divide L, except where one block holds all
        if c.id != "one_block":
            assert c.q[-2] % c.chunk or c.k[-2] % c.chunk, c.id


# ------------------------------------------------------------------------------------------
# attend_backward: every backend


def _backward_inputs(backend: Backend, case: Case) -> dict[str, Any]:
    d = case.make()
    arrays = {n: backend.asarray(d[n], "float64") for n in "qkv"}
    arrays["mask"] = None if d["mask"] is None else backend.asarray(d["mask"])
    arrays["bias"] = None if d["bias"] is None else backend.asarray(d["bias"], "float64")
    return arrays


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_attend_backward_matches_oracle(backend: Backend, case: Case) -> None:
    if backend.name == "jax" and case.id not in JAX_BACKWARD:
        pytest.skip("JAX: the same backward scan runs every case in test_jax_grad_matches_oracle")
    a = _backward_inputs(backend, case)
    q, k, v = a["q"], a["k"], a["v"]
    kw = {"mask": a["mask"], "bias": a["bias"], "chunk_size": case.chunk, **case.kwargs}
    out, lse = attend(q, k, v, return_lse=True, **kw)
    d = case.make()
    lse_np = backend.to_numpy(lse)
    dlse = np.where(np.isfinite(lse_np), d["w_lse"], 0.0)
    before = [backend.to_numpy(x).copy() for x in (q, k, v, out, lse)]
    grads = attend_backward(
        backend.asarray(d["w_out"], "float64"),
        q,
        k,
        v,
        out,
        lse,
        dlse=backend.asarray(dlse, "float64"),
        **kw,
    )
    assert isinstance(grads, Grads)
    for name, g, x in zip("qkv", grads[:3], (q, k, v), strict=True):
        assert_like(g, x, shape=tuple(x.shape), dtype=x.dtype, name=f"d{name}")
    got = {n: backend.to_numpy(g) for n, g in zip("qkv", grads[:3], strict=True)}
    if a["bias"] is None:
        assert grads.dbias is None
    else:
        assert_like(grads.dbias, a["bias"], shape=tuple(a["bias"].shape), dtype=a["bias"].dtype)
        got["bias"] = backend.to_numpy(grads.dbias)
    check_grads(case, got)
    for x, b in zip((q, k, v, out, lse), before, strict=True):  # inputs never modified
        np.testing.assert_array_equal(backend.to_numpy(x), b)


@pytest.mark.parametrize(("dk", "dv"), [(0, 3), (3, 0)])
def test_attend_backward_zero_head_dims(backend: Backend, dk: int, dv: int) -> None:
    """Dk = 0 (every score is 0: each query averages the values it may see) or Dv = 0,
    with as many query heads as key heads (one batched multiply-add per block on torch)
    and several blocks."""
    rng = rng_for("blockwise", "zero-dims", dk, dv)
    q_np, k_np = randn(rng, (1, 2, 6, dk)), randn(rng, (1, 2, 6, dk))
    v_np, dout_np = randn(rng, (1, 2, 6, dv)), randn(rng, (1, 2, 6, dv))
    q, k, v, dout = (backend.asarray(x, "float64") for x in (q_np, k_np, v_np, dout_np))
    out, lse = attend(q, k, v, causal=True, chunk_size=2, return_lse=True)
    g = attend_backward(dout, q, k, v, out, lse, causal=True, chunk_size=2)
    for grad, x in zip(g[:3], (q, k, v), strict=True):
        assert_like(grad, x, shape=tuple(x.shape), dtype=x.dtype)
    # Dk = 0: p is uniform over the keys j <= i; Dv = 0: dp = 0 = delta, so ds = 0.
    p = np.tril(np.ones((6, 6))) / np.arange(1, 7)[:, None]
    np.testing.assert_allclose(backend.to_numpy(g.dv), np.einsum("qk,bhqd->bhkd", p, dout_np))
    for grad in (g.dq, g.dk):
        np.testing.assert_array_equal(backend.to_numpy(grad), 0.0)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_nan_in_a_masked_key_stays_out(backend: Backend, softcap: float | None) -> None:
    """A NaN in a key that the mask hides (a cache's unwritten slot) changes nothing:
    with softcap, where the masked probabilities are zeroed after exp, as without."""
    rng = rng_for("blockwise", "nan-key")
    q_np, k_np, v_np = randn(rng, (1, 2, 4, 8)), randn(rng, (1, 2, 6, 8)), randn(rng, (1, 2, 6, 8))
    k_np[..., 5, :] = np.nan
    mask = np.ones((4, 6), dtype=bool)
    mask[:, 5] = False
    q, k, v = (backend.asarray(x, "float64") for x in (q_np, k_np, v_np))
    kw = {"softcap": softcap, "chunk_size": 4, "return_lse": True}
    out, lse = attend(q, k, v, mask=backend.asarray(mask), **kw)
    want_out, want_lse = attend(q, k[..., :5, :], v[..., :5, :], **kw)
    np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(want_out), rtol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(lse), backend.to_numpy(want_lse), rtol=1e-12)


@requires_backend("torch")
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_torch_func_transforms_of_attend_backward(softcap: float | None) -> None:
    """torch.func's vmap and jvp pass through attend_backward (its blocks then take the
    functional steps: their rules do not cover the in-place steps' `out=` buffers)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    douts = torch.randn(3, 1, 2, 7, 3, generator=gen, dtype=torch.float64)
    kw: dict[str, Any] = {"causal": True, "chunk_size": 3, "softcap": softcap}
    out, lse = attend(q, k, v, return_lse=True, **kw)

    def dk_of(dout: Any, q: Any = q) -> Any:
        return attend_backward(dout, q, k, v, out, lse, **kw).dk

    batched = torch.func.vmap(dk_of)(douts)
    torch.testing.assert_close(batched, torch.stack([dk_of(d) for d in douts]))
    tangent = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    _, jvp = torch.func.jvp(lambda x: dk_of(douts[0], x), (q,), (tangent,))
    eps = 1e-6
    fd = (dk_of(douts[0], q + eps * tangent) - dk_of(douts[0], q - eps * tangent)) / (2 * eps)
    torch.testing.assert_close(jvp, fd, rtol=1e-6, atol=1e-7)


@requires_backend("torch")
@pytest.mark.compile
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_torch_compile_of_attend_backward(softcap: float | None) -> None:
    """attend_backward compiles with ``fullgraph=True`` and gives the eager gradients, in
    float64: inductor fuses and reorders the backward's steps, so in float32 the two would
    round apart by an amount of the machine's (the table's float64 row holds on any)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    v, dout = (torch.randn(1, 2, 9, 2, generator=gen, dtype=torch.float64) for _ in range(2))
    kw: dict[str, Any] = {"causal": True, "chunk_size": 4, "softcap": softcap}
    out, lse = attend(q, k, v, return_lse=True, **kw)

    def grads(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any) -> Any:
        return attend_backward(dout, q, k, v, out, lse, **kw)[:3]

    compiled = torch.compile(grads, fullgraph=True)(q, k, v, out, lse, dout)
    rtol, atol = TOLERANCES["float64"]
    for got, want in zip(compiled, grads(q, k, v, out, lse, dout), strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_attend_backward_takes_out_and_lse_from_elsewhere(backend: Backend) -> None:
    """out and lse from the dense path (or from another shard's computation) serve as
    well as the blockwise path's; and the gradients of two K/V shards, each given the
    global out and lse, are the whole call's (dq summed): the decomposition sequence
    parallelism relies on."""
    case = BY_ID["causal_lq_lt_lk"]
    a = _backward_inputs(backend, case)
    q, k, v = a["q"], a["k"], a["v"]
    out, lse = attend(q, k, v, return_lse=True, implementation="portable", **case.kwargs)
    d = case.make()
    dout, dlse = backend.asarray(d["w_out"], "float64"), backend.asarray(d["w_lse"], "float64")
    whole = attend_backward(dout, q, k, v, out, lse, dlse=dlse, **case.kwargs)
    check_grads(case, {n: backend.to_numpy(g) for n, g in zip("qkv", whole[:3], strict=True)})
    # Two key shards [0, 4) and [4, 8) of the lower-right causal call (Lq=5, Lk=8): query i
    # sees keys j <= i + 3, so each shard is the window of its offset (as a ring step).
    q_np, k_np, v_np = d["q"], d["k"], d["v"]
    dq = np.zeros_like(q_np)
    for start, stop in ((0, 4), (4, 8)):
        keep = oracle.allowed_positions(5, 8, causal=True)[:, start:stop]
        ks, vs = (backend.asarray(x[..., start:stop, :], "float64") for x in (k_np, v_np))
        part = attend_backward(dout, q, ks, vs, out, lse, dlse=dlse, mask=backend.asarray(keep))
        dq += backend.to_numpy(part.dq)
        np.testing.assert_allclose(
            backend.to_numpy(part.dk), backend.to_numpy(whole.dk)[..., start:stop, :], **GRAD_TOL
        )
        np.testing.assert_allclose(
            backend.to_numpy(part.dv), backend.to_numpy(whole.dv)[..., start:stop, :], **GRAD_TOL
        )
    np.testing.assert_allclose(dq, backend.to_numpy(whole.dq), **GRAD_TOL)


@pytest.mark.parametrize(("lq", "lk"), [(0, 5), (4, 0), (0, 0)])
def test_attend_backward_without_queries_or_keys(backend: Backend, lq: int, lk: int) -> None:
    rng = rng_for("empty-backward", lq, lk)
    q = backend.asarray(randn(rng, (2, 2, lq, 3)), "float64")
    k = backend.asarray(randn(rng, (2, 1, lk, 3)), "float64")
    v = backend.asarray(randn(rng, (2, 1, lk, 4)), "float64")
    bias = backend.asarray(randn(rng, (lq, lk)), "float64")
    out, lse = attend(q, k, v, bias=bias, chunk_size=2, return_lse=True)
    dout = backend.asarray(randn(rng, (2, 2, lq, 4)), "float64")
    grads = attend_backward(dout, q, k, v, out, lse, bias=bias, chunk_size=2)
    for g, x in zip(grads[:4], (q, k, v, bias), strict=True):
        assert_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
        assert not np.any(backend.to_numpy(g))


def test_attend_backward_half_precision(backend: Backend, float_dtype: str) -> None:
    """16-bit inputs compute in float32 and return their own dtype; float32 lse accepted."""
    case = BY_ID["gqa_causal"]
    d = case.make()
    q, k, v = (backend.asarray(d[n], float_dtype) for n in "qkv")
    out, lse = attend(q, k, v, return_lse=True, chunk_size=3, **case.kwargs)
    dout = backend.asarray(d["w_out"], float_dtype)
    grads = attend_backward(dout, q, k, v, out, lse, chunk_size=3, **case.kwargs)
    for g, x in zip(grads[:3], (q, k, v), strict=True):
        assert_like(g, x, shape=tuple(x.shape), dtype=x.dtype)
    ref = oracle.loss_grads(
        *(backend.to_numpy(x) for x in (q, k, v)), backend.to_numpy(dout), **case.kwargs
    )
    # The oracle sees the very half values the backend holds; the gradients are computed in
    # float32 (a few products over Lk <= 8 keys: some 30 float32 roundings of the largest
    # term) and rounded once to the input dtype (eps / 2 of the largest gradient). So half
    # dtypes get 32 eps (64x that rounding: 3.1e-2 for float16, 0.25 for bfloat16), float32
    # and float64 at least 800 eps (1e-4, 1e-6).
    tol = {"float64": 1e-6, "float32": 1e-4, "float16": 3.1e-2, "bfloat16": 0.25}[float_dtype]
    for g, w in zip(grads[:3], ref, strict=True):
        np.testing.assert_allclose(backend.to_numpy(g), w, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------
# Dropout: each block's keep mask drawn again in backward


def _dropout_grads(backend: Backend, seed: int, chunk: int = 3) -> tuple[np.ndarray, ...]:
    case = BY_ID["gqa_causal"]
    d = case.make()
    q, k, v = (backend.asarray(d[n], "float64") for n in "qkv")
    kw = {"dropout": 0.4, "chunk_size": chunk, **case.kwargs}
    out, lse = attend(q, k, v, rng=backend.make_rng(seed), return_lse=True, **kw)
    dout = backend.asarray(d["w_out"], "float64")
    grads = attend_backward(dout, q, k, v, out, lse, rng=backend.make_rng(seed), **kw)
    return (backend.to_numpy(out), *(backend.to_numpy(g) for g in grads[:3]))


def test_dropout_replay_same_rng_same_gradients(backend: Backend) -> None:
    a, b, c = (_dropout_grads(backend, seed) for seed in (7, 7, 8))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(a[0], c[0]), "another rng drew the same keep masks"
    assert not np.allclose(a[1], c[1]), "another rng gave the same gradients"


def test_dropout_backward_is_the_forward_s_derivative(backend: Backend) -> None:
    """The forward with dropout is a function of (q, k, v) for a fixed rng state: the
    backward's dq, dk, dv match its central finite differences (NumPy float64)."""
    if backend.name != "numpy":
        pytest.skip("finite differences of the forward on NumPy stand for every backend")
    case = BY_ID["gqa_causal"]
    d = case.make()
    kw = {"dropout": 0.4, "chunk_size": 3, **case.kwargs}
    arrays = {n: d[n].copy() for n in "qkv"}

    def f() -> float:
        out = attend(arrays["q"], arrays["k"], arrays["v"], rng=np.random.default_rng(5), **kw)
        return float(np.sum(out * d["w_out"]))

    out, lse = attend(
        *(arrays[n] for n in "qkv"), rng=np.random.default_rng(5), return_lse=True, **kw
    )
    grads = attend_backward(
        d["w_out"], *(arrays[n] for n in "qkv"), out, lse, rng=np.random.default_rng(5), **kw
    )
    for name, g in zip("qkv", grads[:3], strict=True):
        np.testing.assert_allclose(g, oracle.numerical_grad(f, arrays[name]), **GRAD_TOL)


# ------------------------------------------------------------------------------------------
# torch: the autograd.Function


def _torch_case(case: Case, *, lse: bool = True, **extra: Any) -> dict[str, np.ndarray]:
    import torch

    d = case.make()
    q, k, v = (torch.tensor(d[n], requires_grad=True) for n in "qkv")
    bias = None if d["bias"] is None else torch.tensor(d["bias"], requires_grad=True)
    mask = None if d["mask"] is None else torch.tensor(d["mask"])
    kw = {"mask": mask, "bias": bias, "chunk_size": case.chunk, **case.kwargs, **extra}
    out, lse_t = attend(q, k, v, return_lse=True, **kw)
    loss = (out * torch.tensor(d["w_out"])).sum()
    if lse:
        loss = (
            loss + (torch.where(torch.isfinite(lse_t), lse_t, 0.0) * torch.tensor(d["w_lse"])).sum()
        )
    loss.backward()
    got = {n: t.grad.numpy() for n, t in zip("qkv", (q, k, v), strict=True)}
    if bias is not None:
        got["bias"] = bias.grad.numpy()
    return got


@requires_backend("torch")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_autograd_matches_oracle(case: Case) -> None:
    check_grads(case, _torch_case(case))


@requires_backend("torch")
def test_torch_saves_no_scores_for_backward() -> None:
    """What the blockwise path saves for backward is q, k, v, out and lse: no tensor of the
    scores' size (the dense path saves several)."""
    import torch

    lq = lk = 64
    q, k, v = (torch.randn(1, 2, lq, 8, requires_grad=True) for _ in range(3))
    saved: list[int] = []

    def pack(t: Any) -> Any:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attend(q, k, v, causal=True, softcap=5.0, chunk_size=16).sum().backward()
    assert saved and max(saved) <= 2 * lq * 8, saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attend(q, k, v, causal=True, softcap=5.0, implementation="portable").sum()
    assert max(saved) >= 2 * lq * lk  # the dense path: the contrast this test rests on


@requires_backend("torch")
@pytest.mark.parametrize(
    "name",
    ["causal_lq_gt_lk", "bias_full_neginf", "mask_empty_rows", "softcap_scale", "mqa_window"],
)
def test_torch_gradcheck(name: str) -> None:
    import torch

    case = BY_ID[name]
    d = case.make()
    inputs = [torch.tensor(d[n], requires_grad=True) for n in "qkv"]
    if d["bias"] is not None:
        inputs.append(torch.tensor(d["bias"], requires_grad=True))
    mask = None if d["mask"] is None else torch.tensor(d["mask"])

    def f(q: Any, k: Any, v: Any, bias: Any = None) -> Any:
        out, lse = attend(
            q, k, v, mask=mask, bias=bias, chunk_size=case.chunk, return_lse=True, **case.kwargs
        )
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-5, rtol=1e-4)


@requires_backend("torch")
def test_torch_double_backward() -> None:
    """A double backward differentiates the recorded blockwise backward (gradgradcheck)."""
    import torch

    case = BY_ID["softcap_scale"]
    d = case.make()
    inputs = tuple(torch.tensor(d[n], requires_grad=True) for n in "qkv")

    def f(q: Any, k: Any, v: Any) -> Any:
        return attend(q, k, v, chunk_size=case.chunk, **case.kwargs)

    assert torch.autograd.gradgradcheck(f, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@requires_backend("torch")
def test_torch_dropout_replay_and_gradcheck() -> None:
    import torch

    case = BY_ID["gqa_causal"]
    d = case.make()

    def grads(seed: int) -> list[np.ndarray]:
        q, k, v = (torch.tensor(d[n], requires_grad=True) for n in "qkv")
        out = attend(
            q,
            k,
            v,
            dropout=0.4,
            rng=torch.Generator().manual_seed(seed),
            chunk_size=3,
            **case.kwargs,
        )
        (out * torch.tensor(d["w_out"])).sum().backward()
        return [t.grad.numpy() for t in (q, k, v)]

    a, b, c = grads(1), grads(1), grads(2)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(a[0], c[0])
    inputs = tuple(torch.tensor(d[n], requires_grad=True) for n in "qkv")

    def f(q: Any, k: Any, v: Any) -> Any:  # a fresh generator: the same masks every call
        return attend(
            q, k, v, dropout=0.4, rng=torch.Generator().manual_seed(3), chunk_size=3, **case.kwargs
        )

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@requires_backend("torch")
def test_torch_autograd_agrees_with_attend_backward() -> None:
    """The Function's backward is attend_backward: the same numbers, dropout included."""
    import torch

    case = BY_ID["bias_keys_causal"]
    d = case.make()
    q, k, v = (torch.tensor(d[n], requires_grad=True) for n in "qkv")
    bias = torch.tensor(d["bias"], requires_grad=True)
    kw = {"bias": bias, "chunk_size": 2, "dropout": 0.3, **case.kwargs}
    out, lse = attend(q, k, v, rng=torch.Generator().manual_seed(4), return_lse=True, **kw)
    dout = torch.tensor(d["w_out"])
    out.backward(dout)
    with torch.no_grad():
        grads = attend_backward(dout, q, k, v, out, lse, rng=torch.Generator().manual_seed(4), **kw)
    for g, t in zip(grads[:4], (q, k, v, bias), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=0, atol=0)


@requires_backend("torch")
def test_torch_func_grad() -> None:
    """torch.func.grad passes the Function (it has setup_context): autograd's numbers."""
    import torch
    import torch.func

    case = BY_ID["softcap_scale"]
    d = case.make()
    k, v = torch.tensor(d["k"]), torch.tensor(d["v"])

    def f(q: Any) -> Any:
        return (
            attend(q, k, v, chunk_size=case.chunk, **case.kwargs) * torch.tensor(d["w_out"])
        ).sum()

    q = torch.tensor(d["q"], requires_grad=True)
    f(q).backward()
    torch.testing.assert_close(torch.func.grad(f)(torch.tensor(d["q"])), q.grad)


@requires_backend("torch")
@pytest.mark.parametrize(("lq", "lk"), [(0, 5), (4, 0)])
def test_torch_autograd_without_queries_or_keys(lq: int, lk: int) -> None:
    import torch

    q = torch.randn(1, 2, lq, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, lk, 3, dtype=torch.float64, requires_grad=True) for _ in "kv")
    attend(q, k, v, chunk_size=2).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


@requires_backend("torch")
def test_torch_float32_blockwise_grad() -> None:
    import torch

    case = BY_ID["softcap_scale"]
    d = case.make()
    q, k, v = (torch.tensor(d[n], dtype=torch.float32, requires_grad=True) for n in "qkv")
    out = attend(q, k, v, chunk_size=case.chunk, **case.kwargs)
    (out * torch.tensor(d["w_out"], dtype=torch.float32)).sum().backward()
    want = oracle.loss_grads(d["q"], d["k"], d["v"], d["w_out"], **case.kwargs)
    for t, w in zip((q, k, v), want, strict=True):
        assert t.grad.dtype == torch.float32
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-3, atol=1e-4)


@requires_backend("torch")
@pytest.mark.compile
def test_torch_compile_fullgraph_forward_and_backward() -> None:
    """The Function compiles with fullgraph=True, backward included: its forward and
    backward are custom operators, one node each in the graph whatever the number of
    blocks (traced, the blocks' loops took 47 s to compile at 36 block pairs)."""
    import torch

    case = BY_ID["bias_keys_causal"]
    d = case.make()

    def run(fn: Any) -> list[Any]:
        q, k, v = (torch.tensor(d[n], requires_grad=True) for n in "qkv")
        bias = torch.tensor(d["bias"], requires_grad=True)
        out = fn(q, k, v, bias)
        (out * torch.tensor(d["w_out"])).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad, bias.grad]

    def f(q: Any, k: Any, v: Any, bias: Any) -> Any:
        return attend(q, k, v, bias=bias, chunk_size=3, softcap=4.0, **case.kwargs)

    compiled = run(torch.compile(f, fullgraph=True))
    for a, b in zip(compiled, run(f), strict=True):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------
# JAX: the custom_vjp over lax.scan


def _jax_loss(case: Case, **extra: Any) -> tuple[Any, tuple[Any, ...]]:
    import jax.numpy as jnp

    d = case.make()
    mask = None if d["mask"] is None else jnp.asarray(d["mask"])
    w_out, w_lse = jnp.asarray(d["w_out"]), jnp.asarray(d["w_lse"])
    kw = {"mask": mask, "chunk_size": case.chunk, **case.kwargs, **extra}

    def loss(q: Any, k: Any, v: Any, bias: Any) -> Any:
        out, lse = attend(q, k, v, bias=bias, return_lse=True, **kw)
        return (out * w_out).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse).sum()

    bias = None if d["bias"] is None else jnp.asarray(d["bias"])
    return loss, (*(jnp.asarray(d[n]) for n in "qkv"), bias)


@requires_backend("jax")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_jax_grad_matches_oracle(case: Case) -> None:
    import jax

    loss, args = _jax_loss(case)
    argnums = (0, 1, 2, 3) if args[3] is not None else (0, 1, 2)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    names = ("q", "k", "v", "bias")[: len(grads)]
    check_grads(case, {n: np.asarray(g) for n, g in zip(names, grads, strict=True)})


@requires_backend("jax")
def test_jax_eager_grad_and_vmap() -> None:
    """Eager grad equals jitted; vmap over the batch of a grad equals per-example grads."""
    import jax
    import jax.numpy as jnp

    case = BY_ID["mqa_window"]  # batch 2
    d = case.make()
    q, k, v = (jnp.asarray(d[n]) for n in "qkv")
    kw = {"chunk_size": case.chunk, **case.kwargs}

    def loss(q: Any, k: Any, v: Any) -> Any:
        return (attend(q, k, v, **kw) * jnp.asarray(d["w_out"][0])).sum()

    eager = jax.grad(loss, argnums=(0, 1, 2))(q[0], k[0], v[0])
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[0], k[0], v[0])
    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    want = oracle.loss_grads(d["q"][0], d["k"][0], d["v"][0], d["w_out"][0], **case.kwargs)
    for e, j, b, w in zip(eager, jitted, batched, want, strict=True):
        np.testing.assert_allclose(np.asarray(e), np.asarray(j), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(np.asarray(b[0]), np.asarray(e), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(np.asarray(e), w, **GRAD_TOL)


@requires_backend("jax")
def test_jax_program_does_not_grow_with_length() -> None:
    """Forward and backward each loop over the blocks with one lax.scan: the jaxpr of
    grad has the same number of equations at L=32 and L=256 (compile time cannot grow
    with L; the figures are in the benchmark)."""
    import jax
    import jax.numpy as jnp

    def size(length: int) -> int:
        q = jnp.ones((1, 2, length, 8))

        def loss(q: Any) -> Any:
            return attend(q, q, q, causal=True, softcap=3.0, chunk_size=8).sum()

        return len(jax.make_jaxpr(jax.grad(loss))(q).eqns), len(
            str(jax.make_jaxpr(jax.grad(loss))(q))
        )

    small, large = size(32), size(256)
    assert small[0] == large[0]
    assert abs(small[1] - large[1]) < 0.02 * small[1]


@requires_backend("jax")
@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "window": (5, 0)},
        {"softcap": 4.0, "causal": True, "segment_ids": "packed"},
        {"causal": "upper_left", "bias": True},
        {"causal": True, "mask_mod": "band"},
        {"bias": True},
    ],
    ids=["causal-window", "softcap-segments", "upper-left-bias", "mask-mod", "bias"],
)
def test_one_kernel_two_loops(options: dict[str, Any]) -> None:
    """The blockwise kernel run on JAX arrays with the array-API loops (Python, static
    offsets, blocks cut to the axis) and with JAX's compiled ones (traced offsets, padded
    blocks) computes the same numbers: forward and backward in float64, with Lq and Lk
    not multiples of the block (rows with no key in the segments case). (JAX's loop leaves out the
    backward's folded columns: the products then round another way, within 1e-13.)"""
    import jax
    import jax.numpy as jnp
    from portable_attention import _blockwise, _blockwise_backward, _mods, _options, _spec
    from portable_attention._block_loop import BlockLoop
    from portable_attention.backends import jax as jax_backend

    jax.config.update("jax_enable_x64", True)
    rng = rng_for("one-kernel", str(sorted(options)))
    q, k, v = (jnp.asarray(randn(rng, (2, 2, length, 8))) for length in (37, 45, 45))
    kwargs = dict(options)
    if kwargs.pop("segment_ids", None):
        q_ids = jnp.asarray(np.repeat([0, 1, 2], [10, 20, 7])[None].repeat(2, 0))
        kv_ids = jnp.asarray(np.repeat([0, 2, 3], [15, 15, 15])[None].repeat(2, 0))
        kwargs["segment_ids"] = (q_ids, kv_ids)
    if kwargs.pop("bias", None):
        kwargs["bias"] = jnp.asarray(randn(rng, (2, 1, 37, 45)))
    if kwargs.pop("mask_mod", None):

        def band(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return abs(q_idx - kv_idx) < 9

        kwargs["mask_mod"] = band
    bias = kwargs.pop("bias", None)
    segment_ids = kwargs.pop("segment_ids", None)
    mask_mod = kwargs.pop("mask_mod", None)
    call = _spec.validate_call(
        q, k, v, _options.options(chunk_size=16, return_lse=True, **kwargs), bias=bias,
        segment_ids=segment_ids, mask_mod=mask_mod,
    )  # fmt: skip
    mods = _mods.prepare(call, segment_ids, None, mask_mod)
    dout = jnp.asarray(randn(rng, (2, 2, 37, 8)))
    results = []
    for loop in (BlockLoop(jnp), jax_backend.ScanLoop(jnp)):
        out, lse = _blockwise.forward(call, q, k, v, None, bias, mods=mods, loop=loop)
        grads = _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, None, bias, mods=mods, loop=loop
        )
        results.append((out, lse, *(g for g in grads if g is not None)))
    assert jnp.isneginf(results[0][1]).any() == ("segment_ids" in options)
    for static, traced in zip(*results, strict=True):
        np.testing.assert_allclose(np.asarray(traced), np.asarray(static), rtol=1e-13, atol=1e-13)


@requires_backend("jax")
def test_jax_gradient_of_the_gradient() -> None:
    """Reverse mode through the blockwise backward (a gradient of a gradient) equals the
    dense path's, float64, causal, Lq and Lk not multiples of the block, GQA."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rng = rng_for("blockwise", "grad-of-grad")
    q = jnp.asarray(randn(rng, (2, 4, 37, 8)))
    k, v = (jnp.asarray(randn(rng, (2, 2, 45, 8))) for _ in range(2))

    def twice(**options: Any) -> Any:
        def loss(q: Any) -> Any:
            return jnp.sum(jnp.sin(attend(q, k, v, causal=True, **options)))

        return jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)

    assert plan(q, k, v, causal=True, chunk_size=16).path == "portable:blockwise"
    np.testing.assert_allclose(
        np.asarray(twice(chunk_size=16)),
        np.asarray(twice(implementation="portable")),
        rtol=1e-12,
        atol=1e-12,
    )


@requires_backend("jax")
def test_jax_scans_under_shard_map_check_vma() -> None:
    """Inside shard_map (check_vma=True, the default) the scans' carries vary over the
    mesh axis as the inputs do: jit(grad) and attend_backward compile and run, and agree
    with the call on one device. A fresh interpreter: the host needs 2 devices."""
    code = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from portable_attention import attend, attend_backward
jax.config.update("jax_enable_x64", True)
mesh = jax.make_mesh((2,), ("b",))
spec = P("b")
x = jax.random.normal(jax.random.key(0), (4, 2, 2, 40, 8))
q, k, v, dout = x[0], x[1], x[2], x[3]
opts = dict(causal=True, softcap=3.0, chunk_size=16)
def loss(q, k, v):
    return (attend(q, k, v, **opts) * dout).sum()
grad = jax.grad(loss, argnums=(0, 1, 2))
def local(q, k, v, dout):
    out, lse = attend(q, k, v, return_lse=True, **opts)
    g = attend_backward(dout, q, k, v, out, lse, **opts)
    return (*g[:3],)
shard = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))
placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (q, k, v, dout)]
for a, b in zip(shard(*placed), grad(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
def local_grad(q, k, v, dout):
    f = lambda q, k, v: (attend(q, k, v, **opts) * dout).sum()
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)
graded = jax.jit(jax.shard_map(local_grad, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))
for a, b in zip(graded(*placed), grad(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)
print("ok")
"""
    assert run_python(code).strip().endswith("ok")


@requires_backend("jax")
def test_jax_saves_no_scores_for_backward() -> None:
    """The residuals of jax.vjp are q, k, v, out and lse (no array of the scores' size)."""
    import jax
    import jax.numpy as jnp

    lq = 64
    q = jnp.ones((1, 2, lq, 8))
    _, vjp = jax.vjp(lambda q: attend(q, q, q, causal=True, chunk_size=16), q)
    sizes = [x.size for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "size")]
    assert sizes and max(sizes) <= 2 * lq * 8, sizes


@requires_backend("jax")
def test_jax_dropout_replay() -> None:
    import jax
    import jax.numpy as jnp

    case = BY_ID["gqa_causal"]
    d = case.make()
    q, k, v = (jnp.asarray(d[n]) for n in "qkv")
    kw = {"dropout": 0.4, "chunk_size": 3, **case.kwargs}

    def loss(q: Any, k: Any, v: Any, key: Any) -> Any:
        return (attend(q, k, v, rng=key, **kw) * jnp.asarray(d["w_out"])).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    a, b, c = (grad(q, k, v, jax.random.key(s)) for s in (1, 1, 2))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.allclose(np.asarray(a[0]), np.asarray(c[0]))
    # jax.grad's backward is attend_backward's: the same keep masks from the same key
    key = jax.random.key(1)
    out, lse = attend(q, k, v, rng=key, return_lse=True, **kw)
    grads = attend_backward(jnp.asarray(d["w_out"]), q, k, v, out, lse, rng=key, **kw)
    for x, y in zip(a, grads[:3], strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=1e-13)
    # and it is the derivative of the forward with that key: a central difference along
    # a random direction of q
    direction = jnp.asarray(rng_for("jax-dropout-direction").standard_normal(q.shape))
    h = 1e-6
    numeric = (loss(q + h * direction, k, v, key) - loss(q - h * direction, k, v, key)) / (2 * h)
    np.testing.assert_allclose(float(numeric), float(jnp.sum(a[0] * direction)), rtol=1e-6)


@requires_backend("jax")
@pytest.mark.parametrize(("lq", "lk"), [(0, 5), (4, 0)])
def test_jax_grad_without_queries_or_keys(lq: int, lk: int) -> None:
    import jax
    import jax.numpy as jnp

    q, k, v = jnp.ones((1, 2, lq, 3)), jnp.ones((1, 2, lk, 3)), jnp.ones((1, 2, lk, 3))
    grads = jax.grad(lambda q, k, v: attend(q, k, v, chunk_size=2).sum(), argnums=(0, 1, 2))(
        q, k, v
    )
    for g, x in zip(grads[:3], (q, k, v), strict=True):
        assert g.shape == x.shape and not np.asarray(g).any()


# ------------------------------------------------------------------------------------------
# plan(): auto takes the blockwise path where autodiff would save large probabilities


@requires_backend("torch")
def test_torch_auto_plans() -> None:
    import torch

    q = torch.zeros(1, 8, 1024, 64)
    # SDPA has no softcap; float64, which FlexAttention's CPU kernel does not take
    # (float32 there: test_flex.py)
    wide = q.double()
    p = plan(wide, wide, wide, causal=True, softcap=30.0)
    assert p.path == "portable:blockwise"
    assert "save" in p.reason and "MiB" in p.reason
    assert plan(q, q, q, causal=True).path == "fused:torch"  # SDPA keeps what it covers
    small = torch.zeros(1, 8, 128, 64)
    assert plan(small, small, small, softcap=30.0).path == "portable:dense"
    assert plan(q, q, q, softcap=30.0, return_weights=True).path == "portable:dense"


@requires_backend("jax")
def test_jax_auto_plans() -> None:
    import jax.numpy as jnp

    q = jnp.zeros((1, 8, 1024, 64), jnp.float32)
    p = plan(q, q, q, causal=True)
    assert p.path == "portable:blockwise", p
    assert "save" in p.reason
    mid = jnp.zeros((1, 8, 512, 64), jnp.float32)
    assert plan(mid, mid, mid, causal=True).path == "tuned:jax"


@requires_backend("numpy")
def test_numpy_blockwise_buffers_are_not_the_results() -> None:
    """NumPy's in-place steps keep their product buffers from call to call, one set per
    thread: no result shares memory with them (an earlier call's output, lse and
    gradients, ``dbias`` of a bias of the block's whole shape included, stay as they were
    after later calls, in one block where a leaked buffer would be the last one written),
    and two threads get buffers of their own."""
    from portable_attention.backends.numpy_math import InPlaceMath

    options: dict[str, Any] = {"implementation": "portable", "chunk_size": 16}

    def run(seed: int) -> list[np.ndarray]:
        rng = rng_for("buffers", seed)
        q, k, v = (randn(rng, (1, 2, 16, 8)).astype(np.float32) for _ in range(3))
        bias = randn(rng, (1, 2, 16, 16)).astype(np.float32)
        out, lse = attend(q, k, v, bias=bias, return_lse=True, **options)
        grads = attend_backward(np.ones_like(out), q, k, v, out, lse, bias=bias, chunk_size=16)
        return [out, lse, grads.dq, grads.dk, grads.dv, grads.dbias]

    first = run(0)
    kept = [x.copy() for x in first]
    run(1)
    for got, before in zip(first, kept, strict=True):
        np.testing.assert_array_equal(got, before)

    a, b = np.ones((2, 8, 4), np.float32), np.ones((2, 4, 8), np.float32)
    here = InPlaceMath(np).product(a, b, slot="scores")
    assert np.shares_memory(here, InPlaceMath(np).product(a, b, slot="scores"))  # kept
    there: list[np.ndarray] = []
    thread = threading.Thread(
        target=lambda: there.append(InPlaceMath(np).product(a, b, slot="scores"))
    )
    thread.start()
    thread.join()
    assert not np.shares_memory(here, there[0])


def _out_math(name: str) -> tuple[Any, Any, Any, Any]:
    """The adapter's in-place steps for ``name`` (NumPy's or torch's ``OutMath``), with
    converters to and from its arrays and a same-memory test."""
    import array_api_compat

    if name == "numpy":
        from portable_attention.backends.numpy import ADAPTER

        xp = array_api_compat.array_namespace(np.zeros(1))
        return ADAPTER.block_math(xp, ()), np.asarray, np.asarray, np.shares_memory
    import torch
    from portable_attention.backends.torch import ADAPTER as TORCH

    xp = array_api_compat.array_namespace(torch.zeros(1))
    same = lambda a, b: a.data_ptr() == b.data_ptr()  # noqa: E731
    return TORCH.block_math(xp, ()), torch.from_numpy, lambda t: t.numpy(), same


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=requires_backend(n)) for n in ("numpy", "torch")]
)
def test_in_place_steps_match_the_formulas(name: str) -> None:
    """The in-place steps (``_block_math.OutMath``, written once for NumPy and torch) give
    each step's float64 formula, write into their first argument where the result keeps
    its shape and dtype, and leave it as it was where the other operand would broadcast
    it larger or promote it (the functional form: a wider result). Bound: one or two
    float32 roundings of values of order 1 per step (a 4-term product for matmul_add),
    within rtol 1e-5."""
    math, to, back, same = _out_math(name)
    assert type(math).__name__ == "InPlaceMath"
    assert math.base2  # float32 exponentials in base 2: faster on both (their docstrings)
    rng = rng_for("out-math", name)

    def block(*shape: int, dtype: Any = np.float32) -> np.ndarray:
        return randn(rng, shape).astype(dtype)

    s, row, t, a, b = block(2, 3, 4), block(2, 3, 1), block(2, 3, 4), block(2, 3, 4), block(2, 4, 4)
    t = np.tanh(t)
    allow = rng.random((3, 4)) < 0.5
    wide, wider = block(2, 2, 3, 4), block(2, 3, 4, dtype=np.float64)
    nan = s.copy()
    nan[~np.broadcast_to(allow, s.shape)] = np.nan
    f64 = [x.astype(np.float64) for x in (s, row, t, a, b)]
    s64, row64, t64, a64, b64 = f64
    cases: list[tuple[str, Any, tuple[Any, ...], dict[str, Any], Any, bool | None]] = [
        ("tanh", s, (), {}, np.tanh(s64), True),
        ("scaled", s, (0.5,), {}, 0.5 * s64, True),
        ("exp", s, (), {}, np.exp(s64), True),
        ("exp", s, (), {"base2": True}, 2.0**s64, True),
        ("exp_shifted", s, (row,), {}, np.exp(s64 - row64), True),
        ("masked", s, (allow,), {}, np.where(allow, s64, -np.inf), True),
        ("zeroed", nan, (allow,), {}, np.where(allow, s64, 0.0), True),
        ("add", s, (a,), {}, s64 + a64, True),
        ("mul", s, (row,), {}, s64 * row64, True),
        ("divided", s, (row,), {}, s64 / row64, True),
        ("softcap_grad", s, (t,), {}, s64 * (1.0 - t64 * t64), True),
        ("matmul_add", s, (a, b), {}, s64 + a64 @ b64, True),
        # (a t that broadcasts: either form, t never written past its shape)
        ("softcap_grad", s, (np.tanh(row),), {}, s64 * (1.0 - np.tanh(row64) ** 2), None),
        ("mul", s, (wide,), {}, s64 * wide.astype(np.float64), False),
        ("add", s, (wider,), {}, s64 + wider, False),
        ("divided", s, (wider,), {}, s64 / wider, False),
    ]
    for step, first, args, kwargs, want, in_place in cases:
        x = to(first.copy())
        before = back(x).copy()
        got = getattr(math, step)(
            x, *(to(y.copy()) if isinstance(y, np.ndarray) else y for y in args), **kwargs
        )
        np.testing.assert_allclose(
            back(got).astype(np.float64), want, rtol=1e-5, atol=1e-6, err_msg=step
        )
        if in_place is None:
            continue
        assert same(got, x) == in_place, (step, in_place)
        if not in_place:
            dtype = np.result_type(first, *(y for y in args if isinstance(y, np.ndarray)))
            assert tuple(got.shape) == want.shape and back(got).dtype == dtype, step
            np.testing.assert_array_equal(back(x), before, err_msg=step)
    got = math.matmul_add(None, to(a.copy()), to(b.copy()), slot="acc")
    np.testing.assert_allclose(back(got).astype(np.float64), a64 @ b64, rtol=1e-5, atol=1e-6)


@requires_backend("numpy")
def test_numpy_score_mod_with_large_scores_warns_of_nothing() -> None:
    """A ``score_mod`` on NumPy's blockwise path with scores whose ``exp`` overflows:
    the oracle's result and no NumPy warning (the first try without the max, which would
    overflow, is not taken with a score_mod)."""
    import warnings

    rng = rng_for("score_mod overflow")
    q, k, v = (randn(rng, (1, 2, 40, 8)).astype(np.float32) for _ in range(3))
    q = q * np.float32(40.0)  # scores up to about 100: exp overflows float32

    def shift(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s + np.float32(0.01) * (i - j).astype(np.float32)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attend(q, k, v, score_mod=shift, implementation="portable", chunk_size=16)
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]
    ref, _, _ = oracle.attention(q, k, v, bias=0.01 * (i - j))
    assert_close(out.astype(np.float64), ref, "float32")


@requires_backend("torch")
def test_torch_func_vmap_of_a_score_mod_call_in_grad_mode() -> None:
    """torch.func.vmap over a blockwise ``score_mod`` call with grad mode on (the
    checkpointed forward runs the blocks itself): the per-example results."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))

    def shift(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s + 0.01 * (i - j)

    def f(q: Any) -> Any:
        kw: dict[str, Any] = {"implementation": "portable", "chunk_size": 16, "causal": True}
        return attend(q, k[0], v[0], score_mod=shift, **kw)

    torch.testing.assert_close(torch.func.vmap(f)(q), torch.stack([f(x) for x in q]))


@requires_backend("torch")
@pytest.mark.parametrize("case", ["plain", "softcap_gqa", "segments", "score_mod"])
def test_torch_func_vmap_and_grad_of_the_blockwise_path(case: str) -> None:
    """torch.func.vmap over a blockwise call (its Function's vmap rule: both passes as
    torch operations on the batched tensors), torch.func.grad of one (a score_mod's
    included: no checkpoint, whose saved-tensor hooks torch.func refuses), and vmap of
    grad, each example against the float64 oracle (values) and its finite differences
    (gradients)."""
    import torch

    rng = rng_for("blockwise", "torch-func", case)
    heads_kv = 1 if case == "softcap_gqa" else 2
    q = randn(rng, (3, 2, 12, 4))
    k, v = randn(rng, (3, heads_kv, 12, 4)), randn(rng, (3, heads_kv, 12, 3))
    w_out = randn(rng, (3, 2, 12, 3))
    options: dict[str, Any] = {"causal": True, "chunk_size": 4}
    if case == "softcap_gqa":
        options["softcap"] = 2.0
    if case == "segments":
        options["segment_ids"] = np.repeat(np.arange(3), [5, 4, 3])
    if case == "score_mod":
        options["score_mod"] = lambda s, b, h, i, j: s - abs(i - j) * 0.125  # (exact)

    def ours(options: dict[str, Any]) -> dict[str, Any]:
        ids = options.get("segment_ids")
        return options if ids is None else {**options, "segment_ids": torch.tensor(ids)}

    def loss(q: Any, k: Any, v: Any, w: Any) -> Any:
        return (attend(q, k, v, **ours(options)) * w).sum()

    tq, tk, tv, tw = (torch.tensor(a) for a in (q, k, v, w_out))
    out = torch.func.vmap(lambda q, k, v: attend(q, k, v, **ours(options)))(tq, tk, tv)
    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(tq, tk, tv, tw)
    one = torch.func.grad(loss, argnums=(0, 1, 2))(tq[0], tk[0], tv[0], tw[0])
    ref_options = {key: value for key, value in options.items() if key != "chunk_size"}
    for b in range(3):
        ref = oracle.attention(q[b], k[b], v[b], **ref_options)
        assert_close(out[b].numpy(), ref[0], "float64")
        want = oracle.loss_grads(q[b], k[b], v[b], w_out[b], **ref_options)
        # Central differences of step 1e-6 in float64: error about 1e-10 at these sizes.
        for name, got, w in zip("qkv", grads, want, strict=True):
            np.testing.assert_allclose(got[b].numpy(), w, rtol=1e-6, atol=1e-7, err_msg=name)
            if b == 0:
                single = one["qkv".index(name)].numpy()
                np.testing.assert_allclose(single, w, rtol=1e-6, atol=1e-7, err_msg=name)


@requires_backend("torch")
@pytest.mark.parametrize("batched", ["segment_ids", "k", "mask", "bias", "mod_capture"])
def test_torch_func_vmap_over_one_operand(batched: str) -> None:
    """torch.func.vmap over one operand alone (the others closed over, unbatched): the
    segment ids, k, a mask or bias next to unbatched ids, a tensor a score_mod captures.
    Each example against the float64 oracle."""
    import torch

    rng = rng_for("blockwise", "torch-vmap-one", batched)
    q, k, v = randn(rng, (2, 12, 4)), randn(rng, (2, 12, 4)), randn(rng, (2, 12, 3))
    ids = np.stack([np.repeat([0, 1], [5, 7]), np.repeat([0, 1], [3, 9]), np.zeros(12, int)])
    masks = rng.random((3, 12, 12)) < 0.7
    masks[..., 0] = True
    stacks = {
        "segment_ids": ids,
        "k": randn(rng, (3, 2, 12, 4)),
        "mask": masks,
        "bias": randn(rng, (3, 12, 12)),
        "mod_capture": rng.random((3, 2)),
    }
    stack = stacks[batched]

    def options(x: Any, lib: Any) -> dict[str, Any]:
        """The call's options for one example ``x`` of the batched operand."""
        kw: dict[str, Any] = {"causal": True}
        if batched in ("segment_ids", "mask", "bias"):
            kw[batched] = x
        if batched != "segment_ids":
            kw["segment_ids"] = lib.asarray(ids[0])
        if batched == "mod_capture":
            kw["score_mod"] = lambda s, b, h, i, j: s - x[h] * abs(i - j)
        return kw

    def ours(x: Any) -> Any:
        kk = x if batched == "k" else torch.tensor(k)
        return attend(torch.tensor(q), kk, torch.tensor(v), chunk_size=4, **options(x, torch))

    got = torch.func.vmap(ours)(torch.tensor(stack))
    for b in range(3):
        kk = stack[b] if batched == "k" else k
        ref = oracle.attention(q, kk, v, **options(stack[b], np))
        assert_close(got[b].numpy(), ref[0], "float64", what=f"out[{b}]")


@requires_backend("torch")
def test_torch_func_grad_and_jvp_of_the_blockwise_path() -> None:
    """torch.func.grad with respect to a tensor a score_mod captures (learned ALiBi
    slopes; q, k, v plain), and torch.func.jvp of a blockwise call (the Function has no
    jvp rule: its blocks run as torch operations): against finite differences of the
    float64 oracle."""
    import torch

    rng = rng_for("blockwise", "torch-func-grad-jvp")
    q, k, v = randn(rng, (2, 12, 4)), randn(rng, (2, 12, 4)), randn(rng, (2, 12, 3))
    w_out, slopes, tangent = randn(rng, (2, 12, 3)), rng.random(2), randn(rng, (2, 12, 4))

    def alibi(x: Any) -> Any:
        return lambda s, b, h, i, j: s - x[h] * abs(i - j)

    def loss(x: Any) -> Any:
        out = attend(*map(torch.tensor, (q, k, v)), chunk_size=4, score_mod=alibi(x))
        return (out * torch.tensor(w_out)).sum()

    got = torch.func.grad(loss)(torch.tensor(slopes)).numpy()

    def ref_loss() -> float:
        return float((oracle.attention(q, k, v, score_mod=alibi(slopes))[0] * w_out).sum())

    want = oracle.numerical_grad(ref_loss, slopes)
    # Central differences of step 1e-6 in float64: error about 1e-10 at these sizes.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    def forward(x: Any) -> Any:
        return attend(x, *map(torch.tensor, (k, v)), causal=True, chunk_size=4)

    _, jvp = torch.func.jvp(forward, (torch.tensor(q),), (torch.tensor(tangent),))
    h = 1e-6
    plus, minus = (oracle.attention(q + e * tangent, k, v, causal=True)[0] for e in (h, -h))
    np.testing.assert_allclose(jvp.numpy(), (plus - minus) / (2 * h), rtol=1e-6, atol=1e-7)


@requires_backend("torch")
def test_torch_hessian_and_forward_ad_of_a_mod_capture() -> None:
    """Forward mode that the Function cannot see: torch.func.hessian (a jvp around a
    grad, whose wrapped q shows no tangent), and forward AD under no_grad whose tangent
    only a score_mod's captured slopes carry; against the float64 oracle's differences."""
    import torch
    from torch.autograd import forward_ad

    rng = rng_for("blockwise", "torch-hessian")
    q, k, v = randn(rng, (1, 4, 2)), randn(rng, (1, 6, 2)), randn(rng, (1, 6, 2))
    kt, vt = torch.tensor(k), torch.tensor(v)

    def loss(x: Any) -> Any:
        return (attend(x, kt, vt, causal=True, chunk_size=2) ** 2).sum()

    got = torch.func.hessian(loss)(torch.tensor(q)).numpy().reshape(q.size, q.size)

    def ref(x: np.ndarray) -> float:
        return float((oracle.attention(x, k, v, causal=True)[0] ** 2).sum())

    h, eye = 1e-4, np.eye(q.size).reshape(q.size, *q.shape)
    want = np.array([
        [
            (ref(q + h * a + h * b) - ref(q + h * a - h * b) - ref(q - h * a + h * b)
             + ref(q - h * a - h * b)) / (4 * h * h)
            for b in eye
        ]
        for a in eye
    ])  # fmt: skip
    # A 4-point stencil of step 1e-4 in float64: error about 1e-7 (h^2 and eps / h^2).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    slopes, direction = rng.random(2), randn(rng, (2,))
    q2, k2, v2 = (randn(rng, (2, 8, 3)) for _ in range(3))

    def alibi(x: Any) -> Any:
        return lambda s, b, hd, i, j: s - x[hd] * abs(i - j)

    with torch.no_grad(), forward_ad.dual_level():
        x = forward_ad.make_dual(torch.tensor(slopes), torch.tensor(direction))
        tq, tk, tv = map(torch.tensor, (q2, k2, v2))
        out = attend(tq, tk, tv, causal=True, chunk_size=4, score_mod=alibi(x))
        tangent = forward_ad.unpack_dual(out).tangent
    assert tangent is not None
    e = 1e-6
    plus, minus = (
        oracle.attention(q2, k2, v2, causal=True, score_mod=alibi(slopes + d * direction))[0]
        for d in (e, -e)
    )
    np.testing.assert_allclose(tangent.numpy(), (plus - minus) / (2 * e), rtol=1e-6, atol=1e-7)


@requires_backend("numpy")
def test_a_mask_mod_that_calls_attend() -> None:
    """A mask_mod that calls attend itself (on the same thread, between the outer call's
    products): the outer result is that of the same mod without the inner call (the
    forward's sums must not sit in a buffer the inner call writes)."""
    rng = rng_for("blockwise", "nested-mask-mod")
    q, k, v = (randn(rng, (1, 2, 64, 8)).astype(np.float32) for _ in range(3))
    small = [randn(rng, (1, 2, 16, 8)).astype(np.float32) for _ in range(3)]

    def nested(b: Any, h: Any, i: Any, j: Any) -> Any:
        attend(*small, chunk_size=4)
        return j <= i

    got = attend(q, k, v, mask_mod=nested, chunk_size=16)
    want = attend(q, k, v, mask_mod=lambda b, h, i, j: j <= i, chunk_size=16)
    np.testing.assert_array_equal(got, want)
    ref = oracle.attention(q, k, v, causal=True)
    assert_close(got.astype(np.float64), ref[0], "float32")


def test_key_runs_of_the_grid() -> None:
    """``_block_grid.merged``: runs of up to ``blocks`` consecutive key blocks that the
    band keeps whole become one step; a block the band cuts stays alone; without a band
    every pair is whole."""
    from portable_attention import _block_grid, _options, _spec
    from portable_attention._block_loop import BlockLoop

    q = np.zeros((1, 1, 256, 4))

    def grid(**options: Any) -> list[list[Any]]:
        call = _spec.validate_call(q, q, q, _options.options(chunk_size=64, **options))
        run = _block_grid.prepared(call, BlockLoop(np), q, q, q, None, None, None)
        table = _block_grid.partners(_block_grid.pairs(call, 64), run.nq, by_keys=False)
        return _block_grid.merged(call, run, table, 2)

    assert grid(causal=True) == [[0], [(0, 1), 1], [(0, 2), 2], [(0, 2), (2, 3), 3]]
    assert grid() == [[(0, 2), (2, 4)]] * 4
    assert grid(causal="upper_left", window=(64, None)) == [[0], [0, 1], [1, 2], [2, 3]]


@requires_backend("numpy")
@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"causal": "upper_left"}, {"mask": True}, {"bias": True}],
    ids=["plain", "causal", "upper_left", "mask", "bias"],
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_key_runs_match_oracle(
    options: dict[str, Any], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NumPy's ``auto`` forward in runs of key blocks (blocks of 64, runs of up to 2:
    budgets made small) matches the float64 oracle, Lq < Lk and neither a multiple of the
    block; the runs did form. float32 takes the base-2 exponentials (except with the bias)."""
    from portable_attention import _block_grid, _blockwise, _core
    from portable_attention.backends import numpy as numpy_backend

    monkeypatch.setattr(_core, "CHUNK_BUDGET", 64 * 64 * 4)
    monkeypatch.setattr(numpy_backend, "SPAN_SCORES", 64 * 128 * 4)
    made: list[list[list[Any]]] = []
    merged = _block_grid.merged

    def spy(*args: Any) -> list[list[Any]]:
        made.append(merged(*args))
        return made[-1]

    monkeypatch.setattr(_blockwise, "merged", spy)
    rng = rng_for("key-runs", dtype, str(sorted(options)))
    q = randn(rng, (2, 2, 150, 8)).astype(dtype)
    k, v = (randn(rng, (2, 2, 230, 8)).astype(dtype) for _ in range(2))
    kwargs = dict(options)
    if kwargs.get("mask"):
        kwargs["mask"] = rng.random((150, 230)) < 0.7
    if kwargs.get("bias"):
        kwargs["bias"] = randn(rng, (2, 1, 150, 230)).astype(dtype)
    assert plan(q, k, v, **kwargs).path == "portable:blockwise"
    out, lse = attend(q, k, v, return_lse=True, **kwargs)
    ref_out, _, ref_lse = oracle.attention(*(x.astype(np.float64) for x in (q, k, v)), **kwargs)
    assert_close(out.astype(np.float64), ref_out, dtype)
    assert_close(lse.astype(np.float64), ref_lse, dtype, what="lse")
    assert any(isinstance(step, tuple) and step[1] - step[0] > 1 for r in made[-1] for step in r)


def test_query_block_whose_key_blocks_are_all_skipped(backend: Backend) -> None:
    """Segment ids that leave the first query blocks no key: every key block is skipped
    there (eager loops read it on the host), and those rows get 0 and lse -inf, the
    others the oracle's, float64."""
    rng = rng_for("all-skipped")
    q, k, v = (randn(rng, (1, 2, 96, 8)) for _ in range(3))
    q_ids = np.repeat([7, 0, 1], [40, 30, 26])
    kv_ids = np.repeat([0, 1], [50, 46])
    ids = (backend.asarray(q_ids[None], "int64"), backend.asarray(kv_ids[None], "int64"))
    args = [backend.asarray(x, "float64") for x in (q, k, v)]
    out, lse = attend(*args, segment_ids=ids, chunk_size=16, return_lse=True)
    out, lse = backend.to_numpy(out), backend.to_numpy(lse)
    assert np.all(out[..., :40, :] == 0) and np.all(np.isneginf(lse[..., :40]))
    ref_out, _, ref_lse = oracle.attention(q, k, v, segment_ids=(q_ids[None], kv_ids[None]))
    assert_close(out, ref_out, "float64")
    assert_close(lse[..., 40:], ref_lse[..., 40:], "float64", what="lse")


# ------------------------------------------------------------------------------------------
# Errors


def test_attend_backward_errors(backend: Backend) -> None:
    rng = rng_for("backward-errors")
    q, k, v = (backend.asarray(randn(rng, (1, 2, 4, 3)), "float64") for _ in range(3))
    out, lse = attend(q, k, v, return_lse=True)
    dout = backend.asarray(randn(rng, (1, 2, 4, 3)), "float64")
    with pytest.raises(ValueError, match=r"`dout` must have the output's shape"):
        attend_backward(dout[..., :2, :], q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"`out` must have"):
        attend_backward(dout, q, k, v, out[..., :2], lse)
    with pytest.raises(ValueError, match=r"`lse` must have lse's shape"):
        attend_backward(dout, q, k, v, out, out)
    with pytest.raises(ValueError, match=r"`dlse`"):
        attend_backward(dout, q, k, v, out, lse, dlse=out)
    with pytest.raises(TypeError, match=r"`dout`"):
        attend_backward(backend.asarray(np.ones((1, 2, 4, 3), dtype=np.int64)), q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"`dout`"):
        attend_backward(
            np.ones((1, 2, 4, 3)) if backend.name != "numpy" else [1.0], q, k, v, out, lse
        )
    with pytest.raises(ValueError, match=r"`causal`"):
        attend_backward(dout, q, k, v, out, lse, causal="left")
    with pytest.raises(TypeError, match=r"`rng`"):
        attend_backward(dout, q, k, v, out, lse, dropout=0.1, rng=backend.wrong_rng())
