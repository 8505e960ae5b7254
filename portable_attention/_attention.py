"""``attend()``, ``attend_backward()`` and ``plan()``: validate, plan, run the chosen path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from portable_attention import _blockwise_backward, _core, _dense_backward, _memo, _mods
from portable_attention._blockwise import BlockKeep, Grads, block_math
from portable_attention._options import Options, options
from portable_attention._plan import BLOCKWISE, DENSE, Plan, choose
from portable_attention._spec import Call, fused_unavailable_error, validate_call
from portable_attention.backends import adapter
from portable_attention.backends._base import Prepared

#: Runs a validated call: ``run(q, k, v, mask, bias, rng, mods=None, sinks=None) ->
#: attend's result``.
Runner = Callable[..., Any]


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
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Any = None,
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
        Query/key block length of the blockwise path (an online softmax forward, and a
        backward that recomputes each block from lse: peak memory
        ``O((Lq + Lk) * D + chunk_size**2)`` per head, forward and backward); asks for
        that path. Without it ``auto`` takes the blockwise path by itself where the dense
        scores, or what autodiff would save of them, would be large. Not with
        ``return_weights``.
    implementation : {"auto", "portable", "fused"}
        ``"auto"`` takes the framework's fused kernel where its result matches this
        contract, else the portable path; ``"portable"`` never takes a fused kernel;
        ``"fused"`` raises where none applies. See :func:`plan`.
    sinks : float array, optional
        Attention sinks (gpt-oss): one logit per query head, broadcastable to
        ``[..., Hq]``, added to every row's softmax denominator. The weights exclude it
        (rows sum to less than 1); ``lse`` includes it; a row with no key gives out 0 and
        lse = the sink. Differentiable on every path.
    segment_ids : int array ``[..., L]`` or a pair ``(q_ids [..., Lq], kv_ids [..., Lk])``
        Packed sequences: a query attends only the keys of its own segment (the positions
        of its id; leading dims broadcast to q's batch dims, shared by the heads).
        ``causal`` and ``window`` then align within each segment: its last query with its
        last key (lower-right, as ``flash_attn_varlen_func``), or its first with its first
        (``causal="upper_left"``); with one array of ids that is the global band. No
        dense mask is built: each block's mask comes from the ids, and eager backends skip
        blocks with no matching pair.
    score_mod : callable, optional
        FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
        the scores after ``softcap`` and ``bias``, block by block, on int32 index arrays
        that broadcast against ``[..., Hq, rows, cols]``: ``b [B, 1, 1, 1]``, ``h [Hq, 1,
        1]``, ``q_idx [rows, 1]``, ``kv_idx [1, cols]``. Gradients reach the arrays it
        captures (torch and JAX autodiff).
    mask_mod : callable or masks.BlockPlan, optional
        FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend),
        ANDed with every other mask; a :func:`masks.block_plan` of it also records the
        blocks it masks entirely, which the blockwise path then skips (under jit too).

    Returns
    -------
    out, or a tuple ``(out, weights)``, ``(out, lse)`` or ``(out, weights, lse)``.
        ``out [..., Hq, Lq, Dv]`` and ``weights`` in the input dtype; ``lse`` in the
        compute dtype (float32 for float16/bfloat16 inputs). Query rows with no key to
        attend give ``out = 0``, ``weights = 0``, ``lse = -inf`` (the sink with
        ``sinks``) and zero gradients.

    Raises
    ------
    TypeError
        Arrays of different frameworks, non-array or non-floating inputs, mismatched
        dtypes, a non-boolean ``mask``, an ``rng`` of the wrong type.
    ValueError
        Mismatched shapes, ranks, heads or devices, bad option values, or
        ``implementation="fused"`` where no fused kernel applies.
    """
    raw = (
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
    if (
        sinks is not None
        or segment_ids is not None
        or score_mod is not None
        or mask_mod is not None
    ):
        call = _validated(q, k, v, mask, bias, rng, raw, sinks, segment_ids, score_mod, mask_mod)
        return run_call(call, q, k, v, mask, bias, rng, sinks, segment_ids, score_mod, mask_mod)
    # A repeated call (same types, shapes, dtypes, devices and options; never data)
    # skips validation and planning: see portable_attention._memo.
    key = _memo.key(q, k, v, mask, bias, raw)
    known = _memo.get(type(q), key)
    if known is None:
        call = _validated(q, k, v, mask, bias, rng, raw)
        known = _runner(call, choose(call).path)
        if key is None:  # the first call of these array types: learn their keys
            _memo.register(call, q, k, v, mask, bias)
            key = _memo.key(q, k, v, mask, bias, raw)
        if key is not None:
            _memo.put(type(q), key, known)
    if known.kernel is not None:
        return known.kernel(q, k, v)
    return known.run(q, k, v, mask, bias, rng)


def _validated(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    rng: Any,
    raw: tuple[Any, ...],
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
) -> Call:
    """The validated :class:`Call` of attend's arguments (``raw``: its option tuple, the
    memo's key)."""
    causal, window, scale, softcap, dropout, _, chunk_size, weights, lse, implementation = raw
    normalised = options(
        causal=causal,
        window=window,
        scale=scale,
        softcap=softcap,
        dropout=dropout,
        chunk_size=chunk_size,
        return_weights=weights,
        return_lse=lse,
        implementation=implementation,
    )
    return validate_call(
        q,
        k,
        v,
        normalised,
        mask=mask,
        bias=bias,
        rng=rng,
        sinks=sinks,
        segment_ids=segment_ids,
        score_mod=score_mod,
        mask_mod=mask_mod,
    )


def run_call(
    call: Call,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    bias: Any = None,
    rng: Any = None,
    sinks: Any = None,
    segment_ids: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    *,
    mods: _mods.Mods | None = None,
) -> Any:
    """Run a validated ``call`` on its arrays (or on slices of the arrays it validated,
    with :func:`portable_attention._spec.describe`'s call of them): planned, then run as
    :func:`attend` runs it. The internal entry of the ring's blocks, which give ``mods``
    themselves (the ids of the block's rows and of its columns) instead of the arrays and
    functions they are prepared from."""
    runner = _runner(call, choose(call).path)
    if runner.kernel is not None:  # kernels of (q, k, v) alone: no sinks, ids or mods
        assert not call.modded and sinks is None
        return runner.kernel(q, k, v)
    if not call.modded and sinks is None:
        return runner.run(q, k, v, mask, bias, rng)
    if mods is None:
        mods = _mods.prepare(call, segment_ids, score_mod, mask_mod)
    return runner.run(q, k, v, mask, bias, rng, mods, sinks)


class Runnable(NamedTuple):
    """How a validated call runs (a memo entry): ``run(q, k, v, mask, bias, rng,
    mods=None, sinks=None)``, or where it is not None ``kernel(q, k, v)``, a fused kernel
    with everything else bound (one Python call less)."""

    run: Runner
    kernel: Prepared | None


def _kernel_runner(call: Call, kernel: Any, *, draws: bool) -> Any:
    """The runner of a fused or tuned kernel: dropout's keep mask drawn here for a kernel
    of ours (``draws``), only checked for a fused one (it draws its own); sinks merged
    after it from its lse."""

    def run_kernel(
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        rng: Any,
        mods: Any = None,
        sinks: Any = None,
    ) -> Any:
        keep = _keep_mask(call, rng)  # a given rng is checked even where unused
        result = kernel.run(call, q, k, v, mask, bias, keep if draws else None, mods)
        return _returned(call, *_with_sinks(call, sinks, *result))

    return run_kernel


def _runner(call: Call, path: str) -> Runnable:
    """How ``call`` runs on ``path``, built once per memo entry: a runner of all the
    arguments, and a fused kernel of ``(q, k, v)`` alone where the adapter can bind
    everything else.

    Everything that depends only on the call (the adapter, the path, the kernel's fixed
    arguments) is bound here, so a repeated call pays for the kernel and little else.
    """
    backend = adapter(call.backend)
    # The kernels only where the plan names one: an adapter may import them when read.
    kernels = backend.fused_kernels if path not in (BLOCKWISE, DENSE) else ()
    fused = next((kernel for kernel in kernels if kernel.path == path), None)
    if fused is not None:
        prepared = fused.prepare(call) if not call.rng_given else None
        return Runnable(_kernel_runner(call, fused, draws=False), prepared)

    tuned = backend.tuned if path not in (BLOCKWISE, DENSE) else None
    if tuned is not None and path == tuned.path:
        return Runnable(_kernel_runner(call, tuned, draws=True), None)

    if path == BLOCKWISE:  # else the dense path

        def run_blockwise(
            q: Any,
            k: Any,
            v: Any,
            mask: Any,
            bias: Any,
            rng: Any,
            mods: Any = None,
            sinks: Any = None,
        ) -> Any:
            keep = _block_keep(call, rng)
            out, lse = backend.blockwise(call, q, k, v, mask, bias, keep, mods)
            return _returned(call, *_with_sinks(call, sinks, out, None, lse))

        return Runnable(run_blockwise, None)

    scores = backend.scores(call.xp)

    def run(
        q: Any, k: Any, v: Any, mask: Any, bias: Any, rng: Any, mods: Any = None, sinks: Any = None
    ) -> Any:
        keep = _keep_mask(call, rng)
        # The weights' call writes its steps in place where the adapter can: the weights
        # take the scores' memory (NumPy [1, 8, 2048, 64]: a peak of 140 MiB against 392,
        # 260 ms against 421). Small calls run the functional steps: the in-place ones'
        # checks cost more than they save (decode over 512 keys: 67 us against 73).
        math = None
        if call.return_weights:
            math = block_math(call, (q, k, v, mask, bias, sinks))
        result = _core.dense(call, q, k, v, mask, bias, keep, scores=scores, mods=mods, math=math)
        return _returned(call, *_with_sinks(call, sinks, *result))

    return Runnable(run, None)


def _with_sinks(call: Call, sinks: Any, out: Any, weights: Any, lse: Any) -> tuple[Any, Any, Any]:
    """A kernel's result with the sinks merged in (unchanged without sinks)."""
    if sinks is None:
        return out, weights, lse
    return _core.add_sinks(call, sinks, out, weights, lse)


def _keep_mask(call: Call, rng: Any) -> _core.KeepMask | None:
    """The dropout keep-mask drawer from the framework's ``rng``; None without dropout.

    A given ``rng`` is checked even where it is not used (no dropout, or a fused kernel
    drawing its own): a wrong generator is an error, never silently ignored.
    """
    if call.dropout == 0 and rng is None:
        return None
    keep = adapter(call.backend).keep_mask(rng, call.dropout, call.xp, call.device)
    return keep if call.dropout > 0 else None


def _block_keep(call: Call, rng: Any) -> BlockKeep | None:
    """The blockwise path's per-block keep masks from ``rng``; None without dropout (a
    given ``rng`` is still checked, and a stateful one is not advanced)."""
    if call.dropout == 0:
        _keep_mask(call, rng)
        return None
    return adapter(call.backend).block_keep(rng, call.dropout, call.xp, call.device)


def _returned(call: Call, out: Any, weights: Any, lse: Any) -> Any:
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
    arrays = {name: kwargs.pop(name) for name in _NOT_OPTIONS if name in kwargs}
    unknown = sorted(set(kwargs) - set(Options.__dataclass_fields__))
    if unknown:
        msg = f"plan() got an unexpected keyword argument {unknown[0]!r}: it takes attend's."
        raise TypeError(msg)
    call = validate_call(q, k, v, options(**kwargs), **arrays)
    _keep_mask(call, arrays.get("rng"))
    chosen = choose(call)
    for kernel in adapter(call.backend).fused_kernels:
        why = kernel.hands_over(call, q, k, v) if kernel.path == chosen.path else None
        if why is not None and call.implementation == "fused":
            raise fused_unavailable_error(why)
        if why is not None:
            return Plan(BLOCKWISE, f"{chosen.reason}; but {why}: the blockwise path runs")
    return chosen


#: attend's keywords that are not options: arrays, the rng and the functions.
_NOT_OPTIONS = ("mask", "bias", "rng", "sinks", "segment_ids", "score_mod", "mask_mod")


def attend_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: bool | str = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    rng: Any = None,
    chunk_size: int | None = None,
    dlse: Any = None,
    sinks: Any = None,
    segment_ids: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
) -> Grads:
    """Gradients of a loss through :func:`attend`, from its ``out`` and ``lse`` alone.

    FlashAttention-2's blockwise backward in the arrays' own namespace and on their device
    (NumPy, CuPy, array_api_strict, torch, JAX ...): each block's probabilities are
    recomputed as ``exp(s - lse)``, so peak memory is ``O((Lq + Lk) * D + block**2)`` per
    head and nothing of the forward but ``out`` and ``lse`` is needed. Blocks that
    ``causal``/``window`` mask entirely are skipped; rows with no key get zero gradients.
    Where the batch or a length is unknown (None in the shape: ndonnx's symbolic dims),
    the one block is the whole ``[..., Lq, Lk]`` matrix, built from the arrays' shapes
    (the graph holds for every value; dropout, a pair of segment ids and mods are
    refused there).

    Parameters
    ----------
    dout : array ``[..., Hq, Lq, Dv]``
        The loss's gradient with respect to ``out``.
    q, k, v : arrays
        The inputs of the forward call.
    out, lse : arrays ``[..., Hq, Lq, Dv]`` and ``[..., Hq, Lq]``
        What ``attend(q, k, v, return_lse=True, **options)`` returned. They may come
        from elsewhere: with the *global* ``out`` and ``lse`` of the query rows, a call
        on one shard of K/V gives that shard's ``dk``, ``dv`` and its part of ``dq``
        exactly (sequence parallelism sums the ``dq`` over shards).
    mask, bias, causal, window, scale, softcap
        The forward call's options, as :func:`attend` takes them.
    dropout, rng, chunk_size
        To replay dropout, the forward must have run the blockwise path
        (``plan(...).path == "portable:blockwise"``, e.g. with ``chunk_size=``); pass
        the same ``dropout``, the same ``chunk_size`` and an ``rng`` in the state the
        forward's was in (a generator made again from the same seed, or the same JAX key):
        each block's keep mask is drawn again from it.
        Without dropout, ``chunk_size`` only sets the block length.
    dlse : array ``[..., Hq, Lq]``, optional
        The loss's gradient with respect to ``lse``, where the loss uses it.
    sinks, segment_ids, mask_mod
        As :func:`attend` takes them (``out`` and ``lse`` from that call: its ``lse``
        includes the sinks). Blocks that segment ids or ``mask_mod`` mask entirely are
        skipped.
    score_mod
        Not supported: its derivative needs autodiff. Differentiate ``attend`` with
        torch or JAX instead; a ``score_mod`` here raises ``ValueError``.

    Returns
    -------
    Grads
        ``(dq, dk, dv, dbias, dsinks)``: shaped and typed as ``q``, ``k``, ``v``,
        ``bias`` and ``sinks`` (``dbias`` summed over the axes the bias broadcasts along;
        None without a bias; ``dsinks`` None without sinks).

    Raises
    ------
    TypeError, ValueError
        As :func:`attend` for the inputs and options; for ``dout``, ``out``, ``lse`` or
        ``dlse`` of another framework, device, shape or dtype.
    """
    if score_mod is not None:
        raise _mods.backward_score_mod_error()
    normalised = options(
        causal=causal,
        window=window,
        scale=scale,
        softcap=softcap,
        dropout=dropout,
        chunk_size=chunk_size,
        return_lse=True,
    )
    call = validate_call(
        q,
        k,
        v,
        normalised,
        mask=mask,
        bias=bias,
        rng=rng,
        sinks=sinks,
        segment_ids=segment_ids,
        mask_mod=mask_mod,
    )
    _blockwise_backward.check_backward_arrays(call, q, dout=dout, out=out, lse=lse, dlse=dlse)
    return run_backward(
        call, dout, q, k, v, out, lse, mask, bias, rng, dlse, sinks, segment_ids, mask_mod
    )


def run_backward(
    call: Call,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    mask: Any = None,
    bias: Any = None,
    rng: Any = None,
    dlse: Any = None,
    sinks: Any = None,
    segment_ids: Any = None,
    mask_mod: Any = None,
    *,
    mods: _mods.Mods | None = None,
) -> Grads:
    """:func:`attend_backward` of a validated ``call`` (as :func:`run_call`)."""
    if mods is None:
        mods = _mods.prepare(call, segment_ids, None, mask_mod)
    if call.unknown_dims:  # no blocks of unknown lengths (nor dropout, a pair of ids, mods)
        return _dense_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, dlse=dlse, sinks=sinks, mods=mods
        )
    keep = _block_keep(call, rng)
    return adapter(call.backend).blockwise_backward(
        call, dout, q, k, v, out, lse, mask, bias, keep, dlse, mods, sinks
    )
