"""Multi-head attention: the functional core on every backend against a float64 NumPy oracle,
``init_params``, the plain NumPy class, the torch module (against ``nn.MultiheadAttention``:
outputs, weights, gradients, state round trips) and the encoder-layer example."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from portable_attention import mha
from portable_attention.masks import block_plan
from portable_attention.testing import tolerance

import oracle
from conftest import BACKENDS, BY_NAME, Backend, requires_backend
from helpers import GRAD64, MHA_TOL, assert_like, rng_for, run_python


def oracle_mha(
    params: dict[str, np.ndarray],
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    mask: np.ndarray | None = None,
    causal: bool | str = False,
    key_padding_mask: np.ndarray | None = None,
    **attention_options: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 MHA written out with NumPy: projections, heads, ``oracle.attention``
    (``params['sinks']`` as its ``sinks``; ``attention_options`` such as ``window``,
    ``segment_ids`` or ``mask_mod`` passed on to it)."""
    p = {n: np.asarray(a, dtype=np.float64) for n, a in params.items()}
    q, k, v = oracle_heads(p, query, key, value, num_heads, num_kv_heads)
    full = mask
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        full = kpm if full is None else (full & kpm)
    out, weights, _ = oracle.attention(
        q, k, v, mask=full, causal=causal, sinks=p.get("sinks"), **attention_options
    )
    bsz, h, lq, dv = out.shape
    merged = out.transpose(0, 2, 1, 3).reshape(bsz, lq, h * dv)
    o = merged @ p["w_o"]
    return (o + p["b_o"] if "b_o" in p else o), weights


