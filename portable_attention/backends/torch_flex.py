"""torch's second fused path: FlexAttention (``torch.nn.attention.flex_attention``),
compiled with ``torch.compile``, for what SDPA cannot take or takes slowly: ``score_mod``,
``mask_mod`` and block plans, ``segment_ids``, windows (a band of blocks, not a dense mask),
``softcap`` (as a score_mod) and grouped-query heads (Flex's ``enable_gqa``).

Imported when the planner first asks torch's adapter for its fused kernels
(:attr:`TorchAdapter.fused_kernels`). The call's options become Flex's inputs without
evaluating any mask on the whole grid: the band of ``causal``/``window`` and a
:func:`~portable_attention.masks.block_plan`'s blocks give Flex's ``BlockMask`` directly
(which blocks to compute, which of them need the mask), segment ids give it from a
summary of each block's ids, and the masks and score mods run inside Flex's kernel on the
blocks it computes.

What Flex gives differs by device (torch 2.13):

- **CPU** (inductor's C++ template): forward only, and no logsumexp (``return_lse``
  raises there); float32, float16 and bfloat16 only (float64 raises). Rows with no key
  give 0. So on the CPU this path serves calls that need neither ``lse`` (``return_lse``,
  ``sinks``) nor a gradient: where autograd would need one (grad mode on and ``q``, ``k``
  or ``v`` requiring grad; with a ``score_mod``, grad mode on, since its captured tensors
  may require grad) ``auto`` runs the blockwise path instead (forward and backward), and
  ``implementation="fused"`` raises.
- **CUDA** (Triton): forward and Flex's own backward, with ``lse``: ``return_lse`` and
  ``sinks`` (merged after Flex from its ``lse`` by the runner's guarded log-sum-exp merge,
  ``_core.add_sinks``) are served. Rows with no key are set to ``out = 0``, ``lse =
  -inf`` from its ``lse``. Not yet run on a GPU (``benchmarks/gpu_check.py`` checks it).

Compilation: one compiled function per shape class and set of mods (its key: the device,
dtype, shapes, and the code of each mod; never a function or a tensor), in an
``lru_cache`` of 32; each has a code object of its own, so torch.compile's recompile limit
(8 per code object) is never reached across shape classes, and ``fullgraph=True`` makes a
mod Flex cannot trace an error, never a silent eager fallback. Values the mods read
(softcap, the band's sides, the ids) are tensors the mods capture, so a new value does
not recompile. The first call of a class compiles for 3-7 s on the CPU
(docs/fast-paths.md).

``PORTABLE_ATTENTION_FLEX=0`` (``off``, ``false``, ``no`` too) turns this path off:
``auto`` then plans as without Flex and says so. Plans are cached by the call's
description, so set it before the first call (or in a fresh process).

While a caller's ``torch.compile`` traces ``attend``, Flex is not planned (the call takes
the path it took before Flex: SDPA or the portable path): the compiled function and the
BlockMask are built outside a trace.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from portable_attention import _block_grid, _core, _mods, _spec
from portable_attention.backends import adapter
from portable_attention.backends._base import Kernel

#: The environment variable that turns the Flex path off (``0``, ``off``, ``false``, ``no``).
SWITCH = "PORTABLE_ATTENTION_FLEX"

_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

#: Flex's block length: its BlockMask's blocks (a block plan brings its own).
BLOCK = 128

#: ``auto`` takes Flex only from this many scores per call (batch * heads * Lq * Lk;
#: ``[1, 8, 1024, 1024]``): below, a call saves a few ms at most (``[1, 8, 512, 512]``: 2.5-7
#: ms against 8-14 on the portable path, 2-core CPU), which would take hundreds of calls
#: to repay the 3-7 s that Flex's first call of a shape compiles (docs/fast-paths.md).
MIN_SCORES = 8 * 1024 * 1024

#: ``auto`` takes Flex only where the band and a block plan keep at most this share of
#: Flex's blocks (or segment ids skip blocks): computing every block it measured no faster
#: than the blockwise path (softcap alone: 0.91-1.13x at L = 512-2048), with causal
#: (about half the blocks) 1.1-1.9x faster (docs/fast-paths.md).
MAX_DENSITY = 0.6


#: Why compiling Flex failed in this process (its first failure), once one has: ``auto``
#: then plans the next path for every call, and a call already planned on Flex runs it.
_FAILED: list[str] = []


def switched_off() -> bool:
    """Whether ``PORTABLE_ATTENTION_FLEX`` turns the Flex path off."""
    return os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "false", "no")


def unavailable(device_type: str) -> str | None:
    """Why Flex cannot run on this device type here (None: it can)."""
    if switched_off():
        return f"FlexAttention is turned off ({SWITCH}={os.environ[SWITCH]!r})"
    if _FAILED:
        return _FAILED[0]
    if _VERSION < (2, 6):
        return f"FlexAttention needs torch >= 2.6 (have {torch.__version__})"
    if device_type == "cpu":
        return _cpu_unavailable()
    if device_type != "cuda":
        return f"FlexAttention is used here on the CPU and CUDA only, not {device_type}"
    return None


@functools.lru_cache(maxsize=1)
def _cpu_unavailable() -> str | None:
    """Why inductor cannot compile Flex's CPU kernel here (None: it can)."""
    avx2 = getattr(torch.cpu, "_is_avx2_supported", lambda: True)
    if sys.platform == "darwin" or not avx2():
        return "inductor's FlexAttention CPU kernel needs an x86 CPU with AVX2 (not macOS)"
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return "inductor's FlexAttention CPU kernel is off with ATEN_CPU_CAPABILITY=default"
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return f"inductor needs a C++ compiler to compile FlexAttention on the CPU ({compiler})"
    return None


