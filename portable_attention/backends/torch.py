"""PyTorch: dropout from a ``torch.Generator`` (torch's global RNG when None), the
blockwise path as a ``torch.autograd.Function`` whose backward is the blockwise backward
of :mod:`portable_attention._blockwise` (it saves q, k, v, out and lse, never the
probabilities), and ``torch.nn.functional.scaled_dot_product_attention`` as the fused
path (:mod:`portable_attention.backends.torch_sdpa`, imported when first planned)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import forward_ad

from portable_attention import _band, _block_grid, _blockwise, _blockwise_backward, _spec
from portable_attention._block_math import BlockMath, OutMath
from portable_attention._options import from_fields, to_fields
from portable_attention.backends._base import Adapter, Kernel, MemoKeys

if TYPE_CHECKING:
    from portable_attention._core import KeepMask
    from portable_attention.backends.torch_rng import SeededKeep

NAME = "torch"
RNG = "a torch.Generator on the arrays' device (or None for torch's global RNG)"


# ------------------------------------------------------------------------------------------
# The blockwise path: an autograd.Function over two custom operators.
#
# torch.compile would trace the blocks' Python loops into its graph, and compile time grew
# with the number of blocks (36 block pairs: 47 s, forward and backward). As
# torch.library custom operators (torch >= 2.4) the forward and the backward are one opaque
# node each, whatever L is; their fake kernels give the shapes.

#: The custom operators' arguments after the tensors: the options' fields
#: (:data:`portable_attention._options.Fields`), then dropout's seed (-1: no dropout).
_Schema = tuple[str, int, int, bool, float, float, float, int, int]


def _to_schema(call: _spec.Call, keep: SeededKeep | None) -> _Schema:
    """The custom operators' arguments for ``call`` (:func:`_from_schema` inverts it)."""
    size, wide = _block_grid.block_size(call), _band.widest(call.q_shape[-2], call.k_shape[-2])
    fields = to_fields(call.options, scale=call.scale, chunk_size=size, wide=wide)
    return (*fields, -1 if keep is None else keep.seed)


def _from_schema(
    q: Any, k: Any, v: Any, mask: Any, bias: Any, schema: _Schema
) -> tuple[_spec.Call, SeededKeep | None]:
    """The call (and keep masks) that :func:`_to_schema` wrote, on the operator's
    arguments: the options as they were normalised, nothing checked again."""
    options = from_fields(schema[:-1])
    call = _spec.describe(options, q, k, v, mask=mask, bias=bias)
    seed = schema[-1]
    if seed < 0:
        return call, None
    from portable_attention.backends.torch_rng import SeededKeep

    return call, SeededKeep(seed, options.dropout, q.device)


class InPlaceMath(OutMath):
    """:class:`~portable_attention._block_math.OutMath` on torch's functions, for where
    autograd records nothing (the custom operators, ``autograd.Function.forward``, a
    backward without ``create_graph``, ``attend_backward`` as
    :meth:`TorchAdapter.block_math` decides)."""

    def __init__(self, xp: Any) -> None:
        super().__init__(xp, torch)

    #: ``exp2``: 40 ms where ``exp`` took 100 for 100 [8, 256, 512] float32 blocks (one
    #: CPU thread, copies included); a GPU's exponential is base 2 already.
    base2 = True

    def fill(self, x: Any, where: Any, value: float) -> Any:
        return x.masked_fill_(where, value)

    def matmul_add(self, acc: Any, a: Any, b: Any, *, slot: str | None = None) -> Any:
        if acc is None:  # (no slot: torch's caching allocator keeps the memory)
            return torch.matmul(a, b)
        if not (acc.shape[:-2] == a.shape[:-2] == b.shape[:-2] and acc.is_contiguous()):
            return acc.add_(torch.matmul(a, b))
        # One batched multiply-add (baddbmm) instead of a product and a pass to add it
        # (the batch counted, not -1: a dimension of 0 leaves -1 ambiguous).
        n = math.prod(acc.shape[:-2])
        acc.view(n, *acc.shape[-2:]).baddbmm_(
            a.reshape(n, *a.shape[-2:]), b.reshape(n, *b.shape[-2:])
        )
        return acc

    def softcap_grad(self, ds: Any, t: Any) -> Any:
        return ds.addcmul_(ds, t.square_(), value=-1.0)  # ds - ds * t**2


#: The functorch level now (None outside torch.func); where torch has no such query, a
#: level (the functional steps are always right).
_level = getattr(torch._C._functorch, "maybe_current_level", lambda: 0)


