"""PyTorch: dropout from a ``torch.Generator`` (torch's global RNG when None)."""

from __future__ import annotations

from typing import Any

import torch

from portable_attention import _validate

NAME = "torch"
RNG = "a torch.Generator on the arrays' device (or None for torch's global RNG)"


def keep_mask(rng: Any, p: float, xp: Any, device: Any) -> Any:
    """Keep mask drawn with ``torch.rand`` on ``device`` from ``rng``."""
    if rng is not None and not isinstance(rng, torch.Generator):
        raise _validate.rng_type_error(NAME, RNG, rng)
    if rng is not None and torch.device(rng.device).type != torch.device(device).type:
        raise _validate.rng_device_error(rng.device, device)

    def draw(shape: tuple[int, ...]) -> Any:
        return torch.rand(shape, generator=rng, device=device) >= p

    return draw
