"""A Transformer encoder layer on the portable functional core, run on NumPy and (where
installed) PyTorch and JAX with the same weights.

    python examples/encoder_layer.py

The layer is written once against the array API (``array_api_compat.array_namespace``):
multi-head self-attention (:func:`portable_attention.mha.multi_head_attention`), residual
connections, layer norm (pre-norm or post-norm), a ReLU feed-forward block and, in
training, dropout where ``torch.nn.TransformerEncoderLayer`` has it (the attention weights,
the feed-forward block's hidden units, each branch before its residual sum) drawn from
each framework's own RNG (:func:`portable_attention.mha.dropout`). ``main()`` checks that
the output has the input's shape and differs from it, that the frameworks agree, that
torch's and jax's backward passes give finite gradients for every parameter, and that
training mode drops units, reproducibly from a seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np

from portable_attention.mha import dropout, init_params, multi_head_attention


def init_layer(embed_dim: int, num_heads: int, ffn_dim: int, seed: int = 0) -> dict[str, Any]:
    """NumPy float64 parameters: attention (``attn.*``), two layer norms, feed-forward."""
    rng = np.random.default_rng(seed + 1)
    params: dict[str, Any] = {
        f"attn.{n}": a
        for n, a in init_params(embed_dim, num_heads, dtype=np.float64, seed=seed).items()
    }
    bound1, bound2 = 1 / np.sqrt(embed_dim), 1 / np.sqrt(ffn_dim)
    params |= {
        "ln1.g": np.ones(embed_dim),
        "ln1.b": np.zeros(embed_dim),
        "ln2.g": np.ones(embed_dim),
        "ln2.b": np.zeros(embed_dim),
        "ff.w1": rng.uniform(-bound1, bound1, (embed_dim, ffn_dim)),
        "ff.b1": rng.uniform(-bound1, bound1, ffn_dim),
        "ff.w2": rng.uniform(-bound2, bound2, (ffn_dim, embed_dim)),
        "ff.b2": rng.uniform(-bound2, bound2, embed_dim),
    }
    return params


def layer_norm(xp: Any, x: Any, g: Any, b: Any, eps: float = 1e-5) -> Any:
    mean = xp.mean(x, axis=-1, keepdims=True)
    var = xp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / xp.sqrt(var + eps) * g + b


def encoder_layer(
    params: dict[str, Any],
    x: Any,
    *,
    num_heads: int,
    key_padding_mask: Any = None,
    norm_first: bool = False,
    p: float = 0.0,
    rngs: tuple[Any, Any, Any, Any] | None = None,
) -> Any:
    """One encoder layer on ``x [B, L, E]`` of any array-API framework.

    ``norm_first=True``: pre-norm (``x + attn(ln(x))``, ``x + ff(ln(x))``); else post-norm
    (``ln(x + attn(x))``, ``ln(x + ff(x))``). ``key_padding_mask [B, L]``: True = real token.
    ``p > 0`` (training): dropout on the attention weights, the feed-forward hidden units and
    each branch's output, with ``rngs``, one RNG per site in that order (the same
    generator four times for NumPy or torch; four keys from ``jax.random.split`` for JAX).
    """
    xp = array_api_compat.array_namespace(x)
    attn = {n.removeprefix("attn."): a for n, a in params.items() if n.startswith("attn.")}
    r_weights, r_hidden, r_attn_out, r_ff_out = rngs if rngs is not None else (None,) * 4

    def sa(h: Any) -> Any:
        h = multi_head_attention(
            attn,
            h,
            num_heads=num_heads,
            key_padding_mask=key_padding_mask,
            dropout=p,
            rng=r_weights,
        )
        return dropout(h, p, rng=r_attn_out)

    def ff(h: Any) -> Any:
        h = h @ params["ff.w1"] + params["ff.b1"]
        h = dropout(xp.where(h > 0, h, xp.zeros_like(h)), p, rng=r_hidden)
        return dropout(h @ params["ff.w2"] + params["ff.b2"], p, rng=r_ff_out)

    def ln1(h: Any) -> Any:
        return layer_norm(xp, h, params["ln1.g"], params["ln1.b"])

    def ln2(h: Any) -> Any:
        return layer_norm(xp, h, params["ln2.g"], params["ln2.b"])

    if norm_first:
        x = x + sa(ln1(x))
        return x + ff(ln2(x))
    x = ln1(x + sa(x))
    return ln2(x + ff(x))


def main() -> dict[str, Any]:
    """Run the layer on NumPy and, where installed, torch and jax; return what was checked."""
    b, length, embed_dim, num_heads, ffn_dim = 2, 5, 16, 4, 32
    params = init_layer(embed_dim, num_heads, ffn_dim)
    x = np.random.default_rng(0).standard_normal((b, length, embed_dim))
    kpm = np.ones((b, length), dtype=bool)
    kpm[1, -2:] = False  # the last two tokens of the second sequence are padding
    results: dict[str, Any] = {}
    for norm_first in (False, True):
        out = encoder_layer(
            params, x, num_heads=num_heads, key_padding_mask=kpm, norm_first=norm_first
        )
        assert out.shape == x.shape, (out.shape, x.shape)
        assert not np.allclose(out, x)
        assert np.all(np.isfinite(out))
        results[f"numpy/norm_first={norm_first}"] = out
        diff = np.abs(out - x).max()
        print(f"numpy  norm_first={norm_first}: out {out.shape}, max |out - x| = {diff:.3f}")

    _run_torch(params, x, kpm, num_heads, results)
    _run_jax(params, x, kpm, num_heads, results)

    def numpy_rngs(seed: int) -> tuple[Any, ...]:
        return (np.random.default_rng(seed),) * 4

    _check_training("numpy", params, x, kpm, num_heads, numpy_rngs, np.asarray, results)
    return results


def _check_training(
    name: str,
    params: dict[str, Any],
    x: Any,
    kpm: Any,
    num_heads: int,
    make_rngs: Callable[[int], tuple[Any, ...]],
    to_numpy: Callable[[Any], Any],
    results: dict[str, Any],
) -> None:
    """Training mode (``p=0.1``): the same seed gives the same output, another seed
    another, and both differ from evaluation mode (``p=0``)."""

    def run(seed: int) -> Any:
        out = encoder_layer(
            params, x, num_heads=num_heads, key_padding_mask=kpm, p=0.1, rngs=make_rngs(seed)
        )
        return to_numpy(out)

    first, again, other = run(1), run(1), run(2)
    evaluation = to_numpy(encoder_layer(params, x, num_heads=num_heads, key_padding_mask=kpm))
    np.testing.assert_array_equal(first, again)
    assert np.all(np.isfinite(first))
    assert not np.allclose(first, other) and not np.allclose(first, evaluation)
    results[f"{name}/training"] = first
    print(f"{name:<6} training (p=0.1): reproducible from a seed, differs from evaluation")


def _run_torch(
    params: dict[str, Any], x: Any, kpm: Any, num_heads: int, results: dict[str, Any]
) -> None:
    try:
        import torch
    except ImportError:
        print("torch not installed: skipped")
        return
    tparams = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    tx = torch.tensor(x, requires_grad=True)
    tkpm = torch.tensor(kpm)
    for norm_first in (False, True):
        for p in (*tparams.values(), tx):
            p.grad = None
        out_t = encoder_layer(
            tparams, tx, num_heads=num_heads, key_padding_mask=tkpm, norm_first=norm_first
        )
        assert tuple(out_t.shape) == x.shape
        ref = results[f"numpy/norm_first={norm_first}"]
        np.testing.assert_allclose(out_t.detach().numpy(), ref, rtol=1e-10, atol=1e-12)
        out_t.square().sum().backward()
        grads = {n: p.grad for n, p in tparams.items()}
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values())
        assert tx.grad is not None and bool(torch.isfinite(tx.grad).all())
        results[f"torch/norm_first={norm_first}"] = out_t.detach().numpy()
        results[f"torch-grads/norm_first={norm_first}"] = {
            n: g.numpy() for n, g in grads.items() if g is not None
        }
        print(f"torch  norm_first={norm_first}: matches numpy, {len(grads)} finite gradients")

    def torch_rngs(seed: int) -> tuple[Any, ...]:
        return (torch.Generator().manual_seed(seed),) * 4

    def detached(t: Any) -> Any:
        return t.detach().numpy()

    _check_training("torch", tparams, tx, tkpm, num_heads, torch_rngs, detached, results)


def _run_jax(
    params: dict[str, Any], x: Any, kpm: Any, num_heads: int, results: dict[str, Any]
) -> None:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("jax not installed: skipped")
        return
    jparams = {n: jnp.asarray(a) for n, a in params.items()}  # float32 unless x64 is on
    jx, jkpm = jnp.asarray(x), jnp.asarray(kpm)
    tol = 1e-10 if jx.dtype == jnp.float64 else 1e-4
    for norm_first in (False, True):

        def loss(p: dict[str, Any], h: Any, norm_first: bool = norm_first) -> Any:
            out = encoder_layer(
                p, h, num_heads=num_heads, key_padding_mask=jkpm, norm_first=norm_first
            )
            return jnp.sum(out**2), out

        (_, out_j), (grads, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            jparams, jx
        )
        assert out_j.shape == x.shape
        ref = results[f"numpy/norm_first={norm_first}"]
        np.testing.assert_allclose(np.asarray(out_j), ref, rtol=tol, atol=tol)
        assert all(bool(jnp.isfinite(g).all()) for g in grads.values())
        assert bool(jnp.isfinite(gx).all())
        results[f"jax/norm_first={norm_first}"] = np.asarray(out_j)
        print(f"jax    norm_first={norm_first}: matches numpy, {len(grads)} finite gradients")

    def jax_rngs(seed: int) -> tuple[Any, ...]:
        return tuple(jax.random.split(jax.random.key(seed), 4))

    _check_training("jax", jparams, jx, jkpm, num_heads, jax_rngs, np.asarray, results)


if __name__ == "__main__":
    main()
