"""``python -m portable_attention``: the consistency report, the demo and the benchmark.

Without a command (or with ``report``) it runs the cross-framework consistency report of
:mod:`portable_attention._report` (``--help`` lists its options).

``python -m portable_attention demo`` builds a fixed NumPy example, prints the output and
the attention weights of ``attend``, then passes the same inputs as PyTorch and JAX arrays
(each only if it is installed) through the same ``attend``, once with
``return_weights=True`` and once without (where ``implementation="auto"`` may pick the
framework's fused kernel), and checks every result against NumPy, naming the path
``plan()`` chose. Exit status 0 when all agree, 1 when one disagrees beyond float32's
tolerance of the package's one table (``RTOL``, ``ATOL``:
:func:`portable_attention.testing.tolerance`).

``python -m portable_attention bench`` hands its arguments to ``_bench.main``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from portable_attention import attend, plan
from portable_attention.testing import tolerance

#: The demo's results are float32: they agree where ``|x - ref| <= ATOL + RTOL * |ref|``.
RTOL, ATOL = tolerance("float32")
BOUND = f"atol={ATOL:g} + rtol={RTOL:g} * |NumPy's|"
DEMO_HELP = (
    "Run one small attention (float32, causal, [B=1, H=2, L=4, D=8]) through attend on NumPy "
    "and print its output and weights; run the same inputs as torch and jax arrays (where "
    "installed) and print how far each is from NumPy, and the path plan() chose. Exit "
    f"status 1 if any differs by more than {BOUND} (the package's float32 tolerance)."
)
SEED = 0
B, H, L, D = 1, 2, 4, 8

Array = npt.NDArray[Any]
# name -> (label, numpy -> native array, native array -> numpy)
Framework = tuple[str, Callable[[Array], Any], Callable[[Any], Array]]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("portable-attention")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "(not installed)"


def _example() -> tuple[Array, Array, Array, Array]:
    rng = np.random.default_rng(SEED)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
    # True = may attend. The lower triangle: query i sees keys j <= i (causal).
    mask = np.tril(np.ones((L, L), dtype=bool))
    return q, k, v, mask


def _framework(name: str) -> Framework:
    """``name``'s label and conversions (through ``testing._convert``, the package's one place)."""
    from portable_attention.testing import _convert

    if name == "jax" and "jax" not in sys.modules:
        # The demo runs on the CPU and should not probe for (and warn about) accelerators.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    version = getattr(importlib.import_module(name), "__version__", "")

    def to_native(a: Array) -> Any:
        return _convert.to_backend(np.ascontiguousarray(a), name)

    return f"{name} {version}", to_native, _convert.to_numpy


def _torch() -> Framework:
    return _framework("torch")


def _jax() -> Framework:
    return _framework("jax")


# Imported lazily, and only when installed. (CuPy is not tried: it needs a GPU.)
FRAMEWORKS: dict[str, Callable[[], Framework]] = {"torch": _torch, "jax": _jax}


def _max_abs_diff(a: Array, b: Array) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _excess(a: Array, ref: Array) -> float:
    """The largest ``|a - ref| - RTOL * |ref|``: what ``ATOL`` must cover (inf for a shape
    mismatch, NaN for a NaN)."""
    if a.shape != ref.shape:
        return float("inf")
    a64, r64 = a.astype(np.float64), ref.astype(np.float64)
    return float(np.max(np.abs(a64 - r64) - RTOL * np.abs(r64)))


def _verdict(*excess: float) -> str:
    """``agree`` when every output's :func:`_excess` is at most ``ATOL``."""
    return "agree" if all(e <= ATOL for e in excess) else "DISAGREE"  # NaN disagrees too


