"""Gradients (torch autograd, jax.grad) against finite differences of the float64 oracle,
and jax transformations (jit, vmap, grad). Rows with no key must give finite, zero gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from portable_attention import attend

import oracle
from conftest import requires_backend
from helpers import assert_close, randn, rng_for


@dataclass(frozen=True)
class GradCase:
    id: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    mask: Any = None  # callable(rng) -> np bool array, or None
    bias: Any = None  # callable(rng) -> np float array, or None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def make(self) -> dict[str, Any]:
        rng = rng_for("grad", self.id)
        d = {n: randn(rng, getattr(self, n)) for n in "qkv"}
        d["mask"] = None if self.mask is None else self.mask(rng)
        d["bias"] = None if self.bias is None else self.bias(rng)
        lq, dv = self.q[-2], self.v[-1]
        out_shape = (*self.q[:-1], dv)
        d["w_out"] = randn(rng, out_shape)
        d["w_lse"] = randn(rng, self.q[:-1])
        assert d["w_lse"].shape[-1] == lq
        return d


def _mask_empty_row(rng: np.random.Generator) -> np.ndarray:
    m = rng.random((3, 4)) < 0.7
    m[1] = False
    m[0, 0] = True
    m[2, 3] = True
    return m


def _bias_neginf(rng: np.random.Generator) -> np.ndarray:
    b = randn(rng, (3, 4))
    b[0, 1] = -np.inf
    b[2] = -np.inf  # an empty row
    return b


GRAD_CASES = [
    GradCase("gqa_mask_empty_row", (1, 4, 3, 3), (1, 2, 4, 3), (1, 2, 4, 2), mask=_mask_empty_row),
    GradCase("causal_lq_gt_lk", (1, 2, 5, 3), (1, 2, 3, 3), (1, 2, 3, 3), kwargs={"causal": True}),
    GradCase(
        "bias_softcap_scale",
        (2, 3, 3),
        (2, 4, 3),
        (2, 4, 2),
        bias=_bias_neginf,
        kwargs={"softcap": 1.0, "scale": 0.7},
    ),
    GradCase(
        "window_upper_left",
        (1, 1, 4, 3),
        (1, 1, 6, 3),
        (1, 1, 6, 2),
        kwargs={"window": (1, 1), "causal": "upper_left"},
    ),
    GradCase("two_d_mqa", (3, 2), (4, 2), (4, 3), kwargs={"window": (None, 0)}),
]


# What the scalar loss is made of, and which implementation runs:
#   out_lse: sum(out * w_out) + sum(where(isfinite(lse), lse, 0) * w_lse), auto
#   out:     sum(out * w_out), auto (a fused kernel where the plan takes one)
#   out_portable: sum(out * w_out), implementation="portable"
#   out_lse_blockwise: as out_lse, on the blockwise path (chunk_size=2: torch's
#       autograd.Function, JAX's custom_vjp over lax.scan)
MODES = ("out_lse", "out", "out_portable", "out_lse_blockwise")

# Gradients are computed once per (framework, case, mode) and shared by the tests.
_GRADS: dict[tuple[str, str, str], tuple[np.ndarray, ...]] = {}


def _cached(key: tuple[str, str, str], compute: Any) -> tuple[np.ndarray, ...]:
    if key not in _GRADS:
        _GRADS[key] = compute()
    return _GRADS[key]


def oracle_grads(case: GradCase, mode: str) -> tuple[np.ndarray, ...]:
    def compute() -> tuple[np.ndarray, ...]:
        d = case.make()
        w_lse = d["w_lse"] if _uses_lse(mode) else None
        return oracle.loss_grads(
            d["q"], d["k"], d["v"], d["w_out"], w_lse, mask=d["mask"], bias=d["bias"], **case.kwargs
        )

    return _cached(("oracle", case.id, "out_lse" if _uses_lse(mode) else "out"), compute)


def _uses_lse(mode: str) -> bool:
    return mode.startswith("out_lse")


def attend_kwargs(case: GradCase, mode: str) -> dict[str, Any]:
    kwargs = dict(case.kwargs)
    kwargs["return_lse"] = _uses_lse(mode)
    if mode == "out_portable":
        kwargs["implementation"] = "portable"
    if mode == "out_lse_blockwise":
        kwargs["chunk_size"] = 2
    return kwargs


def empty_rows(d: dict[str, Any], case: GradCase) -> np.ndarray:
    _, _, lse = oracle.attention(
        d["q"], d["k"], d["v"], mask=d["mask"], bias=d["bias"], **case.kwargs
    )
    return np.isneginf(lse)


GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_grad_cases_have_empty_rows() -> None:
    ids = [c.id for c in GRAD_CASES if empty_rows(c.make(), c).any()]
    assert {"gqa_mask_empty_row", "causal_lq_gt_lk", "bias_softcap_scale"} <= set(ids)


# ------------------------------------------------------------------------------------------
# torch


def torch_grads(case: GradCase, mode: str) -> tuple[np.ndarray, ...]:
    return _cached(("torch", case.id, mode), lambda: _torch_grads(case, mode))


def _torch_grads(case: GradCase, mode: str) -> tuple[np.ndarray, ...]:
    import torch

    d = case.make()
    q, k, v = (torch.tensor(d[n], dtype=torch.float64, requires_grad=True) for n in "qkv")
    kwargs = attend_kwargs(case, mode)
    if d["mask"] is not None:
        kwargs["mask"] = torch.tensor(d["mask"])
    if d["bias"] is not None:
        kwargs["bias"] = torch.tensor(d["bias"], dtype=torch.float64)
    result = attend(q, k, v, **kwargs)
    if _uses_lse(mode):
        out, lse = result
        lse_finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        loss = (out * torch.tensor(d["w_out"])).sum() + (
            lse_finite * torch.tensor(d["w_lse"])
        ).sum()
    else:
        loss = (result * torch.tensor(d["w_out"])).sum()
    loss.backward()
    return tuple(a.grad.numpy().copy() for a in (q, k, v))


GRAD_PARAMS = [
    pytest.param(case, mode, id=f"{case.id}-{mode}") for case in GRAD_CASES for mode in MODES
]


def check_grads(case: GradCase, mode: str, got: tuple[np.ndarray, ...]) -> None:
    want = oracle_grads(case, mode)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == np.float64
        assert np.all(np.isfinite(g)), f"d{name} not finite"
        np.testing.assert_allclose(g, w, err_msg=f"d{name}", **GRAD_TOL)
    empty = empty_rows(case.make(), case)
    assert np.all(got[0][empty] == 0.0), "dq not exactly 0 on rows with no key"


@requires_backend("torch")
@pytest.mark.parametrize(("case", "mode"), GRAD_PARAMS)
def test_torch_grad_matches_oracle(case: GradCase, mode: str) -> None:
    check_grads(case, mode, torch_grads(case, mode))


@requires_backend("torch")
@pytest.mark.parametrize(("case", "mode"), GRAD_PARAMS)
def test_torch_gradcheck(case: GradCase, mode: str) -> None:
    import torch

    d = case.make()
    inputs = [torch.tensor(d[n], dtype=torch.float64, requires_grad=True) for n in "qkv"]
    mask = None if d["mask"] is None else torch.tensor(d["mask"])
    if d["bias"] is not None:
        inputs.append(torch.tensor(d["bias"], dtype=torch.float64, requires_grad=True))
    kwargs = attend_kwargs(case, mode)

    def f(q: Any, k: Any, v: Any, bias: Any = None) -> Any:
        result = attend(q, k, v, mask=mask, bias=bias, **kwargs)
        if not _uses_lse(mode):
            return result
        out, lse = result
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-5, rtol=1e-4)


@requires_backend("torch")
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_torch_portable_second_derivatives(case: GradCase) -> None:
    """``implementation="portable"`` differentiates twice (SDPA's CPU kernel does not:
    the docs send double backward there), rows with no key included."""
    import torch

    d = case.make()
    inputs = [torch.tensor(d[n], dtype=torch.float64, requires_grad=True) for n in "qkv"]
    mask = None if d["mask"] is None else torch.tensor(d["mask"])
    bias = None if d["bias"] is None else torch.tensor(d["bias"], dtype=torch.float64)
    kwargs = attend_kwargs(case, "out")

    def f(q: Any, k: Any, v: Any) -> Any:
        return attend(q, k, v, mask=mask, bias=bias, implementation="portable", **kwargs)

    assert torch.autograd.gradgradcheck(f, tuple(inputs), eps=1e-6, atol=1e-5, rtol=1e-4)


@requires_backend("torch")
def test_torch_weights_grad_finite_with_empty_rows() -> None:
    import torch

    case = GRAD_CASES[0]
    d = case.make()
    q, k, v = (torch.tensor(d[n], requires_grad=True) for n in "qkv")
    out, w = attend(q, k, v, mask=torch.tensor(d["mask"]), return_weights=True)
    (out.sum() + (w * w).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[..., 1, :] == 0).all()


@requires_backend("torch")
def test_torch_float32_grad() -> None:
    import torch

    case = GRAD_CASES[1]
    d = case.make()
    q, k, v = (torch.tensor(d[n], dtype=torch.float32, requires_grad=True) for n in "qkv")
    out = attend(q, k, v, **case.kwargs)
    (out * torch.tensor(d["w_out"], dtype=torch.float32)).sum().backward()
    want = oracle.loss_grads(d["q"], d["k"], d["v"], d["w_out"], **case.kwargs)
    for t, w in zip((q, k, v), want, strict=True):
        assert t.grad.dtype == torch.float32
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------------------------------
# jax


def jax_loss_fn(case: GradCase, mode: str) -> Any:
    import jax.numpy as jnp

    d = case.make()
    kwargs = attend_kwargs(case, mode)
    if d["mask"] is not None:
        kwargs["mask"] = jnp.asarray(d["mask"])
    if d["bias"] is not None:
        kwargs["bias"] = jnp.asarray(d["bias"])
    w_out, w_lse = jnp.asarray(d["w_out"]), jnp.asarray(d["w_lse"])

    def loss(q: Any, k: Any, v: Any) -> Any:
        result = attend(q, k, v, **kwargs)
        if not _uses_lse(mode):
            return (result * w_out).sum()
        out, lse = result
        lse_finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return (out * w_out).sum() + (lse_finite * w_lse).sum()

    return loss


def jax_grads(case: GradCase, mode: str, *, jit: bool = True) -> tuple[np.ndarray, ...]:
    return _cached(
        ("jax-jit" if jit else "jax", case.id, mode), lambda: _jax_grads(case, mode, jit=jit)
    )


def _jax_grads(case: GradCase, mode: str, *, jit: bool) -> tuple[np.ndarray, ...]:
    import jax
    import jax.numpy as jnp

    d = case.make()
    g = jax.grad(jax_loss_fn(case, mode), argnums=(0, 1, 2))
    if jit:
        g = jax.jit(g)
    return tuple(np.asarray(a) for a in g(*(jnp.asarray(d[n]) for n in "qkv")))


JAX_GRAD_PARAMS = [
    pytest.param(case, mode, True, id=f"{case.id}-{mode}-jit")
    for case in GRAD_CASES
    for mode in ("out_lse", "out", "out_lse_blockwise")
] + [
    pytest.param(case, mode, False, id=f"{case.id}-{mode}-eager")
    for case in GRAD_CASES[:2]
    for mode in ("out_lse", "out_lse_blockwise")
]


@requires_backend("jax")
@pytest.mark.parametrize(("case", "mode", "jit"), JAX_GRAD_PARAMS)
def test_jax_grad_matches_oracle(case: GradCase, mode: str, jit: bool) -> None:
    check_grads(case, mode, jax_grads(case, mode, jit=jit))


@requires_backend("jax", "torch")
@pytest.mark.parametrize("mode", ["out_lse", "out", "out_lse_blockwise"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_torch_and_jax_grads_agree(case: GradCase, mode: str) -> None:
    pairs = zip("qkv", torch_grads(case, mode), jax_grads(case, mode), strict=True)
    for name, a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


@requires_backend("jax")
def test_jax_jit_matches_eager_and_oracle() -> None:
    import jax
    import jax.numpy as jnp

    rng = rng_for("jit")
    qn, kn, vn = randn(rng, (2, 4, 5, 3)), randn(rng, (2, 2, 7, 3)), randn(rng, (2, 2, 7, 2))
    mask_np = rng.random((2, 1, 5, 7)) < 0.7
    mask_np[0, 0, 2] = False
    bias_np = randn(rng, (5, 7))
    kw = {"causal": True, "window": (3, 1), "softcap": 2.0, "scale": 0.4}

    @jax.jit
    def f(q: Any, k: Any, v: Any, mask: Any, bias: Any) -> Any:
        return attend(q, k, v, mask=mask, bias=bias, return_weights=True, return_lse=True, **kw)

    args = [jnp.asarray(a) for a in (qn, kn, vn, mask_np, bias_np)]
    jitted = f(*args)
    eager = attend(
        *args[:3], mask=args[3], bias=args[4], return_weights=True, return_lse=True, **kw
    )
    ref = oracle.attention(qn, kn, vn, mask=mask_np, bias=bias_np, **kw)
    for name, a, b, r in zip(("out", "weights", "lse"), jitted, eager, ref, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=name)
        assert_close(a, r, "float64", what=name)
    assert np.isneginf(np.asarray(jitted[2])[0, :, 2]).all()
    assert (np.asarray(jitted[0])[0, :, 2] == 0).all()


@requires_backend("jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_jax_jit_dtypes(dtype: str) -> None:
    import jax
    import jax.numpy as jnp

    rng = rng_for("jit-dtypes")
    dt = getattr(jnp, dtype)
    q, k, v = (jnp.asarray(randn(rng, (2, 4, 3))).astype(dt) for _ in range(3))
    out, lse = jax.jit(lambda q, k, v: attend(q, k, v, causal=True, return_lse=True))(q, k, v)
    assert out.dtype == dt
    assert lse.dtype == (jnp.float32 if dtype != "float32" else dt)
    ref_out, _, ref_lse = oracle.attention(
        *(np.asarray(a.astype(jnp.float64)) for a in (q, k, v)), causal=True
    )
    assert_close(np.asarray(out.astype(jnp.float64)), ref_out, dtype)
    assert_close(np.asarray(lse).astype(np.float64), ref_lse, dtype, what="lse")


@requires_backend("jax")
def test_jax_vmap() -> None:
    import jax
    import jax.numpy as jnp

    rng = rng_for("vmap")
    qn, kn, vn = randn(rng, (3, 4, 5, 3)), randn(rng, (3, 2, 6, 3)), randn(rng, (3, 2, 6, 2))
    mask_np = rng.random((3, 5, 6)) < 0.7
    mask_np[1, 0] = False
    q, k, v, mask = (jnp.asarray(a) for a in (qn, kn, vn, mask_np))

    # vmap over the batch axis: each call sees [H, L, D] and a [Lq, Lk] mask
    f = jax.vmap(lambda q, k, v, m: attend(q, k, v, mask=m, causal=True, return_lse=True))
    out, lse = f(q, k, v, mask)
    ref_out, _, ref_lse = oracle.attention(qn, kn, vn, mask=mask_np[:, None], causal=True)
    assert_close(np.asarray(out), ref_out, "float64")
    assert_close(np.asarray(lse), ref_lse, "float64", what="lse")
    assert np.isneginf(np.asarray(lse)[1, :, 0]).all()

    # vmap twice (batch and heads): each call is 2-D
    g = jax.vmap(jax.vmap(lambda q, k, v: attend(q, k, v, window=1), in_axes=(0, None, None)))
    k1, v1 = k[:, :1], v[:, :1]
    out2 = g(q, k1[:, 0], v1[:, 0])
    ref2 = oracle.attention(qn, kn[:, :1], vn[:, :1], window=1)[0]
    assert_close(np.asarray(out2), ref2, "float64")

    # jit of vmap of grad
    def loss(q: Any, k: Any, v: Any) -> Any:
        return attend(q, k, v, causal=True).sum()

    grads = jax.jit(jax.vmap(jax.grad(loss)))(q, k, v)
    assert grads.shape == q.shape
    assert np.all(np.isfinite(np.asarray(grads)))
