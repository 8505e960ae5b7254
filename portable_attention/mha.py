"""Multi-head attention on any array-API framework's arrays: a functional core, parameter
initialisation and a plain (autograd-free) class.

Parameters are a plain ``dict`` of arrays, applied as ``x @ w + b`` on batch-first inputs
``[B, L, E]`` (the one state format, shared with
:class:`portable_attention.nn.torch.MultiHeadAttention`):

| name    | shape              | role                                                        |
| ------- | ------------------ | ----------------------------------------------------------- |
| ``w_q`` | ``(E, Hq * D)``    | query projection                                            |
| ``w_k`` | ``(kdim, Hk * D)`` | key projection                                              |
| ``w_v`` | ``(vdim, Hk * Dv)``| value projection (``Dv == D`` from :func:`init_params`)     |
| ``w_o`` | ``(Hq * Dv, E)``   | output projection                                           |
| ``b_q`` | ``(Hq * D,)``      | optional bias of ``w_q`` (likewise ``b_k``, ``b_v``, ``b_o``) |
| ``sinks`` | ``(Hq,)``        | optional learned attention sinks: ``attend(sinks=...)``     |

``Hq`` is ``num_heads``, ``Hk`` is ``num_kv_heads`` (default ``Hq``; ``Hq % Hk == 0`` gives
grouped-query attention, ``Hk == 1`` multi-query). Attention itself is :func:`attend`, so
every fast path, mask rule and the "no key left gives 0" rule carry over.

``sinks`` (gpt-oss's learned attention sinks) holds one logit per query head, added to
every softmax denominator of that head (:func:`attend`'s ``sinks=``): the weights of a row
then sum to less than 1, and a row with no key left gives 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np

from portable_attention import _checks, _core
from portable_attention._attention import attend
from portable_attention._checks import as_int, is_kind
from portable_attention._spec import check_arrays, check_mask_bias
from portable_attention.backends import adapter

__all__ = ["MultiHeadAttention", "dropout", "init_params", "multi_head_attention"]

WEIGHTS = ("w_q", "w_k", "w_v", "w_o")
BIASES = ("b_q", "b_k", "b_v", "b_o")
#: The optional learned attention sinks, ``(num_heads,)``.
SINKS = "sinks"
#: Every parameter name of the state format.
PARAM_NAMES = (*WEIGHTS, *BIASES, SINKS)


def _split_heads(xp: Any, x: Any, heads: int) -> Any:
    """``[B, L, H * D] -> [B, H, L, D]`` (where B or L is unknown, None in the shape as
    ndonnx's symbolic dims: the heads' slices stacked, no reshape)."""
    b, length, width = x.shape
    d = width // heads
    if not _core.known(x.shape):
        return xp.stack([x[..., h * d : (h + 1) * d] for h in range(heads)], axis=1)
    return xp.permute_dims(xp.reshape(x, (b, length, heads, d)), (0, 2, 1, 3))


def _merge_heads(xp: Any, x: Any, heads: int) -> Any:
    """``[B, H, L, D] -> [B, L, H * D]`` (unknown dims: the heads concatenated)."""
    if not _core.known(x.shape):
        return xp.concat([x[:, h, ...] for h in range(heads)], axis=-1)
    b, _, length, d = x.shape
    return xp.reshape(xp.permute_dims(x, (0, 2, 1, 3)), (b, length, heads * d))


def _project(xp: Any, x: Any, params: dict[str, Any], w: str, b: str) -> Any:
    y = x @ params[w]
    bias = params.get(b)
    return y if bias is None else y + bias


def multi_head_attention(
    params: dict[str, Any],
    query: Any,
    key: Any = None,
    value: Any = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    mask: Any = None,
    bias: Any = None,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    key_padding_mask: Any = None,
    dropout: float = 0.0,
    rng: Any = None,
    return_weights: bool = False,
    segment_ids: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Any = None,
) -> Any:
    """Multi-head attention: project, split heads, :func:`attend`, merge heads, project.

    Parameters
    ----------
    params : dict of arrays
        ``w_q, w_k, w_v, w_o``, optional ``b_q, b_k, b_v, b_o`` and optional ``sinks``
        ``(num_heads,)`` (see the module docstring), same framework and dtype as
        ``query``. ``sinks`` go to :func:`attend` as ``sinks=``: one learned logit per
        query head added to each softmax denominator.
    query : array ``[B, Lq, E]``
    key : array ``[B, Lk, kdim]``, optional
        Defaults to ``query`` (self-attention).
    value : array ``[B, Lk, vdim]``, optional
        Defaults to ``key``.
    num_heads : int
        Query heads ``Hq``.
    num_kv_heads : int, optional
        Key/value heads ``Hk`` (default ``Hq``); ``Hq % Hk == 0``.
    mask : bool array, optional
        Broadcastable to ``[B, Hq, Lq, Lk]``; **True means "may attend"**.
    bias : float array, optional
        Additive score bias broadcastable to ``[B, Hq, Lq, Lk]`` (``-inf`` masks).
    causal : bool or {"lower_right", "upper_left"}
        As in :func:`attend`.
    window : int or (left, right), optional
        Sliding-window attention, as in :func:`attend` (combines with ``causal``).
    key_padding_mask : bool array ``[B, Lk]``, optional
        **True marks a real key** (may be attended), False a padding position; becomes a
        ``[B, 1, 1, Lk]`` mask combined (logical and) with ``mask``. This is the
        opposite polarity of ``torch.nn.MultiheadAttention``.
    dropout, rng
        Dropout on the attention weights and the framework's RNG, as in :func:`attend`.
    return_weights : bool
        Also return the per-head attention weights ``[B, Hq, Lq, Lk]`` (before dropout;
        with ``sinks`` a row sums to less than 1).
    segment_ids : int array ``[B, L]`` or a pair ``(q_ids [B, Lq], kv_ids [B, Lk])``, optional
        Packed sequences, as in :func:`attend`: a query attends only the keys of its own
        segment (the positions of its id in its batch row); ``causal`` and
        ``window`` align within each segment. A leading dim of 1 (or none) shares the
        ids across the batch.
    score_mod, mask_mod : optional
        FlexAttention-style mods, as in :func:`attend`, on the per-head scores
        ``[B, Hq, Lq, Lk]`` (``b`` indexes the batch, ``h`` the query heads); ``mask_mod``
        may be a :func:`portable_attention.masks.block_plan` of ``(Lq, Lk)``.

    Returns
    -------
    out ``[B, Lq, E]``, or ``(out, weights)``.
    """
    key = query if key is None else key
    value = key if value is None else value
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    xp = _check_mha_call(
        params, query, key, value, num_heads, num_kv_heads, key_padding_mask, mask, bias, WEIGHTS
    )

    q = _split_heads(xp, _project(xp, query, params, "w_q", "b_q"), num_heads)
    k = _split_heads(xp, _project(xp, key, params, "w_k", "b_k"), num_kv_heads)
    v = _split_heads(xp, _project(xp, value, params, "w_v", "b_v"), num_kv_heads)
    if key_padding_mask is not None:
        b, lk = key_padding_mask.shape
        if _core.known((b, lk)):
            kpm = xp.reshape(key_padding_mask, (b, 1, 1, lk))
        else:  # unknown dims cannot be written in a reshape
            kpm = xp.expand_dims(xp.expand_dims(key_padding_mask, axis=1), axis=1)
        mask = kpm if mask is None else (mask & kpm)
    result = attend(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        window=window,
        dropout=dropout,
        rng=rng,
        return_weights=return_weights,
        sinks=params.get(SINKS),
        segment_ids=segment_ids,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )
    out, weights = result if return_weights else (result, None)
    out = _project(xp, _merge_heads(xp, out, num_heads), params, "w_o", "b_o")
    return (out, weights) if return_weights else out


def _xavier_uniform(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    """The one Xavier/Glorot-uniform definition: U(-a, a), a = sqrt(6 / (fan_in + fan_out))."""
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=(fan_in, fan_out))


def init_params(
    embed_dim: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    kdim: int | None = None,
    vdim: int | None = None,
    bias: bool = True,
    sinks: bool = False,
    xp: Any = None,
    dtype: Any = None,
    device: Any = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Fresh parameters: Xavier-uniform weights, zero biases and zero sinks.

    Weights are drawn in float64 with ``numpy.random.default_rng(seed)`` in the order
    ``w_q, w_k, w_v, w_o`` (so the same seed gives the same values on every framework),
    then converted with ``xp.asarray(..., dtype=dtype, device=device)``.

    Parameters
    ----------
    embed_dim : int
        ``E``; must be divisible by ``num_heads`` (head size ``D = E // num_heads``).
    num_heads, num_kv_heads : int
        Query heads ``Hq`` and key/value heads ``Hk`` (default ``Hq``).
    kdim, vdim : int, optional
        Input widths of key and value (default ``E``).
    bias : bool
        Include ``b_q, b_k, b_v, b_o`` (zeros).
    sinks : bool
        Include learned attention sinks ``sinks`` ``(num_heads,)``, zeros: a sink of
        logit 0 adds ``exp(0) = 1`` to each softmax denominator of its head (gpt-oss's
        learned sinks start near 0), so a fresh module already gives each row weights
        summing to less than 1. Drawing no random numbers, they leave the weights as they
        are for the same seed.
    xp : namespace or framework module, optional
        Where the arrays go (NumPy when None).
    dtype, device : optional
        Passed to ``xp.asarray``; ``dtype`` defaults to ``xp.float32``.
    seed : int
        Seed of the NumPy generator.
    """
    hk = num_heads if num_kv_heads is None else num_kv_heads
    _check_mha_sizes(embed_dim, num_heads, hk, kdim, vdim)
    if xp is None:
        import numpy as xp
    ns = array_api_compat.array_namespace(xp.asarray(0.0))
    dtype = ns.float32 if dtype is None else dtype
    _check_param_dtype(ns, dtype)
    d = embed_dim // num_heads
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    rng = np.random.default_rng(seed)
    host = {
        "w_q": _xavier_uniform(rng, embed_dim, num_heads * d),
        "w_k": _xavier_uniform(rng, kdim, hk * d),
        "w_v": _xavier_uniform(rng, vdim, hk * d),
        "w_o": _xavier_uniform(rng, num_heads * d, embed_dim),
    }
    if bias:
        host |= {
            "b_q": np.zeros(num_heads * d),
            "b_k": np.zeros(hk * d),
            "b_v": np.zeros(hk * d),
            "b_o": np.zeros(embed_dim),
        }
    if _checks.flag("sinks", sinks):
        host[SINKS] = np.zeros(num_heads)
    kwargs = {} if device is None else {"device": device}
    params = {n: ns.asarray(a.astype(np.float64), dtype=dtype, **kwargs) for n, a in host.items()}
    _check_made_dtype(params["w_q"].dtype, dtype)
    return params