def _check(
    label: str,
    to_numpy: Callable[[Any], Array],
    args: tuple[Any, Any, Any],
    ref_out: Array,
    ref_weights: Array,
    **kwargs: Any,
) -> bool:
    """Run ``attend(*args, **kwargs)``, print one row against the reference; True if it agrees."""
    call = ", ".join(key if key == "mask" else f"{key}={value!r}" for key, value in kwargs.items())
    path = plan(*args, **kwargs).path
    result = attend(*args, **kwargs)
    if kwargs.get("return_weights"):
        out, weights = to_numpy(result[0]), to_numpy(result[1])
        d_out, d_weights = _max_abs_diff(out, ref_out), _max_abs_diff(weights, ref_weights)
        w_text = f"{d_weights:.1e}"
        verdict = _verdict(_excess(out, ref_out), _excess(weights, ref_weights))
    else:
        out = to_numpy(result)
        d_out, w_text = _max_abs_diff(out, ref_out), "-"
        verdict = _verdict(_excess(out, ref_out))  # not max(): max(0.0, nan) is 0.0
    print(f"{label:<18} {call:<26} {path:<14} {d_out:>13.1e} {w_text:>11}  {verdict}")
    return verdict == "agree"


def demo() -> int:
    """Print the NumPy example and check every installed framework against it."""
    q, k, v, mask = _example()
    out, weights = attend(q, k, v, mask=mask, return_weights=True)
    out, weights = np.asarray(out), np.asarray(weights)

    ref_path = plan(q, k, v, mask=mask, return_weights=True).path
    print(f"portable_attention {_version()}: attend(q, k, v, mask=mask, return_weights=True)")
    print(f"NumPy path: {ref_path}")
    print(f"q, k, v: float32 [B={B}, H={H}, L={L}, D={D}], seed {SEED}")
    print(f"mask: bool [{L}, {L}], True = may attend (lower triangle: causal)")
    with np.printoptions(precision=4, suppress=True, floatmode="fixed", linewidth=100):
        print(f"\nNumPy weights {list(weights.shape)} (each row sums to 1; 0 = masked key):")
        print(weights)
        print(f"\nNumPy output {list(out.shape)}:")
        print(out)

    # Each row: one call, the path plan() names for it, and its distance from the NumPy
    # result above. Without return_weights, `auto` may take the framework's fused kernel.
    print(f"\n{'arrays':<18} {'call':<26} {'path':<14} {'max|out diff|':>13} {'max|w diff|':>11}")
    # The same mask said as `causal=True` (lower-right; the triangle when Lq == Lk).
    failures = int(not _check("numpy", np.asarray, (q, k, v), out, weights, causal=True))
    compared: list[str] = []
    for name, load in FRAMEWORKS.items():
        if importlib.util.find_spec(name) is None:
            print(f"{name:<18} not installed, skipped")
            continue
        label, to_native, to_numpy = load()
        args = (to_native(q), to_native(k), to_native(v))
        f_mask = to_native(mask)
        failures += not _check(
            label, to_numpy, args, out, weights, mask=f_mask, return_weights=True
        )
        failures += not _check(label, to_numpy, args, out, weights, mask=f_mask)
        compared.append(name)

    if failures:
        print(f"\n{failures} check(s) disagree beyond {BOUND}.", file=sys.stderr)
        return 1
    if compared:
        print(f"\nNumPy, {' and '.join(compared)} agree within {BOUND}.")
    else:
        print("\nOnly NumPy is installed: install torch or jax to compare frameworks.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m portable_attention``; returns the exit status.

    ``demo`` runs :func:`demo`, ``bench ...`` hands the rest to ``_bench.main``; anything
    else (no command at all, or options) runs the consistency report,
    :func:`portable_attention._report.main`.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:  # the benchmark parses its own options
        from portable_attention import _bench

        return _bench.main(arguments[1:])
    if arguments[:1] == ["demo"]:
        if arguments[1:] and arguments[1] in ("-h", "--help"):
            print("usage: python -m portable_attention demo\n\n" + DEMO_HELP)
            return 0
        if arguments[1:]:
            msg = f"python -m portable_attention demo: takes no arguments, got {arguments[1:]}"
            print(msg, file=sys.stderr)
            return 2
        return demo()
    if arguments[:1] == ["report"]:
        arguments = arguments[1:]
    from portable_attention import _report

    return _report.main(arguments)


if __name__ == "__main__":
    sys.exit(main())
