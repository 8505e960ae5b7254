"""Multi-head attention as a ``torch.nn.Module``: :class:`MultiHeadAttention`, its
drop-in form for ``torch.nn.MultiheadAttention`` (:class:`TorchCompatMultiHeadAttention`)
and their argument checks, on the portable functional core.

``from portable_attention.nn.torch import MultiHeadAttention``

The parameters are ``nn.Parameter`` objects named as in the portable state format of
:mod:`portable_attention.mha` (``w_q (E, Hq*D)``, ``w_k (kdim, Hk*D)``, ``w_v (vdim, Hk*D)``,
``w_o (Hq*D, E)``, optional ``b_q, b_k, b_v, b_o`` and learned attention ``sinks (Hq,)``;
applied as ``x @ w + b``), so
``module.state_dict()`` has those keys and :meth:`MultiHeadAttention.state_dict_portable` /
:meth:`MultiHeadAttention.load_portable` move the same weights to and from NumPy, JAX,
CuPy or :class:`portable_attention.mha.MultiHeadAttention`.

Swapping ``torch.nn.MultiheadAttention``
----------------------------------------
:meth:`MultiHeadAttention.from_torch` copies an ``nn.MultiheadAttention``'s weights
(transposed: torch computes ``x @ W.T + b``; ``in_proj_weight`` is split into the q, k, v
blocks); :meth:`MultiHeadAttention.to_torch` goes back. ``from_torch(m, torch_compat=True)``
returns a :class:`TorchCompatMultiHeadAttention` whose ``forward`` *is*
:meth:`MultiHeadAttention.torch_compat_forward`, i.e. torch's signature and conventions, so it
can replace the torch module inside an existing model unchanged.

Mask polarity in :meth:`MultiHeadAttention.torch_compat_forward` (torch's conventions in,
this package's out):

* boolean ``key_padding_mask [B, Lk]``: torch's **True = padding (masked)** is inverted
  (``~key_padding_mask``) into this package's **True = real key** and reshaped to
  ``[B, 1, 1, Lk]``;
* boolean ``attn_mask [Lq, Lk]`` or ``[B * H, Lq, Lk]``: torch's **True = may NOT attend**
  is inverted into ``mask`` (**True = may attend**), the 3-D form reshaped to
  ``[B, H, Lq, Lk]``;
* float ``attn_mask`` / float ``key_padding_mask``: added to the scores, as in torch; they
  become ``bias=`` (cast to the query's dtype; ``-inf`` masks);
* ``batch_first=False`` (the module's attribute, copied from the torch module) transposes
  ``[L, B, E]`` inputs and the output; weights are ``[B, Lq, Lk]`` (averaged over heads) or
  ``[B, H, Lq, Lk]`` with ``average_attn_weights=False``, as in torch.

Differences from torch that remain: a query row with every key masked gives output 0 and
weights 0 (torch gives NaN); returned weights are those *before* dropout (torch returns them
after dropout in training mode); ``add_bias_kv`` / ``add_zero_attn`` are not supported
(``from_torch`` raises ``ValueError``); torch's module has no attention sinks (``to_torch``
of a module with ``sinks=True`` raises ``ValueError``). The native
:meth:`MultiHeadAttention.forward` is always batch-first and uses this package's polarity
(True = may attend / real key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from portable_attention import _checks
from portable_attention._checks import type_name
from portable_attention.mha import (
    PARAM_NAMES,
    SINKS,
    check_state_sinks,
    host_array,
    init_params,
    multi_head_attention,
)

__all__ = ["MultiHeadAttention", "TorchCompatMultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) attention module running :func:`attend`.

    Parameters
    ----------
    embed_dim, num_heads : int
        ``E`` and query heads ``Hq``; head size ``D = E // Hq``.
    num_kv_heads : int, optional
        Key/value heads ``Hk`` (default ``Hq``; ``Hq % Hk == 0``).
    kdim, vdim : int, optional
        Input widths of key and value (default ``E``).
    bias : bool
        Include ``b_q, b_k, b_v, b_o``.
    sinks : bool
        Include learned attention sinks: an ``nn.Parameter`` ``sinks`` ``[num_heads]``,
        one logit per query head added to each softmax denominator (gpt-oss), starting
        at 0 (each denominator gains ``exp(0) = 1``), trained like any other parameter.
    dropout : float
        Attention-weight dropout, applied in training mode only (``.train()/.eval()``),
        drawn from torch's global RNG.
    batch_first : bool
        Layout used by :meth:`torch_compat_forward` only (as ``nn.MultiheadAttention``);
        :meth:`forward` is always batch-first.
    seed : int, optional
        Seed of the NumPy generator of :func:`portable_attention.mha.init_params` (so the
        same seed gives the same weights as on NumPy/JAX); None draws one from torch's
        global RNG (``torch.manual_seed`` makes it reproducible).
    device, dtype : optional
        Of the parameters (dtype default ``torch.get_default_dtype()``).
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
        batch_first: bool = True,
        seed: int | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.bias = bias
        self.dropout = _checks.check_dropout(dropout)
        self.batch_first = batch_first
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        host = init_params(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            sinks=sinks,
            dtype=np.float64,
            seed=seed,
        )
        dtype = torch.get_default_dtype() if dtype is None else dtype
        for name, value in host.items():
            tensor = torch.from_numpy(value).to(device=device, dtype=dtype)
            self.register_parameter(name, nn.Parameter(tensor))

    @property
    def has_sinks(self) -> bool:
        """Whether the module has learned attention sinks (built with ``sinks=True``)."""
        return SINKS in self._parameters

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
            f"bias={self.bias}, sinks={self.has_sinks}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}"
        )

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters as the portable dict (the live ``nn.Parameter`` objects)."""
        return {n: p for n, p in self.named_parameters(recurse=False) if n in PARAM_NAMES}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        causal: bool | str = False,
        window: int | tuple[int | None, int | None] | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        rng: torch.Generator | None = None,
        segment_ids: Any = None,
        score_mod: Callable[..., Any] | None = None,
        mask_mod: Any = None,
    ) -> Any:
        """Batch-first attention in this package's conventions.

        ``query [B, Lq, E]``, ``key [B, Lk, kdim]`` (default ``query``), ``value
        [B, Lk, vdim]`` (default ``key``); boolean ``mask`` broadcastable to
        ``[B, Hq, Lq, Lk]`` and boolean ``key_padding_mask [B, Lk]`` with **True = may
        attend / real key**; ``bias`` additive; ``window``, ``segment_ids`` (packed
        sequences, ``[B, L]`` or a pair ``(q_ids [B, Lq], kv_ids [B, Lk])``),
        ``score_mod`` and ``mask_mod`` as in
        :func:`portable_attention.mha.multi_head_attention`. Returns ``out [B, Lq, E]``
        or, with ``need_weights``, ``(out, weights [B, Hq, Lq, Lk])``.
        """
        return self._attend(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            causal=causal,
            window=window,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            rng=rng,
            segment_ids=segment_ids,
            score_mod=score_mod,
            mask_mod=mask_mod,
        )

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        *,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        causal: bool | str = False,
        window: int | tuple[int | None, int | None] | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        rng: torch.Generator | None = None,
        segment_ids: Any = None,
        score_mod: Callable[..., Any] | None = None,
        mask_mod: Any = None,
    ) -> Any:
        p = self.dropout if self.training else 0.0
        return multi_head_attention(
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

    def torch_compat_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward``'s signature, conventions and return value.

        Boolean masks use torch's **True = masked** and are inverted (see the module
        docstring); float masks are added to the scores. ``is_causal`` without
        ``attn_mask`` applies a causal mask (with one, it is a hint, as in torch). Returns
        ``(out, weights or None)``.
        """
        unbatched = query.dim() == 2
        batch_first = self.batch_first or unbatched
        seq_axis = 0 if unbatched or not batch_first else 1
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and not (m.dtype == torch.bool or m.is_floating_point()):
                raise _torch_mask_dtype_error(name, m.dtype)
        _check_torch_attn_mask_shapes(  # the shapes as passed, in torch's terms
            key_padding_mask,
            attn_mask,
            None if unbatched else query.shape[1 - seq_axis],
            self.num_heads,
            query.shape[seq_axis],
            key.shape[seq_axis],
        )
        if unbatched:  # [L, E] -> [1, L, E]
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        mask: torch.Tensor | None = None
        bias: torch.Tensor | None = None
        kpm: torch.Tensor | None = None
        if key_padding_mask is not None:
            if key_padding_mask.dtype == torch.bool:
                kpm = ~key_padding_mask
            else:
                bias = key_padding_mask.to(query.dtype).reshape(b, 1, 1, lk)
        if attn_mask is not None:
            am = attn_mask
            if am.dim() == 3:
                am = am.reshape(b, self.num_heads, lq, lk)
            if am.dtype == torch.bool:
                mask = ~am
            else:
                am = am.to(query.dtype)
                bias = am if bias is None else bias + am
        causal = bool(is_causal and attn_mask is None)
        result = self._attend(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            causal=causal,
            key_padding_mask=kpm,
            need_weights=need_weights,
        )
        out, weights = result if need_weights else (result, None)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    # -- the one state format ---------------------------------------------------------------
    def state_dict_portable(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays (detached copies on the host; bfloat16 as
        float32), keyed as in :mod:`portable_attention.mha`."""
        out = {}
        for name, p in self.params().items():
            out[name] = np.array(host_array(p))  # a copy, bfloat16 as float32
        return out

    def load_portable(self, state: dict[str, Any]) -> None:
        """Copy ``state`` (portable keys; NumPy, torch, JAX, ... arrays) into the parameters,
        cast to their dtype and device. Keys and shapes must match (``sinks`` only into a
        module built with ``sinks=True``)."""
        from portable_attention.testing._convert import to_backend

        params = self.params()
        check_state_sinks(state, params, self.num_heads)
        _checks.check_state_keys(state, params)
        with torch.no_grad():
            for name, p in params.items():
                src = state[name]  # any framework's array: bfloat16 and JAX arrays included
                t = src if isinstance(src, torch.Tensor) else to_backend(src, "torch")
                _checks.check_state_shape(name, tuple(t.shape), tuple(p.shape))
                p.copy_(t)

    # -- torch.nn.MultiheadAttention interop ------------------------------------------------
    @classmethod
    def from_torch(
        cls, m: nn.MultiheadAttention, *, torch_compat: bool = False
    ) -> MultiHeadAttention:
        """A module with ``m``'s weights, dropout, batch_first and training mode.

        ``torch_compat=True`` returns a :class:`TorchCompatMultiHeadAttention` (torch's
        ``forward`` signature: a drop-in replacement).
        """
        _check_is_torch_mha(m, nn.MultiheadAttention)
        _check_torch_mha_extras(
            m.bias_k is not None or m.bias_v is not None or bool(m.add_zero_attn)
        )
        if m._qkv_same_embed_dim:
            wq, wk, wv = m.in_proj_weight.chunk(3, dim=0)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        has_bias = m.in_proj_bias is not None
        kind = TorchCompatMultiHeadAttention if torch_compat else MultiHeadAttention
        new = kind(
            m.embed_dim,
            m.num_heads,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=has_bias,
            dropout=m.dropout,
            batch_first=m.batch_first,
            seed=0,
            device=wq.device,
            dtype=wq.dtype,
        )
        state = {"w_q": wq.T, "w_k": wk.T, "w_v": wv.T, "w_o": m.out_proj.weight.T}
        if has_bias:
            bq, bk, bv = m.in_proj_bias.chunk(3, dim=0)
            state |= {"b_q": bq, "b_k": bk, "b_v": bv, "b_o": m.out_proj.bias}
        new.load_portable({n: t.detach() for n, t in state.items()})
        new.train(m.training)
        return new

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` with these weights (same dropout, batch_first and
        training mode). Needs ``num_kv_heads == num_heads`` (torch has no grouped heads) and
        no ``sinks`` (nor has it attention sinks)."""
        _check_no_grouped_heads(self.num_kv_heads, self.num_heads)
        _check_no_sinks(self.has_sinks)
        p = self.params()
        w_q = p["w_q"]
        m = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.bias,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=self.batch_first,
            device=w_q.device,
            dtype=w_q.dtype,
        )
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                m.in_proj_weight.copy_(torch.cat([p["w_q"].T, p["w_k"].T, p["w_v"].T], dim=0))
            else:
                m.q_proj_weight.copy_(p["w_q"].T)
                m.k_proj_weight.copy_(p["w_k"].T)
                m.v_proj_weight.copy_(p["w_v"].T)
            m.out_proj.weight.copy_(p["w_o"].T)
            if self.bias:
                m.in_proj_bias.copy_(torch.cat([p["b_q"], p["b_k"], p["b_v"]]))
                m.out_proj.bias.copy_(p["b_o"])
        m.train(self.training)
        return m


class _DeclinesTorchFastPaths:
    """Stands for a torch projection weight or bias on :class:`TorchCompatMultiHeadAttention`
    (``in_proj_weight``, ``out_proj.weight``, ``out_proj.bias``). torch's fast-path checks
    decline when an argument overrides ``__torch_function__``
    (``torch.overrides.has_torch_function``), as this does; it is no tensor, and any torch
    operation on it raises ``TypeError``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return NotImplemented

    def __repr__(self) -> str:
        return "<not a torch projection: the weights are w_q, w_k, w_v, w_o>"


class _NoOutProj:
    """Stands for ``nn.MultiheadAttention.out_proj`` (see ``_DeclinesTorchFastPaths``)."""

    weight = bias = _DeclinesTorchFastPaths()


class TorchCompatMultiHeadAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` whose ``__call__`` takes ``nn.MultiheadAttention``'s
    arguments and conventions (:meth:`MultiHeadAttention.torch_compat_forward`): a drop-in
    replacement for an ``nn.MultiheadAttention`` inside an existing model."""

    #: torch's Transformer layers read these two to choose their own fused kernel, which
    #: would bypass this module (and raised AttributeError here, in eval mode with
    #: ``batch_first=True``): None and False make them call :meth:`forward`.
    in_proj_bias = None
    _qkv_same_embed_dim = False
    #: ``nn.TransformerEncoder`` (eval mode, a padding mask) reads these to choose its
    #: nested-tensor path, which would hand this module NestedTensors (and raised
    #: AttributeError here): the markers make its check decline that path.
    in_proj_weight = _DeclinesTorchFastPaths()
    out_proj = _NoOutProj()

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.torch_compat_forward(*args, **kwargs)


# -- argument checks and messages of this module ----------------------------------------


def _check_torch_attn_mask_shapes(
    key_padding_mask: Any, attn_mask: Any, batch: int | None, heads: int, lq: int, lk: int
) -> None:
    """``torch_compat_forward``'s masks, in torch's names and shapes: ``key_padding_mask
    [B, Lk]``, ``attn_mask [Lq, Lk]`` or ``[B * H, Lq, Lk]``; unbatched inputs
    (``batch=None``) take ``[Lk]`` and ``[Lq, Lk]`` or ``[H, Lq, Lk]``."""
    kpm_shape, kpm_text = ((lk,), "[Lk]") if batch is None else ((batch, lk), "[B, Lk]")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != kpm_shape:
        msg = (
            f"`key_padding_mask` must be {kpm_text} = {kpm_shape}, got shape "
            f"{tuple(key_padding_mask.shape)}"
        )
        raise ValueError(msg)
    stacked, stacked_text = (
        ((heads, lq, lk), "[num_heads, Lq, Lk]")
        if batch is None
        else ((batch * heads, lq, lk), "[B * num_heads, Lq, Lk]")
    )
    if attn_mask is not None and tuple(attn_mask.shape) not in ((lq, lk), stacked):
        msg = (
            f"`attn_mask` must be [Lq, Lk] = {(lq, lk)} or {stacked_text} = {stacked}, "
            f"got shape {tuple(attn_mask.shape)}"
        )
        raise ValueError(msg)


def _check_is_torch_mha(m: object, torch_mha: type) -> None:
    """``from_torch``: an ``nn.MultiheadAttention`` (or a subclass)."""
    if not isinstance(m, torch_mha):
        msg = f"`m` must be a torch.nn.MultiheadAttention, got {type_name(m)}"
        raise TypeError(msg)


def _check_torch_mha_extras(uses_extras: bool) -> None:
    """``from_torch``: an ``nn.MultiheadAttention`` without add_bias_kv / add_zero_attn."""
    if uses_extras:
        msg = "`m` uses add_bias_kv or add_zero_attn, which this module does not support"
        raise ValueError(msg)


def _check_no_grouped_heads(num_kv_heads: int, num_heads: int) -> None:
    """``to_torch``: nn.MultiheadAttention has no grouped-query heads."""
    if num_kv_heads != num_heads:
        msg = (
            f"`num_kv_heads`={num_kv_heads} != `num_heads`={num_heads}: "
            "nn.MultiheadAttention has no grouped-query heads"
        )
        raise ValueError(msg)


def _check_no_sinks(has_sinks: bool) -> None:
    """``to_torch``: nn.MultiheadAttention has no attention sinks (dropping learned ones
    would change the outputs)."""
    if has_sinks:
        msg = (
            "this module has learned `sinks` (built with `sinks=True`), which "
            "nn.MultiheadAttention does not have; `to_torch` would drop them"
        )
        raise ValueError(msg)


def _torch_mask_dtype_error(name: str, dtype: Any) -> TypeError:
    """``torch_compat_forward``: a mask neither boolean nor floating (torch refuses those)."""
    msg = (
        f"`{name}` must be boolean (torch's True = masked out) or floating (added to the "
        f"scores), got dtype {dtype}; for a 0/1 mask where 1 = masked out pass `{name}.bool()`."
    )
    return TypeError(msg)
