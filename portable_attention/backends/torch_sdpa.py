"""torch's fused path: ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), what
it cannot take (its reasons), and the rows with no key it must give as 0. Imported when
the planner first asks torch's adapter for its fused kernel; CuPy's fused path runs SDPA
from here too, through DLPack."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from portable_attention import _core, _mods, _spec
from portable_attention._options import default_scale
from portable_attention._plan import BLOCKWISE, portable_plan, window_density
from portable_attention.backends._base import Kernel

_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_HAS_GQA = _VERSION >= (2, 5)
_GQA_KWARGS: dict[bool, dict[str, bool]] = {True: {"enable_gqa": True}, False: {}}


def fused_reason(call: _spec.Call) -> str | None:
    """Why SDPA cannot give the contract's answer for ``call`` (None: it can)."""
    modded = _mods.unsupported(call, "SDPA")
    if modded is not None:
        return modded
    if call.return_weights:
        return "return_weights needs the probabilities, which SDPA does not return"
    if call.return_lse:
        return "return_lse needs the logsumexp, which SDPA's public API does not return"
    if call.softcap is not None:
        return "SDPA has no softcap"
    if call.dropout > 0 and call.rng_given:
        return (
            "SDPA draws dropout from torch's global RNG and cannot take `rng` "
            "(pass rng=None to use SDPA's dropout)"
        )
    if call.grouped and not _HAS_GQA:
        return (
            f"grouped-query heads need SDPA's enable_gqa (torch >= 2.5, have {torch.__version__})"
        )
    return None


#: SDPA's CPU kernels give 0 on a row with no key from torch 2.5 (its safe softmax); before,
#: NaN, so rows with no key are then set to 0 as on other devices.
_CPU_EMPTY_ROWS_ZERO = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"


def sdpa(call: _spec.Call, q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool) -> Any:
    """``out`` from SDPA with the operand of ``_core.fused_operand`` (converted to torch
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
    if attn_mask is not None and (q.device.type != "cpu" or not _CPU_EMPTY_ROWS_ZERO):
        # Only SDPA's CPU kernels are verified to give 0 on rows with no key.
        has_key = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        out = torch.where(has_key.any(dim=-1, keepdim=True), out, 0)
    return out


def _prepare(call: _spec.Call) -> Callable[[Any, Any, Any], Any] | None:
    """SDPA of ``(q, k, v)`` with the rest of ``call`` bound, where no mask is needed (no
    mask, bias or window; causal only where SDPA's own flag is exact); else None."""
    if call.mask_shape is not None or call.bias_shape is not None:
        return None
    allowed, is_causal = _core.fused_mask(call, None, None)
    if allowed is not None:
        return None
    # Only what differs from SDPA's defaults: each keyword costs torch's parser time.
    # (SDPA's default scale is 1/sqrt(Dk) in double precision, the same number as ours.)
    bound: dict[str, Any] = dict(_GQA_KWARGS[call.grouped])
    if call.dropout > 0:
        bound["dropout_p"] = call.dropout
    if is_causal:
        bound["is_causal"] = True
    if call.scale != default_scale(call.q_shape[-1]):
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

    def auto_reason(self, call: _spec.Call) -> str | None:
        return _window_declined(call)

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
        return sdpa(call, q, k, v, *_core.fused_operand(call, mask, bias)), None, None

    def prepare(self, call: _spec.Call) -> Callable[[Any, Any, Any], Any] | None:
        return _prepare(call)


#: Where ``auto`` leaves SDPA for a window on the CPU: the window keeps less than this
#: share of the blockwise grid's blocks, the score grid has at least
#: ``_WINDOW_MIN_SCORES`` scores per head (``Lq * Lk``: L = 1024), and the path that
#: runs instead skips blocks (``[1, 8, L, 64]`` float32, 2 cores: SDPA with the band as
#: a dense mask took 1.0-9.6x the portable path's time at L = 2048-8192 for shares
#: 0.09-0.55, and tied at L <= 1024; at L = 512 the dense path, which also computes every
#: score, took 2.2x SDPA's time for window (255, 0), and the blockwise path 1.17x forward
#: (0.86x forward + backward) for window (63, 0); docs/fast-paths.md).
_WINDOW_DENSITY = 0.6
_WINDOW_MIN_SCORES = 1024 * 1024


def _window_declined(call: _spec.Call) -> str | None:
    """Why ``auto`` takes another path for a window on the CPU although SDPA could run
    it (None: SDPA): SDPA takes the band as a dense mask and computes every score, the
    blockwise path (and FlexAttention) only the band's blocks."""
    if call.device is None or getattr(call.device, "type", None) != "cpu":
        return None
    density = window_density(call)
    if density is None or density >= _WINDOW_DENSITY:
        return None
    if call.q_shape[-2] * call.k_shape[-2] < _WINDOW_MIN_SCORES:
        return None
    if portable_plan(call, "").path != BLOCKWISE:  # the dense path computes every score too
        return None
    return (
        f"on the CPU SDPA takes the window as a dense mask and computes every score, and the "
        f"window keeps {density:.0%} of the blocks: the paths that skip the others measured "
        "faster (docs/fast-paths.md)"
    )


KERNEL = ScaledDotProductAttention()