def oracle_heads(
    params: dict[str, np.ndarray],
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The float64 projected heads ``q [B, Hq, Lq, D]``, ``k``, ``v [B, Hk, Lk, D]``."""
    p = {n: np.asarray(a, dtype=np.float64) for n, a in params.items()}

    def proj(x: np.ndarray, w: str, b: str) -> np.ndarray:
        y = np.einsum("ble,ef->blf", np.asarray(x, dtype=np.float64), p[w])
        return y + p[b] if b in p else y

    return (
        split_heads64(proj(query, "w_q", "b_q"), num_heads),
        split_heads64(proj(key, "w_k", "b_k"), num_kv_heads),
        split_heads64(proj(value, "w_v", "b_v"), num_kv_heads),
    )


def split_heads64(x: np.ndarray, heads: int) -> np.ndarray:
    """``[B, L, H * D] -> [B, H, L, D]`` in float64."""
    bsz, length, width = x.shape
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(bsz, length, heads, width // heads).transpose(0, 2, 1, 3)


# (num_heads, num_kv_heads, embed_dim, kdim, vdim, bias, Lq, Lk, self-attention, options)
CASES = {
    "self-kpm": (4, 4, 16, None, None, True, 5, 5, True, {"kpm": True}),
    "gqa-causal": (4, 2, 16, None, None, True, 6, 6, True, {"causal": True}),
    "mqa-cross-mask": (4, 1, 16, 12, 10, False, 3, 7, False, {"mask": True, "kpm": True}),
    "cross-lower-right": (2, 2, 8, 6, 6, True, 3, 5, False, {"causal": "lower_right"}),
}


def _make_case(name: str) -> dict[str, Any]:
    hq, hk, e, kdim, vdim, bias, lq, lk, self_attn, opts = CASES[name]
    rng = rng_for("mha", name)
    params = mha.init_params(e, hq, num_kv_heads=hk, kdim=kdim, vdim=vdim, bias=bias, seed=3)
    params = {n: np.asarray(a, dtype=np.float64) for n, a in params.items()}
    if bias:  # non-zero biases, so that they are exercised
        for n in ("b_q", "b_k", "b_v", "b_o"):
            params[n] = 0.1 * rng.standard_normal(params[n].shape)
    b = 2
    query = rng.standard_normal((b, lq, e))
    key = query if self_attn else rng.standard_normal((b, lk, kdim or e))
    value = key if self_attn else rng.standard_normal((b, lk, vdim or e))
    mask = kpm = None
    if opts.get("mask"):
        mask = rng.random((lq, lk)) > 0.3
        mask[:, 1] = True  # every query keeps a key
    if opts.get("kpm"):
        kpm = np.ones((b, lk), dtype=bool)
        kpm[1, lk - 2 :] = False
        kpm[0, 0] = False
    return {
        "params": params,
        "query": query,
        "key": key,
        "value": value,
        "mask": mask,
        "kpm": kpm,
        "causal": opts.get("causal", False),
        "num_heads": hq,
        "num_kv_heads": hk,
        "self_attn": self_attn,
    }


@pytest.mark.parametrize("case", list(CASES))
def test_functional_matches_oracle(backend: Backend, hp_dtype: str, case: str) -> None:
    c = _make_case(case)
    ref_out, ref_w = oracle_mha(
        c["params"],
        c["query"],
        c["key"],
        c["value"],
        num_heads=c["num_heads"],
        num_kv_heads=c["num_kv_heads"],
        mask=c["mask"],
        causal=c["causal"],
        key_padding_mask=c["kpm"],
    )
    params = {n: backend.asarray(a, hp_dtype) for n, a in c["params"].items()}
    query = backend.asarray(c["query"], hp_dtype)
    key = value = None
    if not c["self_attn"]:
        key, value = backend.asarray(c["key"], hp_dtype), backend.asarray(c["value"], hp_dtype)
    mask = None if c["mask"] is None else backend.asarray(c["mask"])
    kpm = None if c["kpm"] is None else backend.asarray(c["kpm"])
    out, weights = mha.multi_head_attention(
        params,
        query,
        key,
        value,
        num_heads=c["num_heads"],
        num_kv_heads=c["num_kv_heads"],
        mask=mask,
        causal=c["causal"],
        key_padding_mask=kpm,
        return_weights=True,
    )
    dt = backend.dtype(hp_dtype)
    assert_like(out, query, shape=ref_out.shape, dtype=dt, name="out")
    assert_like(weights, query, shape=ref_w.shape, dtype=dt, name="weights")
    rtol, atol = MHA_TOL[hp_dtype]
    np.testing.assert_allclose(backend.to_numpy(out), ref_out, rtol=rtol, atol=atol)
    np.testing.assert_allclose(backend.to_numpy(weights), ref_w, rtol=rtol, atol=atol)
    # Without weights (may take a fused path): the same output.
    out2 = mha.multi_head_attention(
        params,
        query,
        key,
        value,
        num_heads=c["num_heads"],
        num_kv_heads=c["num_kv_heads"],
        mask=mask,
        causal=c["causal"],
        key_padding_mask=kpm,
    )
    np.testing.assert_allclose(backend.to_numpy(out2), ref_out, rtol=rtol, atol=atol)


def test_init_params(backend: Backend, hp_dtype: str) -> None:
    e, hq, hk, kdim, vdim = 16, 4, 2, 12, 10
    dt = backend.dtype(hp_dtype)
    p = mha.init_params(e, hq, num_kv_heads=hk, kdim=kdim, vdim=vdim, xp=backend.xp, dtype=dt)
    d = e // hq
    shapes = {
        "w_q": (e, hq * d),
        "w_k": (kdim, hk * d),
        "w_v": (vdim, hk * d),
        "w_o": (hq * d, e),
        "b_q": (hq * d,),
        "b_k": (hk * d,),
        "b_v": (hk * d,),
        "b_o": (e,),
    }
    like = backend.asarray(np.zeros(1), hp_dtype)
    assert set(p) == set(shapes)
    ref = mha.init_params(e, hq, num_kv_heads=hk, kdim=kdim, vdim=vdim, dtype=np.float64)
    for name, shape in shapes.items():
        assert_like(p[name], like, shape=shape, dtype=dt, name=name)
        a = backend.to_numpy(p[name])
        if name.startswith("b_"):
            assert np.all(a == 0)
        else:
            bound = math.sqrt(6.0 / (shape[0] + shape[1]))
            assert np.all(np.abs(a) <= bound) and np.abs(a).max() > 0.8 * bound
            # One definition: the same values on every backend (up to the dtype's rounding).
            np.testing.assert_allclose(a, ref[name], rtol=1e-6 if hp_dtype == "float32" else 0)
    no_bias = mha.init_params(e, hq, bias=False, xp=backend.xp, dtype=dt)
    assert set(no_bias) == {"w_q", "w_k", "w_v", "w_o"}
    other = mha.init_params(e, hq, num_kv_heads=hk, kdim=kdim, vdim=vdim, dtype=np.float64, seed=1)
    assert not np.allclose(other["w_q"], ref["w_q"])


def test_errors() -> None:
    p = mha.init_params(8, 2)
    x = np.zeros((2, 3, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        mha.multi_head_attention(p, x, num_heads=2, num_kv_heads=3)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha.multi_head_attention(p, x, num_heads=2, key_padding_mask=np.ones((2, 4), bool))
    with pytest.raises(TypeError, match="dtype"):
        mha.multi_head_attention(p, x.astype(np.float64), num_heads=2)
    with pytest.raises(ValueError, match="query"):
        mha.multi_head_attention(p, x[0], num_heads=2)
    with pytest.raises(ValueError, match="parameter shapes"):
        mha.multi_head_attention(p, np.zeros((2, 3, 6), np.float32), num_heads=2)
    with pytest.raises(ValueError, match="embed_dim"):
        mha.init_params(10, 4)


def test_numpy_class() -> None:
    m = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=5)
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    out = m(x)
    ref = mha.multi_head_attention(m.params, x, num_heads=4, num_kv_heads=2)
    np.testing.assert_array_equal(out, ref)
    # the weights run the dense path (the output without them, the blockwise one)
    out_w, w = m(x, return_weights=True)
    rtol, atol = tolerance("float32")
    np.testing.assert_allclose(out_w, out, rtol=rtol, atol=atol)
    assert out_w.dtype == np.float32 and w.shape == (2, 4, 5, 5)
    m2 = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=6)
    assert not np.allclose(m2(x), out)
    m2.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(m2(x), out)
    with pytest.raises(ValueError, match="keys"):
        m2.load_state_dict({"w_q": m.params["w_q"]})


# --------------------------------------------------------------------------------------------
# torch


def _torch_inputs(
    batch_first: bool, kdim: int | None, seed: int, dtype: Any = None
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Inputs and masks in torch's conventions; the floating ones in ``dtype`` (float32 by
    default; the same values, drawn in float32, in any other)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b, lq, lk, e, h = 3, 4, 6, 8, 2
    q = torch.randn(b, lq, e, generator=g)
    if kdim is None:
        k = v = q if lq == lk else torch.randn(b, lk, e, generator=g)
    else:
        k = torch.randn(b, lk, kdim, generator=g)
        v = torch.randn(b, lk, kdim, generator=g)
    if not batch_first:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if dtype is not None:
        q, k, v = (x.to(dtype) for x in (q, k, v))
    kpm = torch.zeros(b, lk, dtype=torch.bool)
    kpm[0, -2:] = True  # torch polarity: True = padding
    kpm[2, -1] = True
    bool_2d = torch.rand(lq, lk, generator=g) > 0.6
    bool_2d[:, 0] = False  # torch polarity: False = may attend; key 0 is never padding
    bool_3d = torch.rand(b * h, lq, lk, generator=g) > 0.6
    bool_3d[..., 0] = False
    masks = {
        "none": {},
        "kpm": {"key_padding_mask": kpm},
        "bool2d": {"attn_mask": bool_2d},
        "bool3d+kpm": {"attn_mask": bool_3d, "key_padding_mask": kpm},
        "float3d": {"attn_mask": torch.randn(b * h, lq, lk, generator=g).to(q.dtype)},
        "float2d+kpm": {
            "attn_mask": torch.randn(lq, lk, generator=g).to(q.dtype),
            "key_padding_mask": kpm,
        },
    }
    return q, k, v, masks


@requires_backend("torch")
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 6])
def test_swap_matches_torch(batch_first: bool, kdim: int | None) -> None:
    import torch
    from portable_attention.nn.torch import (
        MultiHeadAttention,
        TorchCompatMultiHeadAttention,
    )

    # float64 on both sides: two orders of one composed computation agree to float64
    # rounding (MHA_TOL), where float32's rounding would differ between CPUs.
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
    ref = ref.double()
    with torch.no_grad():  # torch initialises biases to 0: make them matter
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
    ours = MultiHeadAttention.from_torch(ref, torch_compat=True)
    assert isinstance(ours, TorchCompatMultiHeadAttention)
    assert ours.params()["w_q"].dtype == torch.float64
    q, k, v, masks = _torch_inputs(batch_first, kdim, seed=1, dtype=torch.float64)
    rtol, atol = MHA_TOL["float64"]
    for name, kw in masks.items():
        for average in (True, False):
            o_ref, w_ref = ref(q, k, v, average_attn_weights=average, **kw)
            o, w = ours(q, k, v, average_attn_weights=average, **kw)
            assert o.shape == o_ref.shape and w is not None and w.shape == w_ref.shape
            torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol, msg=name)
            torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol, msg=name)
        o_ref, _ = ref(q, k, v, need_weights=False, **kw)
        o, w = ours(q, k, v, need_weights=False, **kw)
        assert w is None
        torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol, msg=name)

    # Gradients with respect to inputs and parameters.
    kw = masks["bool3d+kpm"]
    qs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    qo = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    ref(*qs, **kw)[0].square().sum().backward()
    ours(*qo, **kw)[0].square().sum().backward()
    g_rtol, g_atol = GRAD64
    for a, b in zip(qs, qo, strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=g_rtol, atol=g_atol)
    if ref._qkv_same_embed_dim:
        gq, gk, gv = ref.in_proj_weight.grad.chunk(3)
    else:
        gq, gk, gv = ref.q_proj_weight.grad, ref.k_proj_weight.grad, ref.v_proj_weight.grad
    p = ours.params()
    for ours_p, ref_g in ((p["w_q"], gq), (p["w_k"], gk), (p["w_v"], gv)):
        torch.testing.assert_close(ours_p.grad.T, ref_g, rtol=g_rtol, atol=g_atol)
    torch.testing.assert_close(p["w_o"].grad.T, ref.out_proj.weight.grad, rtol=g_rtol, atol=g_atol)
    gb = torch.cat([p["b_q"].grad, p["b_k"].grad, p["b_v"].grad])
    torch.testing.assert_close(gb, ref.in_proj_bias.grad, rtol=g_rtol, atol=g_atol)
    torch.testing.assert_close(p["b_o"].grad, ref.out_proj.bias.grad, rtol=g_rtol, atol=g_atol)

    # Export back to torch: the same module.
    back = ours.to_torch()
    assert back.batch_first == batch_first and back.in_proj_bias.dtype == torch.float64
    for name, kw in masks.items():
        o_back, w_back = back(q, k, v, **kw)
        o_ref, w_ref = ref(q, k, v, **kw)
        torch.testing.assert_close(o_back, o_ref, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(w_back, w_ref, rtol=0, atol=0, msg=name)


@requires_backend("torch")
def test_torch_module_native_forward_and_modes() -> None:
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    m = MultiHeadAttention(16, 4, num_kv_heads=2, dropout=0.5, seed=2, dtype=torch.float64)
    assert {n for n, _ in m.named_parameters()} == {*mha.WEIGHTS, *mha.BIASES}
    assert set(m.state_dict()) == set(m.state_dict_portable())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    kpm = torch.ones(2, 5, dtype=torch.bool)
    kpm[1, -2:] = False  # our polarity: False = padding
    m.eval()
    out, w = m(x, key_padding_mask=kpm, causal=True, need_weights=True)
    ref_out, ref_w = oracle_mha(
        m.state_dict_portable(),
        x.numpy(),
        x.numpy(),
        x.numpy(),
        num_heads=4,
        num_kv_heads=2,
        causal=True,
        key_padding_mask=kpm.numpy(),
    )
    np.testing.assert_allclose(out.detach().numpy(), ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.detach().numpy(), ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)  # eval: no dropout
    m.train()
    torch.manual_seed(0)
    a = m(x)
    b = m(x)
    assert not torch.allclose(a, b)  # train: dropout, fresh draws
    with pytest.raises(ValueError, match="num_kv_heads"):
        m.to_torch()
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    # Same seed, same weights as init_params on NumPy.
    ref_p = mha.init_params(16, 4, num_kv_heads=2, seed=2, dtype=np.float64)
    for n, arr in m.state_dict_portable().items():
        np.testing.assert_array_equal(arr, ref_p[n])


@requires_backend("torch")
def test_state_round_trip_torch_numpy_torch() -> None:
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    # float64: NumPy against torch is one composed computation in two orders (MHA_TOL)
    t1 = MultiHeadAttention(16, 4, kdim=12, vdim=10, seed=7, dtype=torch.float64)
    with torch.no_grad():
        for p in t1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    np_mod = mha.MultiHeadAttention(16, 4, kdim=12, vdim=10, seed=8, dtype=np.float64)
    np_mod.load_state_dict(t1.state_dict_portable())
    t2 = MultiHeadAttention(16, 4, kdim=12, vdim=10, seed=9, dtype=torch.float64)
    t2.load_portable(np_mod.state_dict())
    g = np.random.default_rng(0)
    q, k, v = (g.standard_normal(s) for s in ((2, 3, 16), (2, 5, 12), (2, 5, 10)))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    rtol, atol = MHA_TOL["float64"]
    with torch.no_grad():
        torch.testing.assert_close(t2(tq, tk, tv), t1(tq, tk, tv), rtol=0, atol=0)
        np.testing.assert_allclose(np_mod(q, k, v), t1(tq, tk, tv).numpy(), rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="shape"):
        t2.load_portable({**np_mod.state_dict(), "w_q": np.zeros((3, 3))})


@requires_backend("torch")
def test_frameworks_agree() -> None:
    """The same weights (from the torch module) and inputs on torch, NumPy, JAX and
    array_api_strict give the same float64 result."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    t = MultiHeadAttention(16, 4, num_kv_heads=2, seed=11, dtype=torch.float64)
    state = t.state_dict_portable()
    g = np.random.default_rng(1)
    x = g.standard_normal((2, 6, 16))
    kpm = np.ones((2, 6), dtype=bool)
    kpm[0, -3:] = False
    with torch.no_grad():
        ref = t(torch.from_numpy(x), key_padding_mask=torch.from_numpy(kpm)).numpy()
    np_mod = mha.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=np.float64)
    np_mod.load_state_dict(state)
    np.testing.assert_allclose(np_mod(x, key_padding_mask=kpm), ref, rtol=1e-12, atol=1e-13)
    checked = []
    for b in BACKENDS:
        with b.flags():
            params = {n: b.asarray(a, "float64") for n, a in state.items()}
            out = mha.multi_head_attention(
                params,
                b.asarray(x, "float64"),
                num_heads=4,
                num_kv_heads=2,
                key_padding_mask=b.asarray(kpm),
            )
            np.testing.assert_allclose(b.to_numpy(out), ref, rtol=1e-12, atol=1e-13)
        checked.append(b.name)
    assert checked == [b.name for b in BACKENDS] and "torch" in checked


