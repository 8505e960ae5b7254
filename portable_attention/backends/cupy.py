"""CuPy: no attention kernel of its own. The fused path hands the arrays to torch SDPA
through DLPack (zero-copy, same GPU; a view with negative strides is copied) and the
result back as CuPy; dropout draws from a ``cupy.random.Generator`` or ``RandomState``."""

from __future__ import annotations

import importlib.util
from typing import Any

import cupy

from portable_attention import _core, _spec
from portable_attention._blockwise import BlockKeep
from portable_attention._core import KeepMask
from portable_attention.backends._base import Adapter, Kernel

NAME = "CuPy"
RNG = "a cupy.random.Generator or cupy.random.RandomState (or None for CuPy's global RNG)"


def _keep_mask(rng: Any, p: float, device: Any) -> Any:
    """Keep mask drawn on the arrays' GPU (without ``rng``, from that GPU's global
    random state: CuPy keeps one per device)."""
    if rng is not None and not isinstance(rng, (cupy.random.Generator, cupy.random.RandomState)):
        raise _spec.rng_type_error(NAME, RNG, rng)

    def draw(shape: tuple[int, ...]) -> Any:
        with device:
            state = cupy.random.get_random_state() if rng is None else rng
            if isinstance(state, cupy.random.Generator):
                return state.random(shape, dtype=cupy.float32) >= p
            return state.random_sample(shape, dtype=cupy.float32) >= p

    return draw


def _block_keep(rng: Any, p: float, device: Any) -> BlockKeep:
    """The blockwise path's keep masks on the arrays' GPU: one seed read from ``rng`` (or
    that GPU's global random state) now, then block ``b``'s mask from a generator seeded
    with a mix of the seed and ``b``, so the backward draws each block's mask again.
    **Not yet run on a GPU.**"""
    if rng is not None and not isinstance(rng, (cupy.random.Generator, cupy.random.RandomState)):
        raise _spec.rng_type_error(NAME, RNG, rng)
    with device:
        state = cupy.random.get_random_state() if rng is None else rng
        if isinstance(state, cupy.random.Generator):
            uniform = state.random(dtype=cupy.float64)
        else:
            uniform = state.random_sample(dtype=cupy.float64)
        seed = int(float(uniform) * 2**53)

    def draw(block: Any, shape: tuple[int, ...]) -> Any:
        with device:
            block_state = cupy.random.RandomState(seed=(seed * 1_000_003 + int(block)) % 2**63)
            return block_state.random_sample(shape, dtype=cupy.float32) >= p

    return draw


def _fused_reason(call: _spec.Call) -> str | None:
    """Why torch SDPA cannot run ``call`` for CuPy arrays (None: it can)."""
    if importlib.util.find_spec("torch") is None:
        return "CuPy has no attention kernel and torch (for SDPA via DLPack) is not installed"
    import torch

    if not torch.cuda.is_available():
        return "CuPy has no attention kernel and this torch build has no CUDA"
    from portable_attention.backends import torch_sdpa

    if call.dropout > 0:
        return "SDPA's dropout would draw from torch's RNG, not CuPy's"
    return torch_sdpa.fused_reason(call)


def _run_fused(call: _spec.Call, q: Any, k: Any, v: Any, mask: Any, bias: Any) -> Any:
    """Run torch SDPA on DLPack views of the CuPy arrays; return CuPy. The mask operand
    is built in CuPy (``_core`` on the call's namespace), then viewed by torch."""
    import torch

    from portable_attention.backends import torch_sdpa

    attn_mask, is_causal = _core.fused_operand(call, mask, bias)
    tq, tk, tv = (_to_torch(x) for x in (q, k, v))
    tmask = None if attn_mask is None else _to_torch(attn_mask)
    with torch.cuda.device(tq.device):
        out = torch_sdpa.sdpa(call, tq, tk, tv, tmask, is_causal)
    return cupy.from_dlpack(out)


def _to_torch(x: Any) -> Any:
    """A torch view of a CuPy array through DLPack; a copy where its strides are negative
    (a reversed view), which torch tensors cannot have."""
    import torch

    if any(stride < 0 for stride in x.strides):
        x = cupy.ascontiguousarray(x)
    return torch.from_dlpack(x)


class SdpaViaDlpack(Kernel):
    """torch SDPA on the CuPy arrays' GPU through DLPack."""

    path = "fused:cupy-via-torch"
    why = "torch SDPA on the same GPU through DLPack (no copies) covers this call"

    def reason(self, call: _spec.Call) -> str | None:
        return _fused_reason(call)

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
        return _run_fused(call, q, k, v, mask, bias), None, None


class CupyAdapter(Adapter):
    """CuPy: SDPA through DLPack where torch has CUDA, dropout from CuPy's generators."""

    name = NAME
    rng = RNG
    fused = SdpaViaDlpack()

    def keep_mask(self, rng: Any, p: float, xp: Any, device: Any) -> KeepMask:
        return _keep_mask(rng, p, device)

    def block_keep(self, rng: Any, p: float, xp: Any, device: Any) -> BlockKeep:
        return _block_keep(rng, p, device)

    def device(self, x: Any) -> Any:
        return x.device

    def to_host(self, x: Any) -> Any:
        return x.get()


ADAPTER = CupyAdapter()