def _in_transform(*tensors: Any) -> bool:
    """Whether a torch.func transform runs (vmap, grad, jvp: any functorch level, whatever
    the tensors), or forward-mode AD may see the call (:func:`_forward_mode`). False while
    torch.compile traces (dynamo cannot trace the functorch query)."""
    return not torch.compiler.is_compiling() and (_level() is not None or _forward_mode(*tensors))


def _forward_mode(*tensors: Any) -> bool:
    """Whether forward-mode AD may see the call, which an ``autograd.Function`` without a
    ``jvp`` rule cannot pass: one of ``tensors`` carries a tangent, a forward-AD level is
    open (``forward_ad.dual_level``: a mod's captures may carry tangents), or a
    ``torch.func.jvp`` is among the transforms (around a ``grad``, whose wrapped tensors
    show no tangent: ``torch.func.hessian``)."""
    if getattr(forward_ad, "_current_level", -1) >= 0 or (_level() is not None and _jvp_runs()):
        return True
    return any(x is not None and forward_ad.unpack_dual(x).tangent is not None for x in tensors)


def _jvp_runs() -> bool:
    """Whether a ``torch.func.jvp`` is among the active transforms (where torch cannot
    tell, yes: the blocks as torch operations are always right)."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:
        return True
    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


_HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")
_forward_op: Any = None
_backward_op: Any = None
if _HAS_CUSTOM_OP:

    @torch.library.custom_op("portable_attention::blockwise_forward", mutates_args=())
    def _forward_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        causal: str,
        left: int,
        right: int,
        windowed: bool,
        scale: float,
        softcap: float,
        dropout: float,
        size: int,
        seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        schema = (causal, left, right, windowed, scale, softcap, dropout, size, seed)
        call, keep = _from_schema(q, k, v, mask, bias, schema)
        out, lse = _blockwise.forward(call, q, k, v, mask, bias, keep, math=InPlaceMath(call.xp))
        return out.contiguous(), lse.contiguous()

    @_forward_op.register_fake
    def _(q: Any, k: Any, v: Any, mask: Any, bias: Any, *schema: Any) -> tuple[Any, Any]:
        lse_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        return (
            q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=lse_dtype),
        )

    @torch.library.custom_op("portable_attention::blockwise_backward", mutates_args=())
    def _backward_op(
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        want_dbias: bool,
        causal: str,
        left: int,
        right: int,
        windowed: bool,
        scale: float,
        softcap: float,
        dropout: float,
        size: int,
        seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        schema = (causal, left, right, windowed, scale, softcap, dropout, size, seed)
        call, keep = _from_schema(q, k, v, mask, bias, schema)
        grads = _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, want_dbias=want_dbias,
            math=InPlaceMath(call.xp),
        )  # fmt: skip
        dbias = grads.dbias if grads.dbias is not None else q.new_empty((0,))
        return grads.dq, grads.dk, grads.dv, dbias

    @_backward_op.register_fake
    def _(
        dout: Any, dlse: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any,
        bias: Any, want_dbias: bool, *schema: Any,
    ) -> tuple[Any, Any, Any, Any]:  # fmt: skip
        dbias = bias.new_empty(bias.shape) if want_dbias and bias is not None else q.new_empty((0,))
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


class BlockwiseFunction(torch.autograd.Function):
    """The blockwise path: forward ``_blockwise.forward`` (out, lse), backward
    ``_blockwise_backward.backward`` from the saved q, k, v, out and lse (the probabilities are
    recomputed block by block; dropout's masks drawn again from the same seed).

    Both run as custom operators (opaque to ``torch.compile``, whose compile time then does
    not grow with L) where torch has them (>= 2.4). A double backward
    (``create_graph=True``) runs the backward as differentiable torch operations instead,
    which autograd records and differentiates again; that graph holds the recomputed
    blocks (``O(Lq * Lk)`` memory, as the dense path).

    Under ``torch.func.vmap`` both passes run as torch operations on the batched tensors
    (torch generates the rule: ``generate_vmap_rule``), with the functional steps: the
    custom operators have no batching rule, and the in-place steps' ``out=`` none either.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        call: _spec.Call,
        keep: SeededKeep | None,
        mods: Any,
    ) -> tuple[Any, Any]:
        vmapped = _in_transform(q, k, v, mask, bias)
        if _HAS_CUSTOM_OP and mods is None and not vmapped:
            out, lse = _forward_op(q, k, v, mask, bias, *_to_schema(call, keep))
        else:
            # In place (autograd.Function.forward records nothing) unless vmapped.
            math = BlockMath(call.xp) if vmapped else InPlaceMath(call.xp)
            out, lse = _blockwise.forward(call, q, k, v, mask, bias, keep, mods=mods, math=math)
        return out, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, Any]) -> None:
        q, k, v, mask, bias, call, keep, mods = inputs
        ctx.save_for_backward(q, k, v, *output, mask, bias)
        ctx.call, ctx.keep, ctx.mods = call, keep, mods

    @staticmethod
    def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        call, keep, mods = ctx.call, ctx.keep, ctx.mods
        want_dbias = bias is not None and ctx.needs_input_grad[4]
        if dout is None:
            dout = torch.zeros_like(out)
        functional = torch.is_grad_enabled() or _in_transform(dout, q)
        if _HAS_CUSTOM_OP and mods is None and not functional:
            dq, dk, dv, dbias = _backward_op(
                dout, dlse, q, k, v, out, lse, mask, bias, want_dbias, *_to_schema(call, keep)
            )
            return dq, dk, dv, None, dbias if want_dbias else None, None, None, None
        # In place unless autograd records the backward (create_graph=True) or vmap runs
        # it. Not the adapter's rule: dynamo cannot trace its functorch query.
        math = BlockMath(call.xp) if functional else InPlaceMath(call.xp)
        grads = _blockwise_backward.backward(
            call, dout, q, k, v, out, lse, mask, bias, keep, dlse=dlse, want_dbias=want_dbias,
            mods=mods, math=math,
        )  # fmt: skip
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None, None, None


