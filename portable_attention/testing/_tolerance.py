"""The one tolerance table: how close a correct attention result is, per dtype and output.

Everything in the package that compares attention results uses it: the consistency report
(``python -m portable_attention``), its demo, :func:`assert_backends_agree`,
:func:`check_attention`, the test suite and the GPU script (``benchmarks/gpu_check.py``,
which adds a documented allowance for TF32 on top).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from portable_attention.testing._convert import dtype_name


class Tolerance(NamedTuple):
    """A pair of tolerances: ``x`` agrees with ``ref`` where ``|x - ref| <= atol + rtol * |ref|``.

    A tuple ``(rtol, atol)``, as :func:`numpy.testing.assert_allclose` takes them.
    """

    rtol: float
    atol: float


#: What attention returns, each with its own row of the table.
OUTPUTS = ("out", "weights", "lse")


def _row(out: Tolerance, lse: Tolerance) -> Mapping[str, Tolerance]:
    return MappingProxyType({"out": out, "weights": out, "lse": lse})


TOLERANCES: Mapping[str, Mapping[str, Tolerance]] = MappingProxyType(
    {
        "float64": _row(Tolerance(1e-10, 1e-12), Tolerance(1e-10, 1e-12)),
        "float32": _row(Tolerance(1e-4, 1e-5), Tolerance(1e-4, 1e-5)),
        "float16": _row(Tolerance(5e-3, 5e-3), Tolerance(1e-4, 1e-4)),
        "bfloat16": _row(Tolerance(3e-2, 4e-2), Tolerance(1e-4, 1e-4)),
    }
)
"""``TOLERANCES[dtype][what]``: the :class:`Tolerance` for output ``what`` (``"out"``,
``"weights"`` or ``"lse"``) of an attention computed on inputs of ``dtype``
(``"float64"``, ``"float32"``, ``"float16"``, ``"bfloat16"``), against the float64
reference or against another correct implementation given the same inputs. Read-only.

Where the values come from (measured with :func:`reference_attention` against ``attend``
on NumPy, PyTorch and JAX, every path, L up to 2048, D up to 128):

* float32 out/weights ``(1e-4, 1e-5)``: a correct kernel's error grows with the scores'
  magnitude (an absolute rounding error in a score becomes that relative error in its
  weight): 6e-7 at ``|s| <= 6``, 3.7e-6 at ``|s| = 20``, 8.9e-6 at ``|s| = 31``, which is
  0.74 of this bound. Scores beyond about 40 need a looser one (pass it). The 1e-5 / 1e-6
  that ``assert_backends_agree`` had before failed at ``|s| = 20`` already.
* float16 / bfloat16 out/weights ``(5e-3, 5e-3)`` / ``(3e-2, 4e-2)``: the result is rounded
  to the 16-bit dtype once (half an ulp: 4.9e-4 / 3.9e-3 relative), and kernels that round
  the weights to it before ``weights @ v`` add about as much per unit of ``|v|``. Measured
  at most 0.09 / 0.11 of the bound.
* lse of float16 / bfloat16 inputs ``(1e-4, 1e-4)``: the contract computes it in float32
  (and returns it so) from inputs exact in float32: float32's rtol, and an atol for an lse
  near 0. Measured at most 0.007 of the bound.
* float64 ``(1e-10, 1e-12)``: summation order only; 6.7e-12 relative at most (0.01 of the
  bound).

These are the values the test suite and the consistency report used before the table was
one; ``assert_backends_agree``'s own, tighter float32 and looser float16 values went.

The table is for *one* attention call. It does not bound a computation composed of many
operations (a model's logits, a multi-head module, gradients of a loss through several
layers): their float32 rounding grows with depth and differs between machines. Compare
those in float64, or derive their bound from the computation (docs/testing.md).
"""

# Not attention's dtypes, but assert_backends_agree compares whatever a function returns.
_COMPLEX = {"complex128": "float64", "complex64": "float32"}
_EXACT = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def tolerance(dtype: Any, what: str = "out") -> Tolerance:
    """The :class:`Tolerance` ``(rtol, atol)`` for results of dtype ``dtype``.

    The values are :data:`TOLERANCES` (where each comes from is said there):

    | dtype                   | out, weights  | lse           |
    | ----------------------- | ------------- | ------------- |
    | float64, complex128     | 1e-10, 1e-12  | 1e-10, 1e-12  |
    | float32, complex64      | 1e-4, 1e-5    | 1e-4, 1e-5    |
    | float16                 | 5e-3, 5e-3    | 1e-4, 1e-4    |
    | bfloat16                | 3e-2, 4e-2    | 1e-4, 1e-4    |
    | bool and integer dtypes | 0 (exact)     | 0 (exact)     |

    A value ``x`` agrees with the reference ``ref`` when
    ``|x - ref| <= atol + rtol * |ref|``, as in :func:`numpy.testing.assert_allclose`.
    The bound holds both against the float64 reference and between two correct
    implementations given the same inputs, on any machine.

    It bounds one attention call (or one operation of its kind). A computation composed of
    many (a model's logits, gradients of a loss through several layers) rounds more, and
    differently on each CPU: compare those in float64, where the float64 row holds for
    them too, or with a bound derived from the computation.

    Parameters
    ----------
    dtype : dtype or str
        The dtype of the *inputs* (for ``what="lse"`` of a float16 call: ``"float16"``,
        though the lse itself is float32): a dtype of any framework (``numpy.float32``,
        ``torch.bfloat16``, ``jax.numpy.float16``, ...) or its name.
    what : {"out", "weights", "lse"}
        Which output of attention.

    Returns
    -------
    Tolerance
        ``(rtol, atol)``, also as ``.rtol`` and ``.atol``.

    Raises
    ------
    ValueError
        For a dtype without a default (float8 types, strings, objects): pass ``rtol`` and
        ``atol`` yourself; or a ``what`` not in ``("out", "weights", "lse")``.

    Examples
    --------
    >>> from portable_attention.testing import tolerance
    >>> tolerance("float32")
    Tolerance(rtol=0.0001, atol=1e-05)
    >>> tolerance("bfloat16", "lse").atol
    0.0001
    """
    if what not in OUTPUTS:
        msg = f"`what` must be one of {', '.join(map(repr, OUTPUTS))}, got {what!r}."
        raise ValueError(msg)
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    name = _COMPLEX.get(name, name)
    if name in TOLERANCES:
        return TOLERANCES[name][what]
    if name in _EXACT:
        return Tolerance(0.0, 0.0)
    raise no_tolerance_error(dtype, [*TOLERANCES, *_COMPLEX, *_EXACT])


# -- argument checks and messages of this module ----------------------------------------


def no_tolerance_error(dtype: object, known: list[str]) -> ValueError:
    """The error of ``tolerance`` for a dtype without a default tolerance."""
    msg = (
        f"`dtype` {dtype!r} has no default tolerance (known: "
        f"{', '.join(known)}); pass `rtol` and `atol` explicitly."
    )
    return ValueError(msg)
