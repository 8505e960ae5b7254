"""Array-API libraries beyond the big four that array-api-compat knows, tried with the
real libraries: ndonnx runs eagerly on concrete arrays (its exports: ``test_onnx.py``);
pydata ``sparse`` and ``marray`` are refused with a TypeError that names the argument,
says why and what to pass, from ``attend``, ``plan`` and the mask builders alike."""

from __future__ import annotations

import numpy as np
import portable_attention as pa
import pytest
from portable_attention import masks

import oracle
from helpers import randn, rng_for


def _qkv() -> list[np.ndarray]:
    rng = rng_for("libraries")
    return [randn(rng, (2, h, 9, 8)) for h in (4, 2, 2)]


def test_ndonnx_concrete_arrays_run_eagerly() -> None:
    ndx = pytest.importorskip("ndonnx", reason="ndonnx is a test dependency (the test group)")
    q, k, v = _qkv()
    out = pa.attend(*(ndx.asarray(x) for x in (q, k, v)), causal=True, window=(3, 0))
    assert isinstance(out, ndx.Array) and out.dtype == ndx.float64
    assert tuple(out.shape) == q.shape
    want = oracle.attention(q, k, v, causal=True, window=(3, 0))[0]
    np.testing.assert_allclose(out.unwrap_numpy(), want, rtol=1e-12, atol=1e-12)


def test_pydata_sparse_is_refused_saying_why() -> None:
    sparse = pytest.importorskip("sparse", reason="pydata sparse is a test dependency")
    q, k, v = _qkv()
    s = [sparse.COO.from_numpy(x) for x in (q, k, v)]
    message = r"`q` of type .*COO and shape \(2, 4, 9, 8\) is a pydata sparse array.*todense\(\)"
    with pytest.raises(TypeError, match=message):
        pa.attend(*s)
    with pytest.raises(TypeError, match=message):
        pa.plan(*s, causal=True)
    with pytest.raises(TypeError, match=r"`mask` of type .*COO.*pydata sparse.*`mask.todense\(\)`"):
        pa.attend(q, k, v, mask=sparse.COO.from_numpy(np.ones((9, 9), dtype=bool)))


def test_marray_is_refused_saying_why() -> None:
    marray = pytest.importorskip("marray", reason="marray is a test dependency")
    mxp = marray.masked_namespace(np)
    q, k, v = _qkv()
    arrays = [mxp.asarray(x, mask=np.zeros(x.shape, dtype=bool)) for x in (q, k, v)]
    message = r"`q` of type .*MArray and shape \(2, 4, 9, 8\) is a marray masked array.*`q.data`"
    with pytest.raises(TypeError, match=message):
        pa.attend(*arrays)
    with pytest.raises(TypeError, match=r"`lengths` of type .*MArray"):
        masks.key_padding_mask(mxp.asarray(np.array([3, 9])), 9)