def test_example_runs() -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / "encoder_layer.py"
    spec = importlib.util.spec_from_file_location("encoder_layer_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main()
    assert "numpy/norm_first=True" in results and "numpy/norm_first=False" in results
    assert "numpy/training" in results  # the seed's dropouts, from each framework's RNG
    for name in ("torch", "jax"):
        if name in BY_NAME:
            assert f"{name}/norm_first=True" in results and f"{name}/training" in results


@requires_backend("torch")
@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_compat_unbatched_and_is_causal(batch_first: bool) -> None:
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    torch.manual_seed(1)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first).double()  # as above
    ours = MultiHeadAttention.from_torch(ref, torch_compat=True)
    rtol, atol = MHA_TOL["float64"]
    x = torch.randn(5, 8).double()  # unbatched [L, E]
    kpm = torch.tensor([False, False, False, True, False])
    o_ref, w_ref = ref(x, x, x, key_padding_mask=kpm)
    o, w = ours(x, x, x, key_padding_mask=kpm)
    torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol)
    xb = (torch.randn(2, 5, 8) if batch_first else torch.randn(5, 2, 8)).double()
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    o_ref, _ = ref(xb, xb, xb, attn_mask=causal, is_causal=True)
    o, _ = ours(xb, xb, xb, is_causal=True)  # no attn_mask: a causal mask is applied
    torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol)