def _cpu(call: _spec.Call) -> bool:
    return getattr(call.device, "type", None) == "cpu"


def flex_reason(call: _spec.Call) -> str | None:
    """Why Flex cannot give the contract's answer for ``call`` (None: it can)."""
    if torch.compiler.is_compiling():
        return (
            "a caller's torch.compile is tracing this call: Flex is planned for eager calls "
            "only (its compiled function and its BlockMask are built outside a trace)"
        )
    device = getattr(call.device, "type", None)
    missing = unavailable(device or "unknown")
    if missing is not None:
        return missing
    if call.symbolic:
        return "Flex's BlockMask needs static lengths (the shapes are symbolic)"
    if call.q_shape[-2] == 0 or call.k_shape[-2] == 0:
        return "the call has no queries or no keys"
    if call.return_weights:
        return "Flex does not return the probabilities"
    if call.dropout > 0:
        return "Flex has no dropout"
    if call.mask_shape is not None or call.bias_shape is not None:
        return "Flex here takes no mask or bias array (SDPA takes those without mods)"
    if device == "cpu":
        if call.dtype == torch.float64:
            return "Flex's CPU kernel takes float32, float16 and bfloat16, not float64"
        if call.return_lse:
            return "Flex's CPU kernel returns no lse (torch 2.13)"
        if call.sinks_shape is not None:
            return "Flex's CPU kernel returns no lse to merge the sinks with (torch 2.13)"
    return None


def _blocks_kept(call: _spec.Call) -> float:
    """The share of Flex's blocks that the band and a block plan keep (segment ids count
    as keeping all: their share is known only from the data)."""
    size = _size(call)
    nq, nk = _block_grid.grid(call, size)
    return len(_block_grid.pairs(call, size)) / max(nq * nk, 1)


def _size(call: _spec.Call) -> int:
    """Flex's block length for ``call``: a block plan's, else :data:`BLOCK`."""
    return call.blocks.block_size if call.blocks is not None else BLOCK


