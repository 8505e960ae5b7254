"""Property-based agreement of ``attend`` across backends and paths (hypothesis).

Every property draws whole calls (:mod:`strategies`: ranks 2-5, grouped and multi-query
heads, ``Lq``/``Lk`` 0-300, ``Dk != Dv``, every dtype the backend has, masks from the
builders and raw, fully masked rows and batches, biases with ``-inf``, causal, window,
scale, softcap, chunk sizes) and a path (``auto`` -- NumPy's blockwise path on NumPy --,
``portable``, ``fused`` where :func:`plan` allows it, ``chunked`` through ``chunk_size``);
the backend is a pytest parameter (every selected backend, array_api_strict under its jit
flags), never drawn.

Properties: the float64 oracle agrees within the dtype's tolerance; fused == portable ==
chunked (== native); rows with no key give exactly 0 / 0 / -inf and finite zero gradients
(torch autograd, jax.grad); softmax weights sum to 1 on rows with a key; permuting keys and
values (with the mask/bias key axis) changes nothing, and causal/window equal their explicit
masks; inputs are never modified; the same ``rng`` gives the same dropout, another seed a
different one.

Examples per test and backend: the "ci" profile (the default; derandomized, so every run
draws the same examples) runs ``max_examples=30`` for each of the 7 property tests on each
selected backend: 210 examples per backend, 840 with all four.
``HYPOTHESIS_PROFILE=thorough`` (``nox -s properties``) runs 240 per test and backend, with
fresh random seeds each run. Gradients are checked on torch (every example of
``test_rows_without_keys``) and JAX (its float32 examples, under ``jax.jit``). On JAX the
dims come from a fixed menu (``strategies.JAX_DIMS``): eager JAX compiles each operation
for each new shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from portable_attention import attend, plan

import oracle
from conftest import TOLERANCES, Backend, requires_backend
from helpers import assert_close, assert_like, check_against_oracle
from strategies import PATHS, Case, cases

Result = tuple[Any, Any, Any]


def _call(
    case: Case,
    arrays: tuple[Any, ...],
    path: str,
    *,
    return_weights: bool = False,
    return_lse: bool = False,
    **kwargs: Any,
) -> Result:
    """``(out, weights or None, lse or None)`` of ``attend`` on ``arrays`` along ``path``."""
    q, k, v, mask, bias = arrays
    res = attend(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        return_weights=return_weights,
        return_lse=return_lse,
        **case.options(),
        **case.path_kwargs(path),
        **kwargs,
    )
    if not (return_weights or return_lse):
        return res, None, None
    return res[0], res[1] if return_weights else None, res[-1] if return_lse else None


def _fused_runs(case: Case, arrays: tuple[Any, ...], **kwargs: Any) -> bool:
    """Whether ``plan(implementation="fused")`` accepts the call (it raises where not)."""
    q, k, v, mask, bias = arrays
    try:
        p = plan(q, k, v, mask=mask, bias=bias, implementation="fused", **case.options(), **kwargs)
    except ValueError as exc:
        assert '`implementation="fused"` cannot run this call' in str(exc)
        return False
    assert p.path.startswith("fused:")
    return True


def _resolve(case: Case, arrays: tuple[Any, ...], path: str, **kwargs: Any) -> str:
    """``path``, or ``portable`` where ``fused`` was drawn and no fused kernel applies (after
    checking that ``attend`` refuses it too)."""
    if path != "fused" or _fused_runs(case, arrays, **kwargs):
        return path
    with pytest.raises(ValueError, match="fused"):
        _call(case, arrays, "fused", **kwargs)
    return "portable"


def _float64(backend: Backend, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(q, k, v, mask, bias)`` with the floating arrays widened to float64 (exactly)."""
    q, k, v, mask, bias = arrays
    wide = [
        None if x is None else backend.asarray(backend.to_numpy(x), "float64")
        for x in (q, k, v, bias)
    ]
    return (*wide[:3], mask, wide[3])


def _np(backend: Backend, x: Any) -> np.ndarray | None:
    return None if x is None else backend.to_numpy(x)


