"""portable_attention.parallel on torch.distributed: gloo on 127.0.0.1 with 2 and 4
processes, one spawn per world size running every case; each case a test here.

Each rank checks its shard of the ring's (and Ulysses') output, lse and gradients
against single-device ``attend`` on the whole sequence (1e-12 in float64, the dtype's
tolerance otherwise), counts the ring's sends, and checks the errors. The ranks write
what they saw to a file per rank; the tests read them. ``nox -s parallel`` runs this
module (it sets ``PORTABLE_ATTENTION_PARALLEL=1``); elsewhere it is skipped with that
reason, as the spawns take a while.

Nothing at the top of this module may be slow or skip: the spawned ranks import it.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

WORLD_SIZES = (2, 4)
IN_SESSION = os.environ.get("PORTABLE_ATTENTION_PARALLEL") == "1"
#: Seconds a rank waits in a collective before gloo gives up (a hang fails, not blocks).
TIMEOUT = 60

pytestmark = pytest.mark.skipif(
    not IN_SESSION,
    reason="spawns gloo process groups of 2 and 4 ranks: run by `nox -s parallel` "
    "(or set PORTABLE_ATTENTION_PARALLEL=1)",
)


# -- what each rank runs ----------------------------------------------------------------------


def _tensors(name: str, dtype: Any, *shapes: tuple[int, ...]) -> list[Any]:
    """The same float64 data on every rank (seeded by the case), cast to ``dtype``."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _shard(x: Any, world: int, rank: int, layout: str, axis: int = -2, ids: Any = None) -> Any:
    """This rank's slice of ``x`` in ``layout`` (``ids``: the global segment ids, which
    the per-document layout reads)."""
    from portable_attention import parallel

    documents = {"segment_ids": ids} if layout == "document_zigzag" else {}
    return parallel.reorder(x, world, layout, axis=axis, **documents).chunk(world, dim=axis)[rank]


def _close(name: str, got: Any, want: Any, tol: tuple[float, float], scale: float = 1.0) -> None:
    a = got.detach().double().numpy()
    b = want.detach().double().numpy()
    assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
    assert not np.isnan(a).any(), f"{name}: NaN"
    np.testing.assert_allclose(a, b, rtol=tol[0], atol=tol[1] * scale, err_msg=name)