def auto_declined(call: _spec.Call) -> str | None:
    """Why ``auto`` takes another path although Flex could run ``call`` (None: Flex)."""
    total = math.prod(call.q_shape[:-2]) * call.q_shape[-2] * call.k_shape[-2]
    if total < MIN_SCORES:
        return (
            f"the call has {total} scores, under the {MIN_SCORES} from which Flex's saving "
            "repays its first call's compilation (3-7 s on the CPU; docs/fast-paths.md)"
        )
    share = _blocks_kept(call)
    if call.segments is None and share > MAX_DENSITY:
        if call.mask_mod and call.blocks is None:
            return (
                "a mask_mod given as a function: Flex would compute and mask every block "
                "(measured 0.46-0.70x the speed of the blockwise path, which skips the blocks "
                "it empties); pass masks.block_plan(mask_mod, ...) and Flex computes only its "
                "blocks"
            )
        return (
            f"Flex would compute {share:.0%} of the blocks, and computing most blocks it "
            "measured no faster than the portable path (docs/fast-paths.md)"
        )
    return None


def taken_reason(call: _spec.Call) -> str:
    """Why ``auto`` (or ``fused``) takes Flex for ``call``, in words."""
    what = "FlexAttention (compiled) runs this call"
    share = _blocks_kept(call)
    if share < 1:
        what += f", computing only the {share:.0%} of its blocks that the band/plan keep"
    if call.segments is not None:
        what += ", only the blocks where the segment ids meet"
    where = "" if _cpu(call) else " on the CPU (on CUDA not yet measured)"
    why = (
        "implementation='fused' asked for it"
        if call.implementation == "fused"
        else f"it measured faster than the blockwise path and SDPA for this call class{where} "
        "(docs/fast-paths.md)"
    )
    parts = [
        what,
        f"{why}; the first call of each shape and set of mods compiles it (3-7 s on the CPU)",
    ]
    if _cpu(call):
        parts.append(
            "on the CPU Flex has no backward and no lse (torch 2.13): where autograd needs "
            "gradients (grad mode on and q, k or v requiring grad; with a score_mod, grad "
            "mode on) "
            + (
                "this call raises"
                if call.implementation == "fused"
                else "auto runs portable:blockwise instead"
            )
        )
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------
# Blocks: which of Flex's blocks the band, segment ids and a block plan keep.


def _band_blocks(call: _spec.Call, size: int) -> tuple[Any, Any]:
    """``(kept, full)`` boolean ``[1, 1, nq, nk]`` tensors of the band (None: no band):
    the blockwise path's block summary (:func:`_block_grid.band_blocks`)."""
    if _core.band_keeps_all(call):
        return None, None
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    return _band_grid(lq, lk, size, *_core.window_sides(call), call.band_offset)


