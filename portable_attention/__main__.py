"""``python -m portable_attention``: run one small attention on every installed framework.

The demo builds a fixed NumPy example, prints the output and the attention weights of
``attend``, then passes the same inputs as PyTorch and JAX arrays (each only if it is
installed) through the same ``attend`` and checks that every framework agrees with
NumPy. Exit status 0 when all agree, 1 when one disagrees beyond ``TOLERANCE``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from portable_attention import attend

TOLERANCE = 1e-5
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


def _torch() -> Framework:
    import torch

    def to_torch(a: Array) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a))

    def to_numpy(t: Any) -> Array:
        return np.asarray(t.detach().cpu().numpy())

    return f"torch {torch.__version__}", to_torch, to_numpy


def _jax() -> Framework:
    # The demo runs on the CPU and should not probe for (and warn about) accelerators.
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    def to_jax(a: Array) -> Any:
        return jnp.asarray(a)

    def to_numpy(x: Any) -> Array:
        return np.asarray(x)

    return f"jax {jax.__version__}", to_jax, to_numpy


# Imported lazily, and only when installed. (CuPy is not tried: it needs a GPU.)
FRAMEWORKS: dict[str, Callable[[], Framework]] = {"torch": _torch, "jax": _jax}


def _max_abs_diff(a: Array, b: Array) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def _verdict(diff: float) -> str:
    return "agree" if diff <= TOLERANCE else "DISAGREE"  # NaN disagrees too


def demo() -> int:
    """Print the NumPy example and check every installed framework against it."""
    q, k, v, mask = _example()
    out, weights = attend(q, k, v, mask=mask, return_weights=True)
    out, weights = np.asarray(out), np.asarray(weights)

    print(f"portable_attention {_version()}: attend(q, k, v, mask=mask, return_weights=True)")
    print(f"q, k, v: float32 [B={B}, H={H}, L={L}, D={D}], seed {SEED}")
    print(f"mask: bool [{L}, {L}], True = may attend (lower triangle: causal)")
    with np.printoptions(precision=4, suppress=True, floatmode="fixed", linewidth=100):
        print(f"\nNumPy weights {list(weights.shape)} (each row sums to 1; 0 = masked key):")
        print(weights)
        print(f"\nNumPy output {list(out.shape)}:")
        print(out)
    print()

    failures = 0
    compared: list[str] = []

    # The same mask said with `causal=True` (lower-right; equal to the triangle when Lq == Lk).
    diff = _max_abs_diff(np.asarray(attend(q, k, v, causal=True)), out)
    print(f"{'numpy causal=True':<20} max |out - mask=tril| = {diff:.1e}  {_verdict(diff)}")
    failures += _verdict(diff) != "agree"

    for name, load in FRAMEWORKS.items():
        if importlib.util.find_spec(name) is None:
            print(f"{name:<20} not installed, skipped")
            continue
        label, to_native, to_numpy = load()
        f_out, f_weights = attend(
            to_native(q), to_native(k), to_native(v), mask=to_native(mask), return_weights=True
        )
        d_out = _max_abs_diff(to_numpy(f_out), out)
        d_weights = _max_abs_diff(to_numpy(f_weights), weights)
        verdict = _verdict(max(d_out, d_weights))
        print(
            f"{label:<20} max |out - numpy| = {d_out:.1e}, "
            f"max |weights - numpy| = {d_weights:.1e}  {verdict}"
        )
        failures += verdict != "agree"
        compared.append(name)

    if failures:
        print(f"\n{failures} check(s) disagree beyond {TOLERANCE:g}.", file=sys.stderr)
        return 1
    if compared:
        print(f"\nNumPy, {' and '.join(compared)} agree within {TOLERANCE:g}.")
    else:
        print("\nOnly NumPy is installed: install torch or jax to compare frameworks.")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m portable_attention",
        description=(
            "Run one small attention through portable_attention.attend on NumPy and on "
            "every installed framework (torch, jax), print it, and check they agree "
            f"(exit 1 if any differs by more than {TOLERANCE:g})."
        ),
    )
    parser.add_argument("--version", action="version", version=f"portable_attention {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("demo", help="the cross-framework example (the default)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m portable_attention``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        return demo()
    parser.error(f"unknown command {args.command!r}")  # argparse exits with status 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
