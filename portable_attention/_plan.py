"""Which path runs a call of ``attend`` and why: a :class:`Plan` with ``.path`` and ``.reason``.

Decisions depend only on the call's description (array type, device, dtype, shapes and
options; never data) and on what the framework's adapter declares
(:class:`portable_attention.backends._base.Kernel`). They are cached with
``functools.lru_cache`` by the whole :class:`~portable_attention._spec.Call` (a frozen,
hashable description), so no list of the options a kernel reads can go stale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from portable_attention import _block_grid
from portable_attention._core import DENSE_LIMIT_BYTES, SAVED_LIMIT_BYTES, dense_bytes
from portable_attention._spec import Call, fused_unavailable_error
from portable_attention.backends import adapter

DENSE = "portable:dense"
BLOCKWISE = "portable:blockwise"

#: A window that keeps less than this share of the blockwise grid's blocks runs on the
#: blockwise path, which computes only those, rather than on a path that computes every
#: score (the dense path; on torch's CPU, SDPA with the band as a dense mask).
WINDOW_DENSITY_LIMIT = 0.25


#: Why a call of symbolic lengths takes the dense path (whatever its size).
_SYMBOLIC = (
    "the shapes are symbolic (an export with dynamic shapes), so no choice may depend on "
    "their values: the dense path serves every size, where the size rules, the blockwise "
    "loops and the tuned kernels would fix them"
)


@dataclass(frozen=True)
class Plan:
    """The path ``attend`` takes for a call, and why.

    Attributes
    ----------
    path : str
        Three kinds, named ``kind:where``. ``"fused:torch"``, ``"fused:torch-flex"``,
        ``"fused:jax"``, ``"fused:cupy-via-torch"``: the framework's own fused kernel (SDPA,
        FlexAttention compiled, ``jax.nn.dot_product_attention``). ``"tuned:jax"``: the
        dense path on query blocks under ``lax.map`` (JAX on CPU); ``"per-chunk:dask"``:
        ``attend`` on
        each batch/head chunk of dask arrays. ``"portable:dense"``: the array-API
        implementation with the whole score matrix (autodiff saves its probabilities for
        backward);
        ``"portable:blockwise"``: the array-API blockwise path, an online softmax over
        query and key blocks whose backward (FlashAttention-2's) recomputes each block
        from the saved q, k, v, out and lse (torch: an ``autograd.Function``; JAX: a
        ``custom_vjp`` over compiled loops; elsewhere
        :func:`~portable_attention.attend_backward`: one kernel on every framework).
        ``implementation="portable"`` always gives a ``portable:*`` path; the reason
        says what chose the blockwise one (``chunk_size=``, a block plan that skips
        blocks, a window that keeps under a quarter of the blocks, dense scores over 256
        MiB, or, for ``auto`` on torch and JAX, over 16 MiB of probabilities that
        autodiff would save; on torch's CPU, a window that SDPA would take as a dense
        mask); NumPy's ``auto`` takes it from 64K scores on but with ``return_weights``.
        Earlier names: ``tuned:numpy`` (NumPy's own kernel, now the blockwise path);
        ``native:*`` for ``tuned:*``/``per-chunk:dask``, ``portable`` for
        ``portable:dense`` and ``portable:chunked`` for one of the two spellings of
        ``portable:blockwise`` (docs/migrating.md).
    reason : str
        In words, why this path and not a faster one.
    """

    path: str
    reason: str


def portable_plan(call: Call, why: str) -> Plan:
    """The portable path for ``call`` (dense or blockwise), its reason ``why`` and what
    chose it: also asked by kernels that weigh it against themselves (torch SDPA for a
    window)."""
    if call.return_weights:
        return Plan(DENSE, f"{why}; return_weights needs the whole score matrix")
    if call.symbolic:
        return Plan(DENSE, f"{why}; {_SYMBOLIC}")
    plan = call.blocks
    if plan is not None and plan.density < 1:
        return Plan(
            BLOCKWISE,
            f"{why}; the block plan of mask_mod keeps {len(plan.kept)} of its blocks "
            f"({plan.density:.0%}), so the blockwise path computes only those",
        )
    density = window_density(call)
    if density is not None and density < WINDOW_DENSITY_LIMIT:
        return Plan(
            BLOCKWISE,
            f"{why}; the window keeps {density:.0%} of the blockwise grid's blocks, so the "
            "blockwise path computes only those",
        )
    if dense_bytes(call) > DENSE_LIMIT_BYTES:
        return Plan(
            BLOCKWISE,
            f"{why}; the dense scores would take over {DENSE_LIMIT_BYTES >> 20} MiB, "
            "so key/query blocks with an online softmax run (the blockwise backward "
            "recomputes them from lse)",
        )
    backend = adapter(call.backend)
    if backend.autodiff and dense_bytes(call) > SAVED_LIMIT_BYTES:
        return Plan(
            BLOCKWISE,
            f"{why}; {backend.name}'s autodiff of the dense path would save over "
            f"{SAVED_LIMIT_BYTES >> 20} MiB of probabilities for backward, so the blockwise "
            "path runs (it saves q, k, v, out and lse and recomputes each block in backward)",
        )
    return Plan(DENSE, why)


def window_density(call: Call) -> float | None:
    """The share of the blockwise grid's blocks that a call's ``window`` (with its
    ``causal``) keeps; None without a window, or on a grid of one block."""
    if call.window is None or call.symbolic:
        return None
    size = _block_grid.block_size(call)
    nq, nk = _block_grid.grid(call, size)
    if nq * nk <= 1:
        return None
    return len(_block_grid.pairs(call, size)) / (nq * nk)


def forget() -> None:
    """Drop every memoised decision: a kernel found it cannot run here after all (Flex's
    compilation failed), and the next calls plan again."""
    _decide.cache_clear()


@functools.lru_cache(maxsize=4096)
def _decide(call: Call) -> Plan:
    implementation = call.implementation
    if call.chunk_size is not None:  # before any kernel: every backend would decline
        if call.symbolic_lengths or call.unknown_dims:
            raise symbolic_chunks_error(call)
        return Plan(
            BLOCKWISE,
            f"chunk_size={call.chunk_size} asks for the blockwise path (blocks of "
            "that size forward and in the blockwise backward)",
        )
    if implementation == "portable":
        return portable_plan(call, "implementation='portable' was asked for")
    backend = adapter(call.backend)
    kernels = backend.fused_kernels
    refused: list[str] = []
    for kernel in kernels:  # in the adapter's order: the first that runs the call takes it
        why = kernel.reason(call)
        if why is None and implementation == "auto":
            why = kernel.auto_reason(call)
        if why is None:
            taken = kernel.taken(call)
            return Plan(kernel.path, "; ".join([*refused, taken]) if refused else taken)
        refused.append(why if not refused else f"not {kernel.path}: {why}")
    why = "; ".join(refused) if refused else f"{call.backend} has no fused attention kernel"
    tuned = backend.tuned
    if implementation == "auto" and tuned is not None and not call.symbolic:
        declined = tuned.reason(call)
        if declined is None:
            return Plan(tuned.path, f"{why}; {tuned.why}")
        why = f"{why}; not {tuned.path}: {declined}"
    if implementation == "auto" and not call.symbolic and not call.return_weights:
        preferred = backend.blockwise_reason(call)
        if preferred is not None:
            return Plan(BLOCKWISE, f"{why}; {preferred}")
    return portable_plan(call, why)


def choose(call: Call) -> Plan:
    """The plan for ``call``; ``implementation="fused"`` raises where none applies."""
    # A block plan's blocks (a new one per batch of documents, say) would fill the cache
    # with layouts of up to a few MB each: such calls are decided afresh (it is quick).
    if call.blocks is not None or adapter(call.backend).tracing():
        plan = _decide.__wrapped__(call)
    else:
        plan = _decide(call)
    if call.implementation == "fused" and not plan.path.startswith("fused"):
        raise fused_unavailable_error(plan.reason)
    return plan


def symbolic_chunks_error(call: Call) -> ValueError:
    msg = (
        f"`chunk_size={call.chunk_size}` walks blocks of static shapes, but this call's "
        f"batch or lengths are symbolic (q {tuple(call.q_shape)}, k {tuple(call.k_shape)}: "
        "an export with dynamic shapes); leave chunk_size out (the dense path serves every "
        "size) or export with static shapes."
    )
    return ValueError(msg)