class MultiHeadAttention:
    """Multi-head attention holding its parameters as a ``dict`` of arrays of any array-API
    framework (NumPy, CuPy, array_api_strict, ...); no autograd, no training mode.

    Calls :func:`multi_head_attention`; see it for the arguments of ``__call__``, and
    :func:`init_params` for those of the constructor (``sinks=True`` adds learned
    attention sinks, one per query head, starting at 0).
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
        xp: Any = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
    ) -> None:
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.dropout = _checks.check_dropout(dropout)
        self.params = init_params(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            sinks=sinks,
            xp=xp,
            dtype=dtype,
            device=device,
            seed=seed,
        )

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
        rng: Any = None,
        return_weights: bool = False,
        segment_ids: Any = None,
        score_mod: Callable[..., Any] | None = None,
        mask_mod: Any = None,
    ) -> Any:
        """Attention with this object's parameters; ``dropout`` applies when it is > 0."""
        return multi_head_attention(
            self.params,
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
            dropout=self.dropout,
            rng=rng,
            return_weights=return_weights,
            segment_ids=segment_ids,
            score_mod=score_mod,
            mask_mod=mask_mod,
        )

    def state_dict(self) -> dict[str, Any]:
        """A shallow copy of the parameter dict (the one state format)."""
        return dict(self.params)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the parameters with ``state`` (any framework's arrays, e.g. from
        ``state_dict_portable()`` of the torch module), converted to this object's namespace,
        dtype and device. Keys and shapes must match the current ones (``sinks`` only
        into an object built with ``sinks=True``)."""
        check_state_sinks(state, self.params, self.num_heads)
        _checks.check_state_keys(state, self.params)
        new = {}
        for name, old in self.params.items():
            xp = array_api_compat.array_namespace(old)
            src = state[name]
            if not array_api_compat.is_array_api_obj(src) or (
                array_api_compat.array_namespace(src) is not xp
            ):  # another framework's array
                src = xp.asarray(host_array(src))
            arr = xp.asarray(xp.astype(src, old.dtype), device=array_api_compat.device(old))
            _checks.check_state_shape(name, tuple(arr.shape), tuple(old.shape))
            new[name] = arr
        self.params = new


def host_array(x: Any) -> np.ndarray:
    """Any framework's array (grad-tracking tensors, GPU arrays included) as a NumPy array
    of a standard dtype, for loading parameters: bfloat16, which NumPy has only through
    ml_dtypes, comes as float32 (exactly). The conversion is the testing kit's, imported
    only when a state of another framework is loaded."""
    from portable_attention.testing._convert import dtype_name, to_numpy

    half = dtype_name(getattr(x, "dtype", None)) == "bfloat16"
    return to_numpy(x, dtype="float32" if half else None)


def dropout(x: Any, p: float, *, rng: Any = None) -> Any:
    """Inverted dropout on any framework's floating array, with that framework's RNG.

    Each entry of ``x`` is kept with probability ``1 - p`` and scaled by ``1 / (1 - p)``,
    or set to 0; the keep-mask is drawn as :func:`attend` draws its own, from ``rng``: a
    ``numpy.random.Generator`` (NumPy and other array-API libraries), ``torch.Generator``,
    JAX PRNG key (required on JAX when ``p > 0``; split it for each call) or CuPy
    generator, ``None`` for the framework's global RNG where it has one. ``p == 0``
    returns ``x`` itself (a given ``rng`` is still checked). For the residual and
    feed-forward dropouts of a Transformer layer: see ``examples/encoder_layer.py``.
    """
    p = _checks.check_dropout(p, name="p")
    xp, backend, device = _check_dropout_input(x)
    if p == 0 and rng is None:
        return x
    keep = adapter(backend).keep_mask(rng, p, xp, device)  # a wrong rng raises here
    if p == 0:
        return x
    return _core.inverted_dropout(xp, x, keep, p)


# -- argument checks and messages of this module ----------------------------------------


def _check_mha_call(
    params: dict[str, Any],
    query: Any,
    key: Any,
    value: Any,
    num_heads: int,
    num_kv_heads: int,
    key_padding_mask: Any,
    mask: Any,
    bias: Any,
    weights: tuple[str, ...],
) -> Any:
    """Every argument check of ``mha.multi_head_attention``; returns the namespace.

    ``mask`` and ``bias`` are checked here as :func:`attend` would, against the scores
    ``[B, Hq, Lq, Lk]``: ``mask`` is combined with ``key_padding_mask`` before ``attend``
    sees it."""
    missing = [n for n in weights if n not in params]
    if missing:
        msg = f"`params` lacks {missing}; expected keys {list(weights)} (+ optional biases)"
        raise ValueError(msg)
    if not isinstance(num_heads, int) or num_heads <= 0:
        msg = f"`num_heads` must be a positive int, got {num_heads!r}"
        raise ValueError(msg)
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
        msg = (
            f"`num_kv_heads` must be a positive divisor of `num_heads`={num_heads}, "
            f"got {num_kv_heads!r}"
        )
        raise ValueError(msg)
    named = {f"params[{n!r}]": p for n, p in params.items() if p is not None}
    xp, _, _ = check_arrays(
        query=query,
        key=key,
        value=value,
        key_padding_mask=key_padding_mask,
        mask=mask,
        bias=bias,
        **named,
    )
    if key_padding_mask is not None and not is_kind(xp, key_padding_mask.dtype, "bool"):
        msg = (
            f"`key_padding_mask` must be boolean [B, Lk] (True = real key), got dtype "
            f"{key_padding_mask.dtype}; for 0/1 where 1 = real key pass `key_padding_mask != 0`, "
            "for torch's True = padding pass its negation."
        )
        raise TypeError(msg)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 3:
            got = getattr(x, "shape", type(x))
            msg = f"`{name}` must be a batch-first [B, L, E] array, got {got}"
            raise ValueError(msg)
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        msg = f"batch sizes differ: `query` {query.shape}, `key` {key.shape}, `value` {value.shape}"
        raise ValueError(msg)
    if key.shape[1] != value.shape[1]:
        msg = f"`key` {key.shape} and `value` {value.shape} must have the same length"
        raise ValueError(msg)
    shapes = {n: tuple(params[n].shape) for n in weights}
    wq, wk, wv, wo = (shapes[n] for n in weights)
    ok = (
        len(wq) == len(wk) == len(wv) == len(wo) == 2
        and wq[1] % num_heads == 0
        and wk[1] % num_kv_heads == 0
        and wv[1] % num_kv_heads == 0
        and wq[1] // num_heads == wk[1] // num_kv_heads
        and wo[0] == num_heads * (wv[1] // num_kv_heads)
        and wq[0] == query.shape[2]
        and wk[0] == key.shape[2]
        and wv[0] == value.shape[2]
    )
    if not ok:
        msg = (
            f"parameter shapes {shapes} do not fit `num_heads`={num_heads}, "
            f"`num_kv_heads`={num_kv_heads} and inputs `query` {query.shape}, `key` {key.shape}, "
            f"`value` {value.shape}; expected w_q (E, Hq*D), w_k (kdim, Hk*D), "
            "w_v (vdim, Hk*Dv), w_o (Hq*Dv, E)"
        )
        raise ValueError(msg)
    _check_params_sinks(params, num_heads)
    for name, arr in params.items():
        if arr is not None and arr.dtype != query.dtype:
            msg = f"`params[{name!r}]` has dtype {arr.dtype}, `query` has {query.dtype}; cast one"
            raise TypeError(msg)
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (
        key.shape[0],
        key.shape[1],
    ):
        msg = (
            f"`key_padding_mask` must be boolean [B, Lk] = {(key.shape[0], key.shape[1])}, "
            f"got shape {tuple(key_padding_mask.shape)}"
        )
        raise ValueError(msg)
    scores = (query.shape[0], num_heads, query.shape[1], key.shape[1])
    check_mask_bias(xp, mask, bias, query.dtype, scores)
    return xp


def _check_params_sinks(params: dict[str, Any], num_heads: int) -> None:
    """``params['sinks']``, where present: an array ``(num_heads,)``, one logit per query
    head (its framework and dtype are checked with the other parameters)."""
    sinks = params.get(SINKS)
    if sinks is None:
        return
    shape = getattr(sinks, "shape", None)
    if shape is None or tuple(shape) != (num_heads,):
        got = type(sinks).__name__ if shape is None else f"shape {tuple(shape)}"
        msg = (
            f"`params['sinks']` must be an array [num_heads] = ({num_heads},): one learned "
            f"attention-sink logit per query head, got {got}; make it with "
            "`init_params(..., sinks=True)` or drop the key for no sinks."
        )
        raise ValueError(msg)


def check_state_sinks(state: Any, expected: Any, num_heads: int) -> None:
    """A state to load into a multi-head module (``expected``: the module's parameter
    names) has ``sinks`` exactly where the module does, of shape ``(num_heads,)``."""
    has, wants = SINKS in state, SINKS in expected
    if has != wants:
        msg = (
            f"`state` has no 'sinks' but the module was built with `sinks=True`; build it "
            f"with `sinks=False` or add `state['sinks']` [num_heads] = ({num_heads},)"
            if wants
            else "`state` has 'sinks' (learned attention sinks) but the module was built "
            "without them; build it with `sinks=True` to load them"
        )
        raise ValueError(msg)
    if has:
        shape = getattr(state[SINKS], "shape", None)
        if shape is None or tuple(shape) != (num_heads,):
            got = type(state[SINKS]).__name__ if shape is None else f"shape {tuple(shape)}"
            msg = (
                f"`state['sinks']` must be [num_heads] = ({num_heads},): one attention-sink "
                f"logit per query head, got {got}"
            )
            raise ValueError(msg)


def _check_mha_sizes(
    embed_dim: int, num_heads: int, num_kv_heads: int, kdim: int | None, vdim: int | None
) -> None:
    """``init_params``: positive ints; ``embed_dim`` a multiple of ``num_heads``, which
    ``num_kv_heads`` divides."""
    sizes = {"embed_dim": embed_dim, "num_heads": num_heads, "num_kv_heads": num_kv_heads}
    sizes |= {n: d for n, d in (("kdim", kdim), ("vdim", vdim)) if d is not None}
    for name, size in sizes.items():
        number = as_int(size)
        if number is None or number <= 0:
            msg = f"`{name}` must be a positive int, got {size!r}"
            raise TypeError(msg) if number is None else ValueError(msg)
    if embed_dim % num_heads:
        msg = f"`embed_dim`={embed_dim} must be a positive multiple of `num_heads`={num_heads}"
        raise ValueError(msg)
    if num_heads % num_kv_heads:
        msg = f"`num_kv_heads`={num_kv_heads} must be a positive divisor of `num_heads`={num_heads}"
        raise ValueError(msg)


def _check_dropout_input(x: Any) -> tuple[Any, str, Any]:
    """``mha.dropout``'s ``x``: one floating array; returns ``(xp, backend, device)``."""
    xp, backend, device = check_arrays(x=x)
    if not is_kind(xp, x.dtype, "real floating"):
        msg = f"`x` must have a real floating dtype, got {x.dtype}."
        raise TypeError(msg)
    return xp, backend, device


def _check_param_dtype(xp: Any, dtype: Any) -> None:
    """``init_params``: a real floating ``dtype`` of the namespace."""
    if not is_kind(xp, dtype, "real floating"):
        msg = f"`dtype` must be a real floating dtype (float32, float64, ...), got {dtype!r}."
        raise TypeError(msg)


def _check_made_dtype(got: Any, wanted: Any) -> None:
    """``init_params``: the framework made the asked dtype (JAX without 64-bit types makes
    float64 into float32 with only a warning)."""
    if got != wanted:
        name = getattr(wanted, "__name__", wanted)
        msg = (
            f"`dtype`={name} came out as {got}: the framework cannot hold it here (for JAX "
            "enable 64-bit types with `jax.config.update('jax_enable_x64', True)` at startup), "
            "or ask for the dtype it gives."
        )
        raise TypeError(msg)