@functools.lru_cache(maxsize=64)
def _band_grid(
    lq: int, lk: int, size: int, left: int | None, right: int | None, offset: int
) -> tuple[Any, Any]:
    """:func:`_band_blocks` of a band, as tensors (read only; cached)."""
    kept, full = _block_grid.band_blocks(lq, lk, size, left, right, offset)
    nq, nk = -(-lq // size), -(-lk // size)
    return _grid(kept, nq, nk)[None, None], _grid(full, nq, nk)[None, None]


def _grid(pairs: Any, nq: int, nk: int) -> Any:
    """A boolean ``[nq, nk]`` tensor, True at the ``(query block, key block)`` pairs."""
    blocks = torch.zeros((nq, nk), dtype=torch.bool)
    if pairs:
        blocks[tuple(torch.tensor(list(pairs)).T)] = True
    return blocks


def _plan_blocks(call: _spec.Call, nq: int, nk: int) -> tuple[Any, Any]:
    """``(kept, full)`` ``[B|1, H|1, nq, nk]`` of a block plan (its batch and heads axes
    where it was built with them)."""
    layout = call.blocks
    assert layout is not None
    b, h = layout.batch or 1, layout.heads or 1
    kept, full = _grid(layout.kept, nq, nk), _grid(layout.full, nq, nk)
    return kept.expand(b, h, nq, nk), full.expand(b, h, nq, nk)


def _segment_blocks(ids_q: Any, ids_k: Any, size: int, nq: int, nk: int) -> tuple[Any, Any]:
    """``(kept, full)`` ``[B, 1, nq, nk]`` of segment ids ``[B, Lq]``, ``[B, Lk]``: a block
    is kept where one id is in both its rows and its columns, full where its rows and its
    columns hold one and the same id (from a one-hot summary of each block's ids)."""
    both = torch.cat([ids_q, ids_k], dim=-1)
    _, inverse = torch.unique(both, return_inverse=True)
    n_ids = int(inverse.max()) + 1 if inverse.numel() else 1
    iq, ik = inverse[..., : ids_q.shape[-1]], inverse[..., ids_q.shape[-1] :]

    def summary(ids: Any, n_blocks: int) -> tuple[Any, Any]:
        batch, length = ids.shape
        pad = n_blocks * size - length
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1) if pad else ids
        blocks = ids.reshape(batch, n_blocks, size)
        onehot = torch.zeros((batch, n_blocks, n_ids + 1), dtype=torch.float32, device=ids.device)
        onehot.scatter_(-1, (blocks + 1).clamp(min=0), 1.0)  # column 0: the padding
        first = blocks[..., :1]
        valid = blocks >= 0
        single = ((blocks == first) | ~valid).all(-1)
        return onehot[..., 1:], torch.where(single, first[..., 0], -2)

    hot_q, one_q = summary(iq, nq)
    hot_k, one_k = summary(ik, nk)
    kept = (hot_q @ hot_k.transpose(-1, -2)) > 0
    full = (one_q[..., :, None] == one_k[..., None, :]) & (one_q[..., :, None] >= 0)
    return kept[:, None].cpu(), full[:, None].cpu()


def _block_mask(kept: Any, full: Any, size: int, lengths: tuple[int, int], mask_mod: Any) -> Any:
    """Flex's ``BlockMask`` of ``kept``/``full`` ``[B, H, nq, nk]`` blocks: the blocks kept
    but not full take ``mask_mod``; the full ones none."""
    from torch.nn.attention.flex_attention import BlockMask

    def indices(blocks: Any) -> tuple[Any, Any]:
        count = blocks.sum(-1, dtype=torch.int32)
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count.contiguous(), order.contiguous()

    kept, full = torch.broadcast_tensors(kept, full)
    partial = kept & ~full
    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=size, mask_mod=mask_mod,
        seq_lengths=lengths,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# The mods: the call's options as Flex's score_mod and mask_mod.


