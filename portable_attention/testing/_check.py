"""``check_attention``: the contract's edge cases run on any attention function.

For people who port a model or write a kernel: declare the conventions your function
follows (its layout, the polarity of its boolean mask, the alignment of its causal flag,
the keywords it takes them by, what it returns) and :func:`check_attention` runs the
cases where attention implementations most often differ, each against
:func:`~portable_attention.testing.reference_attention`, and says case by case where
the function departs, with the likely cause where one fits (the other causal alignment,
the inverted mask, an interleaved head mapping, ``mean(V)`` on rows with no key).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from portable_attention.testing._convert import (
    check_name,
    import_backend,
    to_backend,
)
from portable_attention.testing._kit_cases import CASES, RUNNERS
from portable_attention.testing._kit_judge import Conventions, Returned, Skip, rounded

LAYOUTS = ("bhld", "blhd")
POLARITIES = ("keep", "drop")
ALIGNMENTS = ("lower_right", "upper_left")
RETURNED = ("out", "weights", "lse")
DTYPES = ("float32", "float64", "float16", "bfloat16")


# -- the result -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    """One case of :func:`check_attention` and its verdict.

    Attributes
    ----------
    name : str
        The case (a name of :data:`CASES`).
    about : str
        What it checks, in one line.
    verdict : {"ok", "departs", "error", "skipped"}
        ``"departs"``: the function's result differs from the reference (or has the
        wrong shape or dtype); ``"error"``: it raised; ``"skipped"``: the function takes
        no argument for what the case needs (no mask keyword, say) or, for the gradient
        cases, its arrays have no autodiff the kit uses (torch's and JAX's only).
    details : tuple of str
        Why: each departure (with the likely cause where one fits), the exception, or
        the reason for the skip; for ``"ok"``, the largest errors.
    """

    name: str
    about: str
    verdict: str
    details: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True for ``"ok"`` and ``"skipped"``."""
        return self.verdict in ("ok", "skipped")


