"""JAX's blockwise path for a call with segment ids or FlexAttention-style mods: a
``custom_vjp`` built per call, its ids and a ``score_mod``'s captured arrays passed as
explicit inputs (so those arrays get their gradients). Imported when such a call first
runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from portable_attention import _block_grid, _blockwise, _blockwise_backward, _mods, _spec
from portable_attention._block_loop import BlockLoop


def _closure_converted(score_mod: Any, example: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """``score_mod`` as ``score(s, b, h, q_idx, kv_idx, *consts)`` and its ``consts``: the
    floating-point arrays it captures (what can have a gradient), traced once on
    ``example``'s types. What ``jax.closure_convert`` does, without its process-wide cache,
    which keeps every converted function and what it captured until ``jax.clear_caches()``:
    a call must not keep a user's arrays alive after it returns."""
    closed = jax.make_jaxpr(score_mod)(*example)
    found = closed.consts
    explicit = [i for i, c in enumerate(found) if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]

    def score(*args_and_consts: Any) -> Any:
        args, given = args_and_consts[: len(example)], args_and_consts[len(example) :]
        consts = list(found)
        for i, c in zip(explicit, given, strict=True):
            consts[i] = c
        (out,) = jax.core.eval_jaxpr(closed.jaxpr, consts, *args)
        return out

    return score, tuple(found[i] for i in explicit)


@dataclass(frozen=True)
class _ScoreGrad:
    """A ``score_mod`` closure-converted (:func:`_closure_converted`) into ``score(s, b, h,
    q_idx, kv_idx, *consts)``, so the arrays it captures are explicit inputs of the
    ``custom_vjp`` and get their gradients (``_blockwise_backward.ScoreGrad``)."""

    call: _spec.Call
    mods: _mods.Mods
    score: Any
    consts: tuple[Any, ...]

    def modded(self) -> _mods.Mods:
        """The mods whose score_mod applies ``score`` with ``consts``."""
        score, consts = self.score, self.consts

        def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score(s, b, h, q_idx, kv_idx, *consts)

        m = self.mods
        return _mods.Mods(m.q_ids, m.kv_ids, m.q_pos, m.kv_pos, score_mod, m.mask_mod)

    def __call__(self, s: Any, rows: Any, cols: Any) -> Any:
        def modded(s_: Any, *c: Any) -> Any:
            mods = _ScoreGrad(self.call, self.mods, self.score, tuple(c)).modded()
            return _mods.apply_score_mod(self.call, mods, s_, rows, cols)

        s_mod, pull = jax.vjp(modded, s, *self.consts)
        return s_mod, pull


def modded_blockwise(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any, mods: _mods.Mods,
    loop: BlockLoop,
) -> tuple[Any, Any]:  # fmt: skip
    """The blockwise path of a call with segment ids or mods: a ``custom_vjp`` built for
    this call (the mods are functions: it is traced again each call outside ``jit``), its
    ids and a score_mod's captured arrays passed explicitly."""
    converted: Any = None
    consts: Any = ()
    if mods.score_mod is not None:
        size = _block_grid.block_size(call, loop)
        example_s = jnp.zeros(_mods.user_shape(call, size, size), call.compute_dtype)
        example = _mods.indices(call, (0, size), (0, size))
        converted, consts = _closure_converted(mods.score_mod, (example_s, *example))
    arrays = (mods.q_ids, mods.kv_ids, mods.q_pos, mods.kv_pos)

    def grad_of(ids: Any, c: Any) -> _ScoreGrad:
        plain = _plain(ids, mods.mask_mod)
        return _ScoreGrad(call, plain, converted, tuple(c))

    def modded(ids: Any, c: Any) -> _mods.Mods:
        if converted is None:
            return _plain(ids, mods.mask_mod)
        return grad_of(ids, c).modded()

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any, ids: Any, c: Any) -> Any:
        return _blockwise.forward(call, q, k, v, mask, bias, keep, mods=modded(ids, c))

    def fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any, ids: Any, c: Any) -> Any:
        out, lse = _blockwise.forward(call, q, k, v, mask, bias, keep, mods=modded(ids, c))
        return (out, lse), (q, k, v, mask, bias, keep, ids, c, out, lse)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, mask, bias, keep, ids, c, out, lse = res
        dout, dlse = cotangents
        plain = _plain(ids, mods.mask_mod)
        score_grad: Any = grad_of(ids, c) if converted is not None else None
        grads, dc = _blockwise_backward.backward_and_consts(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, mods=plain,
            score_grad=score_grad,
        )  # fmt: skip
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None, None, tuple(dc)

    run.defvjp(fwd, bwd)
    out, lse = run(q, k, v, mask, bias, keep, arrays, tuple(consts))
    return out, lse


def _plain(ids: Any, mask_mod: Any) -> _mods.Mods:
    """The mods of segment ids ``(q_ids, kv_ids, q_pos, kv_pos)`` and a ``mask_mod``."""
    q_ids, kv_ids, q_pos, kv_pos = ids
    return _mods.Mods(q_ids, kv_ids, q_pos, kv_pos, None, mask_mod)