def _checkpointed(
    call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any, mods: Any
) -> tuple[Any, Any]:
    """The blockwise forward of a call with a ``score_mod`` under autograd: each query
    block a non-reentrant checkpoint, so backward recomputes it with autograd (peak
    memory ``O(size * Lk)`` per head while it does) and the score_mod's captured tensors
    get their gradients as any function's would."""
    from torch.utils.checkpoint import checkpoint

    if call.q_shape[-2] == 0 or call.k_shape[-2] == 0:
        return _blockwise.forward(call, q, k, v, mask, bias, keep, mods=mods)
    size = _block_grid.block_size(call)
    nq = _block_grid.grid(call, size)[0]
    outs, lses = [], []
    for qi in range(max(nq, 1)):

        def rows(q: Any, k: Any, v: Any, mask: Any, bias: Any, qi: int = qi) -> Any:
            return _blockwise.forward(
                call, q, k, v, mask, bias, keep, mods=mods, query_blocks=(qi, qi + 1)
            )

        out, lse = checkpoint(rows, q, k, v, mask, bias, use_reentrant=False)
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, -2), torch.cat(lses, -1))
    if not out.requires_grad and any(x.requires_grad for x in (q, k, v)):
        # Every block was masked: out is 0 and no block touched q, k, v. Tie it to them
        # with zero (finite, NaN-proof) gradients, as the other paths give.
        ties = [torch.nan_to_num(x.sum() * 0, nan=0.0, posinf=0.0, neginf=0.0) for x in (q, k, v)]
        out = out + (ties[0] + ties[1] + ties[2]).to(out.dtype)
    return out, lse


