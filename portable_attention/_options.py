"""The options of ``attend``, checked and normalised once: :class:`Options`.

:func:`options` turns ``attend``'s option keywords (everything but the arrays, the ``rng``
and the functions) into one frozen, hashable :class:`Options`, which the validated
:class:`~portable_attention._spec.Call` carries. Every layer after it passes that object
on: the plan reads it, torch's custom operators take it through one to-schema /
from-schema pair, the ring gives each block a copy with that block's band
(``dataclasses.replace`` with values the ring's schedule already normalised). The
multi-head modules and the transformers integration call the public ``attend``, whose
memo skips this on a repeated call. Nothing checks an option twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from portable_attention._checks import (
    as_int,
    check_dropout,
    flag,
    is_numpy_bool,
    real_number,
    type_name,
)

CAUSAL_ALIGNMENTS = ("lower_right", "upper_left")

IMPLEMENTATIONS = ("auto", "portable", "fused")


@dataclass(frozen=True)
class Options:
    """``attend``'s options, normalised: plain Python data, so equal options compare and
    hash equal (the plan cache and the JAX custom-gradient caches key on them).

    Attributes
    ----------
    causal : "lower_right", "upper_left" or None
    window : (left, right) with None for an unbounded side, or None
    scale : float or None
        None: ``1 / sqrt(Dk)``, resolved by the :class:`~portable_attention._spec.Call`
        (which knows ``Dk``) as ``call.scale``.
    softcap : float or None
    dropout : float in ``[0, 1)``
    chunk_size : int > 0 or None
    return_weights, return_lse : bool
    implementation : "auto", "portable" or "fused"
    """

    causal: str | None = None
    window: tuple[int | None, int | None] | None = None
    scale: float | None = None
    softcap: float | None = None
    dropout: float = 0.0
    chunk_size: int | None = None
    return_weights: bool = False
    return_lse: bool = False
    implementation: str = "auto"


#: :class:`Options` as the scalars of a compiled operator's schema (torch.library's custom
#: operators take no None, tuple or dataclass): ``(causal, left, right, windowed, scale,
#: softcap, dropout, chunk_size)``: causal "" for none, a window side -1 for unbounded
#: (``windowed`` False: no window), softcap 0.0 for none. Only what a kernel reads: the
#: weights are never asked for there, and ``return_lse`` is always.
Fields = tuple[str, int, int, bool, float, float, float, int]


def to_fields(options: Options, *, scale: float, chunk_size: int, wide: int) -> Fields:
    """``options`` as :data:`Fields`, with the call's resolved ``scale`` and block length.
    A window side over ``wide`` (no distance on the call's grid is larger) becomes
    ``wide``: the same band, and it fits a schema's int64 (a side up to 2**70 is valid)."""
    left, right = options.window if options.window is not None else (None, None)
    return (
        options.causal or "",
        -1 if left is None else min(left, wide),
        -1 if right is None else min(right, wide),
        options.window is not None,
        scale,
        options.softcap or 0.0,
        options.dropout,
        chunk_size,
    )


def from_fields(fields: Fields) -> Options:
    """The :class:`Options` that :func:`to_fields` wrote (with ``return_lse``): already
    normalised, nothing checked again."""
    causal, left, right, windowed, scale, softcap, dropout, chunk_size = fields
    window = (None if left < 0 else left, None if right < 0 else right) if windowed else None
    return Options(
        causal=causal or None,
        window=window,
        scale=scale,
        softcap=softcap or None,
        dropout=dropout,
        chunk_size=chunk_size,
        return_lse=True,
    )


def options(
    *,
    causal: object = False,
    window: object = None,
    scale: object = None,
    softcap: object = None,
    dropout: object = 0.0,
    chunk_size: object = None,
    return_weights: object = False,
    return_lse: object = False,
    implementation: object = "auto",
) -> Options:
    """Check ``attend``'s option keywords; return them as one :class:`Options`."""
    weights = flag("return_weights", return_weights)
    return Options(
        causal=normalize_causal(causal),
        window=normalize_window(window),
        scale=None if scale is None else check_scale(scale),
        softcap=None if softcap is None else check_softcap(softcap),
        dropout=check_dropout(dropout),
        chunk_size=check_chunk_size(chunk_size, weights),
        return_weights=weights,
        return_lse=flag("return_lse", return_lse),
        implementation=check_implementation(implementation),
    )


def normalize_causal(causal: object) -> str | None:
    """``False -> None``, ``True -> "lower_right"`` (NumPy's bools too), a known alignment
    string -> itself."""
    if is_numpy_bool(causal):
        causal = bool(causal)
    if causal is False:
        return None
    if causal is True:
        return "lower_right"
    if isinstance(causal, str):
        if causal in CAUSAL_ALIGNMENTS:
            return causal
        msg = f"`causal` must be True, False, 'lower_right' or 'upper_left', got {causal!r}."
        raise ValueError(msg)
    msg = (
        "`causal` must be True, False, 'lower_right' or 'upper_left', "
        f"got {causal!r} of type {type_name(causal)}."
    )
    raise TypeError(msg)


def normalize_align(align: object) -> str:
    """Check the ``align=`` of the mask builders."""
    if align not in CAUSAL_ALIGNMENTS:
        msg = f"`align` must be 'lower_right' or 'upper_left', got {align!r}."
        raise ValueError(msg)
    return str(align)


def normalize_window(window: object) -> tuple[int | None, int | None] | None:
    """``None``, an int ``w`` (means ``(w, w)``) or ``(left, right)`` of ints >= 0 / None."""
    if window is None:
        return None
    sides: Sequence[object]
    if as_int(window) is not None:
        sides = (window, window)
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        sides = window
    else:
        msg = (
            "`window` must be an int w (meaning (w, w)) or a pair (left, right) of ints >= 0 "
            f"or None (unbounded), got {window!r}."
        )
        raise ValueError(msg)
    ints = [None if side is None else as_int(side) for side in sides]
    if -1 in ints and all(n is not None and n >= -1 for n in ints):
        fix = tuple(None if n == -1 else n for n in ints)
        msg = (
            f"`window` sides must be ints >= 0 or None (unbounded), got {window!r}: -1 is "
            f"flash-attn's unbounded side, here None: pass window={fix!r}."
        )
        raise ValueError(msg)
    for side, number in zip(sides, ints, strict=True):
        if side is not None and (number is None or number < 0):
            why = "; a negative window keeps no key" if number is not None else ""
            msg = f"`window` sides must be ints >= 0 or None (unbounded), got {window!r}{why}."
            raise ValueError(msg)
    return (ints[0], ints[1])


def default_scale(dk: int) -> float:
    """The score scale when ``scale=None``: ``1 / sqrt(Dk)`` (1 for ``Dk == 0``)."""
    return 1.0 / math.sqrt(dk) if dk > 0 else 1.0


def check_scale(scale: object) -> float:
    """A given ``scale``: a finite number > 0."""
    value = real_number("scale", scale)
    if not 0 < value < math.inf:  # comparisons only: torch.compile traces them on
        # symbolic floats (dynamic=True), math.isfinite it cannot
        msg = (
            f"`scale` must be a finite number > 0 (or None for 1/sqrt(Dk)), got {scale!r}; "
            "0 would weigh every key alike and a negative scale inverts the attention "
            "(check for an integer division such as `1 // d`)."
        )
        raise ValueError(msg)
    return value


def check_softcap(softcap: object) -> float:
    """A given ``softcap``: a finite number > 0."""
    value = real_number("softcap", softcap)
    if value == 0:
        msg = (
            "`softcap=0.0` is flash-attn's 'off'; here no softcap is `softcap=None` (the "
            "default): a softcap must be a finite number > 0."
        )
        raise ValueError(msg)
    if not 0 < value < math.inf:  # NaN fails both; as scale's, traceable
        msg = f"`softcap` must be a finite number > 0 (or None), got {softcap!r}."
        raise ValueError(msg)
    return value


def check_chunk_size(chunk_size: object, return_weights: bool) -> int | None:
    """``chunk_size``: None or an int > 0, and not with ``return_weights``."""
    if chunk_size is None:
        return None
    size = as_int(chunk_size)
    if size is None or size <= 0:
        msg = f"`chunk_size` must be an int > 0 (or None for automatic), got {chunk_size!r}."
        raise ValueError(msg)
    if return_weights:
        msg = (
            "`chunk_size` asks for the blockwise path, which never holds the whole weight "
            "matrix: drop `return_weights=True` or `chunk_size`."
        )
        raise ValueError(msg)
    return size


def check_implementation(implementation: object) -> str:
    """``"auto"``, ``"portable"`` or ``"fused"``."""
    if implementation not in IMPLEMENTATIONS:
        msg = f"`implementation` must be 'auto', 'portable' or 'fused', got {implementation!r}."
        raise ValueError(msg)
    return str(implementation)