def _empty_rows(ref_lse: np.ndarray) -> np.ndarray:
    return np.isneginf(ref_lse)


# ------------------------------------------------------------------------------------------


@given(data=st.data())
def test_matches_the_oracle(backend: Backend, data: st.DataObject) -> None:
    """Every path equals the float64 oracle within the dtype's tolerance (framework, device,
    dtype and shape too); the mask builders equal their NumPy definitions."""
    case = data.draw(cases(backend), label="case")
    path = data.draw(st.sampled_from(PATHS), label="path")
    # (fused kernels return neither, so a fused draw asks for none: else it would never run)
    asks = path != "fused"
    return_weights = asks and path != "chunked" and data.draw(st.booleans(), label="weights")
    return_lse = asks and data.draw(st.booleans(), label="return_lse")
    arrays = case.arrays(backend)
    flags = {"return_weights": return_weights, "return_lse": return_lse}
    path = _resolve(case, arrays, path, **flags)
    q, k, v, mask, bias = arrays
    kwargs = {**case.options(), **case.path_kwargs(path), **flags}
    event(plan(q, k, v, mask=mask, bias=bias, **kwargs).path)  # --hypothesis-show-statistics
    result = _call(case, arrays, path, **flags)
    check_against_oracle(backend, case.dtype, arrays[0], result, case.reference(backend, arrays))
    if mask is not None:
        full = case.dims.score_shape
        built = np.broadcast_to(backend.to_numpy(mask), full)
        np.testing.assert_array_equal(built, np.broadcast_to(case.expected_mask(), full))


@given(data=st.data())
def test_paths_agree(backend: Backend, data: st.DataObject) -> None:
    """portable == chunked == auto (NumPy: native) == fused (where it runs), within the dtype's
    tolerance; lse of portable and chunked alike, -inf on the same rows. (``auto`` runs where
    it plans a path of its own: where it plans ``portable`` it is that call again.)"""
    case = data.draw(cases(backend), label="case")
    arrays = case.arrays(backend)
    out, _, lse = _call(case, arrays, "portable", return_lse=True)
    ref_out, ref_lse = backend.to_numpy(out), backend.to_numpy(lse)
    empty = np.isneginf(ref_lse)
    assert np.all(ref_out[empty] == 0)
    others = {"chunked": _call(case, arrays, "chunked", return_lse=True)}
    q, k, v, mask, bias = arrays
    if plan(q, k, v, mask=mask, bias=bias, **case.options()).path != "portable":
        others["auto"] = _call(case, arrays, "auto")
    if _fused_runs(case, arrays):
        others["fused"] = _call(case, arrays, "fused")
    event(f"fused kernel ran: {'fused' in others}")  # --hypothesis-show-statistics
    for name, (o, _, other_lse) in others.items():
        assert_like(o, arrays[0], shape=case.dims.out_shape, dtype=out.dtype, name=name)
        o_np = backend.to_numpy(o)
        assert np.all(o_np[empty] == 0), f"{name}: rows with no key are not 0"
        assert_close(o_np, ref_out, case.dtype, what=f"{name} out")
        if other_lse is not None:
            c_lse = backend.to_numpy(other_lse)
            np.testing.assert_array_equal(np.isneginf(c_lse), empty, err_msg=f"{name} lse -inf")
            assert_close(c_lse[~empty], ref_lse[~empty], case.dtype, what="lse")