def _score_mod(call: _spec.Call, mods: _mods.Mods | None, device: Any) -> Any:
    """Flex's ``score_mod``: softcap (its value a captured tensor), then the user's."""
    user = mods.score_mod if mods is not None else None
    if call.softcap is None:
        return user
    cap = torch.tensor(call.softcap, dtype=torch.float32, device=device)

    def softcapped(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    if user is None:
        return softcapped

    def both(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return user(cap * torch.tanh(score / cap), b, h, q_idx, kv_idx)

    return both


def _within(sides: tuple[int | None, int | None], device: Any) -> Callable[[Any], Any]:
    """``distance -> -left <= distance <= right`` with the sides as captured tensors (no
    recompilation for another window); None where both sides are unbounded."""
    left, right = sides
    lo = None if left is None else torch.tensor(left, dtype=torch.int64, device=device)
    hi = None if right is None else torch.tensor(right, dtype=torch.int64, device=device)

    def within(distance: Any) -> Any:
        keep = None if lo is None else distance >= -lo
        if hi is not None:
            keep = distance <= hi if keep is None else keep & (distance <= hi)
        return keep

    return within


def _band_mod(offset: int, sides: tuple[int | None, int | None], device: Any) -> Any:
    """The mask_mod of the global band: ``-left <= kv_idx - (q_idx + offset) <= right``
    (:mod:`portable_attention._band`'s rule), its offset and sides captured tensors."""
    within = _within(sides, device)
    at = torch.tensor(offset, dtype=torch.int64, device=device)

    def band(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return within(kv_idx - (q_idx + at))

    return band


def _mask_mod(call: _spec.Call, mods: _mods.Mods | None, ids: Any, device: Any) -> Any:
    """Flex's ``mask_mod``: the band (global, or within segments with positions), the
    segment ids, the user's mask_mod; None where nothing masks. Every value is a tensor
    the closure captures (no recompilation for another window or offset)."""
    checks: list[Callable[[Any, Any, Any, Any], Any]] = []
    if ids is not None:
        q_ids, kv_ids, q_pos, kv_pos = ids

        def same_segment(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_ids[b, q_idx] == kv_ids[b, kv_idx]

        checks.append(same_segment)
        if q_pos is not None and call.band_sides != (None, None):
            within = _within(call.band_sides, device)

            def segment_band(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return within(kv_pos[b, kv_idx] - q_pos[b, q_idx])

            checks.append(segment_band)
    if not _core.band_keeps_all(call):  # (a band within segments is not global)
        checks.append(_band_mod(call.band_offset, call.band_sides, device))
    user = mods.mask_mod if mods is not None else None
    if user is not None:
        checks.append(user)
    if not checks:
        return None
    if len(checks) == 1:
        return checks[0]
    return functools.reduce(_and, checks)


def _and(first: Any, second: Any) -> Any:
    def both(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)

    return both


def _flat_ids(call: _spec.Call, mods: _mods.Mods, batch: int) -> tuple[Any, ...]:
    """The segment ids (and positions) as ``[B, L]`` tensors, B the flat batch of q."""
    lead = tuple(call.q_shape[:-3]) if len(call.q_shape) >= 3 else ()

    def flat(x: Any) -> Any:
        if x is None:
            return None
        shape = (*lead, x.shape[-1])
        return torch.broadcast_to(x, shape).reshape(batch, x.shape[-1]).to(torch.int64)

    return flat(mods.q_ids), flat(mods.kv_ids), flat(mods.q_pos), flat(mods.kv_pos)


# ------------------------------------------------------------------------------------------
# Compiled Flex, once per shape class and set of mods.


def _flex_call(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any, scale: float,
               gqa: bool, lse: bool) -> Any:  # fmt: skip
    from torch.nn.attention import flex_attention as fa

    options = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale}
    if not lse:
        return fa.flex_attention(q, k, v, enable_gqa=gqa, **options), None
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9; return_lse before (deprecated since)
        out, aux = fa.flex_attention(
            q, k, v, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True), **options
        )
        return out, aux.lse
    return fa.flex_attention(q, k, v, enable_gqa=gqa, return_lse=True, **options)


@functools.lru_cache(maxsize=32)
def _compiled(key: tuple[Any, ...]) -> Callable[..., Any]:
    """``torch.compile`` of :func:`_flex_call` on a code object of its own for ``key``
    (so each shape class has its own recompile budget)."""
    code = _flex_call.__code__.replace(co_name=f"_flex_call_{abs(hash(key)):x}")
    fn = types.FunctionType(code, _flex_call.__globals__, code.co_name)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _code(fn: Any) -> Any:
    return None if fn is None else getattr(fn, "__code__", type(fn))


def _needs_grad(call: _spec.Call, q: Any, k: Any, v: Any) -> bool:
    """Whether autograd would need this call's gradient (a score_mod's captures count as
    requiring it whenever grad mode is on)."""
    if not torch.is_grad_enabled():
        return False
    return bool(call.score_mod) or any(x.requires_grad for x in (q, k, v))


def cpu_training_error() -> ValueError:
    msg = (
        '`implementation="fused"` cannot run this call: FlexAttention has no backward on the '
        "CPU (torch 2.13) and autograd needs one here (grad mode on with q, k or v requiring "
        'grad, or a score_mod); use implementation="auto" (it runs the blockwise path) or '
        "wrap inference in torch.no_grad()."
    )
    return ValueError(msg)


def tracing_error() -> ValueError:
    msg = (
        '`implementation="fused"` cannot run this call under torch.compile: FlexAttention '
        "is taken for eager calls only (its BlockMask and compiled function are built "
        'outside a trace); use implementation="auto" there.'
    )
    return ValueError(msg)


def flex(call: _spec.Call, q: Any, k: Any, v: Any, mods: _mods.Mods | None) -> tuple[Any, Any]:
    """``(out, lse or None)`` of Flex for a call :func:`flex_reason` accepted (``lse`` on
    CUDA only), rows with no key repaired to ``out = 0``, ``lse = -inf`` where Flex
    returns ``lse``."""
    device = q.device
    lq, lk = call.q_shape[-2], call.k_shape[-2]
    size = _size(call)
    nq, nk = _block_grid.grid(call, size)
    band_only = call.blocks is None and (
        mods is None or (mods.q_ids is None and mods.mask_mod is None)
    )
    if band_only:  # the whole BlockMask depends on the shapes and options alone
        block_mask = None
        if not _core.band_keeps_all(call):
            left, right = _core.window_sides(call)
            block_mask = _band_block_mask(lq, lk, size, left, right, call.band_offset, device)
        return _run(call, q, k, v, mods, block_mask)
    kept, full = _band_blocks(call, size)
    if call.blocks is not None:
        pk, pf = _plan_blocks(call, nq, nk)
        kept = pk if kept is None else pk & kept
        full = pf if full is None else pf & full
    ids = None
    if mods is not None and mods.q_ids is not None:
        ids = _flat_ids(call, mods, math.prod(call.q_shape[:-3]))
        sk, sf = _segment_blocks(ids[0], ids[1], size, nq, nk)
        if ids[2] is not None:
            sf = torch.zeros_like(sf)  # a band within segments: every block takes the mask
        kept = sk if kept is None else sk & kept
        full = sf if full is None else sf & full
    mask_mod = _mask_mod(call, mods, ids, device)
    block_mask = None
    if mask_mod is not None:
        if kept is None:  # a plain mask_mod: every block computed, every block masked
            kept = torch.ones((1, 1, nq, nk), dtype=torch.bool)
            full = torch.zeros_like(kept)
        if full is None or (mods is not None and mods.mask_mod is not None and call.blocks is None):
            full = torch.zeros_like(kept)
        block_mask = _block_mask(kept.to(device), full.to(device), size, (lq, lk), mask_mod)
    return _run(call, q, k, v, mods, block_mask)


@functools.lru_cache(maxsize=32)
def _band_block_mask(
    lq: int, lk: int, size: int, left: int | None, right: int | None, offset: int, device: Any
) -> Any:
    """The BlockMask of a call whose only mask is its global band: built once per shape
    and band (it holds no user data: the band's mask_mod is this module's, its sides
    captured tensors). At L = 1024 building it took about 1 ms a call."""
    kept, full = _band_grid(lq, lk, size, left, right, offset)
    mask_mod = _band_mod(offset, (left, right), device)
    return _block_mask(kept.to(device), full.to(device), size, (lq, lk), mask_mod)


def _run(
    call: _spec.Call, q: Any, k: Any, v: Any, mods: _mods.Mods | None, block_mask: Any
) -> tuple[Any, Any]:
    """Flex of ``q, k, v`` (any leading dims) with ``block_mask`` and the call's
    score_mod, compiled once per shape class; ``(out, lse or None)``."""
    device = q.device
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    lq, lk = qs[-2], ks[-2]
    batch = math.prod(qs[:-3])
    hq = qs[-3] if len(qs) >= 3 else 1
    hk = ks[-3] if len(ks) >= 3 else 1
    q4 = q.reshape(batch, hq, lq, qs[-1])
    k4 = k.reshape(batch, hk, lk, ks[-1])
    v4 = v.reshape(batch, hk, lk, vs[-1])
    size = _size(call)
    mask_mod = None if block_mask is None else block_mask.mask_mod
    score_mod = _score_mod(call, mods, device)

    want_lse = not _cpu(call)
    args = (q4, k4, v4, score_mod, block_mask, call.scale, hq != hk, want_lse)
    key = (
        device.type, q.dtype, qs, ks, vs, size, want_lse, _code(score_mod), _code(mask_mod),
        _code(mods.score_mod if mods is not None else None),
        _code(mods.mask_mod if mods is not None else None),
        # what the mods compose (their values are captured tensors: no key)
        call.segments, call.global_band, call.band_sides == (None, None),
        call.softcap is not None, call.blocks is not None,
    )  # fmt: skip
    out, lse = _compiled(key)(*args)
    out = out.reshape((*qs[:-1], vs[-1]))
    if lse is not None:
        lse = lse.reshape(qs[:-1])
        empty = lse == -torch.inf
        out = torch.where(empty[..., None], torch.zeros((), dtype=out.dtype, device=device), out)
    return out, lse


class FlexAttention(Kernel):
    """``torch.nn.attention.flex_attention.flex_attention``, compiled."""

    path = "fused:torch-flex"
    why = "FlexAttention (compiled) runs this call"

    def reason(self, call: _spec.Call) -> str | None:
        return flex_reason(call)

    def auto_reason(self, call: _spec.Call) -> str | None:
        return auto_declined(call)

    def taken(self, call: _spec.Call) -> str:
        return taken_reason(call)

    def hands_over(self, call: _spec.Call, q: Any, k: Any, v: Any) -> str | None:
        if torch.compiler.is_compiling():
            return "FlexAttention is taken for eager calls only, not under torch.compile"
        if _FAILED:
            return f"FlexAttention failed to compile here earlier ({_FAILED[0]})"
        if _cpu(call) and _needs_grad(call, q, k, v):
            return (
                "FlexAttention has no CPU backward (torch 2.13) and autograd needs one here "
                "(in torch.no_grad() FlexAttention runs)"
            )
        return None

    def run(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        mods: Any = None,
    ) -> tuple[Any, Any, Any]:
        # A call planned eagerly and memoised, now traced by a caller's torch.compile (the
        # memo's runner is reused there), or one that needs a CPU gradient: the blockwise
        # path, which serves every call Flex does.
        tracing = torch.compiler.is_compiling()
        if not (tracing or _FAILED or (_cpu(call) and _needs_grad(call, q, k, v))):
            try:
                with torch.no_grad() if _cpu(call) else contextlib.nullcontext():
                    out, lse = flex(call, q, k, v, mods)
                return out, None, lse
            except Exception as err:
                if call.implementation == "fused" or not _compile_failure(err):
                    raise
                _compile_failed(err)
        elif call.implementation == "fused":
            if _FAILED:
                raise ValueError(_FAILED[0])
            raise tracing_error() if tracing else cpu_training_error()
        out, lse = adapter(call.backend).blockwise(call, q, k, v, mask, bias, None, mods)
        return out, None, lse


def _compile_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch.compile's failure to build Flex's kernel here (no working
    C++ toolchain or headers, an unsupported CPU): not a wrong call, so ``auto`` goes on."""
    from torch._dynamo.exc import BackendCompilerFailed

    kinds: tuple[type[BaseException], ...] = (BackendCompilerFailed,)
    inductor = getattr(sys.modules.get("torch._inductor.exc"), "InductorError", None)
    if isinstance(inductor, type):
        kinds = (*kinds, inductor)
    return isinstance(err, kinds)


def _compile_failed(err: BaseException) -> None:
    """Remember (and warn once) that Flex cannot compile here: ``auto`` plans the next
    path from now on, and ``plan()`` says why."""
    import warnings

    from portable_attention import _plan

    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    _FAILED.append(
        f"compiling FlexAttention failed in this process ({type(err).__name__}: {first}); "
        "auto runs the blockwise path instead"
    )
    _plan.forget()
    warnings.warn(_FAILED[0], RuntimeWarning, stacklevel=4)


KERNEL = FlexAttention()
