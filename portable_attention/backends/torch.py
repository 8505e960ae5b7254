"""PyTorch: ``torch.nn.functional.scaled_dot_product_attention`` as the fused path,
dropout from a ``torch.Generator`` (torch's global RNG when None), and the blockwise path
as a ``torch.autograd.Function`` whose backward is the blockwise backward of
:mod:`portable_attention._blockwise` (it saves q, k, v, out and lse, never the
probabilities)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from portable_attention import _blockwise, _core, _spec
from portable_attention._blockwise import BlockKeep
from portable_attention._core import KeepMask
from portable_attention.backends._base import Adapter, Kernel

NAME = "torch"
RNG = "a torch.Generator on the arrays' device (or None for torch's global RNG)"

_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_HAS_GQA = _VERSION >= (2, 5)
_GQA_KWARGS: dict[bool, dict[str, bool]] = {True: {"enable_gqa": True}, False: {}}


def _keep_mask(rng: Any, p: float, device: Any) -> Any:
    """Keep mask drawn with ``torch.rand`` on ``device`` from ``rng``."""
    if rng is not None and not isinstance(rng, torch.Generator):
        raise _spec.rng_type_error(NAME, RNG, rng)
    if rng is not None and torch.device(rng.device).type != torch.device(device).type:
        raise _spec.rng_device_error(rng.device, device)

    def draw(shape: tuple[int, ...]) -> Any:
        return torch.rand(shape, generator=rng, device=device) >= p

    return draw


#: Spreads block numbers over the 63-bit seeds of the per-block generators (2**64 / phi).
_GOLDEN = 0x9E37_79B9_7F4A_7C15


def _block_keep(rng: Any, p: float, device: Any) -> BlockKeep:
    """The blockwise path's keep masks: one seed drawn from ``rng`` (torch's global RNG when
    None) now, then block ``b``'s mask from a generator on ``device`` seeded with the seed
    and ``b``, so the backward draws each block's mask again."""
    _keep_mask(rng, p, device)  # the same checks
    where = rng.device if rng is not None else device
    seed = int(torch.randint(0, 2**62, (1,), generator=rng, device=where).item())

    def draw(block: Any, shape: tuple[int, ...]) -> Any:
        gen = torch.Generator(device=device)
        gen.manual_seed((seed + int(block) * _GOLDEN) % 2**63)
        return torch.rand(shape, generator=gen, device=device) >= p

    return draw


class BlockwiseFunction(torch.autograd.Function):
    """The blockwise path: forward ``_blockwise.forward`` (out, lse), backward
    ``_blockwise.backward`` from the saved q, k, v, out and lse (the probabilities are
    recomputed block by block; dropout's masks drawn again from the same ``keep``).

    The backward is made of differentiable torch operations, so a double backward
    (``create_graph=True``) records it and differentiates it again; that graph holds the
    recomputed blocks (``O(Lq * Lk)`` memory, as the dense path).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        call: _spec.Call,
        keep: BlockKeep | None,
    ) -> tuple[Any, Any]:
        out, lse = _blockwise.forward(call, q, k, v, mask, bias, keep)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.call = call
        ctx.keep = keep
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        grads = _blockwise.backward(
            ctx.call,
            dout,
            q,
            k,
            v,
            out,
            lse,
            mask,
            bias,
            ctx.keep,
            dlse=dlse,
            want_dbias=bias is not None and ctx.needs_input_grad[4],
        )
        return grads.dq, grads.dk, grads.dv, None, grads.dbias, None, None


def fused_reason(call: _spec.Call) -> str | None:
    """Why SDPA cannot give the contract's answer for ``call`` (None: it can)."""
    if call.return_weights:
        return "return_weights needs the probabilities, which SDPA does not return"
    if call.return_lse:
        return "return_lse needs the logsumexp, which SDPA's public API does not return"
    if call.softcap is not None:
        return "SDPA has no softcap"
    if call.dropout > 0 and call.seeded:
        return (
            "SDPA draws dropout from torch's global RNG and cannot take `rng` "
            "(pass rng=None to use SDPA's dropout)"
        )
    if call.grouped and not _HAS_GQA:
        return (
            f"grouped-query heads need SDPA's enable_gqa (torch >= 2.5, have {torch.__version__})"
        )
    return None


