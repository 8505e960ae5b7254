"""The blockwise path's backward: FlashAttention-2's, over the blocks of the same grid as
the forward (:mod:`portable_attention._blockwise`, whose module docstring describes both
passes), through the same primitives.

Gradients from ``q, k, v, out, lse, dout`` alone, each block's probabilities recomputed as
``exp(s - lse)``: ``delta = rowsum(dout * out)``, ``dv += p^T dout``, ``dp = dout v^T``,
``ds = p * (dp - delta)``, softcap's derivative, ``dq += scale * ds k``, ``dk += scale *
ds^T q`` (and ``dbias``, ``ds`` summed to the bias's shape). Array-API only, as the
forward; JAX's custom gradient of a ``score_mod`` differentiates the mod per block
(:class:`ScoreGrad`, :func:`backward_and_consts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from portable_attention import _core
from portable_attention._block_grid import (
    HostBool,
    Span,
    block_number,
    masked_out,
    pairs,
    partners,
    prepared,
    trimmed,
)
from portable_attention._block_loop import BlockLoop
from portable_attention._block_math import BlockMath
from portable_attention._blockwise import (
    BlockKeep,
    Grads,
    bounded_scores,
    grouped,
    primitives,
)
from portable_attention._checks import is_kind, shape_of
from portable_attention._core import Scores
from portable_attention._mods import Mods
from portable_attention._spec import Call, check_arrays

_INF = float("inf")


#: ``score_grad(s, rows, cols) -> (s_modded, pullback)``: a ``score_mod`` applied to one
#: block with its vector-Jacobian product, where the framework differentiates it (JAX);
#: ``pullback(ds) -> (ds before the mod, *d consts)``, ``consts`` being the arrays the mod
#: captures (:attr:`ScoreGrad.consts`), whose gradients the backward sums over blocks.
class ScoreGrad(Protocol):
    consts: tuple[Any, ...]

    def __call__(
        self, s: Any, rows: tuple[Any, int], cols: tuple[Any, int]
    ) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]: ...


def _sum_group(call: Call, x: Any) -> Any:
    """``[..., Hk, G, L, D] -> [..., Hk, 1, L, D]``: the query heads of a K/V head summed."""
    return call.xp.sum(x, axis=-3, keepdims=True) if call.grouped else x


def _add_product(call: Call, math: BlockMath, acc: Any, a: Any, b: Any) -> Any:
    """``acc + a @ b`` with grouped-query heads summed over their group (``a @ b``
    where ``acc`` is None)."""
    if not call.grouped:
        return math.matmul_add(acc, a, b)
    product = _sum_group(call, call.xp.matmul(a, b))
    return product if acc is None else math.add(acc, product)


def _reduce_to(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` summed over the axes where ``shape`` has 1 and ``x`` does not (keepdims)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 != a)
    return xp.sum(x, axis=axes, keepdims=True) if axes else x


def backward(
    call: Call,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    mask: Any = None,
    bias: Any = None,
    keep: BlockKeep | None = None,
    *,
    dlse: Any = None,
    want_dbias: bool = True,
    scores: Scores | None = None,
    mods: Mods | None = None,
    host_bool: HostBool | None = None,
    sinks: Any = None,
    math: BlockMath | None = None,
    loop: BlockLoop | None = None,
) -> Grads:
    """FlashAttention-2's backward over the blocks of ``_block_grid.pairs`` (see the
    module).

    ``out`` and ``lse`` are the forward's (or, for a shard of K/V, those of the whole
    call); ``dlse`` the loss's gradient with respect to ``lse`` where it uses it. ``keep``
    must draw the forward's masks. ``want_dbias=False`` skips ``dbias`` (None then).
    ``mods``: segment ids and a ``mask_mod`` (a ``score_mod`` needs autodiff: torch
    differentiates it on its own path, JAX through :func:`backward_and_consts`).
    ``sinks``: with the ``lse`` that includes them, every block's ``exp(s - lse)`` is
    already the probability with the sink in the denominator; ``dsinks`` comes from the
    rows' ``delta`` (:func:`_core.sinks_grad`). The primitives as the forward's
    (:func:`portable_attention._blockwise.forward`).
    Returns :class:`Grads` in the inputs' dtypes and shapes.
    """
    assert not call.score_mod, "the array-API backward cannot differentiate a score_mod"
    return backward_and_consts(
        call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, want_dbias=want_dbias,
        scores=scores, mods=mods, host_bool=host_bool, sinks=sinks, math=math, loop=loop,
    )[0]  # fmt: skip


def backward_and_consts(
    call: Call,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    mask: Any = None,
    bias: Any = None,
    keep: BlockKeep | None = None,
    *,
    dlse: Any = None,
    want_dbias: bool = True,
    scores: Scores | None = None,
    mods: Mods | None = None,
    host_bool: HostBool | None = None,
    sinks: Any = None,
    math: BlockMath | None = None,
    loop: BlockLoop | None = None,
    score_grad: ScoreGrad | None = None,
) -> tuple[Grads, tuple[Any, ...]]:
    """:func:`backward`, with a ``score_mod`` differentiated by ``score_grad``: returns
    ``(grads, gradients of score_grad.consts)`` (``()`` without one)."""
    xp = call.xp
    scores, host_bool, math, loop = primitives(
        call, (dout, q, k, v, out, lse, bias, dlse, sinks), scores, host_bool, math, loop
    )
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    consts = () if score_grad is None else tuple(score_grad.consts)
    dbias_wanted = bias is not None and want_dbias
    dsinks = None
    if sinks is not None:
        dsinks = _core.sinks_grad_from(call, sinks, dout, out, lse, dlse)
    if lq == 0 or lk == 0:
        grads = Grads(
            xp.zeros_like(q),
            xp.zeros_like(k),
            xp.zeros_like(v),
            xp.zeros_like(bias) if dbias_wanted else None,
            dsinks,
        )
        return grads, tuple(xp.zeros_like(c) for c in consts)
    run = prepared(call, loop, q, k, v, mask, bias, mods)
    ops, size = run.ops, run.size
    lqp = run.nq * size
    dv_size = call.v_shape[-1]
    do = loop.pad(grouped(call, dout, last=dv_size), lqp, -2, 0.0)
    delta = xp.sum(do * loop.pad(grouped(call, out, last=dv_size), lqp, -2, 0.0), axis=-1)
    if dlse is not None:  # d lse / d s = p: ds = p * (dp - (delta - dlse))
        delta = delta - loop.pad(grouped(call, dlse, last=None), lqp, -1, 0.0)
    # Rows with no key (lse = -inf): +inf makes every p = exp(s - inf) = 0 (NaN stays NaN).
    lse_g = grouped(call, lse, last=None)
    lse_g = loop.pad(xp.where(lse_g == -xp.inf, xp.inf, lse_g), lqp, -1, _INF)
    queries_of = partners(pairs(call, size), run.nk, by_keys=True)
    bias_shape = tuple(ops.bias.shape) if dbias_wanted else ()
    # One column more in a matmul instead of a pass over each block: [dout, delta] @
    # [v, -1]^T = dp - delta (not with dropout, whose mask applies to dp alone), and
    # without softcap [q, -lse] @ [k, 1]^T = s - lse (softcap's tanh, or a score_mod,
    # comes in between); where the loop's compiler fuses those passes itself, the
    # augmented copies of q and dout only cost memory (BlockLoop.fold_columns).
    fold_delta = keep is None and loop.fold_columns
    fold_lse = call.softcap is None and not call.score_mod and loop.fold_columns
    # With softcap bounding the scores (no bias), p = exp(s) * exp(-lse): the row factor
    # goes into dout and delta (rows with no key: exp(-inf) = 0), a pass less per block.
    bounded = bounded_scores(call)
    if bounded:
        factor = xp.exp(-lse_g)
        do = do * factor[..., None]
        delta = delta * factor
    do_aug = xp.concat([do, delta[..., None]], axis=-1) if fold_delta else do
    q_aug = xp.concat([ops.q, -lse_g[..., None]], axis=-1) if fold_lse else ops.q
    ct = call.compute_dtype
    like = run.like(do, delta, lse_g, *consts)
    dq0 = loop.blocks(tuple(ops.q.shape), ct, like)
    db0 = loop.blocks(bias_shape, ct, like) if dbias_wanted else None
    dc0 = tuple(loop.full(tuple(c.shape), c.dtype, 0.0, like) for c in consts)

    def key_block(carry: Any, ki: Any) -> tuple[Any, tuple[Any, Any]]:
        cols = run.cols(ki)
        kb = loop.take(ops.k, *cols, -2)
        vb = loop.take(ops.v, *cols, -2)
        column = (*kb.shape[:-1], 1)
        if fold_lse:
            kb_aug = xp.concat([kb, xp.ones(column, dtype=kb.dtype, device=call.device)], axis=-1)
        if fold_delta:
            vb_aug = xp.concat([vb, -xp.ones(column, dtype=vb.dtype, device=call.device)], axis=-1)
        init = (
            loop.accumulator(tuple(kb.shape), ct, like),
            loop.accumulator(tuple(vb.shape), ct, like),
            *carry,
        )

        def step(state: Any, qi: Any) -> Any:
            dk_b, dv_b, dq, db_store, dconsts = state
            rows = run.rows(qi)
            allow = run.allow(rows, cols, (qi, ki))
            if loop.static and masked_out(call, allow, host_bool, run.mods):
                return state
            qb = loop.take(ops.q, *rows, -2)
            dob = loop.take(do, *rows, -2)
            pullback: list[Any] = []
            score_fn = None
            if score_grad is not None:

                def score_fn(s: Any, rows: Span, cols: Span) -> Any:
                    s_mod, pull = score_grad(s, rows, cols)
                    pullback.append(pull)
                    return s_mod

            if fold_lse:
                s_lse, t = _core.block_scores(
                    call, loop.take(q_aug, *rows, -2), kb_aug, rows, cols,
                    bias=run.block(ops.bias, rows, cols), mods=run.mods, allow=allow,
                    math=math, scores=scores,
                )  # fmt: skip
                p = math.exp(s_lse)
            else:
                s, t = _core.block_scores(
                    call, qb, kb, rows, cols, bias=run.block(ops.bias, rows, cols),
                    mods=run.mods, allow=allow, math=math, scores=scores, need_t=True,
                    zero_after=bounded, score_fn=score_fn,
                )  # fmt: skip
                if bounded:
                    p = math.exp(s)
                    if allow is not None:
                        p = math.zeroed(p, allow)
                else:
                    p = math.exp_shifted(s, loop.take(lse_g, *rows, -1)[..., None])
            p_used = p
            if fold_delta:  # (no buffer where dbias may keep ds, made from it)
                dp_delta = math.product(
                    loop.take(do_aug, *rows, -2),
                    xp.matrix_transpose(vb_aug),
                    slot=None if dbias_wanted or pullback else "dp",
                )
            else:
                dp = xp.matmul(dob, xp.matrix_transpose(vb))
                if keep is not None:
                    kept = keep(block_number(qi, ki, run.nk), tuple(p.shape))
                    p_used = _core.apply_keep(xp, p, kept, call.dropout)
                    dp = _core.apply_keep(xp, dp, kept, call.dropout)
                dp_delta = dp - loop.take(delta, *rows, -1)[..., None]
            dv_b = _add_product(call, math, dv_b, xp.matrix_transpose(p_used), dob)
            ds = math.mul(dp_delta, p)
            if pullback:  # d score_mod: back to the scores before it, and to its consts
                ds, *dcs = pullback[0](ds)
                dconsts = tuple(a + b for a, b in zip(dconsts, dcs, strict=True))
            if dbias_wanted:
                key, starts, sizes, axes = _bias_block(bias_shape, (qi, ki), rows, cols)
                target = (*bias_shape[:-2], *sizes_of(bias_shape, rows, cols))
                db = _reduce_to(xp, ds, target)

                def add_db(old: Any, db: Any = db) -> Any:
                    return db if old is None else old + db

                db_store = loop.add_block(db_store, key, starts, sizes, axes, add_db)
            if t is not None:  # (functionally where dbias may hold ds itself)
                ds = (BlockMath(xp) if dbias_wanted else math).softcap_grad(ds, t)

            def add_dq(old: Any, ds: Any = ds) -> Any:
                return math.matmul_add(old, ds, kb)

            dq = loop.add_block(dq, (qi,), (rows[0],), (rows[1],), (-2,), add_dq)
            dk_b = _add_product(call, math, dk_b, xp.matrix_transpose(ds), qb)
            return dk_b, dv_b, dq, db_store, dconsts

        dk_b, dv_b, *carry = loop.inner(step, init, queries_of, ki)
        if dk_b is None:  # no pair touched this key block
            dk_b = _zeros(call, ops.k, cols[1])
            dv_b = _zeros(call, ops.v, cols[1])
        return tuple(carry), (dk_b, dv_b)

    (dq_store, db_store, dconsts), (dk, dv) = loop.outer(
        key_block, (dq0, db0, dc0), range(run.nk), (-2, -2)
    )
    nq, nk = run.nq, run.nk

    def dq_zeros(key: tuple[Any, ...]) -> Any:
        return _zeros(call, ops.q, run.rows(key[0])[1])

    dq = loop.assembled(dq_store, [range(nq)], (-2,), dq_zeros)
    # ds was taken with respect to s; with q times q_factor, the scores' factor comes back
    # as the scale (dq) and as softcap (dk: its q blocks carry scale / softcap).
    dq = trimmed(dq, lq, -2) * call.scale
    dk, dv = trimmed(dk, lk, -2), trimmed(dv, lk, -2)
    if call.softcap is not None:
        dk = dk * call.softcap
    dbias = None
    if dbias_wanted:

        def db_zeros(key: tuple[Any, ...]) -> Any:
            rows, cols = run.rows(key[0]), run.cols(key[1])
            shape = (*bias_shape[:-2], *sizes_of(bias_shape, rows, cols))
            return xp.zeros(shape, dtype=ct, device=call.device)

        keys = [
            range(nq) if bias_shape[-2] != 1 else range(1),
            range(nk) if bias_shape[-1] != 1 else range(1),
        ]
        dbias = loop.assembled(db_store, keys, (-2, -1), db_zeros)
        if bias_shape[-2] != 1:
            dbias = trimmed(dbias, lq, -2)
        if bias_shape[-1] != 1:
            dbias = trimmed(dbias, lk, -1)
        dbias = xp.astype(xp.reshape(dbias, shape_of(bias)), bias.dtype, copy=False)
    grads = Grads(
        _as_input(call, dq, q), _as_input(call, dk, k), _as_input(call, dv, v), dbias, dsinks
    )
    return grads, tuple(dconsts)


def sizes_of(shape: tuple[int, ...], rows: Span, cols: Span) -> tuple[int, int]:
    """The block lengths of a bias of ``shape`` at ``rows x cols`` (1 on its size-1 axes)."""
    return (rows[1] if shape[-2] != 1 else 1, cols[1] if shape[-1] != 1 else 1)


def _bias_block(
    shape: tuple[int, ...], pair: tuple[Any, Any], rows: Span, cols: Span
) -> tuple[tuple[Any, Any], tuple[Any, ...], tuple[int, ...], tuple[int, ...]]:
    """``(key, starts, sizes, axes)`` of the dbias block of ``pair`` for a bias of
    ``shape``: its size-1 axes are one block, not sliced."""
    key = (pair[0] if shape[-2] != 1 else 0, pair[1] if shape[-1] != 1 else 0)
    starts: list[Any] = []
    sizes: list[int] = []
    axes: list[int] = []
    for axis, (start, length) in ((-2, rows), (-1, cols)):
        if shape[axis] != 1:
            starts.append(start)
            sizes.append(length)
            axes.append(axis)
    return key, tuple(starts), tuple(sizes), tuple(axes)


def _zeros(call: Call, like: Any, length: int) -> Any:
    """Zeros of ``like``'s shape with ``length`` rows (a block no pair touched)."""
    shape = (*like.shape[:-2], length, like.shape[-1])
    return call.xp.zeros(shape, dtype=call.compute_dtype, device=call.device)