def _check_against_one_device(
    ctx: dict[str, Any],
    case: str,
    method: str,
    layout: str,
    options: dict[str, Any],
    *,
    heads: tuple[int, int] = (4, 2),
    lengths: tuple[int, int] = (64, 64),
    dtype: str = "float64",
    transposed_gradient: bool = False,
) -> None:
    """One call of ring_attend / ulysses_attend on this rank's shard against attend on
    the whole sequence: out, lse and the gradients of q, k, v (cotangents on out and
    lse)."""
    import portable_attention as pa
    import torch
    from portable_attention import masks, parallel

    world, rank = ctx["world"], ctx["rank"]
    dt = getattr(torch, dtype)
    (hq, hk), (lq, lk) = heads, lengths
    q, k, v, dout, dlse = _tensors(
        case, dt, (2, hq, lq, 8), (2, hk, lk, 8), (2, hk, lk, 6), (2, hq, lq, 6), (2, hq, lq)
    )
    dlse = dlse.float() if dtype == "bfloat16" else dlse
    if options.get("sinks") == "random":  # the same sinks on every rank, one per head
        (sinks,) = _tensors(case + "-sinks", dt, (hq,))
        options = {**options, "sinks": sinks}
    ids = None
    if options.get("segment_ids") == "packed":  # whole-sequence ids, as Ulysses takes them
        ids = torch.repeat_interleave(torch.arange(6), torch.tensor([5, 1, 20, 0, 14, 24]))
    if options.get("segment_ids") == "documents":  # lengths in multiples of 2 * 4 shards
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([8, 24, 16, 16]))
    if ids is not None:
        options = {**options, "segment_ids": ids}
    if options.get("mask_mod") in ("documents-window", "plan"):  # global positions and heads
        docs = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 30, lk - 50]))

        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (docs[q_idx] == docs[kv_idx]) & (q_idx - kv_idx < 9 + h)  # per head

        if options["mask_mod"] == "plan":
            options = {
                **options,
                "mask_mod": masks.block_plan(mod, lq, lk, heads=hq, block_size=8, like=q),
            }
        else:
            options = {**options, "mask_mod": mod}
    for x in (q, k, v):
        x.requires_grad_()
    ref, ref_lse = pa.attend(q, k, v, return_lse=True, **options)
    empty = torch.isneginf(ref_lse)
    loss = (ref * dout).sum() + torch.where(empty, 0.0, ref_lse * dlse).sum()
    ref_grads = torch.autograd.grad(loss, (q, k, v))

    def shard(x: Any, axis: int = -2) -> Any:
        return _shard(x, world, rank, layout, axis, ids)

    local = [shard(x.detach()).requires_grad_() for x in (q, k, v)]
    fn = parallel.ring_attend if method == "ring" else parallel.ulysses_attend
    if method == "ring" and options.get("segment_ids") is not None:  # the shard's own ids
        options = {**options, "segment_ids": shard(ids, axis=-1)}
    out, lse = fn(*local, layout=layout, return_lse=True, **options)
    out_cot = shard(dout)
    lse_cot = shard(dlse, axis=-1)
    local_empty = torch.isneginf(lse)
    if transposed_gradient:  # the incoming gradient is a non-contiguous view
        loss = (out.mT * out_cot.mT.contiguous()).sum()
    else:
        loss = (out * out_cot).sum()
    loss = loss + torch.where(local_empty, 0.0, lse * lse_cot).sum()
    grads = torch.autograd.grad(loss, local)

    tol = ctx["tolerances"][dtype]
    lse_tol = tol if dtype == "float64" else (1e-4, 1e-4)
    assert out.dtype == dt and lse.dtype == ref_lse.dtype
    want_empty = shard(empty, axis=-1)
    assert torch.equal(local_empty, want_empty), "-inf rows of lse"
    assert torch.all(out[local_empty] == 0), "rows with no key are not 0"
    _close("out", out, shard(ref), tol)
    _close(
        "lse",
        lse[~local_empty],
        shard(ref_lse, axis=-1)[~local_empty],
        lse_tol,
    )
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.dtype == dt, name
        assert torch.isfinite(g).all(), name
        scale = 1.0 if dtype == "float64" else max(1.0, float(r.abs().max()))
        _close(name, g, shard(r), tol, scale)


RING_OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {}),
    "causal": ({"causal": True}, {}),
    "causal-window": ({"causal": True, "window": (5, 0)}, {}),
    "window": ({"window": (3, 7)}, {}),
    "softcap-scale": ({"causal": True, "softcap": 2.0, "scale": 0.3}, {}),
    "mqa": ({"causal": True}, {"heads": (4, 1)}),
    "empty-rows": ({"causal": True}, {"lengths": (64, 32)}),
    "upper-left": ({"causal": "upper_left", "window": (9, None)}, {"lengths": (32, 64)}),
    "sinks": ({"causal": True, "sinks": "random"}, {"heads": (4, 1)}),
    "packed": ({"causal": True, "segment_ids": "packed"}, {}),
    "packed-window-sinks": (
        {"window": (3, 7), "segment_ids": "packed", "sinks": "random"},
        {"heads": (4, 1)},
    ),
    "mask-mod": ({"causal": True, "mask_mod": "documents-window"}, {}),
    "block-plan-packed-sinks": (
        {"mask_mod": "plan", "segment_ids": "packed", "sinks": "random"},
        {"heads": (4, 1)},
    ),
}
#: The per-document zigzag layout: causal document masks, with and without sinks.
DOCUMENT_OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "documents": ({"causal": True, "segment_ids": "documents"}, {}),
    "documents-sinks-mqa": (
        {"causal": True, "segment_ids": "documents", "sinks": "random", "softcap": 3.0},
        {"heads": (4, 1)},
    ),
    "documents-noncausal": ({"segment_ids": "documents"}, {}),
}