@given(data=st.data())
def test_rows_without_keys(backend: Backend, data: st.DataObject) -> None:
    """Rows that lose every key give out 0 and lse -inf on every path; on torch and JAX their
    gradients are finite, zero for the empty query rows, and equal the portable path's."""
    case = data.draw(cases(backend, empty_rows=True), label="case")
    path = data.draw(st.sampled_from(PATHS), label="path")
    arrays = case.arrays(backend)
    path = _resolve(case, arrays, path)
    want_lse = path != "fused"
    out, _, lse = _call(case, arrays, path, return_lse=want_lse)
    ref_out, _, ref_lse = case.reference(backend, arrays)
    empty = _empty_rows(ref_lse)
    assert empty.size == 0 or empty.any(), "the strategy made no empty row"
    out_np = backend.to_numpy(out)
    assert np.all(np.isfinite(out_np))
    assert np.all(out_np[empty] == 0)
    if lse is not None:
        np.testing.assert_array_equal(np.isneginf(backend.to_numpy(lse)), empty)
    if backend.name != "torch" and (backend.name != "jax" or case.dtype != "float32"):
        return  # gradients: torch, and JAX in float32 (its VJPs compile per shape and dtype)
    rng = np.random.default_rng(case.seed)
    w_out, w_lse = rng.standard_normal(ref_out.shape), rng.standard_normal(ref_lse.shape)
    grads = _grads(backend, case, arrays, path, w_out, w_lse if want_lse else None)
    for name, g in zip("qkv", grads, strict=True):
        assert np.all(np.isfinite(g)), f"d{name} is not finite"
    assert np.all(grads[0][empty] == 0), "dq is not 0 on rows with no key"
    if path == "fused" or (path != "portable" and backend.name == "torch"):  # JAX: compiles
        # The gradients are a composed computation (three products and the softmax's
        # backward), so the one-operation table does not bound them, and their rounding
        # differs between CPUs. Both paths are held to the float64 gradients instead: each
        # may be at most 4x as far from them as the other in the same dtype (both round the
        # same products, so their distances scale together with the machine's rounding),
        # plus the table's atol per unit of gradient. Either path wrong fails it.
        lse_w = w_lse if want_lse else None
        portable = _grads(backend, case, arrays, "portable", w_out, lse_w)
        exact = _grads(backend, case, _float64(backend, arrays), "portable", w_out, lse_w)
        atol = TOLERANCES[case.dtype][1]
        for name, g, p, r in zip("qkv", grads, portable, exact, strict=True):
            floor = atol * (1.0 + float(np.max(np.abs(r), initial=0.0)))
            err, err_p = (float(np.max(np.abs(x - r), initial=0.0)) for x in (g, p))
            msg = f"d{name}: {path} {err:.3g}, portable {err_p:.3g} from float64"
            assert err <= 4 * err_p + floor and err_p <= 4 * err + floor, msg


def _grads(
    backend: Backend,
    case: Case,
    arrays: tuple[Any, ...],
    path: str,
    w_out: np.ndarray,
    w_lse: np.ndarray | None,
) -> list[np.ndarray]:
    """Gradients wrt q, k, v of ``sum(out * w_out) + sum(finite lse * w_lse)``."""
    q, k, v, mask, bias = arrays
    extra = case.path_kwargs(path) | case.options()
    if backend.name == "torch":
        import torch

        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        res = attend(*leaves, mask=mask, bias=bias, return_lse=w_lse is not None, **extra)
        out, lse = res if w_lse is not None else (res, None)
        loss = (out.double() * torch.from_numpy(w_out)).sum()
        if lse is not None:
            finite = torch.where(torch.isfinite(lse), lse, 0.0)
            loss = loss + (finite.double() * torch.from_numpy(w_lse)).sum()
        loss.backward()
        return [backend.to_numpy(x.grad) for x in leaves]
    import jax
    import jax.numpy as jnp

    def loss_fn(a: Any, b: Any, c: Any) -> Any:
        res = attend(a, b, c, mask=mask, bias=bias, return_lse=w_lse is not None, **extra)
        out, lse = res if w_lse is not None else (res, None)
        total = jnp.sum(out.astype(jnp.float64) * w_out)
        if lse is not None:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
        return total

    # Under jit: one compilation instead of one per operation of the eager VJP (5x faster).
    grad = jax.jit(jax.grad(loss_fn, argnums=(0, 1, 2)))
    return [backend.to_numpy(g) for g in grad(q, k, v)]