def _as_input(call: Call, grad: Any, x: Any) -> Any:
    """A gradient in the shape and dtype of the input ``x`` (heads merged again)."""
    xp = call.xp
    return xp.astype(xp.reshape(grad, shape_of(x)), x.dtype, copy=False)


def check_backward_arrays(call: Call, q: Any, *, dout: Any, out: Any, lse: Any, dlse: Any) -> None:
    """Check ``attend_backward``'s ``dout``, ``out``, ``lse`` (and ``dlse``) against the
    call: arrays of q's framework and device, the output's and lse's shapes, real
    floating dtypes of the inputs' dtype or the compute dtype."""
    check_arrays(q=q, dout=dout, out=out, lse=lse, dlse=dlse)
    out_shape = (*call.q_shape[:-1], call.v_shape[-1])
    lse_shape = call.q_shape[:-1]
    dtypes = (call.dtype, call.compute_dtype)
    for name, x, shape, what in (
        ("dout", dout, out_shape, "the output's shape [..., Hq, Lq, Dv]"),
        ("out", out, out_shape, "the output's shape [..., Hq, Lq, Dv]"),
        ("lse", lse, lse_shape, "lse's shape [..., Hq, Lq]"),
        ("dlse", dlse, lse_shape, "lse's shape [..., Hq, Lq]"),
    ):
        if x is None:
            continue
        if not _same_shape(shape_of(x), shape):
            msg = (
                f"`{name}` must have {what} = {shape} for q {call.q_shape}, k {call.k_shape}, "
                f"v {call.v_shape}, got {shape_of(x)}; pass the `out` and `lse` that "
                "`attend(..., return_lse=True)` returned and the gradient of the loss with "
                "respect to `out`."
            )
            raise ValueError(msg)
        if not is_kind(call.xp, x.dtype, "real floating") or x.dtype not in dtypes:
            allowed_text = " or ".join(dict.fromkeys(str(d) for d in dtypes))
            msg = (
                f"`{name}` must have the inputs' dtype or the compute dtype ({allowed_text}), "
                f"got {x.dtype}; cast it with `xp.astype({name}, ...)` first."
            )
            raise TypeError(msg)


def _same_shape(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    """Whether shapes agree where both are known (None: a dimension a lazy library leaves
    unknown, such as ndonnx's symbolic dims, which its results may lose)."""
    return len(got) == len(want) and all(
        a is None or b is None or a == b for a, b in zip(got, want, strict=True)
    )