def test_mixed_frameworks_name_both_types() -> None:
    torch = pytest.importorskip("torch")
    params = mha.init_params(8, 2)
    x = np.zeros((1, 3, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"`key`.*Tensor.*`query`.*ndarray"):
        mha.multi_head_attention(params, x, torch.zeros(1, 3, 8), num_heads=2)


@requires_backend("torch", "jax")
def test_same_loss_same_gradients_torch_and_jax() -> None:
    """One set of float64 weights and inputs; the gradients of sum(out**2) with respect to
    every parameter and the query agree between torch autograd and jax.grad."""
    import jax
    import jax.numpy as jnp
    import torch

    params = mha.init_params(12, 4, num_kv_heads=2, kdim=10, vdim=10, dtype=np.float64, seed=5)
    params = {n: p + 0.01 * (i + 1) for i, (n, p) in enumerate(params.items())}  # biases != 0
    rng = np.random.default_rng(7)
    query, key = rng.standard_normal((2, 5, 12)), rng.standard_normal((2, 6, 10))
    pad = np.ones((2, 6), dtype=bool)
    pad[1, 4:] = False

    def loss(xp_params: dict, q: Any, k: Any, kpm: Any) -> Any:
        out = mha.multi_head_attention(
            xp_params, q, k, num_heads=4, num_kv_heads=2, key_padding_mask=kpm, causal=True
        )
        return (out**2).sum()

    t_params = {n: torch.tensor(p, requires_grad=True) for n, p in params.items()}
    t_query = torch.tensor(query, requires_grad=True)
    loss(t_params, t_query, torch.tensor(key), torch.tensor(pad)).backward()

    j_params = {n: jnp.asarray(p) for n, p in params.items()}
    g_params, g_query = jax.grad(loss, argnums=(0, 1))(
        j_params, jnp.asarray(query), jnp.asarray(key), jnp.asarray(pad)
    )
    for name, tp in t_params.items():
        np.testing.assert_allclose(
            np.asarray(g_params[name]), tp.grad.numpy(), rtol=1e-9, atol=1e-12
        )
    np.testing.assert_allclose(np.asarray(g_query), t_query.grad.numpy(), rtol=1e-9, atol=1e-12)


@requires_backend("torch", "jax")
def test_weights_move_torch_jax_numpy_torch_by_dlpack() -> None:
    """torch module -> JAX dict -> NumPy class -> torch module, each hop through DLPack,
    gives the same outputs (float64, identical weights, so agreement to float64 rounding:
    each framework computes the module in its own order)."""
    import jax.numpy as jnp
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    torch.manual_seed(0)
    first = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
    x = np.random.default_rng(1).standard_normal((2, 7, 16))
    with torch.no_grad():
        ref = first(torch.from_numpy(x)).numpy()
    j_params = {n: jnp.from_dlpack(p.detach()) for n, p in first.params().items()}
    assert all(p.dtype == jnp.float64 for p in j_params.values())
    j_out = mha.multi_head_attention(j_params, jnp.asarray(x), num_heads=4, num_kv_heads=2)
    n_mod = mha.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=np.float64)
    n_mod.load_state_dict({n: np.from_dlpack(p) for n, p in j_params.items()})
    n_out = n_mod(x)
    last = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
    last.load_portable({n: torch.from_dlpack(p) for n, p in n_mod.state_dict().items()})
    with torch.no_grad():
        last_out = last(torch.from_numpy(x)).numpy()
    for name, p in last.params().items():
        np.testing.assert_array_equal(p.detach().numpy(), first.params()[name].detach().numpy())
    rtol, atol = MHA_TOL["float64"]
    np.testing.assert_allclose(np.asarray(j_out), ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(n_out, ref, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(last_out, ref)


@requires_backend("torch")
@pytest.mark.compile
def test_torch_module_under_torch_compile() -> None:
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    # float64: the compiled module fuses and reorders the whole composed computation, so
    # it agrees with eager to rounding through it (MHA_TOL), which in float32 varies by CPU.
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64).eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, 5] = False
    compiled = torch.compile(module, fullgraph=True)
    rtol, atol = MHA_TOL["float64"]
    torch.testing.assert_close(
        compiled(x, key_padding_mask=pad, causal=True),
        module(x, key_padding_mask=pad, causal=True),
        rtol=rtol,
        atol=atol,
    )


# --------------------------------------------------------------------------------------------
# Review fixes: masks, drop-in use inside torch's layers, loading, dtypes, errors


@requires_backend("torch")
@pytest.mark.parametrize("which", ["key_padding_mask", "attn_mask"])
def test_torch_compat_refuses_integer_masks(which: str) -> None:
    """torch refuses a uint8/int mask; an old-style 0/1 mask (1 = masked) must not be added
    to the scores as a bias, silently attending to the keys it meant to hide."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    module = MultiHeadAttention(8, 2, seed=0)
    q, k, v, _ = _torch_inputs(True, None, 0)
    shape = (q.shape[0], k.shape[1]) if which == "key_padding_mask" else (q.shape[1], k.shape[1])
    mask = torch.zeros(shape, dtype=torch.uint8)
    mask[..., -1] = 1
    with pytest.raises(TypeError, match=f"`{which}`.*uint8.*bool"):
        module.torch_compat_forward(q, k, v, **{which: mask})


@requires_backend("torch")
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("nested", [False, True])
def test_from_torch_drop_in_inside_transformer_layers(
    batch_first: bool, training: bool, nested: bool
) -> None:
    """``from_torch(m, torch_compat=True)`` replaces ``self_attn`` in torch's encoder layer
    and stack, also after the stack was built: in eval mode the layer (``batch_first=True``)
    and the stack (``enable_nested_tensor``, the default, with a padding mask) read
    attributes to pick torch's fused and nested-tensor paths (AttributeError before);
    outputs match torch's, with and without autograd recording. In float64: torch's fused
    and nested-tensor paths check no dtype, so they run in float64 too, and two whole
    encoder stacks agree to float64 rounding (MHA_TOL)."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        16, 4, dim_feedforward=32, dropout=0.0, batch_first=batch_first, dtype=torch.float64
    )
    stack = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).train(training)
    x = (torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)).double()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, -2:] = True  # torch polarity: True = padding
    with torch.no_grad():
        want = stack(x, src_key_padding_mask=pad)
    for sub in stack.layers:
        sub.self_attn = MultiHeadAttention.from_torch(sub.self_attn, torch_compat=True)
    with torch.no_grad():
        got = stack(x, src_key_padding_mask=pad)
    got_recorded = stack(x, src_key_padding_mask=pad)
    keep = ~pad if batch_first else ~pad.T  # torch's fast path zeroes padded rows' outputs
    rtol, atol = MHA_TOL["float64"]
    torch.testing.assert_close(got[keep], want[keep], rtol=rtol, atol=atol)
    torch.testing.assert_close(got_recorded.detach(), got)


@requires_backend("torch", "jax")
def test_state_loads_bfloat16_and_grad_tracking_arrays() -> None:
    """Every module loads any framework's parameters: bfloat16 (NumPy has it only through
    ml_dtypes) and tensors that require grad, converted to the module's dtype."""
    import torch
    from portable_attention.nn.flax import MultiHeadAttention as FlaxMHA
    from portable_attention.nn.torch import MultiHeadAttention as TorchMHA

    bf16 = TorchMHA(16, 4, num_kv_heads=2, seed=3, dtype=torch.bfloat16)
    f32 = TorchMHA(16, 4, num_kv_heads=2, seed=4)  # parameters require grad
    for source in (bf16.state_dict(), bf16.params(), f32.params()):
        want = {n: t.detach().float().numpy() for n, t in source.items()}
        numpy_module = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0)
        numpy_module.load_state_dict(source)
        flax_module = FlaxMHA(16, 4, num_kv_heads=2, seed=0)
        flax_module.load_state_dict(source)
        torch_module = TorchMHA(16, 4, num_kv_heads=2, seed=0)
        torch_module.load_portable(flax_module.params())
        for name, w in want.items():
            np.testing.assert_array_equal(numpy_module.params[name], w)
            np.testing.assert_array_equal(np.asarray(flax_module.params()[name]), w)
            np.testing.assert_array_equal(torch_module.params()[name].detach().numpy(), w)


def test_init_params_refuses_dtypes_it_cannot_make() -> None:
    with pytest.raises(TypeError, match=r"`dtype`.*floating"):
        mha.init_params(8, 2, dtype=np.int32)
    if "jax" in BY_NAME:
        import jax
        import jax.numpy as jnp

        if not jax.config.jax_enable_x64:  # float64 would come out float32, with a warning
            with pytest.warns(UserWarning), pytest.raises(TypeError, match="jax_enable_x64"):
                mha.init_params(8, 2, xp=jnp, dtype=jnp.float64)