@given(data=st.data())
def test_weights_sum_to_one(backend: Backend, data: st.DataObject) -> None:
    """The returned softmax weights lie in [0, 1], sum to 1 on every row that has a key and
    to exactly 0 on rows without one."""
    case = data.draw(cases(backend), label="case")
    path = data.draw(st.sampled_from(("auto", "portable")), label="path")
    arrays = case.arrays(backend)
    _, weights, lse = _call(case, arrays, path, return_weights=True, return_lse=True)
    w = backend.to_numpy(weights)
    empty = np.isneginf(backend.to_numpy(lse))
    assert np.all((w >= 0) & (w <= 1))
    sums = w.sum(axis=-1)
    assert np.all(sums[empty] == 0)
    rtol = TOLERANCES[case.dtype][0]
    np.testing.assert_allclose(sums[~empty], 1.0, rtol=rtol, atol=0)


@given(data=st.data())
def test_key_permutation_invariance(backend: Backend, data: st.DataObject) -> None:
    """Permuting k, v and the key axis of mask and bias together leaves out and lse alone and
    permutes the weights; causal and window there become the same explicit mask."""
    case = data.draw(cases(backend), label="case")
    d = case.dims
    perm = np.array(data.draw(st.permutations(range(d.lk)), label="perm"), dtype=np.int64)
    path = data.draw(st.sampled_from(PATHS), label="path")
    arrays = case.arrays(backend)
    flags = {"return_weights": path in ("auto", "portable"), "return_lse": path != "fused"}
    path = _resolve(case, arrays, path, **flags)
    out, weights, lse = _call(case, arrays, path, **flags)

    q, k, v, _, bias = arrays
    allowed = oracle.allowed_positions(d.lq, d.lk, causal=case.causal, window=case.window)
    mask = case.expected_mask()
    mask = allowed if mask is None else (mask & allowed)
    permuted_mask = mask[..., perm] if mask.shape[-1] > 1 else mask
    b_np = _np(backend, bias)
    permuted_bias = None
    if b_np is not None:
        permuted_bias = backend.asarray(b_np[..., perm] if b_np.shape[-1] > 1 else b_np, bias.dtype)
    permuted = (
        q,
        backend.asarray(backend.to_numpy(k)[..., perm, :], k.dtype),
        backend.asarray(backend.to_numpy(v)[..., perm, :], v.dtype),
        backend.asarray(permuted_mask),
        permuted_bias,
    )
    plain = dataclasses.replace(case, causal=False, window=None)
    out_p, weights_p, lse_p = _call(plain, permuted, path, **flags)

    assert_close(backend.to_numpy(out_p), backend.to_numpy(out), case.dtype)
    if lse is not None:
        a, b = backend.to_numpy(lse_p), backend.to_numpy(lse)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
        assert_close(a[np.isfinite(b)], b[np.isfinite(b)], case.dtype, what="lse")
    if weights is not None:
        w = backend.to_numpy(weights)[..., perm]
        assert_close(backend.to_numpy(weights_p), w, case.dtype, what="weights")


@given(data=st.data())
def test_inputs_are_not_modified(backend: Backend, data: st.DataObject) -> None:
    """q, k, v, mask and bias hold the same values (and, on torch, the same version counter)
    after the call, on every path, with and without dropout. Not on JAX, whose arrays
    cannot be written: what a call could do to them there (donate their buffers, which
    deletes them) breaks every test that reads its inputs after the call, the whole sweep's
    comparison with the oracle first."""
    if backend.name == "jax":
        pytest.skip("JAX arrays are immutable (donated inputs fail every oracle comparison)")
    case = data.draw(cases(backend), label="case")
    path = data.draw(st.sampled_from(PATHS), label="path")
    dropout = data.draw(st.sampled_from((0.0, 0.0, 0.3)), label="dropout")
    arrays = case.arrays(backend)
    kwargs: dict[str, Any] = {"return_lse": path != "fused"}
    if dropout:
        kwargs |= {"dropout": dropout, "rng": backend.make_rng(case.seed)}
    path = _resolve(case, arrays, path, **kwargs)
    before = [_np(backend, x) for x in arrays]
    versions = [getattr(x, "_version", None) for x in arrays]
    _call(case, arrays, path, **kwargs)
    for name, x, old, version in zip(
        ["q", "k", "v", "mask", "bias"], arrays, before, versions, strict=True
    ):
        if x is None:
            continue
        np.testing.assert_array_equal(backend.to_numpy(x), old, err_msg=f"{name} changed")
        assert getattr(x, "_version", None) == version, f"{name} was written in place"


