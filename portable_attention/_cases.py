"""The fixed battery of attention cases that ``python -m portable_attention`` runs.

Each :class:`Case` is NumPy data (``q``, ``k``, ``v`` and an optional boolean ``mask``
and float ``bias``) plus the keyword arguments of :func:`portable_attention.attend`.
The data are drawn once from a fixed seed in float64 and rounded to each dtype on the
NumPy side (:func:`rounded`), so that every backend receives the same numbers exactly and
the float64 oracle (:func:`oracle`: :func:`portable_attention.testing.reference_attention`,
written apart from the package's kernels) sees the very inputs the backend computed
with: what remains in the error is the computation, not the rounding of the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from portable_attention.testing import reference_attention

Array = npt.NDArray[Any]

SEED = 0


@dataclass(frozen=True)
class Case:
    """One attention call of the battery.

    Attributes
    ----------
    name : str
        Short name (a column of the report, a choice of ``--plot-case``).
    about : str
        One line: what the case checks.
    arrays : dict of str to numpy.ndarray
        ``q``, ``k``, ``v`` (float64) and where the case has them ``mask`` (bool) and
        ``bias`` (float64).
    options : dict
        The other keyword arguments of ``attend`` (``causal``, ``window``, ...).
    """

    name: str
    about: str
    arrays: dict[str, Array]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def returns_weights(self) -> bool:
        """Whether the case asks ``attend`` for the weights too (and compares them)."""
        return bool(self.options.get("return_weights"))

    def shapes(self) -> str:
        """``q [2, 4, 6, 16]``-style summary of the input shapes."""
        return ", ".join(f"{n} {list(a.shape)}" for n, a in self.arrays.items())


def _qkv(
    rng: np.random.Generator,
    b: int,
    hq: int,
    hk: int,
    lq: int,
    lk: int,
    d: int,
    *,
    q_scale: float = 1.0,
) -> dict[str, Array]:
    return {
        "q": q_scale * rng.standard_normal((b, hq, lq, d)),
        "k": rng.standard_normal((b, hk, lk, d)),
        "v": rng.standard_normal((b, hk, lk, d)),
    }


def battery() -> list[Case]:
    """The cases, in report order; the same data on every call (fixed seed)."""
    rng = np.random.default_rng(SEED)
    b, h, lq, lk, d = 2, 4, 16, 16, 16
    cases = [Case("plain", "no mask: softmax(q k^T / sqrt(d)) v", _qkv(rng, b, h, h, lq, lk, d))]

    cases.append(
        Case(
            "causal",
            "causal=True with Lq=6 < Lk=16: lower-right aligned (query i sees j <= i + 10)",
            _qkv(rng, b, h, h, 6, lk, d),
            {"causal": True},
        )
    )

    arrays = _qkv(rng, b, h, h, lq, lk, d)
    lengths = np.array([lk, 9])  # batch 1 has 7 padded keys
    arrays["mask"] = (np.arange(lk) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, Lk]
    cases.append(Case("padding", "key padding mask [B, 1, 1, Lk] (True = may attend)", arrays))

    cases.append(
        Case(
            "window",
            "sliding window: causal=True, window=(4, 0) (each query sees itself and 4 before)",
            _qkv(rng, b, h, h, lq, lk, d),
            {"causal": True, "window": (4, 0)},
        )
    )

    cases.append(
        Case(
            "gqa",
            "grouped-query heads: Hq=8 query heads share Hk=2 key/value heads",
            _qkv(rng, b, 8, 2, lq, lk, d),
        )
    )

    arrays = _qkv(rng, b, h, h, lq, lk, d)
    slopes = 2.0 ** -np.arange(1, h + 1)  # ALiBi: -slope_h * |i - j|
    distance = np.abs(np.arange(lq)[:, None] - np.arange(lk)[None, :])
    arrays["bias"] = (-slopes[:, None, None] * distance)[None]  # [1, H, Lq, Lk]
    cases.append(Case("bias", "additive float bias [1, H, Lq, Lk] (ALiBi slopes)", arrays))

    cases.append(
        Case(
            "softcap",
            "softcap=5 on large scores (scale=1): 5 * tanh(s / 5)",
            _qkv(rng, b, h, h, lq, lk, d),
            {"softcap": 5.0, "scale": 1.0},
        )
    )

    arrays = _qkv(rng, b, h, h, lq, lk, d)
    mask = rng.random((b, 1, lq, lk)) < 0.7
    mask[:, :, [0, 5, 11], :] = False  # these query rows have no key: output must be 0
    arrays["mask"] = mask
    cases.append(
        Case("masked_rows", "query rows 0, 5, 11 with no key: output 0, never NaN", arrays)
    )
    cases.append(
        Case(
            "weights",
            "as masked_rows with return_weights=True: out and weights (0 on empty rows)",
            {n: a.copy() for n, a in arrays.items()},
            {"return_weights": True},
        )
    )

    cases.append(
        Case(
            "chunked",
            "causal, Lq=Lk=32, chunk_size=8: the online-softmax path over key/query blocks",
            _qkv(rng, b, h, h, 32, 32, d),
            {"causal": True, "chunk_size": 8},
        )
    )
    return cases


def _bfloat16(a: Array) -> Array:
    """``a`` rounded to float32, then to the nearest bfloat16 (ties to even, as torch and
    JAX cast float32), held in float32 (exact values). Needs ``ml_dtypes``."""
    import ml_dtypes

    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def has_bfloat16() -> bool:
    """Whether :func:`rounded` can round to bfloat16 here (``ml_dtypes`` imports)."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def rounded(a: Array, dtype: str) -> Array:
    """``a`` rounded to ``dtype`` (a name) and held in a NumPy dtype that stores it exactly.

    float32 and float16 come back in that NumPy dtype; bfloat16 as float32 holding
    bfloat16 values (rounded by ``ml_dtypes``), so the backend's cast to bfloat16 is
    exact. Boolean arrays come back unchanged.
    """
    if a.dtype == np.bool_:
        return a
    if dtype == "bfloat16":
        return _bfloat16(a)
    return np.asarray(a, dtype=np.dtype(dtype))


def oracle(case: Case, dtype: str) -> tuple[Array, Array]:
    """The float64 reference ``(out, weights)`` for ``case`` on inputs rounded to ``dtype``.

    It is :func:`portable_attention.testing.reference_attention`: the dense formula in
    float64 NumPy, sharing no code with the package's kernels, so that a bug of the
    portable code cannot pass the report by agreeing with itself.
    """
    arrays: dict[str, Any] = {n: rounded(a, dtype).astype(a.dtype) for n, a in case.arrays.items()}
    options = {n: v for n, v in case.options.items() if n not in ("chunk_size", "return_weights")}
    ref = reference_attention(
        arrays.pop("q"), arrays.pop("k"), arrays.pop("v"), **arrays, **options
    )
    return ref.out, ref.weights
