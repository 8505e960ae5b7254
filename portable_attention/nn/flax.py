"""Multi-head attention as a Flax NNX module: :class:`MultiHeadAttention` and its argument
checks, on the array-API core.

``from portable_attention.nn.flax import MultiHeadAttention`` (``pip install
portable-attention[flax]``). The module holds the parameters of
:mod:`portable_attention.mha` (same names and shapes, the one state format) as
``nnx.Param`` and calls :func:`portable_attention.mha.multi_head_attention`, so
``nnx.jit``, ``nnx.vmap`` and ``nnx.grad`` go through :func:`portable_attention.attend`.

With ``sinks=True`` the module also holds learned attention sinks, ``sinks`` ``[num_heads]``
(an ``nnx.Param`` starting at 0, trained by ``nnx.grad`` like the weights), passed to
:func:`portable_attention.attend` as ``sinks=``.

Dropout draws from ``rngs.dropout()`` (an ``nnx.Rngs`` given at construction) unless an
explicit key is passed as ``rng=``; ``.eval()`` turns it off, ``.train()`` back on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from portable_attention import _checks, mha

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Flax NNX multi-head attention; constructor arguments as the torch module's.

    Parameters
    ----------
    embed_dim, num_heads, num_kv_heads, kdim, vdim, bias, dropout
        As :class:`portable_attention.mha.MultiHeadAttention`.
    sinks : bool
        Include learned attention sinks ``sinks`` ``[num_heads]`` (zeros: each softmax
        denominator starts with ``exp(0) = 1`` more, as gpt-oss's sinks start near 0).
    seed : int
        Seed of :func:`portable_attention.mha.init_params` (same values on every framework).
    dtype
        Parameter dtype (float32 by default).
    rngs : nnx.Rngs, optional
        Source of dropout keys (``rngs.dropout()``); needed for ``dropout > 0`` in
        training mode unless each call passes ``rng=``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        sinks: bool = False,
        seed: int = 0,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.dropout = _checks.check_dropout(dropout)
        self.deterministic = False  # nnx's .eval() / .train() set this
        self.rngs = rngs
        params = mha.init_params(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            sinks=sinks,
            xp=jnp,
            dtype=dtype,
            seed=seed,
        )
        self.names = tuple(params)
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))

    def params(self) -> dict[str, Any]:
        """The parameters as the portable dict of arrays."""
        return {name: getattr(self, name)[...] for name in self.names}

    def __call__(
        self,
        query: Any,
        key: Any = None,
        value: Any = None,
        *,
        mask: Any = None,
        bias: Any = None,
        causal: bool | str = False,
        window: int | tuple[int | None, int | None] | None = None,
        key_padding_mask: Any = None,
        need_weights: bool = False,
        rng: Any = None,
        segment_ids: Any = None,
        score_mod: Callable[..., Any] | None = None,
        mask_mod: Any = None,
    ) -> Any:
        """Batch-first attention in this package's conventions (True = may attend / real
        key); ``window``, ``segment_ids``, ``score_mod`` and ``mask_mod`` as in
        :func:`portable_attention.mha.multi_head_attention`. Returns ``out [B, Lq, E]`` or
        ``(out, weights [B, Hq, Lq, Lk])``."""
        p = 0.0 if self.deterministic else self.dropout
        if p > 0 and rng is None:
            if self.rngs is None:
                raise _flax_dropout_key_error()
            rng = self.rngs.dropout()
        return mha.multi_head_attention(
            self.params(),
            query,
            key,
            value,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            mask=mask,
            bias=bias,
            causal=causal,
            window=window,
            key_padding_mask=key_padding_mask,
            dropout=p,
            rng=rng,
            return_weights=need_weights,
            segment_ids=segment_ids,
            score_mod=score_mod,
            mask_mod=mask_mod,
        )

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays, keyed as in :mod:`portable_attention.mha`."""
        return {name: np.asarray(v) for name, v in self.params().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load portable-format arrays of any framework (converted through NumPy/DLPack);
        keys and shapes must match (``sinks`` only into a module built with ``sinks=True``)."""
        mha.check_state_sinks(state, self.names, self.num_heads)
        _checks.check_state_keys(state, self.names)
        for name in self.names:
            param = getattr(self, name)
            new = jnp.asarray(mha.host_array(state[name]), dtype=param[...].dtype)
            _checks.check_state_shape(name, tuple(new.shape), tuple(param[...].shape))
            param[...] = new


# -- argument checks and messages of this module ----------------------------------------


def _flax_dropout_key_error() -> ValueError:
    """The Flax module in training mode with ``dropout > 0`` and no key to draw from."""
    msg = (
        "`dropout` > 0 in training mode needs JAX keys: build the module with "
        "`rngs=nnx.Rngs(dropout=0)`, pass `rng=jax.random.key(...)` to the call, or call "
        "`.eval()` to turn dropout off."
    )
    return ValueError(msg)
