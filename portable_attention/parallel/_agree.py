"""What the ranks of a torch.distributed group must agree on before a ring or Ulysses call
(framework-free: the exchange itself is the collectives module's ``check_agreement``), and
the split of ``attend``'s keywords into option scalars and arrays/functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from portable_attention import _options

#: attend's keywords that are arrays or functions: ranks must agree on their presence.
GIVEN = ("mask", "bias", "rng", "sinks", "segment_ids", "score_mod", "mask_mod")


def scalars(options: dict[str, Any]) -> dict[str, Any]:
    """attend's option keywords of ``options``, without its arrays and functions; a
    keyword ``attend`` does not take is a TypeError naming it."""
    known = {field.name for field in dataclasses.fields(_options.Options)}
    unknown = sorted(set(options) - known - set(GIVEN))
    if unknown:
        msg = (
            f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}: the options "
            f"are attend's ({', '.join(sorted(known | set(GIVEN)))})."
        )
        raise TypeError(msg)
    return {name: value for name, value in options.items() if name not in GIVEN}


def agree(
    check_agreement: Callable[[Any, dict[str, Any], dict[str, object]], None],
    link: Any,
    q: Any,
    k: Any,
    v: Any,
    options: dict[str, Any],
    layout: str,
    *,
    travels: dict[str, Any] | None = None,
    refused: Exception | None = None,
    extra: dict[str, object] | None = None,
) -> _options.Options:
    """torch.distributed: every rank of the group holds shards of one shape and dtype and
    passes the same options (normalised: ``causal=True`` and ``"lower_right"`` agree, as
    ``scale=None`` and ``1/sqrt(Dk)``), the same layout and the same arrays and functions
    present, checked in one exchange before anything else can raise on one rank alone:
    options that do not validate enter it too, so every rank raises, none waits.
    Arrays that ``travels`` names go around the ring with K/V (the ring's segment ids):
    their shapes enter the exchange too, None where absent. ``refused``: what this rank
    found wrong with its own shard's arrays (the per-document layout's ids), raised on
    every rank after the exchange. ``extra``: more values the ranks must agree on.
    Returns the normalised options (checked once, here)."""
    invalid: Exception | None = None
    try:
        normalised = _options.options(**scalars(options))
    except (TypeError, ValueError) as err:
        normalised, invalid = _options.Options(), err
    agreed: dict[str, object] = dict(vars(normalised))
    if normalised.scale is None:
        agreed["scale"] = _options.default_scale(q.shape[-1])
    agreed.update({name: options.get(name) is not None for name in GIVEN})
    agreed["layout"] = layout
    agreed["invalid options"] = None if invalid is None else str(invalid)
    agreed["refused shard arrays"] = None if refused is None else str(refused)
    agreed.update(extra or {})
    check_agreement(link, {"q": q, "k": k, "v": v, **(travels or {})}, agreed)
    if invalid is not None:  # on every rank alike: the exchange compared it
        raise invalid
    if refused is not None:
        raise refused
    return normalised
