"""The Flax NNX multi-head attention module (runs where jax is selected and flax imports)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import mha

import oracle
from conftest import requires_backend
from helpers import GRAD64, MHA_TOL

# Compositions compared within one dtype (jit against eager, a vmap against single calls,
# nnx.grad against jax.grad, a state moved from torch) run in float64, where two orders of
# one computation agree to float64 rounding; in float32 that rounding differs by CPU.
F64 = MHA_TOL["float64"]

pytestmark = requires_backend("jax")


def _module(**kwargs: Any) -> Any:
    pytest.importorskip("flax")
    from portable_attention.nn.flax import MultiHeadAttention

    return MultiHeadAttention(16, 4, num_kv_heads=2, **kwargs)


def _x(shape: tuple[int, ...] = (2, 5, 16), dtype: Any = None) -> Any:
    import jax.numpy as jnp

    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype or jnp.float32)


def test_forward_matches_functional_core_and_oracle() -> None:
    import jax.numpy as jnp

    m = _module(seed=3)
    x = _x()
    kpm = np.ones((2, 5), dtype=bool)
    kpm[1, 3:] = False
    out = m(x, key_padding_mask=jnp.asarray(kpm), causal=True)
    params = mha.init_params(16, 4, num_kv_heads=2, seed=3, dtype=np.float64)
    x64 = np.asarray(x, dtype=np.float64)
    ref = mha.multi_head_attention(
        params, x64, num_heads=4, num_kv_heads=2, key_padding_mask=kpm, causal=True
    )
    rtol, atol = MHA_TOL["float32"]
    np.testing.assert_allclose(np.asarray(out), ref, rtol=rtol, atol=atol)
    # and the attention inside against the independent oracle
    q = (x64 @ params["w_q"]).reshape(2, 5, 4, 4).transpose(0, 2, 1, 3)
    k = (x64 @ params["w_k"]).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    v = (x64 @ params["w_v"]).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    att = oracle.attention(q, k, v, mask=kpm[:, None, None, :], causal=True)[0]
    expected = att.transpose(0, 2, 1, 3).reshape(2, 5, 16) @ params["w_o"]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=rtol, atol=atol)


def test_jit_vmap_grad_through_the_module() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    m = _module(dtype=jnp.float64)
    x = _x(dtype=jnp.float64)
    eager = m(x, causal=True)
    jitted = nnx.jit(lambda mod, a: mod(a, causal=True))(m, x)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), *F64)
    batched = nnx.vmap(lambda mod, a: mod(a), in_axes=(None, 0))(m, jnp.stack([x, 2 * x]))
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(m(2 * x)), *F64)
    grads = nnx.grad(lambda mod, a: (mod(a) ** 2).sum())(m, x)
    params = m.params()
    want = jax.grad(
        lambda p: (mha.multi_head_attention(p, x, num_heads=4, num_kv_heads=2) ** 2).sum()
    )(params)
    for name in params:
        got = np.asarray(grads[name][...])
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, np.asarray(want[name]), *GRAD64)


def test_train_eval_switch_dropout() -> None:
    from flax import nnx

    m = _module(dropout=0.5, rngs=nnx.Rngs(dropout=0))
    x = _x()
    assert not np.allclose(np.asarray(m(x)), np.asarray(m(x)))
    m.eval()
    np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(m(x)))
    m.train()
    assert not m.deterministic


def test_state_moves_between_torch_and_flax() -> None:
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    from portable_attention.nn.torch import MultiHeadAttention as TorchMHA

    # float32 state keeps float32 both ways; the outputs are compared in float64 (F64)
    f32 = _module(seed=1)
    f32.load_state_dict(TorchMHA(16, 4, num_kv_heads=2, seed=9).state_dict_portable())
    assert all(a.dtype == jnp.float32 for a in f32.params().values())
    back32 = TorchMHA(16, 4, num_kv_heads=2, seed=2)
    back32.load_portable(f32.state_dict())
    assert all(p.dtype == torch.float32 for p in back32.params().values())

    t = TorchMHA(16, 4, num_kv_heads=2, seed=9, dtype=torch.float64)
    f = _module(seed=1, dtype=jnp.float64)
    f.load_state_dict(t.state_dict_portable())
    x = _x(dtype=jnp.float64)
    with torch.no_grad():
        ref = t(torch.from_numpy(np.asarray(x))).numpy()
    np.testing.assert_allclose(np.asarray(f(x)), ref, *F64)
    back = TorchMHA(16, 4, num_kv_heads=2, seed=2, dtype=torch.float64)
    back.load_portable(f.state_dict())
    with torch.no_grad():
        np.testing.assert_array_equal(back(torch.from_numpy(np.asarray(x))).numpy(), ref)
    with pytest.raises(ValueError, match="`state`"):
        f.load_state_dict({"w_q": np.zeros((16, 16))})


def test_dropout_without_keys_says_how_to_give_them() -> None:
    """Training mode with dropout and neither ``rngs`` nor ``rng=``: the error names the
    three ways out; an explicit key or ``.eval()`` runs."""
    import jax

    m = _module(dropout=0.5)
    x = _x()
    with pytest.raises(ValueError, match=r"rngs=nnx\.Rngs.*rng=.*\.eval\(\)"):
        m(x)
    assert m(x, rng=jax.random.key(0)).shape == x.shape
    m.eval()
    assert m(x).shape == x.shape


SINK_VALUES = np.array([0.7, -1.5, 2.5, 0.0])  # one logit per query head (Hq = 4)


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    """``[B, L, H * D] -> [B, H, L, D]``."""
    b, length, width = x.shape
    return x.reshape(b, length, heads, width // heads).transpose(0, 2, 1, 3)


def _sink_module() -> Any:
    """A float64 module with sinks set to distinct values (and non-zero biases)."""
    import jax.numpy as jnp

    m = _module(sinks=True, seed=5, dtype=jnp.float64)
    m.sinks[...] = jnp.asarray(SINK_VALUES)
    m.b_q[...] = jnp.linspace(-0.2, 0.2, 16)
    return m


def test_sinks_match_oracle_get_gradients_and_train() -> None:
    """The ``sinks`` param under ``nnx.jit``: the output equals the float64 oracle on the
    projected heads; its ``nnx.grad`` gradient equals ``oracle.sink_grads`` (a query with
    no key included); one optax SGD step moves it by ``-lr * grad``. (Eager forward with
    sinks: ``test_mha``; one jitted step keeps this test fast.)"""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    m = _sink_module()
    assert m.params()["sinks"].shape == (4,) and "sinks" in m.state_dict()
    rng = np.random.default_rng(3)
    x, w_loss = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 8, 16))
    kpm = np.ones((2, 8), dtype=bool)
    kpm[0, 0] = kpm[1, 6:] = False

    def loss(mod: Any, a: Any) -> Any:
        out = mod(a, key_padding_mask=jnp.asarray(kpm), causal=True)
        return (out * jnp.asarray(w_loss)).sum(), out

    p = {n: np.asarray(a) for n, a in m.params().items()}
    q, k, v = (_heads(x @ p[f"w_{n}"] + p[f"b_{n}"], h) for n, h in (("q", 4), ("k", 2), ("v", 2)))
    mask = kpm[:, None, None, :]
    att = oracle.attention(q, k, v, mask=mask, causal=True, sinks=SINK_VALUES)[0]
    ref = att.transpose(0, 2, 1, 3).reshape(2, 8, 16) @ p["w_o"] + p["b_o"]
    (_, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(m, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-10, atol=1e-12)
    want = oracle.sink_grads(
        q, k, v, _heads(w_loss @ p["w_o"].T, 4), sinks=SINK_VALUES, mask=mask, causal=True
    )
    assert np.abs(want).min() > 1e-3
    np.testing.assert_allclose(np.asarray(grads["sinks"][...]), want, rtol=1e-9, atol=1e-12)
    optimizer = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
    optimizer.update(m, grads)
    np.testing.assert_allclose(np.asarray(m.sinks[...]), SINK_VALUES - 0.1 * want, rtol=1e-12)


def test_segment_ids_and_mask_mod_through_the_module_under_jit() -> None:
    """Under ``nnx.jit`` (ids traced): packed sequences (causal, a window, sinks) equal
    the float64 oracle run on each sequence alone; a ``mask_mod`` and its block plan equal
    the dense mask they stand for."""
    import jax.numpy as jnp
    from flax import nnx
    from portable_attention import masks

    m = _sink_module()
    p = {n: np.asarray(a) for n, a in m.params().items()}
    x = np.random.default_rng(4).standard_normal((2, 8, 16))
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 7, 7, 7, 7]])
    runs = [[(0, 3), (3, 5), (5, 8)], [(0, 4), (4, 8)]]
    packed = nnx.jit(lambda mod, a, s: mod(a, segment_ids=s, causal=True, window=(2, 0)))(
        m, jnp.asarray(x), jnp.asarray(ids)
    )
    want = np.zeros_like(x)
    for row, spans in enumerate(runs):
        for start, end in spans:
            seg = x[row : row + 1, start:end]
            q, k, v = (
                _heads(seg @ p[f"w_{n}"] + p[f"b_{n}"], h)
                for n, h in (("q", 4), ("k", 2), ("v", 2))
            )
            att = oracle.attention(q, k, v, causal=True, window=(2, 0), sinks=SINK_VALUES)[0]
            merged = att.transpose(0, 2, 1, 3).reshape(1, end - start, 16)
            want[row : row + 1, start:end] = merged @ p["w_o"] + p["b_o"]
    np.testing.assert_allclose(np.asarray(packed), want, rtol=1e-10, atol=1e-12)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (h == 0)  # head 0 sees every key, the others causal

    dense = (np.arange(8)[None, :] <= np.arange(8)[:, None])[None] | (np.arange(4) == 0)[
        :, None, None
    ]
    xj = jnp.asarray(x)
    plan = masks.block_plan(mask_mod, 8, 8, heads=4, block_size=4, like=xj)
    with_mask = nnx.jit(lambda mod, a, mk: mod(a, mask=mk))(m, xj, jnp.asarray(dense))
    for mod_ in (mask_mod, plan):
        got = nnx.jit(lambda mod, a, mm=mod_: mod(a, mask_mod=mm))(m, xj)
        np.testing.assert_allclose(np.asarray(got), np.asarray(with_mask), rtol=1e-12, atol=1e-13)


def test_sinks_state_dict_round_trip_and_errors() -> None:
    import jax.numpy as jnp

    m = _sink_module()
    other = _module(sinks=True, seed=1, dtype=jnp.float64)
    other.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(np.asarray(other.sinks[...]), SINK_VALUES)
    for name, value in m.state_dict().items():  # every parameter, hence the same outputs
        np.testing.assert_array_equal(other.state_dict()[name], value)
    with pytest.raises(ValueError, match=r"`state` has no 'sinks'.*`sinks=True`"):
        m.load_state_dict({n: a for n, a in m.state_dict().items() if n != "sinks"})
    with pytest.raises(ValueError, match=r"`state\['sinks'\]` must be \[num_heads\] = \(4,\)"):
        m.load_state_dict({**m.state_dict(), "sinks": np.zeros(2)})
    with pytest.raises(ValueError, match=r"`state` has 'sinks'.*build it with `sinks=True`"):
        _module().load_state_dict(m.state_dict())
    with pytest.raises(TypeError, match="`sinks` must be True or False"):
        _module(sinks=1)
