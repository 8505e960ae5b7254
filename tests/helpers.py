"""Small helpers shared by the test modules (of the package, only its testing tools:
the one tolerance table)."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from typing import Any

import array_api_compat
import numpy as np
from array_api_extra.testing import assert_equal
from portable_attention.testing import to_numpy, tolerance

from conftest import Backend, compute_dtype_name


def rng_for(*key: object) -> np.random.Generator:
    """A NumPy Generator seeded stably from ``key`` (independent of test order)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randn(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape)


def assert_like(
    result: Any, like: Any, *, shape: tuple[int, ...], dtype: Any, name: str = "result"
) -> None:
    """Assert ``result`` is an array of ``like``'s framework (same type and namespace), on the
    same device, with the given shape and dtype."""
    assert type(result) is type(like), f"{name}: type {type(result)} != {type(like)}"
    ns = array_api_compat.array_namespace(result)
    assert ns is array_api_compat.array_namespace(like), f"{name}: namespace {ns}"
    assert result.dtype == dtype, f"{name}: dtype {result.dtype} != {dtype}"
    assert tuple(result.shape) == tuple(shape), f"{name}: shape {tuple(result.shape)} != {shape}"
    dev, want = array_api_compat.device(result), array_api_compat.device(like)
    assert dev == want, f"{name}: device {dev} != {want}"


def assert_same(actual: Any, desired: Any) -> None:
    """Two arrays of one framework are equal, in its namespace: the same type, dtype,
    shape and values (``array_api_extra.testing.assert_equal``; NaN equals NaN).
    bfloat16, which array-api-extra cannot take through DLPack to NumPy, is compared
    after ``to_numpy`` (ml_dtypes), its type, dtype and shape checked first."""
    if "bfloat16" not in str(actual.dtype):
        assert_equal(actual, desired)
        return
    assert type(actual) is type(desired), (type(actual), type(desired))
    assert actual.dtype == desired.dtype and tuple(actual.shape) == tuple(desired.shape)
    np.testing.assert_array_equal(to_numpy(actual), to_numpy(desired))


def assert_close(
    actual: np.ndarray, expected: np.ndarray, dtype_name: str, *, what: str = "out"
) -> None:
    """``actual`` within the package's tolerance for output ``what`` of a ``dtype_name``
    call (``what`` names the lse, the weights, or anything else: a gradient, compared as
    the output is)."""
    rtol, atol = tolerance(dtype_name, what if what in ("weights", "lse") else "out")
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def check_against_oracle(
    backend: Backend,
    dtype_name: str,
    q: Any,
    result: tuple[Any, Any | None, Any | None],
    ref: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """Check ``(out, weights, lse)`` (weights/lse may be None when not asked for) against the
    oracle's float64 values: framework, device, dtype, shape, values, and exact 0 / 0 / -inf
    on rows with no key."""
    out, weights, lse = result
    ref_out, ref_w, ref_lse = ref
    dt = backend.dtype(dtype_name)
    empty = np.isneginf(ref_lse)

    assert_like(out, q, shape=ref_out.shape, dtype=dt, name="out")
    out_np = backend.to_numpy(out)
    assert np.all(np.isfinite(out_np)), "out has non-finite values"
    # Rows with no key: exactly 0 output.
    assert np.all(out_np[empty] == 0.0), "out not exactly 0 on rows with no key"
    assert_close(out_np, ref_out, dtype_name, what="out")

    if weights is not None:
        assert_like(weights, q, shape=ref_w.shape, dtype=dt, name="weights")
        w_np = backend.to_numpy(weights)
        assert np.all(np.isfinite(w_np)), "weights have non-finite values"
        assert np.all(w_np[empty] == 0.0), "weights not exactly 0 on rows with no key"
        assert np.all(w_np[ref_w == 0.0] == 0.0), "nonzero weight at a masked position"
        assert_close(w_np, ref_w, dtype_name, what="weights")

    if lse is not None:
        lse_dt = backend.dtype(compute_dtype_name(dtype_name))
        assert_like(lse, q, shape=ref_lse.shape, dtype=lse_dt, name="lse")
        lse_np = backend.to_numpy(lse)
        assert not np.any(np.isnan(lse_np)), "lse has NaN"
        np.testing.assert_array_equal(np.isneginf(lse_np), empty, err_msg="lse -inf rows")
        assert_close(lse_np[~empty], ref_lse[~empty], dtype_name, what="lse")


def run_python(code: str, *, timeout: float = 300) -> str:
    """Run ``code`` in a fresh interpreter (the tests folder importable) and return its
    stdout; a failure shows the end of its stderr. For what needs a fresh process: flags
    read when a framework starts, ``fork``, a first trace."""
    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# How far a multi-head result in `dtype` may be from the float64 oracle (tests/test_mha.py and
# tests/test_flax_mha.py): a first-order bound from the computation, not what passed on one CPU. The
# tolerance table covers attend's own arithmetic on the projected q, k, v. The products
# around it have length n <= E = 16 (kdim, vdim <= 16), and whatever the summation order,
# vector width or FMA use, a dot product errs by at most n * u * sum_i |x_i w_i| (u = 2**-24
# in float32, 2**-53 in float64; Higham, Accuracy and Stability of Numerical Algorithms,
# sec. 3.1). With the rounding of the inputs and the bias: (n + 3) * u * M, where
# M = max(sum_i |x_i w_i| + |b|) = 7.0 at most for these tests' seeded inputs (x ~ N(0, 1),
# Xavier weights, |b| <= 0.3). A score q.k / sqrt(D) then moves by at most S = 8.5 times that
# (S = max(|q|_1 + |k|_1) / sqrt(D) here), a softmax weight by twice that, relatively:
# rho = 2 * S * (n + 3) * M * u (1.35e-4 in float32), added to the table's rtol and, per unit
# of output (|out| < 2.3 here), to its atol.
_MHA_STEPS = 2 * 8.5 * (16 + 3) * 7.0  # rho / u
MHA_TOL = {
    dt: (tolerance(dt).rtol + _MHA_STEPS * u, tolerance(dt).atol + _MHA_STEPS * u)
    for dt, u in (("float64", 2.0**-53), ("float32", 2.0**-24))
}
# Composed computations compared with each other (a module against torch's, one framework
# against another, compiled against eager, packed against alone) run in float64, where the
# same chain bounds both sides' rounding by MHA_TOL["float64"] (to first order; the encoder
# stack's feed-forward and norms lie outside it, inside the float64 slack); in float32 that
# rounding differs between CPUs. Gradients go back through the same products (twice the steps) and
# sum over batch and positions (values up to 30x the outputs): 10x that, GRAD64.
GRAD64 = (10 * MHA_TOL["float64"][0], 10 * MHA_TOL["float64"][1])


class Capture:
    """What a user's mod captures (a batch's document ids, say): weakly referable, so a
    test can see whether anything still holds it after a call."""

    def __init__(self, value: Any) -> None:
        self.value = value
