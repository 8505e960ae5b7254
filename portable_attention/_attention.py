"""``attend()`` and ``plan()``: validate, plan, run the chosen path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from portable_attention import _core, _memo
from portable_attention._plan import CHUNKED, Plan, choose
from portable_attention._spec import Call, check_implementation, validate_call
from portable_attention.backends import adapter
from portable_attention.backends._base import Prepared

#: Runs a validated call: ``run(q, k, v, mask, bias, rng) -> attend's result``.
Runner = Callable[[Any, Any, Any, Any, Any, Any], Any]


def attend(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    rng: Any = None,
    return_weights: bool = False,
    return_lse: bool = False,
    chunk_size: int | None = None,
    implementation: str = "auto",
) -> Any:
    """Scaled dot-product attention on any array-API framework's arrays.

    Computes ``softmax(mask(bias + softcap(scale * q @ k^T))) @ v`` in the namespace
    of the inputs, on their device, differentiable by that framework's autodiff.

    Parameters
    ----------
    q : array ``[..., Hq, Lq, Dk]`` (or ``[Lq, Dk]``)
        Queries.
    k : array ``[..., Hk, Lk, Dk]``
        Keys; ``Hq % Hk == 0`` gives grouped-query attention (``Hk == 1``: multi-query)
        without copying K/V per head.
    v : array ``[..., Hk, Lk, Dv]``
        Values; ``Dv`` may differ from ``Dk``.
    mask : bool array, optional
        Broadcastable to ``[..., Hq, Lq, Lk]``; **True means "may attend"** (as torch
        SDPA and ``jax.nn.dot_product_attention``, the opposite of
        ``nn.MultiheadAttention``).
    bias : float array, optional
        Added to the scores (after ``softcap``); ``-inf`` entries act as a mask.
    causal : bool or {"lower_right", "upper_left"}
        **True means "lower_right"**: query i sees keys ``j <= i + (Lk - Lq)`` (the
        KV-cache convention). "upper_left": ``j <= i``. Both agree when ``Lq == Lk``.
    window : int or (left, right), optional
        Keep keys within ``left`` before and ``right`` after the query's aligned
        position (alignment as ``causal``; lower-right unless "upper_left"). ``None``
        for a side leaves it unbounded. Combines with ``causal``.
    scale : float, optional
        Score scale, a finite number > 0; default ``1 / sqrt(Dk)``.
    softcap : float, optional
        Scores become ``softcap * tanh(scores / softcap)``.
    dropout : float
        Dropout probability on the attention weights, in ``[0, 1)`` (inverted dropout).
    rng : framework RNG, optional
        ``numpy.random.Generator``, ``torch.Generator``, JAX PRNG key (required on JAX
        when ``dropout > 0``), or a CuPy generator.
    return_weights, return_lse : bool
        Also return the softmax weights ``[..., Hq, Lq, Lk]`` (before dropout) and/or
        the natural-log logsumexp ``[..., Hq, Lq]`` of the masked scores.
    chunk_size : int, optional
        Query/key block length of the memory-efficient chunked path (online softmax,
        peak memory ``O(Lq * Dv + chunk_size**2)`` per head); asks for that path.
        Without it ``auto`` chunks by itself when the dense scores would be large.
        Not with ``return_weights``.
    implementation : {"auto", "portable", "fused"}
        ``"auto"`` takes the framework's fused kernel where its result matches this
        contract, else the portable path; ``"portable"`` never takes a fused kernel;
        ``"fused"`` raises where none applies. See :func:`plan`.

    Returns
    -------
    out, or a tuple ``(out, weights)``, ``(out, lse)`` or ``(out, weights, lse)``.
        ``out [..., Hq, Lq, Dv]`` and ``weights`` in the input dtype; ``lse`` in the
        compute dtype (float32 for float16/bfloat16 inputs). Query rows with no key to
        attend give ``out = 0``, ``weights = 0``, ``lse = -inf`` and zero gradients.

    Raises
    ------
    TypeError
        Arrays of different frameworks, non-array or non-floating inputs, mismatched
        dtypes, a non-boolean ``mask``, an ``rng`` of the wrong type.
    ValueError
        Mismatched shapes, ranks, heads or devices, bad option values, or
        ``implementation="fused"`` where no fused kernel applies.
    """
    options = (
        causal,
        window,
        scale,
        softcap,
        dropout,
        rng is not None,
        chunk_size,
        return_weights,
        return_lse,
        implementation,
    )
    # A repeated call (same types, shapes, dtypes, devices and options; never data)
    # skips validation and planning: see portable_attention._memo.
    key = _memo.key(q, k, v, mask, bias, options)
    known = _memo.get(type(q), key)
    if known is None:
        call = validate_call(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=causal,
            window=window,
            scale=scale,
            softcap=softcap,
            dropout=dropout,
            rng=rng,
            chunk_size=chunk_size,
            return_weights=return_weights,
            return_lse=return_lse,
        )
        path = choose(call, check_implementation(implementation)).path
        known = (call, *_runner(call, path))
        if key is None:  # the first call of these array types: learn their keys
            _memo.register(call, q, k, v, mask, bias)
            key = _memo.key(q, k, v, mask, bias, options)
        if key is not None:
            _memo.put(type(q), key, known)
    if known[2] is not None:
        return known[2](q, k, v)
    return known[1](q, k, v, mask, bias, rng)


def _runner(call: Call, path: str) -> tuple[Runner | None, Prepared | None]:
    """The function that runs ``call`` on ``path``, built once per memo entry: a fused
    kernel of ``(q, k, v)`` alone where the adapter can bind everything else (one Python
    call less), else a runner of all the arguments (None in the other slot).

    Everything that depends only on the call (the adapter, the path, the kernel's fixed
    arguments) is bound here, so a repeated call pays for the kernel and little else.
    """
    backend = adapter(call.backend)
    if path.startswith("fused"):
        fused = backend.fused
        assert fused is not None
        kernel = fused.prepare(call) if not call.seeded else None
        if kernel is not None:
            return None, kernel

        def run_fused(q: Any, k: Any, v: Any, mask: Any, bias: Any, rng: Any) -> Any:
            _keep_mask(call, rng)  # a given rng is checked; the kernel draws its own
            return _pack(call, *fused.run(call, q, k, v, mask, bias, None))

        return run_fused, None

    if path.startswith("native"):
        native = backend.native
        assert native is not None

        def run_native(q: Any, k: Any, v: Any, mask: Any, bias: Any, rng: Any) -> Any:
            keep = _keep_mask(call, rng)
            return _pack(call, *native.run(call, q, k, v, mask, bias, keep))

        return run_native, None

    scores = backend.scores(call.xp)

    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, rng: Any) -> Any:
        keep = _keep_mask(call, rng)
        if path == CHUNKED:
            out, lse = _core.chunked(call, q, k, v, mask, bias, keep, scores=scores)
            return _pack(call, out, None, lse)
        return _pack(call, *_core.dense(call, q, k, v, mask, bias, keep, scores=scores))

    return run, None


def _keep_mask(call: Call, rng: Any) -> _core.KeepMask | None:
    """The dropout keep-mask drawer from the framework's ``rng``; None without dropout.

    A given ``rng`` is checked even where it is not used (no dropout, or a fused kernel
    drawing its own): a wrong generator is an error, never silently ignored.
    """
    if call.dropout == 0 and rng is None:
        return None
    keep = adapter(call.backend).keep_mask(rng, call.dropout, call.xp, call.device)
    return keep if call.dropout > 0 else None


def _pack(call: Call, out: Any, weights: Any, lse: Any) -> Any:
    if call.return_weights and call.return_lse:
        return out, weights, lse
    if call.return_weights:
        return out, weights
    if call.return_lse:
        return out, lse
    return out


def plan(q: Any, k: Any, v: Any, **kwargs: Any) -> Plan:
    """Which path ``attend(q, k, v, **kwargs)`` would take, and why, without running it.

    Takes the same arguments as :func:`attend` and validates them the same way.
    ``implementation="fused"`` raises ``ValueError`` with the reason where no fused
    kernel applies.
    """
    implementation = check_implementation(kwargs.pop("implementation", "auto"))
    call = validate_call(q, k, v, **kwargs)
    _keep_mask(call, kwargs.get("rng"))
    return choose(call, implementation)
