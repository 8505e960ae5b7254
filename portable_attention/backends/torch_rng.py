"""PyTorch's dropout: keep masks drawn from a ``torch.Generator`` (torch's global RNG
when None), for the dense path (one draw) and the blockwise path (one seeded generator
per block, so the backward draws the forward's masks again). Imported when a call first
asks for dropout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from portable_attention import _spec


def keep_mask(framework: str, rng_text: str, rng: Any, p: float, device: Any) -> Any:
    """Keep mask drawn with ``torch.rand`` on ``device`` from ``rng``."""
    if rng is not None and not isinstance(rng, torch.Generator):
        raise _spec.rng_type_error(framework, rng_text, rng)
    if rng is not None and torch.device(rng.device).type != torch.device(device).type:
        raise _spec.rng_device_error(rng.device, device)

    def draw(shape: tuple[int, ...]) -> Any:
        return torch.rand(shape, generator=rng, device=device) >= p

    return draw


#: Spreads block numbers over the 63-bit seeds of the per-block generators (2**64 / phi).
_GOLDEN = 0x9E37_79B9_7F4A_7C15


@dataclass(frozen=True)
class SeededKeep:
    """The blockwise path's keep masks (a ``_blockwise.BlockKeep``): block ``b``'s is drawn
    by a generator on ``device`` seeded with a mix of ``seed`` and ``b``. The seed (an int)
    is all the backward needs to draw the forward's masks again."""

    seed: int
    p: float
    device: Any

    def __call__(self, block: Any, shape: tuple[int, ...]) -> Any:
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed + int(block) * _GOLDEN) % 2**63)
        return torch.rand(shape, generator=gen, device=self.device) >= self.p


def block_keep(framework: str, rng_text: str, rng: Any, p: float, device: Any) -> SeededKeep:
    """One seed drawn from ``rng`` (torch's global RNG when None) now: see :class:`SeededKeep`."""
    keep_mask(framework, rng_text, rng, p, device)  # the same checks
    where = rng.device if rng is not None else device
    seed = int(torch.randint(0, 2**62, (1,), generator=rng, device=where).item())
    return SeededKeep(seed, p, torch.device(device))