def _value_cases() -> dict[str, Callable[[dict[str, Any]], None]]:
    cases: dict[str, Callable[[dict[str, Any]], None]] = {}
    for layout in ("contiguous", "zigzag"):
        for name, (options, shapes) in RING_OPTIONS.items():
            case = f"ring-{layout}-{name}"
            cases[case] = lambda ctx, c=case, lo=layout, o=options, s=shapes: (
                _check_against_one_device(ctx, c, "ring", lo, o, **s)
            )
    for name, (options, shapes) in DOCUMENT_OPTIONS.items():
        case = f"ring-document_zigzag-{name}"
        cases[case] = lambda ctx, c=case, o=options, s=shapes: _check_against_one_device(
            ctx, c, "ring", "document_zigzag", o, **s
        )
    for dtype in ("float32", "bfloat16"):
        case = f"ring-zigzag-causal-{dtype}"
        cases[case] = lambda ctx, c=case, d=dtype: _check_against_one_device(
            ctx, c, "ring", "zigzag", {"causal": True}, dtype=d, lengths=(128, 128)
        )
    ulysses = {
        "ulysses-contiguous-causal-window": (
            "contiguous",
            {"causal": True, "window": (11, 0)},
            (4, 4),
        ),
        "ulysses-zigzag-softcap": ("zigzag", {"causal": True, "softcap": 4.0}, (4, 2)),
        "ulysses-contiguous-mqa": ("contiguous", {"causal": True}, (4, 1)),
        "ulysses-zigzag-sinks-segments": (
            "zigzag",
            {"causal": True, "sinks": "random", "segment_ids": "packed"},
            (4, 2),
        ),
    }
    for case, (layout, options, heads) in ulysses.items():
        cases[case] = lambda ctx, c=case, lo=layout, o=options, h=heads: _check_against_one_device(
            ctx, c, "ulysses", lo, o, heads=h
        )
    # gloo's all_gather backward once gave wrong gradients for non-contiguous incoming
    # gradients: every collective's backward is fed one.
    cases["ulysses-noncontiguous-gradient"] = lambda ctx: _check_against_one_device(
        ctx, "ulysses-nc", "ulysses", "contiguous", {"causal": True}, transposed_gradient=True
    )
    cases["ring-noncontiguous-gradient"] = lambda ctx: _check_against_one_device(
        ctx, "ring-nc", "ring", "zigzag", {"causal": True}, transposed_gradient=True
    )
    return cases


def _ring_score_mod(ctx: dict[str, Any]) -> None:
    """A score_mod on the ring (global positions and heads) with a captured tensor that
    requires grad, and a mask_mod: out and the gradients of q, k, v and of the captured
    slopes (summed over the ranks) equal one process's attend in float64, both layouts."""
    import portable_attention as pa
    import torch
    import torch.distributed as dist
    from portable_attention import masks, parallel

    world, rank = ctx["world"], ctx["rank"]
    tol = ctx["tolerances"]["float64"]
    q, k, v, dout = _tensors("ring-score-mod", torch.float64, *[(2, 4, 64, 8)] * 3, (2, 4, 64, 8))
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 30, 14]))

    def alibi_of(slopes: Any) -> Any:
        def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score - slopes[h] * (q_idx - kv_idx).abs().to(score.dtype)

        return alibi

    def run(fn: Any, *args: Any, **options: Any) -> Any:
        slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64, requires_grad=True)

        def documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return docs[q_idx] == docs[kv_idx]

        out = fn(*args, causal=True, score_mod=alibi_of(slopes), mask_mod=documents, **options)
        return out, slopes

    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, ref_slopes = run(pa.attend, *whole)
    ref_grads = torch.autograd.grad(ref, [*whole, ref_slopes], dout)
    for layout in ("zigzag", "contiguous"):
        local = [_shard(x, world, rank, layout).requires_grad_() for x in (q, k, v)]
        out, slopes = run(parallel.ring_attend, *local, layout=layout)
        grads = torch.autograd.grad(out, [*local, slopes], _shard(dout, world, rank, layout))
        _close(f"out ({layout})", out, _shard(ref, world, rank, layout), tol)
        for name, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3], strict=True):
            _close(f"{name} ({layout})", g, _shard(r, world, rank, layout), tol)
        d_slopes = grads[3].clone()
        dist.all_reduce(d_slopes)  # each rank's queries' share of the slopes' gradient
        _close(f"dslopes ({layout})", d_slopes, ref_grads[3], tol)
    # A loss of lse alone, and a rank whose rows keep no key (contiguous causal: rank 0
    # has no block after the first step; the plan empties the last half's rows): every
    # rank's backward runs, none waits, the gradients are one process's.
    lq = q.shape[-2]

    def first_half(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx < lq // 2

    plan = masks.block_plan(first_half, lq, lq, block_size=8, like=q)
    for name, extra in (("lse only", {}), ("rows with no key", {"mask_mod": plan})):
        ref_lse = pa.attend(
            *whole, causal=True, score_mod=alibi_of(ref_slopes), return_lse=True, **extra
        )[1]
        loss = torch.where(ref_lse.isinf(), 0, ref_lse).sum()
        grads = torch.autograd.grad(loss, whole, allow_unused=True)  # lse needs no v
        want = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, whole, strict=True)]
        local = [_shard(x, world, rank, "contiguous").requires_grad_() for x in (q, k, v)]
        _, lse = parallel.ring_attend(
            *local, layout="contiguous", causal=True, score_mod=alibi_of(ref_slopes),
            return_lse=True, **extra,
        )  # fmt: skip
        got = torch.autograd.grad(torch.where(lse.isinf(), 0, lse).sum(), local)
        for g, r in zip(got, want, strict=True):
            _close(f"gradient ({name})", g, _shard(r, world, rank, "contiguous"), tol)