def test_functional_errors_name_the_argument() -> None:
    params = mha.init_params(8, 2)
    x = np.zeros((2, 3, 8), dtype=np.float32)
    with pytest.raises(TypeError, match="`key_padding_mask` must be boolean"):
        mha.multi_head_attention(params, x, num_heads=2, key_padding_mask=np.ones((2, 3)))
    if "torch" in BY_NAME:
        import torch

        with pytest.raises(TypeError, match=r"`params\['w_q'\]` is a numpy.ndarray.*torch"):
            mha.multi_head_attention(params, torch.zeros(2, 3, 8), num_heads=2)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_modules_refuse_dropout_out_of_range(p: float) -> None:
    """Refused when the module is built (and by ``from_torch``), not at its first call."""
    with pytest.raises(ValueError, match="`dropout` must be in"):
        mha.MultiHeadAttention(8, 2, dropout=p)
    if "torch" in BY_NAME:
        import torch
        from portable_attention.nn.torch import MultiHeadAttention

        with pytest.raises(ValueError, match="`dropout` must be in"):
            MultiHeadAttention(8, 2, dropout=p)
        if 0 <= p <= 1:  # torch takes p = 1 (all dropped), which attend does not compute
            with pytest.raises(ValueError, match="`dropout` must be in"):
                MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, dropout=p))


def test_init_params_sizes_are_positive_ints() -> None:
    """NumPy integers are ints; bools, floats and non-positive sizes are refused by name."""
    assert mha.init_params(8, np.int64(2))["w_q"].shape == (8, 8)
    with pytest.raises(ValueError, match="`kdim` must be a positive int"):
        mha.init_params(8, 2, kdim=0)
    with pytest.raises(TypeError, match="`num_heads` must be a positive int"):
        mha.init_params(8, True)
    with pytest.raises(TypeError, match="`embed_dim` must be a positive int"):
        mha.init_params(8.0, 2)


@requires_backend("torch")
def test_from_torch_takes_only_multihead_attention() -> None:
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    with pytest.raises(TypeError, match=r"`m` must be a torch\.nn\.MultiheadAttention"):
        MultiHeadAttention.from_torch(torch.nn.Linear(8, 8))  # type: ignore[arg-type]


def test_mask_is_checked_before_it_meets_key_padding_mask(backend: Backend) -> None:
    """``mask`` and ``key_padding_mask`` are combined before ``attend``: a float mask or
    a misshapen one must get ``attend``'s error, naming `mask` and the shape passed, not
    the framework's error about ``&``."""
    params = {n: backend.asarray(a) for n, a in mha.init_params(8, 2, seed=0).items()}
    x = backend.asarray(np.zeros((2, 5, 8), dtype=np.float32))
    kpm = backend.asarray(np.ones((2, 5), dtype=bool))
    float_mask = backend.asarray(np.zeros((5, 5), dtype=np.float32))
    with pytest.raises(TypeError, match=r"`mask` must be boolean.*`bias=`"):
        mha.multi_head_attention(params, x, num_heads=2, mask=float_mask, key_padding_mask=kpm)
    short = backend.asarray(np.ones((3, 5), dtype=bool))
    with pytest.raises(ValueError, match=r"`mask` of shape \(3, 5\) does not broadcast"):
        mha.multi_head_attention(params, x, num_heads=2, mask=short, key_padding_mask=kpm)
    with pytest.raises(TypeError, match=r"`bias` must be an additive float"):
        mha.multi_head_attention(params, x, num_heads=2, bias=kpm)


@requires_backend("torch")
@pytest.mark.parametrize(
    ("which", "shape", "dtype"),
    [
        ("attn_mask", (3, 5, 5), "bool"),  # 3-D must be [B * H, Lq, Lk] = [8, 5, 5]
        ("attn_mask", (3, 5, 5), "float32"),
        ("attn_mask", (4, 4), "bool"),
        ("attn_mask", (2, 4, 5, 5), "bool"),  # torch takes no 4-D attn_mask
        ("key_padding_mask", (2, 4), "float32"),
        ("key_padding_mask", (2, 4), "bool"),
    ],
)
def test_torch_compat_misshapen_masks_name_torchs_argument(
    which: str, shape: tuple[int, ...], dtype: str
) -> None:
    """Wrong mask shapes in torch's signature: a ValueError naming torch's argument and
    the shapes it takes, not a reshape error from inside (nor `mask` for `attn_mask`)."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    module = MultiHeadAttention(16, 4, batch_first=True, seed=0)  # B=2, H=4, L=5
    x = torch.randn(2, 5, 16)
    m = torch.zeros(shape, dtype=getattr(torch, dtype))
    with pytest.raises(
        ValueError, match=rf"`{which}` must be \[.*got shape {re.escape(str(shape))}"
    ):
        module.torch_compat_forward(x, x, x, **{which: m})


@requires_backend("torch")
def test_torch_compat_mask_shapes_as_passed_unbatched_and_sequence_first() -> None:
    """The shapes are checked as the caller passed them, in torch's terms: ``[Lk]`` for an
    unbatched query (not the ``[1, Lk]`` made inside), ``[B, Lk]`` with ``batch_first=False``
    (``[L, B, E]`` inputs), ``[num_heads, Lq, Lk]`` as the unbatched stacked attn_mask."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    module = MultiHeadAttention(16, 4, batch_first=False, seed=0)
    x = torch.randn(5, 16)  # unbatched: [L, E]
    with pytest.raises(
        ValueError, match=r"`key_padding_mask` must be \[Lk\] = \(5,\), got shape \(1, 5\)"
    ):
        module.torch_compat_forward(x, x, x, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    stacked = torch.zeros(4, 5, 5, dtype=torch.bool)
    stacked[:, :, -1] = True  # torch polarity: the last key is hidden
    out, _ = module.torch_compat_forward(x, x, x, attn_mask=stacked)
    want, _ = module.torch_compat_forward(x[:, :], x[:4], x[:4])
    torch.testing.assert_close(out, want)
    seq_first = torch.randn(5, 2, 16)  # [L, B, E]
    with pytest.raises(ValueError, match=r"`key_padding_mask` must be \[B, Lk\] = \(2, 5\)"):
        module.torch_compat_forward(
            seq_first, seq_first, seq_first, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool)
        )


def test_framework_modules_live_in_nn_which_imports_no_framework() -> None:
    """The public modules are ``portable_attention.nn.torch`` / ``.nn.flax``; ``backends/``
    holds only adapters (no ``torch_mha`` / ``flax_mha`` left there), and importing
    ``portable_attention.nn`` imports no framework."""
    for gone in ("torch_mha", "flax_mha"):
        assert importlib.util.find_spec(f"portable_attention.backends.{gone}") is None
    for name in ("torch", "flax"):
        assert importlib.util.find_spec(f"portable_attention.nn.{name}") is not None
    out = run_python(
        "import sys\n"
        "import portable_attention.nn\n"
        "print(sorted(m for m in ('torch', 'jax', 'flax') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"


# --------------------------------------------------------------------------------------------
# Issue 18 through the modules: learned sinks, window, segment_ids, score_mod, mask_mod

SINK_VALUES = np.array([0.7, -1.5, 2.5, 0.0])  # one logit per query head (Hq = 4)


def _packed_inputs() -> tuple[np.ndarray, np.ndarray, list[list[tuple[int, int]]]]:
    """``x [2, 8, 16]``, packed ids ``[2, 8]`` and each row's ``(start, end)`` runs."""
    x = rng_for("mha", "packed").standard_normal((2, 8, 16))
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 7, 7, 7, 7]])
    runs = [[(0, 3), (3, 5), (5, 8)], [(0, 4), (4, 8)]]
    return x, ids, runs