@dataclass(frozen=True)
class AttentionReport:
    """What :func:`check_attention` returns: one :class:`CaseResult` per case.

    ``str(report)`` is a table with a line per case; ``report["gqa"]`` is one case;
    iterating gives the cases in order.

    Attributes
    ----------
    function : str
        The function's name.
    conventions : str
        The conventions it was called with, in one line.
    cases : tuple of CaseResult
    """

    function: str
    conventions: str
    cases: tuple[CaseResult, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether no case departs or raised (skipped cases do not count)."""
        return all(case.ok for case in self.cases)

    @property
    def departures(self) -> tuple[CaseResult, ...]:
        """The cases that depart or raised."""
        return tuple(case for case in self.cases if not case.ok)

    def __getitem__(self, name: str) -> CaseResult:
        for case in self.cases:
            if case.name == name:
                return case
        raise unknown_case_error(name, [c.name for c in self.cases])

    def __iter__(self) -> Iterator[CaseResult]:
        return iter(self.cases)

    def __str__(self) -> str:
        width = max([len(c.name) for c in self.cases] + [4])
        lines = [f"check_attention({self.function}): {self.conventions}"]
        for case in self.cases:
            shown = case.verdict if case.ok else case.verdict.upper()
            details = list(case.details) or [""]
            lines.append(f"  {case.name:<{width}}  {shown:<7}  {details[0]}".rstrip())
            lines += [f"  {'':<{width}}  {'':<7}  {d}" for d in details[1:]]
        n = len(self.departures)
        skipped = sum(c.verdict == "skipped" for c in self.cases)
        run = len(self.cases) - skipped
        summary = f"{n} of {run} cases depart" if n else f"all {run} cases agree"
        lines.append(summary + (f" ({skipped} skipped)" if skipped else "") + ".")
        return "\n".join(lines)


def _name_of(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)}, ...)"
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def check_attention(
    fn: Callable[..., Any],
    *,
    backend: str = "numpy",
    device: Any = None,
    dtype: str = "float32",
    layout: str = "bhld",
    mask: str | None = "mask",
    mask_polarity: str = "keep",
    causal: str | None = "causal",
    causal_alignment: str = "lower_right",
    window: str | None = None,
    sinks: str | None = None,
    returns: str | Sequence[str | None] = "out",
    options: Mapping[str, Any] | None = None,
    cases: Sequence[str] | None = None,
    raise_on_departure: bool = False,
) -> AttentionReport:
    """Run the attention contract's edge cases on ``fn`` and say where it departs.

    Each case builds inputs in float64 from a fixed seed, rounds them to ``dtype``,
    converts them to ``backend`` arrays in ``fn``'s ``layout``, calls
    ``fn(q, k, v, **options, [mask=...], [causal=True])`` with the keywords you name,
    and compares what ``fn`` returns with
    :func:`~portable_attention.testing.reference_attention` (on the same rounded
    inputs) within :func:`~portable_attention.testing.tolerance` of ``dtype``: shape,
    dtype and framework of each output; its values; exactly 0 (and lse ``-inf``) on
    query rows with no key.

    The cases (:data:`CASES`): ``plain``, ``mask``, ``empty_rows``, ``causal``,
    ``causal_lq_gt_lk``, ``causal_lq_lt_lk``, ``gqa``, ``mqa``, ``half_overflow``
    (float16 whatever ``dtype``), ``decode`` (``Lq = 1`` against the last row of the
    ``Lq = Lk`` call; causal when the alignment is lower-right), ``padding`` (a
    ``[B, 1, 1, Lk]`` key-padding mask, one sequence all padding), ``window``
    (``(left, right)`` counts, inclusive, aligned as ``causal_alignment`` says, with
    ``Lq != Lk``; needs ``window``), ``window_causal`` (``causal`` and a window together:
    causal caps the window's right side; needs both), ``head_dim_256``, ``head_dim_512``,
    ``dv_ne_dk`` (``Dk = 192``, ``Dv = 128``), ``sinks`` (needs ``sinks``), ``grad_empty_rows`` and
    ``grad_sinks`` (gradients through torch's or JAX's autodiff against the reference's
    float64 gradients; skipped for other backends), ``batch_invariance`` (one sequence
    alone against the same sequence in a batch of 4: within tolerance, and the notes say
    whether bitwise) and ``determinism`` (three calls bitwise equal).

    Parameters
    ----------
    fn : callable
        The attention function, called as ``fn(q, k, v, **keywords)``.
    backend : {"numpy", "torch", "jax", "cupy", "array_api_strict"}
        The framework of the arrays ``fn`` takes.
    device : str or device, optional
        Where the arrays live (as :func:`to_backend` takes it: ``"cuda"``, ...).
    dtype : {"float32", "float64", "float16", "bfloat16"}
        The dtype of the inputs of every case but ``half_overflow``.
    layout : {"bhld", "blhd"}
        ``q``, ``k``, ``v`` and the output as ``[B, H, L, D]`` (torch SDPA) or
        ``[B, L, H, D]`` (``jax.nn.dot_product_attention``, flash-attn). Masks are
        ``[B, 1, Lq, Lk]`` either way, lse ``[B, H, Lq]``, weights ``[B, H, Lq, Lk]``.
    mask : str or None
        The keyword ``fn`` takes a boolean mask by (``"attn_mask"`` for torch SDPA);
        None where it takes none: the mask cases are then skipped.
    mask_polarity : {"keep", "drop"}
        What True means in ``fn``'s mask: "keep" (may attend: torch SDPA, jax.nn, this
        package) or "drop" (masked out: ``nn.MultiheadAttention``'s masks).
    causal : str or None
        The keyword of ``fn``'s causal flag (passed ``True``): ``"is_causal"`` for
        torch SDPA and jax.nn; None where it has none (the causal cases are skipped).
    causal_alignment : {"lower_right", "upper_left"}
        What ``fn``'s causal flag means when ``Lq != Lk``: query ``i`` sees keys
        ``j <= i + (Lk - Lq)`` (lower-right: this package, flash-attn >= 2.1) or
        ``j <= i`` (upper-left: torch SDPA's ``is_causal``, jax.nn's). The ``window``
        case aligns the window the same way.
    window : str or None
        The keyword ``fn`` takes a sliding window ``(left, right)`` by (a tuple of two
        ints: keys from ``left`` before to ``right`` after the query's aligned position,
        both inclusive): ``"window"`` for this package's ``attend``,
        ``"local_window_size"`` for jax.nn, ``"window_size"`` for flash-attn. None (the
        default): the ``window`` case is skipped.
    sinks : str or None
        The keyword ``fn`` takes attention sinks by (one logit per query head, ``[Hq]``,
        in ``dtype``): ``"sinks"`` for ``attend``. None (the default): the sink cases are
        skipped.
    returns : "out" or sequence of {"out", "weights", "lse", None}
        What ``fn`` returns: the output alone, or a tuple whose items are named so
        (None for an item to ignore), e.g. ``("out", "lse", None)`` for
        ``flash_attn_func(..., return_attn_probs=True)``. Returned weights and lse are
        checked too.
    options : mapping, optional
        More keyword arguments for every call (``{"enable_gqa": True}`` for torch SDPA).
    cases : sequence of str, optional
        Run only these cases (names of :data:`CASES`).
    raise_on_departure : bool
        Raise an ``AssertionError`` with the report when a case departs or raises,
        instead of returning the report.

    Returns
    -------
    AttentionReport
        A verdict per case (``report.ok``, ``report["gqa"].verdict``); ``print(report)``
        shows the table.

    Raises
    ------
    ValueError, TypeError
        Bad arguments (a layout, polarity or case name not known; a ``dtype`` that
        ``backend`` lacks). An exception of ``fn`` does not raise: the case's verdict is
        ``"error"``.
    AssertionError
        With ``raise_on_departure=True``, where a case departs.

    Examples
    --------
    >>> from portable_attention import attend
    >>> from portable_attention.testing import check_attention
    >>> report = check_attention(attend, options={"return_lse": True}, returns=("out", "lse"))
    >>> report.ok
    True
    """
    conv = _check_conventions(
        backend,
        device,
        dtype,
        layout,
        mask,
        mask_polarity,
        causal,
        causal_alignment,
        returns,
        options,
        window,
        sinks,
    )
    names = list(CASES) if cases is None else check_case_names(cases, list(CASES))
    results = []
    for name in names:
        try:
            departures, notes = RUNNERS[name](fn, conv)
        except Skip as skip:
            results.append(CaseResult(name, CASES[name], "skipped", (str(skip),)))
            continue
        except Returned as err:
            results.append(CaseResult(name, CASES[name], "departs", (str(err),)))
            continue
        except Exception as err:  # the function under test raised: that case's verdict
            text = _first_line(f"{type(err).__name__}: {err}")
            results.append(CaseResult(name, CASES[name], "error", (text,)))
            continue
        verdict = "departs" if departures else "ok"
        details = departures or [_ok_details(notes)]
        results.append(CaseResult(name, CASES[name], verdict, tuple(details)))
    report = AttentionReport(_name_of(fn), conv.describe(), tuple(results))
    if raise_on_departure and not report.ok:
        raise AssertionError(str(report))
    return report


def _first_line(text: str, limit: int = 300) -> str:
    """An exception's first line, its start and end kept where it is longer than
    ``limit`` (a C++ assertion puts the reason last)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    if len(line) <= limit:
        return line
    return f"{line[: limit // 3]} ... {line[-(limit - limit // 3 - 5) :]}"


def _ok_details(notes: list[str]) -> str:
    """An agreeing case's line: its largest errors (``"out 2e-07"``) and other notes."""
    errors = [n for n in notes if n.split(" ")[-1][:1].isdigit() and "bitwise" not in n]
    others = [n for n in notes if n not in errors]
    return ", ".join(([f"max abs err {', '.join(errors)}"] if errors else []) + others)


# -- argument checks and messages of this module ----------------------------------------


def _check_conventions(
    backend: object,
    device: Any,
    dtype: object,
    layout: object,
    mask: object,
    mask_polarity: object,
    causal: object,
    causal_alignment: object,
    returns: object,
    options: Mapping[str, Any] | None,
    window: object = None,
    sinks: object = None,
) -> Conventions:
    name = check_name(backend)
    import_backend(name)
    for arg, value, known in (
        ("dtype", dtype, DTYPES),
        ("layout", layout, LAYOUTS),
        ("mask_polarity", mask_polarity, POLARITIES),
        ("causal_alignment", causal_alignment, ALIGNMENTS),
    ):
        if value not in known:
            msg = f"`{arg}` must be one of {', '.join(map(repr, known))}, got {value!r}."
            raise ValueError(msg)
    for arg, value in (("mask", mask), ("causal", causal), ("window", window), ("sinks", sinks)):
        if value is not None and not (isinstance(value, str) and value.isidentifier()):
            msg = f"`{arg}` must be the keyword `fn` takes it by (a str) or None, got {value!r}."
            raise TypeError(msg)
    if returns == "out":
        items: tuple[str | None, ...] | None = None
    else:
        if isinstance(returns, str) or not isinstance(returns, Sequence):
            msg = (
                "`returns` must be 'out' or a sequence naming each returned item ('out', "
                f"'weights', 'lse' or None), got {returns!r}."
            )
            raise TypeError(msg)
        items = tuple(returns)
        named = [item for item in items if item is not None]
        if any(item not in RETURNED for item in named) or len(set(named)) != len(named):
            msg = (
                "`returns` may name each of 'out', 'weights' and 'lse' once (None for an "
                f"item to ignore), got {returns!r}."
            )
            raise ValueError(msg)
        if "out" not in named:
            msg = f"`returns` must name the output ('out'), got {returns!r}."
            raise ValueError(msg)
    try:
        to_backend(rounded(np.zeros(1), str(dtype)), name, device)
    except TypeError as err:
        msg = f"`dtype`={dtype!r} on `backend`={name!r}: {err}"
        raise TypeError(msg) from None
    return Conventions(
        name,
        device,
        str(dtype),
        str(layout),
        mask if isinstance(mask, str) else None,
        str(mask_polarity),
        causal if isinstance(causal, str) else None,
        str(causal_alignment),
        items,
        dict(options or {}),
        window if isinstance(window, str) else None,
        sinks if isinstance(sinks, str) else None,
    )


def check_case_names(cases: object, known: list[str]) -> list[str]:
    """``cases=`` of ``check_attention``: names of :data:`CASES`, each once."""
    if isinstance(cases, str) or not isinstance(cases, Sequence):
        msg = f"`cases` must be a sequence of case names like ['plain', 'gqa'], got {cases!r}."
        raise TypeError(msg)
    unknown = [c for c in cases if c not in known]
    if unknown or not cases:
        msg = f"`cases` has unknown names {unknown or cases!r}; known: {', '.join(known)}."
        raise ValueError(msg)
    return list(dict.fromkeys(cases))


def unknown_case_error(name: object, known: list[str]) -> KeyError:
    """``report[name]`` for a case the report does not have."""
    msg = f"no case {name!r} in this report; it has: {', '.join(known)}."
    return KeyError(msg)