@given(data=st.data())
def test_dropout_follows_the_rng(backend: Backend, data: st.DataObject) -> None:
    """The same ``rng`` (seed) gives the same output on every portable path; another seed
    gives another one where enough weights are nonzero; rows with no key stay 0."""
    case = data.draw(cases(backend, dtypes=("float32", "float64")), label="case")
    path = data.draw(st.sampled_from(("auto", "portable", "chunked")), label="path")
    p = data.draw(st.sampled_from((0.2, 0.5, 0.8)), label="dropout")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    arrays = case.arrays(backend)

    def run(s: int) -> np.ndarray:
        out = _call(case, arrays, path, dropout=p, rng=backend.make_rng(s))[0]
        assert_like(out, arrays[0], shape=case.dims.out_shape, dtype=arrays[0].dtype)
        return backend.to_numpy(out)

    first, again, other = run(seed), run(seed), run(seed + 1)
    np.testing.assert_array_equal(first, again, err_msg="same rng, different dropout")
    _, ref_w, ref_lse = case.reference(backend, arrays)
    assert np.all(first[np.isneginf(ref_lse)] == 0)
    if case.dims.dv > 0 and np.count_nonzero(ref_w > 1e-3) >= 32:
        assert not np.array_equal(first, other), "another seed gave the same dropout"


# ------------------------------------------------------------------------------------------
# Regressions: minimal failing examples the properties found.


@requires_backend("torch")
@pytest.mark.parametrize(("lq", "lk"), [(0, 0), (3, 0), (0, 3)])
@pytest.mark.parametrize("kwargs", [{"implementation": "portable"}, {"chunk_size": 2}])
def test_empty_sequences_stay_on_the_autograd_graph(lq: int, lk: int, kwargs: dict) -> None:
    """test_rows_without_keys: ``q [0, 1]``, ``k``/``v [0, 1]``, ``return_lse=True`` gave an
    ``out`` without grad_fn on the portable and chunked paths (``backward`` raised "element 0
    of tensors does not require grad"), while SDPA's was connected. Now zeros from
    ``(q @ k^T) @ v``, with zero gradients."""
    import torch

    q = torch.randn(1, 4, lq, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, lk, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, lk, 3, dtype=torch.float64, requires_grad=True)
    out, lse = attend(q, k, v, return_lse=True, **kwargs)
    assert out.shape == (1, 4, lq, 3) and bool(torch.all(out == 0))
    assert bool(torch.all(torch.isneginf(lse)))
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and bool(torch.all(x.grad == 0))


@requires_backend("jax")
def test_jax_fused_bias_row_of_neg_inf_has_zero_gradient() -> None:
    """test_rows_without_keys on JAX, path "fused": a query row whose bias is all -inf gave
    out 0 but dq NaN (jax.nn's softmax of a row of -inf is NaN; the repair's where passes
    0 * NaN back). -inf bias entries now join jax.nn's boolean mask."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 4)), dtype=jnp.float32) for _ in range(3))
    bias = jnp.asarray([[0.0, -np.inf], [-np.inf, -np.inf]], dtype=jnp.float32)

    def loss(a: Any, b: Any, c: Any, impl: str) -> Any:
        return jnp.sum(attend(a, b, c, bias=bias, implementation=impl))

    grads = {}
    for impl in ("fused", "portable"):
        out = attend(q, k, v, bias=bias, implementation=impl)
        assert bool(jnp.all(out[:, 1] == 0))
        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, impl)
    for g, want in zip(grads["fused"], grads["portable"], strict=True):
        assert bool(jnp.all(jnp.isfinite(g)))
        # two keys, four features: a gradient of a handful of float32 operations, which the
        # table's float32 row bounds with room (it bounds one attention call of any size)
        rtol, atol = TOLERANCES["float32"]
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=rtol, atol=atol)
    assert bool(jnp.all(grads["fused"][0][:, 1] == 0))
