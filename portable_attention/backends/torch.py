"""PyTorch: dropout from a ``torch.Generator`` (torch's global RNG when None)."""

from __future__ import annotations

from typing import Any

import torch

from portable_attention import _validate

RNG = "a torch.Generator on the arrays' device (or None for torch's global RNG)"


def keep_mask(rng: Any, p: float, xp: Any, device: Any) -> Any:
    """Keep mask drawn with ``torch.rand`` on ``device`` from ``rng``."""
    if rng is not None and not isinstance(rng, torch.Generator):
        raise _validate.rng_type_error("torch", RNG, rng)
    if rng is not None and torch.device(rng.device).type != torch.device(device).type:
        msg = (
            f"`rng` is a torch.Generator on {rng.device} but the arrays are on {device}; "
            f"make it with `torch.Generator(device={str(device)!r})`."
        )
        raise ValueError(msg)

    def draw(shape: tuple[int, ...]) -> Any:
        return torch.rand(shape, generator=rng, device=device) >= p

    return draw