def _ulysses_mask_bias_weights(ctx: dict[str, Any]) -> None:
    import portable_attention as pa
    import torch
    from portable_attention import parallel

    world, rank = ctx["world"], ctx["rank"]
    q, k, v, dout, bias = _tensors(
        "ulysses-mb",
        torch.float64,
        (2, 8, 32, 8),
        (2, 4, 32, 8),
        (2, 4, 32, 6),
        (2, 8, 32, 6),
        (8, 32, 32),
    )
    mask = _tensors("ulysses-mb-mask", torch.float64, (1, 8, 32, 32))[0] > -0.5
    mask[:, :, 3] = False  # rows with no key
    for x in (q, k, v, bias):
        x.requires_grad_()
    ref, ref_w = pa.attend(q, k, v, mask=mask, bias=bias, return_weights=True)
    ref_grads = torch.autograd.grad((ref * dout).sum() + ref_w.sum(), (q, k, v, bias))
    local = [_shard(x.detach(), world, rank, "contiguous").requires_grad_() for x in (q, k, v)]
    out, weights = parallel.ulysses_attend(*local, mask=mask, bias=bias, return_weights=True)
    grads = torch.autograd.grad(
        (out * _shard(dout, world, rank, "contiguous")).sum() + weights.sum(), (*local, bias)
    )
    tol = ctx["tolerances"]["float64"]
    _close("out", out, _shard(ref, world, rank, "contiguous"), tol)
    _close("weights", weights, _shard(ref_w, world, rank, "contiguous"), tol)
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3], strict=True):
        _close(name, g, _shard(r, world, rank, "contiguous"), tol)
    # The bias is replicated: each rank's dbias holds its heads' rows; summed, the whole.
    dbias = grads[3].clone()
    torch.distributed.all_reduce(dbias)
    _close("dbias", dbias, ref_grads[3], tol)


def _count_sends(ctx: dict[str, Any]) -> None:
    """The forward sends P - 1 K/V shards (K and V in one message each step); a window
    narrower than a shard sends one."""
    import torch
    import torch.distributed as dist
    from portable_attention import parallel

    world, rank = ctx["world"], ctx["rank"]
    q, k, v = _tensors("count", torch.float64, (1, 4, 64, 8), (1, 2, 64, 8), (1, 2, 64, 8))
    local = [_shard(x, world, rank, "zigzag") for x in (q, k, v)]
    real = dist.batch_isend_irecv
    sent: list[int] = []

    def counting(ops: list[Any]) -> Any:  # the real call, counted
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        with torch.no_grad():
            parallel.ring_attend(*local, causal=True)
        full = list(sent)
        sent.clear()
        narrow = [_shard(x, world, rank, "contiguous") for x in (q, k, v)]
        with torch.no_grad():
            parallel.ring_attend(*narrow, layout="contiguous", causal=True, window=(3, 0))
    finally:
        dist.batch_isend_irecv = real
    shard_numel = local[1].numel() + local[2].numel()
    assert full == [shard_numel] * (world - 1), full
    assert sent == [shard_numel], sent


def _expect(error: type[Exception], pattern: str, fn: Callable[[], Any]) -> None:
    import re

    try:
        fn()
    except error as err:
        assert re.search(pattern, str(err)), f"{error.__name__} without {pattern!r}: {err}"
        return
    msg = f"no {error.__name__} ({pattern!r})"
    raise AssertionError(msg)


