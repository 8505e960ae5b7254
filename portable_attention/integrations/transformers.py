"""Hugging Face transformers: every attention of a model through :func:`~portable_attention.attend`.

Usage (``config`` any transformers model config)::

    from portable_attention.integrations.transformers import register

    name = register()  # "portable"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

:func:`register` adds :func:`attention_forward` to transformers' public
``AttentionInterface`` under ``name``, and (transformers >= 4.53, which has
``AttentionMaskInterface``) transformers' own ``sdpa_mask`` as the mask builder for
``name``: the model then hands each attention a boolean 4-D mask ``[B, 1, Lq, Lk]`` whose
True means "may attend" (the polarity of ``attend``), or None where a plain causal (or no)
mask suffices. Older releases (4.48 - 4.52) hand custom implementations an additive float
mask (0 / the dtype's minimum), which goes to ``bias=``.

How transformers' arguments map (see ``docs/transformers.md``):

* ``query [B, Hq, Lq, D]``, ``key``/``value [B, Hkv, Lk, D]``: passed as they are;
  grouped-query heads (``Hq % Hkv == 0``) are native in ``attend``, K/V are never
  repeated. The output goes back as ``[B, Lq, Hq, Dv]``, the layout transformers expects.
* ``attention_mask``: boolean -> ``mask=`` (same polarity); floating (additive) ->
  ``bias=``; its key axis is cut to ``Lk`` as transformers' own kernels do.
* no mask: ``is_causal`` (the keyword, else ``module.is_causal``, else True) gives
  ``causal="upper_left"`` when ``Lq > 1``, and no causal mask for a single query, exactly
  what transformers' ``sdpa`` does. transformers leaves the mask out only where that
  alignment is right: ``Lq == Lk`` (where upper-left and lower-right agree), one query
  token, or the prefill of an empty static cache (keys past ``Lq`` are unfilled slots, so
  the *upper-left* alignment is the right one there). With a filled cache transformers
  always builds the mask, whose positions carry the offset.
* ``scaling`` -> ``scale=``; ``softcap`` (Gemma 2's ``attn_logit_softcapping``) ->
  ``softcap=``; ``position_bias`` (T5-style) -> added to ``bias=``.
* ``dropout`` -> ``dropout=`` only while ``module.training``, drawn from torch's global
  RNG (``rng=None``), so ``torch.manual_seed`` makes it reproducible.
* ``sliding_window=w``: transformers' window keeps keys with ``q - k < w``. The mask it
  builds for sliding layers already holds the window (eager and sdpa use nothing else),
  so with a mask it is not applied twice; without one it becomes ``window=(w - 1, 0)``
  with the causal alignment above.
* ``output_attentions`` (the keyword, else ``module.config.output_attentions``) ->
  ``return_weights=True``; the weights are returned as the second value (before dropout,
  and 0 on query rows with no key where eager has a uniform row). Otherwise None.
* ``s_aux`` (gpt-oss and the other models with a learned sink per head: a ``[Hq]``
  parameter) or ``sinks`` -> ``sinks=``: one extra logit per query head in the softmax's
  denominator, as eager's extra key column that is dropped after the softmax. A sink in
  that column layout ``[B|1, Hq|1, 1, 1]`` is squeezed to ``[B|1, Hq|1]``; a sink per
  query (``[B, Hq, Lq, 1]``, Inkling 2) is a ``TypeError``. Gradients reach the parameter.
* Any other keyword that could change the result: ``TypeError``. Keywords that only other
  kernels read (flash-attention's ``cu_seq_lens_*``/``max_length_*``, whose packing the
  mask already holds; ``position_ids``, ``use_cache``, ...) are ignored, as transformers'
  sdpa does.
"""

from __future__ import annotations

from typing import Any

import torch

from portable_attention._attention import attend

__all__ = ["attention_forward", "register"]