def _each_alone(call: Any, x: np.ndarray, runs: list[list[tuple[int, int]]], to: Any) -> np.ndarray:
    """``call`` on every packed sequence of ``x`` alone, put back in place (float64)."""
    out = np.zeros_like(x)
    for row, spans in enumerate(runs):
        for start, end in spans:
            out[row : row + 1, start:end] = call(to(x[row : row + 1, start:end]))
    return out


def _head_mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Causal for heads 1.., everything for head 0 (reads ``h``: the query heads)."""
    return (kv_idx <= q_idx) | (h == 0)


def _head_mask(heads: int, lq: int, lk: int) -> np.ndarray:
    causal = np.arange(lk)[None, :] <= np.arange(lq)[:, None]
    return causal[None] | (np.arange(heads) == 0)[:, None, None]  # [Hq, Lq, Lk]


def _sink_params(e: int = 16, hq: int = 4, hk: int = 2, seed: int = 3) -> dict[str, np.ndarray]:
    params = mha.init_params(e, hq, num_kv_heads=hk, sinks=True, dtype=np.float64, seed=seed)
    params["sinks"] = SINK_VALUES[:hq].copy()
    params["b_q"] = 0.1 * rng_for("mha", "b_q").standard_normal(params["b_q"].shape)
    return params


def test_sinks_in_params_match_oracle(backend: Backend, hp_dtype: str) -> None:
    """``params['sinks']`` reach attend: out and weights equal the float64 oracle's (a
    softmax with one more column per head), self-attention (grouped heads, causal, padding)
    and cross-attention (``kdim != E``, a mask too); rows sum to less than 1, and a query with
    no key left (key 0 padded, causal) gives exactly the output bias."""
    rng = rng_for("mha", "sinks-oracle")
    self_params = _sink_params()
    self_params["b_o"] = 0.1 * rng.standard_normal(16)
    wide = mha.init_params(16, 4, num_kv_heads=2, kdim=12, vdim=12, dtype=np.float64)
    cross_params = {**_sink_params(), "w_k": wide["w_k"], "w_v": wide["w_v"]}
    x = rng.standard_normal((2, 8, 16))
    kv = rng.standard_normal((2, 8, 12))
    kpm = np.ones((2, 8), dtype=bool)
    kpm[0, 0] = kpm[1, 6:] = False
    mask = rng.random((8, 8)) > 0.4
    cases = {
        "self": (self_params, x, x, {"causal": True, "key_padding_mask": kpm}),
        "cross": (cross_params, x, kv, {"mask": mask, "causal": True, "key_padding_mask": kpm}),
    }
    rtol, atol = MHA_TOL[hp_dtype]
    dt = backend.dtype(hp_dtype)
    for case, (p64, q_in, kv_in, opts) in cases.items():
        ref_out, ref_w = oracle_mha(p64, q_in, kv_in, kv_in, num_heads=4, num_kv_heads=2, **opts)
        params = {n: backend.asarray(a, hp_dtype) for n, a in p64.items()}
        query, key = backend.asarray(q_in, hp_dtype), backend.asarray(kv_in, hp_dtype)
        out, weights = mha.multi_head_attention(
            params,
            query,
            None if case == "self" else key,
            num_heads=4,
            num_kv_heads=2,
            return_weights=True,
            **{n: o if isinstance(o, bool) else backend.asarray(o) for n, o in opts.items()},
        )
        assert_like(out, query, shape=ref_out.shape, dtype=dt, name="out")
        assert_like(weights, query, shape=ref_w.shape, dtype=dt, name="weights")
        np.testing.assert_allclose(backend.to_numpy(out), ref_out, rtol=rtol, atol=atol)
        np.testing.assert_allclose(backend.to_numpy(weights), ref_w, rtol=rtol, atol=atol)
        sums = ref_w.sum(-1)
        assert np.all(sums < 1 - 1e-3) and sums.max() > 0.5, case
        if case == "self":  # batch 0, query 0 sees only key 0, which is padding
            assert np.all(ref_w[0, :, 0] == 0) and np.all(backend.to_numpy(weights)[0, :, 0] == 0)
            got = backend.to_numpy(out)[0, 0]  # 0 through attention: the output bias
            np.testing.assert_allclose(got, self_params["b_o"], rtol=rtol, atol=atol)


def test_init_params_sinks(backend: Backend) -> None:
    """``sinks=True`` adds zeros ``(num_heads,)`` of the parameters' namespace, dtype and
    device, and leaves every other parameter as the same seed gives without it; a zero
    sink is not no sink (``exp(0)`` joins each denominator)."""
    dt = backend.dtype("float64")
    p = mha.init_params(16, 4, num_kv_heads=2, sinks=True, xp=backend.xp, dtype=dt, seed=4)
    plain = mha.init_params(16, 4, num_kv_heads=2, xp=backend.xp, dtype=dt, seed=4)
    assert list(p) == [*plain, "sinks"]
    assert_like(p["sinks"], p["w_q"], shape=(4,), dtype=dt, name="sinks")
    assert np.all(backend.to_numpy(p["sinks"]) == 0)
    for name in plain:
        np.testing.assert_array_equal(backend.to_numpy(p[name]), backend.to_numpy(plain[name]))
    x = backend.asarray(rng_for("mha", "init-sinks").standard_normal((2, 8, 16)), "float64")
    _, w = mha.multi_head_attention(p, x, num_heads=4, num_kv_heads=2, return_weights=True)
    _, w_plain = mha.multi_head_attention(
        plain, x, num_heads=4, num_kv_heads=2, return_weights=True
    )
    w, w_plain = backend.to_numpy(w), backend.to_numpy(w_plain)
    np.testing.assert_allclose(w_plain.sum(-1), 1, rtol=1e-12)
    # A sink only rescales each row (its denominator gains exp(0) = 1): normalised again,
    # the weights are those without it.
    np.testing.assert_allclose(w / w.sum(-1, keepdims=True), w_plain, rtol=1e-10, atol=1e-14)
    assert np.all(w.sum(-1) < 1)
    with pytest.raises(TypeError, match="`sinks` must be True or False"):
        mha.init_params(16, 4, sinks="yes")  # type: ignore[arg-type]


def test_params_sinks_errors_name_them() -> None:
    p = mha.init_params(8, 2, sinks=True)
    x = np.zeros((2, 3, 8), dtype=np.float32)
    for bad in (np.zeros(3, np.float32), np.zeros((1, 2), np.float32), np.zeros((), np.float32)):
        with pytest.raises(
            ValueError, match=r"`params\['sinks'\]` must be an array \[num_heads\] = \(2,\)"
        ):
            mha.multi_head_attention({**p, "sinks": bad}, x, num_heads=2)
    with pytest.raises(TypeError, match=r"`params\['sinks'\]` has dtype float64"):
        mha.multi_head_attention({**p, "sinks": np.zeros(2)}, x, num_heads=2)
    with pytest.raises(TypeError, match=r"`params\['sinks'\]` must be an array"):
        mha.multi_head_attention({**p, "sinks": [0.0, 0.0]}, x, num_heads=2)
    if "torch" in BY_NAME:
        import torch

        with pytest.raises(TypeError, match=r"`params\['sinks'\]` is a torch.Tensor"):
            mha.multi_head_attention({**p, "sinks": torch.zeros(2)}, x, num_heads=2)
    # segment ids are attend's to check: the message names them
    with pytest.raises(ValueError, match="`segment_ids` must have shape"):
        mha.multi_head_attention(p, x, num_heads=2, segment_ids=np.zeros((2, 4), np.int32))


def test_segment_ids_window_and_sinks_equal_each_sequence_alone(backend: Backend) -> None:
    """Packed self-attention (``segment_ids [B, L]``, causal and a window aligned within
    each sequence, sinks) equals the float64 oracle run on each sequence alone; the pair
    form (cross-attention, each query run with its own keys, ids broadcast over the
    batch) likewise."""
    params64 = _sink_params()
    params = {n: backend.asarray(a, "float64") for n, a in params64.items()}
    x, ids, runs = _packed_inputs()
    opts = {"num_heads": 4, "num_kv_heads": 2, "causal": True, "window": (2, 0)}
    out = mha.multi_head_attention(
        params, backend.asarray(x, "float64"), segment_ids=backend.asarray(ids), **opts
    )
    alone = _each_alone(lambda a: oracle_mha(params64, a, a, a, **opts)[0], x, runs, np.asarray)
    assert_like(out, params["w_q"], shape=x.shape, dtype=backend.dtype("float64"), name="out")
    np.testing.assert_allclose(backend.to_numpy(out), alone, rtol=1e-10, atol=1e-12)

    # cross-attention, ids as a pair: query runs (3, 4, 1), key runs (2, 3, 3)
    rng = rng_for("mha", "pair")
    q_in, kv_in = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 16))
    q_ids, kv_ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2]]), np.array([[0, 0, 1, 1, 1, 2, 2, 2]])
    cross = mha.multi_head_attention(
        params,
        backend.asarray(q_in, "float64"),
        backend.asarray(kv_in, "float64"),
        segment_ids=(backend.asarray(q_ids), backend.asarray(kv_ids)),
        num_heads=4,
        num_kv_heads=2,
        causal=True,
    )
    want = np.zeros_like(q_in)
    for (qs, qe), (ks, ke) in zip([(0, 3), (3, 7), (7, 8)], [(0, 2), (2, 5), (5, 8)], strict=True):
        q_seg, kv_seg = q_in[:, qs:qe], kv_in[:, ks:ke]
        want[:, qs:qe] = oracle_mha(
            params64, q_seg, kv_seg, kv_seg, num_heads=4, num_kv_heads=2, causal=True
        )[0]
    np.testing.assert_allclose(backend.to_numpy(cross), want, rtol=1e-10, atol=1e-12)


def test_mask_mod_and_score_mod_equal_mask_and_bias(backend: Backend) -> None:
    """A ``mask_mod`` (a function and its block plan) through the functional core equals
    its dense mask, combined with ``key_padding_mask``; a ``score_mod`` its bias. Both see
    ``h`` as the query head."""
    import array_api_compat

    params = {n: backend.asarray(a, "float64") for n, a in _sink_params().items()}
    x64 = rng_for("mha", "mods").standard_normal((2, 8, 16))
    x = backend.asarray(x64, "float64")
    kpm = np.ones((2, 8), dtype=bool)
    kpm[1, 5:] = False
    opts = {"num_heads": 4, "num_kv_heads": 2, "key_padding_mask": backend.asarray(kpm)}
    dense = mha.multi_head_attention(
        params, x, mask=backend.asarray(_head_mask(4, 8, 8)), return_weights=True, **opts
    )
    plan = block_plan(_head_mask_mod, 8, 8, heads=4, block_size=4, like=x)
    for mod in (_head_mask_mod, plan):
        got = mha.multi_head_attention(params, x, mask_mod=mod, return_weights=True, **opts)
        for a, b in zip(got, dense, strict=True):
            np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), atol=1e-13)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = array_api_compat.array_namespace(score)
        return (
            score + 0.25 * xp.astype(kv_idx - q_idx, score.dtype) - 0.5 * xp.astype(h, score.dtype)
        )

    i = np.arange(8)
    bias = 0.25 * (i[None, :] - i[:, None])[None] - 0.5 * np.arange(4)[:, None, None]
    with_bias = mha.multi_head_attention(
        params, x, bias=backend.asarray(bias, "float64"), causal=True, **opts
    )
    with_mod = mha.multi_head_attention(params, x, score_mod=score_mod, causal=True, **opts)
    np.testing.assert_allclose(
        backend.to_numpy(with_mod), backend.to_numpy(with_bias), rtol=1e-12, atol=1e-13
    )
    ref, _ = oracle_mha(
        _sink_params(),
        x64,
        x64,
        x64,
        num_heads=4,
        num_kv_heads=2,
        causal=True,
        key_padding_mask=kpm,
        score_mod=lambda s, b, h, q, k: s + bias,
    )
    np.testing.assert_allclose(backend.to_numpy(with_mod), ref, rtol=1e-10, atol=1e-12)


def test_numpy_class_sinks_and_state() -> None:
    m = mha.MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, seed=5)
    assert m.params["sinks"].shape == (4,) and m.params["sinks"].dtype == np.float32
    # packed against alone: the module in float64 (each call runs the composed
    # computation in its own shapes, so they agree to rounding: MHA_TOL)
    m64 = mha.MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, seed=5, dtype=np.float64)
    x, ids, runs = _packed_inputs()
    out = m64(x, segment_ids=ids, causal=True)
    alone = _each_alone(lambda a: m64(a, causal=True), x, runs, lambda a: a)
    np.testing.assert_allclose(out, alone, *MHA_TOL["float64"])
    other = mha.MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, seed=6)
    other.load_state_dict({**m.state_dict(), "sinks": SINK_VALUES})
    np.testing.assert_array_equal(other.params["sinks"], SINK_VALUES.astype(np.float32))
    with pytest.raises(ValueError, match=r"built with `sinks=True`"):
        m.load_state_dict(mha.MultiHeadAttention(16, 4, num_kv_heads=2).state_dict())
    with pytest.raises(ValueError, match=r"build it with `sinks=True`"):
        mha.MultiHeadAttention(16, 4, num_kv_heads=2).load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match=r"`state\['sinks'\]` must be \[num_heads\] = \(4,\)"):
        m.load_state_dict({**m.state_dict(), "sinks": np.zeros((1, 4))})


@requires_backend("torch")
def test_torch_sinks_match_oracle_get_gradients_and_train() -> None:
    """The torch module's ``sinks`` parameter: output equals the float64 oracle, its
    gradient equals ``oracle.sink_grads`` on the projected heads (a query with no key
    included), and one SGD step moves it by ``-lr * grad``."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    m = MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, seed=5, dtype=torch.float64)
    assert "sinks=True" in repr(m) and m.has_sinks
    assert set(m.state_dict()) == {*mha.WEIGHTS, *mha.BIASES, "sinks"}
    with torch.no_grad():
        m.sinks.copy_(torch.from_numpy(SINK_VALUES))
    rng = rng_for("mha", "torch-sinks")
    x, w_loss = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    kpm = np.ones((2, 5), dtype=bool)
    kpm[0, 0] = kpm[1, 3:] = False
    out = m(torch.from_numpy(x), key_padding_mask=torch.from_numpy(kpm), causal=True)
    (out * torch.from_numpy(w_loss)).sum().backward()
    state = m.state_dict_portable()
    ref, _ = oracle_mha(
        state, x, x, x, num_heads=4, num_kv_heads=2, causal=True, key_padding_mask=kpm
    )
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-10, atol=1e-12)
    q, k, v = oracle_heads(state, x, x, x, 4, 2)
    w_att = split_heads64(w_loss @ state["w_o"].T, 4)  # d loss / d (attention output)
    want = oracle.sink_grads(
        q, k, v, w_att, sinks=state["sinks"], mask=kpm[:, None, None, :], causal=True
    )
    assert m.sinks.grad is not None and np.abs(want).min() > 1e-3
    np.testing.assert_allclose(m.sinks.grad.numpy(), want, rtol=1e-9, atol=1e-12)
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    np.testing.assert_allclose(m.sinks.detach().numpy(), SINK_VALUES - 0.1 * want, rtol=1e-12)
    with pytest.raises(ValueError, match=r"`sinks`.*nn\.MultiheadAttention"):
        MultiHeadAttention(16, 4, sinks=True).to_torch()