def _errors(ctx: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from portable_attention import parallel

    world, rank = ctx["world"], ctx["rank"]
    x = torch.zeros(1, 2, 8, 4)
    # Unequal shards: every rank learns it from one all-reduce, none hangs.
    mine = torch.zeros(1, 2, 8 + 2 * (rank == 0), 4)
    _expect(
        ValueError, r"unequal shapes.*equal slice", lambda: parallel.ring_attend(mine, mine, mine)
    )
    _expect(ValueError, r"unequal shapes", lambda: parallel.ulysses_attend(mine, mine, mine))
    # Options that differ across ranks: every rank raises, naming the option and the ranks
    # (before, each rank computed with its own options and returned).
    causal = rank != 0
    for call in (parallel.ring_attend, parallel.ulysses_attend):
        _expect(
            ValueError,
            r"different options \(`causal`: rank 0 None, rank 1 'lower_right'.*same options",
            lambda call=call: call(x, x, x, causal=causal),
        )
    _expect(
        ValueError,
        r"`layout`: rank 0 'zigzag', rank 1 'contiguous'",
        lambda: parallel.ring_attend(x, x, x, layout="zigzag" if rank == 0 else "contiguous"),
    )
    _expect(
        ValueError,
        r"`sinks`: rank 0 False, rank 1 True",
        lambda: parallel.ring_attend(x, x, x, sinks=None if rank == 0 else torch.zeros(2)),
    )
    _expect(
        ValueError,
        r"`scale`: rank 0 0.5, rank 1 0.25",
        lambda: parallel.ulysses_attend(x, x, x, scale=0.5 if rank == 0 else 0.25),
    )
    # Per-document ids that only rank 0 gets wrong (a document of odd length on its
    # shard, read on its host): every rank raises, rank 0 with the reason.
    good = torch.repeat_interleave(torch.arange(2), torch.tensor([4, 4]))
    odd = torch.repeat_interleave(torch.arange(2), torch.tensor([3, 5]))
    _expect(
        ValueError,
        r"`refused shard arrays`: rank 0 .*has length 3" if rank else r"has length 3",
        lambda: parallel.ring_attend(
            x, x, x, layout="document_zigzag", causal=True, segment_ids=odd if rank == 0 else good
        ),
    )

    # A score_mod with grad mode on one rank only: the two backwards exchange differently.
    def ring_with_score_mod() -> Any:
        return parallel.ring_attend(x, x, x, score_mod=lambda s, b, h, i, j: s * 0.5)

    def mixed_grad_mode() -> Any:
        with torch.set_grad_enabled(rank != 0):
            return ring_with_score_mod()

    _expect(ValueError, r"`autograd route \(a score_mod with grad mode on\)`", mixed_grad_mode)
    # Segment ids on one rank only (they travel with K/V): every rank raises.
    ids = torch.zeros(8, dtype=torch.int64)
    _expect(
        ValueError,
        r"`segment_ids`: rank 0 False, rank 1 True",
        lambda: parallel.ring_attend(x, x, x, segment_ids=None if rank == 0 else ids),
    )
    _expect(
        TypeError,
        r"one integer array.*not a pair",
        lambda: parallel.ring_attend(x, x, x, segment_ids=(ids, ids)),
    )
    # An option that one rank alone gets wrong: every rank raises, none waits for it.
    _expect(
        ValueError,
        r"`invalid options`: rank 0 \S.*softcap",
        lambda: parallel.ring_attend(x, x, x, softcap=-1.0 if rank == 0 else 20.0),
    )
    _expect(
        ValueError,
        r"`invalid options`: rank 0 \S.*window",
        lambda: parallel.ulysses_attend(x, x, x, window=-1 if rank == 0 else 2),
    )
    # An option attend does not take: every rank raises, naming it.
    _expect(
        TypeError,
        r"unexpected keyword.*'casual'.*causal",
        lambda: parallel.ulysses_attend(x, x, x, casual=True),
    )
    # The same wrong option on every rank: attend's own error, on every rank.
    _expect(
        ValueError,
        r"`window` sides must be ints >= 0",
        lambda: parallel.ulysses_attend(x, x, x, window=-1),
    )
    odd = torch.zeros(1, 2, 3, 4)  # 3 * P positions: not a multiple of 2P
    _expect(
        ValueError,
        rf"multiple of {2 * world}.*layout='contiguous'",
        lambda: parallel.ring_attend(odd, odd, odd),
    )
    _expect(
        TypeError,
        r"`group`.*ProcessGroup.*axis_name",
        lambda: parallel.ring_attend(x, x, x, group="seq"),
    )
    _expect(
        TypeError,
        r"`axis_name` names a JAX mesh axis",
        lambda: parallel.ring_attend(x, x, x, axis_name="s"),
    )
    heads = torch.zeros(1, world + 1, 8, 4)
    _expect(
        ValueError,
        rf"Hq={world + 1}.*P={world}",
        lambda: parallel.ulysses_attend(heads, heads, heads),
    )
    dist.barrier()


def _device_mesh_and_subgroup(ctx: dict[str, Any]) -> None:
    """A 1-D DeviceMesh as the group, and a subgroup whose ranks are not 0..n-1."""
    import portable_attention as pa
    import torch
    import torch.distributed as dist
    from portable_attention import parallel
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = ctx["world"], ctx["rank"]
    q, k, v = _tensors("mesh", torch.float64, (1, 4, 32, 8), (1, 2, 32, 8), (1, 2, 32, 8))
    ref = pa.attend(q, k, v, causal=True)
    tol = ctx["tolerances"]["float64"]
    mesh = init_device_mesh("cpu", (world,))
    out = parallel.ring_attend(
        *(_shard(x, world, rank, "zigzag") for x in (q, k, v)), group=mesh, causal=True
    )
    _close("out (mesh)", out, _shard(ref, world, rank, "zigzag"), tol)
    members = list(range(1, world, 2))  # ranks 1, 3: group ranks 0, 1
    sub = dist.new_group(ranks=members)
    if rank in members:
        index, size = members.index(rank), len(members)
        local = [_shard(x, size, index, "zigzag") for x in (q, k, v)]
        out = parallel.ring_attend(*local, group=sub, causal=True)
        _close("out (subgroup)", out, _shard(ref, size, index, "zigzag"), tol)
    two_d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))
    _expect(ValueError, r"DeviceMesh of 2 dims", lambda: parallel.ring_attend(q, k, v, group=two_d))
    dist.barrier()


