"""The Flax NNX multi-head attention module (runs where jax is selected and flax imports)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import mha

import oracle
from conftest import requires_backend

pytestmark = requires_backend("jax")


def _module(**kwargs: Any) -> Any:
    pytest.importorskip("flax")
    from portable_attention.nn.flax import MultiHeadAttention

    return MultiHeadAttention(16, 4, num_kv_heads=2, **kwargs)


def _x(shape: tuple[int, ...] = (2, 5, 16)) -> Any:
    import jax.numpy as jnp

    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)


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
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)
    # and the attention inside against the independent oracle
    q = (x64 @ params["w_q"]).reshape(2, 5, 4, 4).transpose(0, 2, 1, 3)
    k = (x64 @ params["w_k"]).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    v = (x64 @ params["w_v"]).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    att = oracle.attention(q, k, v, mask=kpm[:, None, None, :], causal=True)[0]
    expected = att.transpose(0, 2, 1, 3).reshape(2, 5, 16) @ params["w_o"]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)


def test_jit_vmap_grad_through_the_module() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    m = _module()
    x = _x()
    eager = m(x, causal=True)
    jitted = nnx.jit(lambda mod, a: mod(a, causal=True))(m, x)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-6)
    batched = nnx.vmap(lambda mod, a: mod(a), in_axes=(None, 0))(m, jnp.stack([x, 2 * x]))
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(m(2 * x)), rtol=1e-5, atol=1e-5)
    grads = nnx.grad(lambda mod, a: (mod(a) ** 2).sum())(m, x)
    params = m.params()
    want = jax.grad(
        lambda p: (mha.multi_head_attention(p, x, num_heads=4, num_kv_heads=2) ** 2).sum()
    )(params)
    for name in params:
        got = np.asarray(grads[name][...])
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, np.asarray(want[name]), rtol=1e-5, atol=1e-6)


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
    from portable_attention.nn.torch import MultiHeadAttention as TorchMHA

    t = TorchMHA(16, 4, num_kv_heads=2, seed=9)
    f = _module(seed=1)
    f.load_state_dict(t.state_dict_portable())
    x = _x()
    with torch.no_grad():
        ref = t(torch.from_numpy(np.asarray(x))).numpy()
    np.testing.assert_allclose(np.asarray(f(x)), ref, rtol=1e-5, atol=1e-6)
    back = TorchMHA(16, 4, num_kv_heads=2, seed=2)
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