#: Keywords transformers passes that do not change this kernel's result: flash-attention's
#: varlen metadata (the mask carries the same packing), bookkeeping and output flags that
#: transformers' hooks act on. transformers' own ``sdpa`` ignores all of them too.
IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "past_key_value",
        "past_key_values",
        "layer_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "deterministic",
        "num_items_in_batch",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "seq_idx",
        "indices",
        "kernel_options",
    }
)

#: Keywords that change attention in a way ``attend`` does not implement.
UNSUPPORTED_KWARGS = {
    "block_indices": "sparse block selection",
}

#: Query dtypes beside which a float32 sink stays float32 (``attend`` computes in float32).
_HALF = frozenset({torch.float16, torch.bfloat16})


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    output_attentions: bool | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers attention function that runs :func:`~portable_attention.attend`.

    The signature is that of transformers' ``AttentionInterface`` functions (as
    ``sdpa_attention_forward``); :func:`register` installs it.

    Parameters
    ----------
    module : torch.nn.Module
        The model's attention layer (``training``, ``is_causal`` and ``config`` are read).
    query, key, value : torch.Tensor
        ``[B, Hq, Lq, D]``, ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]``; ``Hq % Hkv == 0``.
    attention_mask : torch.Tensor or None
        Boolean (True = may attend) or additive float, broadcastable to
        ``[B, Hq, Lq, Lk']`` with ``Lk' >= Lk`` (cut to ``Lk``); None: see ``is_causal``.
    dropout : float
        Dropout probability, applied only while ``module.training``.
    scaling : float, optional
        Score scale; default ``1 / sqrt(D)``.
    softcap : float, optional
        Logit soft-capping (Gemma 2).
    sliding_window : int, optional
        Keys with ``q - k < sliding_window`` are kept; applied only without a mask (a
        mask from transformers already holds the window).
    is_causal : bool, optional
        With no mask: causal (upper-left aligned, as transformers' sdpa) when ``Lq > 1``.
        Default ``module.is_causal``, else True.
    position_bias : torch.Tensor, optional
        Additive score bias (T5-style relative positions), added to ``bias=``.
    output_attentions : bool, optional
        Return the attention weights; default ``module.config.output_attentions``.
    s_aux, sinks : torch.Tensor, optional
        Attention sinks (one of the two names): one logit per query head added to the
        softmax's denominator, ``[Hq]`` (gpt-oss's ``module.sinks``) or broadcastable to
        ``[B, Hq]``; transformers' key-column layout ``[B|1, Hq|1, 1, 1]`` is accepted
        too. Cast to the query's dtype unless it is float32 for a half-precision query.
    **kwargs
        Flash-attention metadata and bookkeeping keywords are ignored (see
        :data:`IGNORED_KWARGS`); anything else is a ``TypeError``.

    Returns
    -------
    (torch.Tensor, torch.Tensor or None)
        The output ``[B, Lq, Hq, Dv]`` (contiguous) and the weights ``[B, Hq, Lq, Lk]``
        (before dropout) when asked for, else None.

    Raises
    ------
    TypeError
        A keyword that changes the result but is not supported (sparse block selection,
        ...), both ``s_aux`` and ``sinks``, sinks per query, or an attention mask that is
        neither boolean nor floating.
    ValueError
        A bidirectional ``sliding_window`` without a mask where it would cut keys.
    """
    _check_kwargs(kwargs)
    sink = _sinks(s_aux, sinks, query)
    lq, lk = query.shape[-2], key.shape[-2]
    mask = bias = None
    causal: bool | str = False
    window = None
    if attention_mask is None:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if is_causal and lq > 1:
            causal = "upper_left"  # as transformers' sdpa: is_causal=True is upper-left there
        if sliding_window is not None:
            window = _window(sliding_window, bool(is_causal), lq, lk)
    else:
        attention_mask = attention_mask[..., :lk]
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        elif attention_mask.is_floating_point():
            bias = attention_mask
        else:
            raise _attention_mask_dtype_error(attention_mask.dtype)
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if bias is not None and bias.dtype not in (query.dtype, torch.float32):
        bias = bias.to(query.dtype)
    if output_attentions is None:
        output_attentions = bool(
            getattr(getattr(module, "config", None), "output_attentions", False)
        )
    p = float(dropout) if module.training else 0.0
    result = attend(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        causal=causal,
        window=window,
        scale=None if scaling is None else float(scaling),
        softcap=None if softcap is None else float(softcap),
        dropout=p,
        sinks=sink,
        return_weights=bool(output_attentions),
    )
    out, weights = result if output_attentions else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _window(sliding_window: int, causal: bool, lq: int, lk: int) -> tuple[int, int] | None:
    """``window=`` for transformers' ``sliding_window`` when no mask came."""
    _check_sliding_window(sliding_window)
    if causal:
        # transformers keeps kv_idx > q_idx - w: w - 1 keys back and the query itself
        return (sliding_window - 1, 0)
    if max(lq, lk) <= sliding_window:
        return None  # no key is farther than the window on either side
    raise _bidirectional_window_error(sliding_window, lq, lk)


def _sinks(
    s_aux: torch.Tensor | None, sinks: torch.Tensor | None, query: torch.Tensor
) -> torch.Tensor | None:
    """``sinks=`` for ``attend`` from transformers' ``s_aux`` or ``sinks`` (None: none)."""
    if s_aux is not None and sinks is not None:
        raise _two_sinks_error()
    name, sink = ("s_aux", s_aux) if s_aux is not None else ("sinks", sinks)
    if sink is None or not isinstance(sink, torch.Tensor):
        return sink  # None; anything else is attend's to refuse, by the name `sinks`
    if sink.ndim == query.ndim and sink.ndim >= 2:
        # transformers' eager layout: an extra key column [B|1, Hq|1, Lq|1, 1]
        if sink.shape[-1] != 1 or sink.shape[-2] != 1:
            raise _per_query_sinks_error(name, tuple(sink.shape), tuple(query.shape))
        sink = sink[..., 0, 0]
    # attend takes the query's dtype, or float32 (its compute dtype) for half precision
    kept = sink.dtype == query.dtype or (sink.dtype == torch.float32 and query.dtype in _HALF)
    if sink.is_floating_point() and not kept:
        sink = sink.to(query.dtype)  # differentiable: the gradient reaches the parameter
    return sink


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if value is None or name in IGNORED_KWARGS:
            continue
        raise _unsupported_kwarg_error(name, UNSUPPORTED_KWARGS.get(name))


def register(name: str = "portable") -> str:
    """Make ``attn_implementation=name`` run every attention through ``attend``.

    Registers :func:`attention_forward` with ``transformers.AttentionInterface`` (the
    plain ``ALL_ATTENTION_FUNCTIONS`` dict before transformers 4.50) and,
    where transformers has ``AttentionMaskInterface`` (>= 4.53), its ``sdpa_mask``
    (boolean masks, True = may attend; None where a plain causal mask suffices) for
    ``name``. Calling it again is harmless.

    Parameters
    ----------
    name : str
        The ``attn_implementation`` string to register.

    Returns
    -------
    str
        ``name``, to pass as ``attn_implementation=``.

    Raises
    ------
    ValueError
        An empty ``name``, one of transformers' own implementations, or a name that
        transformers would take for one of its kernels (containing ``"sdpa"``,
        ``"flash"``, ``"flex_attention"``, ``"paged|"`` or ``"/"``).
    ImportError
        transformers is not installed.

    Examples
    --------
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from portable_attention.integrations.transformers import register
    >>> config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                      num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=register())
    """
    try:
        import transformers
    except ImportError as exc:
        raise _transformers_missing_error() from exc
    _check_attn_implementation(name)
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is not None:
        interface.register(name, attention_forward)
    else:  # transformers 4.48 - 4.49: the registry is a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = attention_forward
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:  # transformers < 4.53 builds additive float masks for custom kernels
        return name
    # the boolean mask builder transformers' own sdpa uses in this release
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


# -- argument checks and messages of this module ----------------------------------------

#: transformers' own attn_implementation names, which ``register`` must not replace.
_TRANSFORMERS_BUILTIN = frozenset({"eager", "sdpa", "flex_attention", "paged|eager"})


def _transformers_missing_error() -> ImportError:
    """The error of ``register`` without transformers."""
    msg = (
        "`register` needs Hugging Face transformers (>= 4.48): "
        "pip install 'portable-attention[transformers]'"
    )
    return ImportError(msg)


#: Parts of a name that make transformers treat it as one of its own kernels: it runs that
#: kernel's support checks on any name containing them (so a model with
#: ``_supports_sdpa = False``, as gpt-oss, refuses a name containing "sdpa").
_TRANSFORMERS_NAME_PARTS = ("flash", "sdpa", "flex_attention", "paged|", "/")


def _check_attn_implementation(name: object) -> None:
    """``name`` of ``register``: a new, non-empty string, none of transformers' own."""
    if (
        not isinstance(name, str)
        or not name
        or name in _TRANSFORMERS_BUILTIN
        or any(part in name for part in _TRANSFORMERS_NAME_PARTS)
    ):
        msg = (
            f"`name` must be a new, non-empty attn_implementation string such as 'portable', "
            f"got {name!r} (transformers' own implementations cannot be replaced, and names "
            f"containing any of {', '.join(map(repr, _TRANSFORMERS_NAME_PARTS))} are "
            "dispatched and checked as transformers' own kernels)."
        )
        raise ValueError(msg)


def _attention_mask_dtype_error(dtype: object) -> TypeError:
    """The error for an ``attention_mask`` neither boolean nor floating."""
    msg = (
        f"`attention_mask` must be boolean (True = may attend) or an additive float "
        f"mask, got dtype {dtype}; convert it with `.bool()` if its "
        "nonzero entries mean 'attend'."
    )
    return TypeError(msg)


def _check_sliding_window(sliding_window: object) -> None:
    """transformers' ``sliding_window``: an int."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        msg = f"`sliding_window` must be an int, got {sliding_window!r}."
        raise TypeError(msg)


def _bidirectional_window_error(sliding_window: int, lq: int, lk: int) -> ValueError:
    """The error for a sliding window without a mask on a bidirectional layer."""
    msg = (
        f"`sliding_window={sliding_window}` without an attention mask on a bidirectional "
        f"layer (Lq={lq}, Lk={lk}) would cut keys, and its two-sided convention is "
        "model-specific; pass the mask transformers builds (the registered mask function "
        "does) or use attn_implementation='eager'."
    )
    return ValueError(msg)


def _two_sinks_error() -> TypeError:
    """The error for attention sinks given as both ``s_aux`` and ``sinks``."""
    msg = (
        "portable_attention's transformers integration got both `s_aux` and `sinks` "
        "(attention sinks under two names); pass one of them."
    )
    return TypeError(msg)


def _per_query_sinks_error(
    name: str, shape: tuple[int, ...], query_shape: tuple[int, ...]
) -> TypeError:
    """The error for sinks that differ per query position (an extra key column
    ``[B, Hq, Lq, 1]`` with ``Lq > 1``), which ``attend``'s one logit per head cannot hold."""
    msg = (
        f"portable_attention's transformers integration got `{name}` of shape {shape} for "
        f"a query of shape {query_shape}: a sink logit per query position, which is not "
        "supported (`attend` takes one sink per head, broadcastable to [B, Hq], or the "
        "column layout [B|1, Hq|1, 1, 1]); use attn_implementation='eager' for this model."
    )
    return TypeError(msg)


def _unsupported_kwarg_error(name: str, what: str | None) -> TypeError:
    """The error for a keyword from transformers that would change the result: ``what`` it
    does (None: a keyword the integration does not know)."""
    about = "an option this integration does not know" if what is None else what
    msg = (
        f"portable_attention's transformers integration got `{name}` ({about}), which "
        "would change the attention result but is not supported; use "
        "attn_implementation='eager' (or 'sdpa') for this model."
    )
    return TypeError(msg)