class TorchAdapter(Adapter):
    """PyTorch: SDPA, and dropout from a ``torch.Generator``."""

    name = NAME
    rng = RNG
    autodiff = True

    @property
    def fused(self) -> Kernel:
        from portable_attention.backends.torch_sdpa import KERNEL

        return KERNEL

    @property
    def fused_kernels(self) -> tuple[Kernel, ...]:
        # SDPA first; FlexAttention for what SDPA cannot take or takes slowly.
        from portable_attention.backends.torch_flex import KERNEL as FLEX

        return (self.fused, FLEX)

    def keep_mask(self, rng: Any, p: float, xp: Any, device: Any) -> KeepMask:
        from portable_attention.backends.torch_rng import keep_mask

        return keep_mask(self.name, self.rng, rng, p, device)

    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> SeededKeep:
        from portable_attention.backends.torch_rng import block_keep

        return block_keep(self.name, self.rng, rng, p, device)

    def blockwise(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: Any,
        mods: Any = None,
    ) -> tuple[Any, Any]:
        arrays = (q, k, v, mask, bias)
        if _in_transform(*arrays) and (mods is not None or _forward_mode(*arrays)):
            # Under torch.func the mods' tensors (ids, a mod's captures) must be seen by the
            # transform, and the Function's inputs hold none of them; grad/vjp take no
            # saved-tensor hooks (checkpoint's), and the Function has no jvp rule: the
            # blocks run as torch operations, which the transforms record (O(Lq * Lk)
            # memory under grad, as the dense path).
            return _blockwise.forward(call, q, k, v, mask, bias, keep, mods=mods)
        if mods is not None and mods.score_mod is not None and torch.is_grad_enabled():
            return _checkpointed(call, q, k, v, mask, bias, keep, mods)
        out, lse = BlockwiseFunction.apply(q, k, v, mask, bias, call, keep, mods)
        return out, lse

    def unshifted_exp(self, call: _spec.Call) -> bool:
        # On the CPU only: the check is a host read, a synchronisation on CUDA. Forward
        # at [1, 8, 4096, 64] float32 causal, blocks of 256: 160-168 ms against 178-200.
        # Not under torch.func: vmap batches the check, which no host can read.
        device = getattr(call.device, "type", None)
        return device == "cpu" and not torch.compiler.is_compiling() and not _in_transform()

    def block_math(self, xp: Any, arrays: tuple[Any, ...]) -> BlockMath:
        # In place unless autograd records the steps (grad mode on and an input that
        # requires grad: attend_backward differentiated again) or a transform sees them
        # (torch.func's vmap/jvp, forward-mode AD): their rules do not cover `out=`.
        # Under torch.compile the functional steps (dynamo cannot trace the functorch
        # query, and the compiler makes its own buffers).
        if torch.compiler.is_compiling():
            return BlockMath(xp)
        tensors = [x for x in arrays if x is not None]
        if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
            return BlockMath(xp)
        if _in_transform(*tensors):
            return BlockMath(xp)
        return InPlaceMath(xp)

    def host_bool(self, x: Any) -> bool | None:
        # None while torch.compile traces, or where vmap batches x (no host read of a
        # batched value): the blocks are then computed, not skipped.
        if torch.compiler.is_compiling():
            return None
        try:
            return bool(x)
        except RuntimeError as err:  # vmap's "data-dependent control flow" refusal
            if "vmap" not in str(err) or not _in_transform(x):
                raise
            return None

    def to_host(self, x: Any) -> Any:
        return x.detach().cpu().numpy()

    def tracing(self) -> bool:
        return bool(torch.compiler.is_compiling())

    def scalar_refusal(self, name: str, x: Any) -> str | None:
        if x.requires_grad:
            return (
                "a tensor that requires grad; its gradient would be lost: multiply q (or the "
                "scores' inputs) by it instead"
            )
        return None

    def check_array(self, name: str, x: Any) -> None:
        # Sparse and nested tensors: our TypeError, not torch's from inside a kernel.
        if x.is_nested or x.layout is not torch.strided:
            kind, fix = (
                ("nested", f"`{name}.to_padded_tensor(0.0)` with a `mask=` for the padding")
                if x.is_nested
                else (str(x.layout), f"`{name}.to_dense()`")
            )
            msg = f"`{name}` is a {kind} tensor; attend takes dense (strided) tensors: pass {fix}."
            raise TypeError(msg)

    def device(self, x: Any) -> Any:
        return x.device

    def memo_keys(self) -> MemoKeys:
        return _memo_key, _memo_qkv_key


def _memo_key(x: Any) -> tuple[Any, ...] | None:
    # The layout tells sparse tensors from dense ones of the same shape: validation
    # refuses those, so the memo must never take one for the other. A nested tensor
    # (strided ones have no sizes to read) has no key: validation names it. (A plain
    # function: torch.compile traces this, and cannot trace ``operator.attrgetter``.)
    if x.is_nested:
        return None
    return (x.shape, x.dtype, x.device, x.layout)


def _memo_qkv_key(q: Any, k: Any, v: Any) -> tuple[Any, ...] | None:
    # Flat: one tuple to build and hash. A repeated torch call sits right after a kernel
    # that has flushed the caches, where every Python step of the key costs: right after
    # SDPA, one getter for q, k and v took 1.6-2.2 us where three took 1.8-2.7.
    if q.is_nested or k.is_nested or v.is_nested:
        return None
    return (
        type(k), type(v), q.shape, q.dtype, q.device, q.layout, k.shape, k.dtype, k.device,
        k.layout, v.shape, v.dtype, v.device, v.layout,
    )  # fmt: skip


ADAPTER = TorchAdapter()