@requires_backend("torch")
def test_torch_module_segment_ids_and_mask_mod() -> None:
    """Through the torch module: packed sequences equal each sequence alone (sinks on),
    and a mask_mod (function or block plan) equals its mask, gradients included."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    m = MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, seed=1, dtype=torch.float64)
    with torch.no_grad():
        m.sinks.copy_(torch.from_numpy(SINK_VALUES))
    x, ids, runs = _packed_inputs()
    with torch.no_grad():
        out = m(torch.from_numpy(x), segment_ids=torch.from_numpy(ids), causal=True, window=2)
        alone = _each_alone(
            lambda a: m(a, causal=True, window=2).numpy(), x, runs, torch.from_numpy
        )
    np.testing.assert_allclose(out.numpy(), alone, rtol=1e-10, atol=1e-12)

    xt = torch.from_numpy(x[:, :6]).requires_grad_(True)
    plan = block_plan(_head_mask_mod, 6, 6, heads=4, block_size=2, like=xt)
    dense = m(xt, mask=torch.from_numpy(_head_mask(4, 6, 6)))
    (g_dense,) = torch.autograd.grad(dense.square().sum(), (xt,))
    for mod in (_head_mask_mod, plan):
        got = m(xt, mask_mod=mod)
        (g_got,) = torch.autograd.grad(got.square().sum(), (xt,))
        torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(g_got, g_dense, rtol=1e-10, atol=1e-12)


@requires_backend("torch", "jax")
def test_sinks_modules_agree_across_frameworks_and_states_round_trip() -> None:
    """Same seed with ``sinks=True``: the NumPy class, the torch module, the Flax module
    and ``init_params`` on every selected backend give the same outputs (which differ from
    those without sinks); trained (non-zero) sinks go torch -> NumPy -> Flax -> torch
    unchanged; loading into a module without sinks (or the reverse, or a wrong shape)
    is refused by name. In float64: each framework computes the module in its own order,
    so they agree to float64 rounding (MHA_TOL)."""
    import jax.numpy as jnp
    import torch
    from portable_attention.nn.flax import MultiHeadAttention as FlaxMHA
    from portable_attention.nn.torch import MultiHeadAttention as TorchMHA

    x = rng_for("mha", "agree-sinks").standard_normal((2, 6, 16))
    kpm = np.ones((2, 6), dtype=bool)
    kpm[0, -2:] = False
    same = {"num_kv_heads": 2, "sinks": True, "seed": 11}
    t = TorchMHA(16, 4, **same, dtype=torch.float64)
    sinkless = TorchMHA(16, 4, num_kv_heads=2, seed=11, dtype=torch.float64)
    with torch.no_grad():
        ref = t(torch.from_numpy(x), key_padding_mask=torch.from_numpy(kpm)).numpy()
        plain = sinkless(torch.from_numpy(x)).numpy()
    assert not np.allclose(ref, plain, atol=1e-3)
    n = mha.MultiHeadAttention(16, 4, **same, dtype=np.float64)
    f = FlaxMHA(16, 4, **same, dtype=jnp.float64)
    rtol, atol = MHA_TOL["float64"]
    np.testing.assert_allclose(n(x, key_padding_mask=kpm), ref, rtol=rtol, atol=atol)
    f_out = f(jnp.asarray(x), key_padding_mask=jnp.asarray(kpm))
    np.testing.assert_allclose(np.asarray(f_out), ref, rtol=rtol, atol=atol)
    for b in BACKENDS:
        with b.flags():
            dt = b.dtype("float64")
            params = mha.init_params(16, 4, num_kv_heads=2, sinks=True, xp=b.xp, dtype=dt, seed=11)
            out = mha.multi_head_attention(
                params,
                b.asarray(x, "float64"),
                num_heads=4,
                num_kv_heads=2,
                key_padding_mask=b.asarray(kpm),
            )
            np.testing.assert_allclose(b.to_numpy(out), ref, rtol=rtol, atol=atol, err_msg=b.name)

    with torch.no_grad():
        t.sinks.copy_(torch.from_numpy(SINK_VALUES))
        trained = t(torch.from_numpy(x)).numpy()
    n.load_state_dict(t.state_dict_portable())
    f.load_state_dict(n.state_dict())
    back = TorchMHA(16, 4, num_kv_heads=2, sinks=True, seed=0, dtype=torch.float64)
    back.load_portable(f.state_dict())
    np.testing.assert_array_equal(back.sinks.detach().numpy(), SINK_VALUES)
    np.testing.assert_array_equal(np.asarray(f.params()["sinks"]), back.sinks.detach().numpy())
    with torch.no_grad():
        np.testing.assert_array_equal(back(torch.from_numpy(x)).numpy(), trained)
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), trained, rtol=rtol, atol=atol)
    torch_state = t.state_dict()  # torch's own state dict, with sinks, round-trips too
    again = TorchMHA(16, 4, num_kv_heads=2, sinks=True, seed=3, dtype=torch.float64)
    again.load_state_dict(torch_state)
    torch.testing.assert_close(again.sinks, t.sinks, rtol=0, atol=0)

    no_sinks = (
        TorchMHA(16, 4, num_kv_heads=2).load_portable,
        FlaxMHA(16, 4, num_kv_heads=2).load_state_dict,
    )
    for load in no_sinks:
        with pytest.raises(ValueError, match=r"`state` has 'sinks'.*`sinks=True`"):
            load(t.state_dict_portable())
    without = {k: a for k, a in t.state_dict_portable().items() if k != "sinks"}
    wrong = {**t.state_dict_portable(), "sinks": np.zeros(3, np.float32)}
    for load in (back.load_portable, f.load_state_dict):
        with pytest.raises(ValueError, match=r"`state` has no 'sinks'.*`sinks=True`"):
            load(without)
        with pytest.raises(ValueError, match=r"`state\['sinks'\]` must be \[num_heads\]"):
            load(wrong)