def sdpa(call: _spec.Call, q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool) -> Any:
    """``out`` from SDPA with the operand of ``_core.kernel_operand`` (converted to torch
    by the caller); rows with no key give 0 (SDPA's safe softmax on CPU, forced elsewhere).
    Reads only ``scale``, ``dropout`` and ``grouped`` of ``call``: CuPy arrays come here
    through DLPack."""
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.reshape(1, -1)  # SDPA wants [Lq|1, Lk] at least
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=call.dropout,
        is_causal=is_causal,
        scale=call.scale,
        **_GQA_KWARGS[call.grouped],  # enable_gqa exists only from torch 2.5
    )
    if attn_mask is not None and q.device.type != "cpu":
        # Only SDPA's CPU kernels are verified to give 0 on rows with no key.
        has_key = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        out = torch.where(has_key.any(dim=-1, keepdim=True), out, 0)
    return out


def _prepare(call: _spec.Call) -> Callable[[Any, Any, Any], Any] | None:
    """SDPA of ``(q, k, v)`` with the rest of ``call`` bound, where no mask is needed (no
    mask, bias or window; causal only where SDPA's own flag is exact); else None."""
    if call.mask_shape is not None or call.bias_shape is not None:
        return None
    allowed, is_causal = _core.kernel_mask(call, None, None)
    if allowed is not None:
        return None
    # Only what differs from SDPA's defaults: each keyword costs torch's parser time.
    # (SDPA's default scale is 1/sqrt(Dk) in double precision, the same number as ours.)
    bound: dict[str, Any] = dict(_GQA_KWARGS[call.grouped])
    if call.dropout > 0:
        bound["dropout_p"] = call.dropout
    if is_causal:
        bound["is_causal"] = True
    if call.scale != _spec.default_scale(call.q_shape[-1]):
        bound["scale"] = call.scale
    if not bound:  # SDPA itself: one Python call less than a partial of nothing
        return F.scaled_dot_product_attention
    return functools.partial(F.scaled_dot_product_attention, **bound)


class ScaledDotProductAttention(Kernel):
    """``torch.nn.functional.scaled_dot_product_attention``."""

    path = "fused:torch"
    why = "torch.nn.functional.scaled_dot_product_attention covers every option of this call"

    def reason(self, call: _spec.Call) -> str | None:
        return fused_reason(call)

    def run(
        self, call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any, keep: Any
    ) -> tuple[Any, Any, Any]:
        return sdpa(call, q, k, v, *_core.kernel_operand(call, mask, bias)), None, None

    def prepare(self, call: _spec.Call) -> Callable[[Any, Any, Any], Any] | None:
        return _prepare(call)


class TorchAdapter(Adapter):
    """PyTorch: SDPA, and dropout from a ``torch.Generator``."""

    name = NAME
    rng = RNG
    fused = ScaledDotProductAttention()
    autodiff = True

    def keep_mask(self, rng: Any, p: float, xp: Any, device: Any) -> KeepMask:
        return _keep_mask(rng, p, device)

    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> BlockKeep:
        return _block_keep(rng, p, device)

    def blockwise(
        self,
        call: _spec.Call,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        bias: Any,
        keep: BlockKeep | None,
    ) -> tuple[Any, Any]:
        out, lse = BlockwiseFunction.apply(q, k, v, mask, bias, call, keep)
        return out, lse

    def tracing(self) -> bool:
        return bool(torch.compiler.is_compiling())


ADAPTER = TorchAdapter()