def cases() -> dict[str, Callable[[dict[str, Any]], None]]:
    """Every case a rank runs, by name (the same list on every rank, in order)."""
    return {
        **_value_cases(),
        "ulysses-mask-bias-weights": _ulysses_mask_bias_weights,
        "ring-score-mod": _ring_score_mod,
        "count-sends": _count_sends,
        "errors": _errors,
        "device-mesh-and-subgroup": _device_mesh_and_subgroup,
    }


def _rank_main(rank: int, world: int, out_dir: str, tolerances: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    # One intra-op thread per rank, as torchrun sets (OMP_NUM_THREADS=1 for several
    # processes per node): 4 ranks on 2 cores with 2 threads each oversubscribe them, and
    # there the first attend of a fresh process computed exp(s - max) with float32-sized
    # error on one thread's half of the tensor in about 1 run in 10 (a float64 reference
    # off by 1e-9; with one thread, 0 in 24): a defect of its own, not the ring's, still open.
    torch.set_num_threads(1)

    # Rendezvous through a file in the run's own directory: a TCP port picked free by the
    # test and bound later by rank 0 could be taken meanwhile by another run on the
    # machine (two parallel sessions at once), whose ranks then met these.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(out_dir, 'rendezvous')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    ctx = {"rank": rank, "world": world, "tolerances": tolerances}
    seen: dict[str, str] = {}
    try:
        for name, case in cases().items():
            try:
                case(ctx)
                seen[name] = "ok"
            except Exception as err:  # recorded for the test of that case
                seen[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2500:]}"
            Path(out_dir, f"{rank}.json").write_text(json.dumps(seen))
            dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[str]]:
    """Spawn the ranks once per world size; what each saw, per case."""
    import torch.multiprocessing as mp

    from conftest import TOLERANCES

    world = request.param
    out_dir = tmp_path_factory.mktemp(f"world{world}")
    context = mp.start_processes(
        _rank_main,
        args=(world, str(out_dir), dict(TOLERANCES)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    while not context.join(timeout=600):
        pass
    seen = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]
    return {name: [s.get(name, "not run") for s in seen] for name in cases()}


@pytest.mark.parametrize("case", list(cases()))
def test_case_on_every_rank(ranks: dict[str, list[str]], case: str) -> None:
    failures = [f"rank {r}: {what}" for r, what in enumerate(ranks[case]) if what != "ok"]
    assert not failures, "\n".join(failures)
