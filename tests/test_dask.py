"""dask.array: ``attend``, ``attend_backward`` and the mask builders build a lazy graph
(nothing is computed before the user computes), which computes what the independent
float64 oracle does, on the threaded scheduler and on a ``dask.distributed`` cluster of
worker processes; arrays of unknown chunk sizes are refused with a message."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import portable_attention as pa
import pytest
from portable_attention import masks

import oracle
from helpers import randn, rng_for

da = pytest.importorskip("dask.array", reason="dask is a test dependency (the test group)")
dask = pytest.importorskip("dask")

B, HQ, HK, L, D = 2, 4, 2, 48, 8
TOL = 1e-12


def _refuse_compute(*args: Any, **kwargs: Any) -> Any:
    msg = "a dask graph was computed during the call"
    raise AssertionError(msg)


def _lazy() -> Any:
    """A scheduler under which any compute (a host read of a dask array) fails."""
    return dask.config.set(scheduler=_refuse_compute)


def _arrays(key: str, chunks: tuple[int, ...] = (1, 1, L, D)) -> tuple[Any, ...]:
    rng = rng_for("dask", key)
    q, k, v = (randn(rng, (B, h, L, D)) for h in (HQ, HK, HK))
    return (q, k, v), tuple(da.from_array(x, chunks=chunks) for x in (q, k, v))


IDS = np.repeat([0, 1, 1, 2, 3, 3], L // 6)[None].repeat(B, 0)


def _band_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return abs(q_idx - kv_idx) <= 7


def _tilt(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score - 0.05 * (q_idx - kv_idx) + 0.1 * h


#: attend's options, with the oracle's spelling where it differs (arrays given as NumPy;
#: the test wraps them in dask arrays for attend).
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "window-softcap": {"window": (5, 2), "softcap": 5.0},
    "chunked-causal-softcap": {"causal": True, "softcap": 5.0, "chunk_size": 16},
    "mask": {"mask": np.random.default_rng(1).random((B, 1, L, L)) > 0.4},
    "bias": {"bias": np.random.default_rng(2).standard_normal((1, HQ, L, L))},
    "segment-ids-causal": {"segment_ids": IDS, "causal": True},
    "segment-ids-chunked": {"segment_ids": IDS, "causal": True, "chunk_size": 16},
    "sinks": {"sinks": np.linspace(-1.0, 1.0, HQ)},
    "score-mod": {"score_mod": _tilt},
    "mask-mod-chunked": {"mask_mod": _band_mod, "chunk_size": 16},
}


def _dask_of(options: dict[str, Any]) -> dict[str, Any]:
    return {
        name: da.from_array(value) if isinstance(value, np.ndarray) else value
        for name, value in options.items()
    }


def _oracle_options(options: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in options.items() if name != "chunk_size"}


@pytest.mark.parametrize("case", list(CASES))
def test_attend_is_lazy_and_matches_the_oracle(case: str) -> None:
    options = CASES[case]
    (q, k, v), (dq, dk, dv) = _arrays(case)
    with _lazy():
        out, lse = pa.attend(dq, dk, dv, return_lse=True, **_dask_of(options))
    assert isinstance(out, da.Array) and isinstance(lse, da.Array)
    assert out.chunks[0] == dq.chunks[0]  # the batch stays chunked as given (heads may be
    # joined into whole groups of the K/V heads)
    ref_out, _, ref_lse = oracle.attention(q, k, v, **_oracle_options(options))
    got_out, got_lse = dask.compute(out, lse, scheduler="threads")
    np.testing.assert_allclose(got_out, ref_out, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got_lse, ref_lse, rtol=TOL, atol=TOL)


def test_weights_and_dropout_are_lazy() -> None:
    """``return_weights`` and dropout (masks from a NumPy Generator, drawn as on NumPy's
    portable path: the same seed gives the same masks)."""
    (q, k, v), (dq, dk, dv) = _arrays("weights")
    with _lazy():
        out, weights = pa.attend(dq, dk, dv, causal=True, return_weights=True)
        dropped = pa.attend(
            dq, dk, dv, dropout=0.3, rng=np.random.default_rng(5), implementation="portable"
        )
    ref_out, ref_weights, _ = oracle.attention(q, k, v, causal=True)
    np.testing.assert_allclose(weights.compute(), ref_weights, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out.compute(), ref_out, rtol=TOL, atol=TOL)
    on_numpy = pa.attend(
        q, k, v, dropout=0.3, rng=np.random.default_rng(5), implementation="portable"
    )
    np.testing.assert_allclose(dropped.compute(), on_numpy, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("case", ["causal", "segment-ids-chunked", "sinks", "mask-mod-chunked"])
def test_attend_backward_is_lazy_and_matches_finite_differences(case: str) -> None:
    options = dict(CASES[case])
    small = {"q": (1, 2, 12, 4), "k": (1, 1, 12, 4)}
    rng = rng_for("dask-backward", case)
    q, k, v = (randn(rng, s) for s in (small["q"], small["k"], small["k"]))
    if "segment_ids" in options:
        options["segment_ids"] = np.repeat([0, 1, 1], 4)[None]
    if "sinks" in options:
        options["sinks"] = np.array([0.5, -0.5])
    w_out = randn(rng, (1, 2, 12, 4))
    dq, dk, dv = (da.from_array(x, chunks=(1, 1, 12, 4)) for x in (q, k, v))
    with _lazy():
        out, lse = pa.attend(dq, dk, dv, return_lse=True, **_dask_of(options))
        grads = pa.attend_backward(da.from_array(w_out), dq, dk, dv, out, lse, **_dask_of(options))
    want = oracle.loss_grads(q, k, v, w_out, **_oracle_options(options))
    for name, got, ref in zip("qkv", dask.compute(*grads[:3]), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=f"d{name}")


def test_sequence_axis_chunked() -> None:
    """Chunks along the sequence (or the head dim) work too: dask joins them where the
    scores need whole rows (see docs/dask.md for what that costs)."""
    (q, k, v), (dq, dk, dv) = _arrays("sequence", chunks=(1, 2, 16, 4))
    with _lazy():
        out = pa.attend(dq, dk, dv, causal=True, chunk_size=16)
    ref, _, _ = oracle.attention(q, k, v, causal=True)
    np.testing.assert_allclose(out.compute(), ref, rtol=TOL, atol=TOL)


def test_mask_builders_are_lazy() -> None:
    lengths = da.from_array(np.array([[5, 0, 7], [12, 0, 0]]))
    cu = da.from_array(np.array([0, 5, 5, 12]))
    padding = da.from_array(np.array([3, 12]))
    with _lazy():
        ids = masks.segment_ids_from_lengths(lengths, total=12)
        from_cu = masks.segment_ids_from_cu_seqlens(cu, total=12)
        keys = masks.key_padding_mask(padding, 12)
        both = masks.combine(masks.segment_mask(ids), keys)  # keys: [B, 1, 1, Lk]
    assert all(isinstance(x, da.Array) for x in (ids, from_cu, keys, both))
    np.testing.assert_array_equal(
        ids.compute(), masks.segment_ids_from_lengths(np.array([[5, 0, 7], [12, 0, 0]]))
    )
    np.testing.assert_array_equal(from_cu.compute(), np.repeat([0, 2], [5, 7]))
    want_keys = np.arange(12) < np.array([[3], [12]])
    np.testing.assert_array_equal(keys.compute(), want_keys[:, None, None, :])
    assert both.compute().shape == (2, 1, 12, 12)


def test_mask_builders_need_total_without_computing() -> None:
    with _lazy(), pytest.raises(ValueError, match=r"`total` is required.*lazy \(a dask array"):
        masks.segment_ids_from_lengths(da.from_array(np.array([3, 4])))


def test_unknown_chunk_sizes_are_refused() -> None:
    x = da.from_array(np.arange(24.0), chunks=8)
    filtered = x[x > 3.0]  # dask cannot know how many remain before computing
    q = filtered[None, None, :, None]
    with pytest.raises(ValueError, match=r"unknown chunk sizes.*compute_chunk_sizes\(\)"):
        pa.attend(q, q, q)


@pytest.fixture(scope="module")
def cluster_client() -> Iterator[Any]:
    distributed = pytest.importorskip("distributed", reason="dask.distributed: a test dependency")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


def test_on_a_cluster_of_worker_processes(cluster_client: Any) -> None:
    """The graph attend builds runs on worker processes (each computing its batch and
    head chunks): the functions it holds (the mods, the kernels) travel by pickle. Built
    lazily (no compute during the calls), with ``attend_backward`` and the mask builders;
    equal to the float64 oracle and to NumPy's ``attend_backward`` to 1e-12."""
    (q, k, v), (dq, dk, dv) = _arrays("cluster")
    w_out = randn(rng_for("dask", "cluster-dout"), q.shape)
    lengths = np.array([[8, 0, 40], [48, 0, 0]])
    with _lazy():
        out = pa.attend(dq, dk, dv, causal=True, softcap=5.0, chunk_size=16)
        ids = masks.segment_ids_from_lengths(da.from_array(lengths), total=L)
        modded, lse = pa.attend(
            dq, dk, dv, segment_ids=ids, mask_mod=_band_mod, causal=True, return_lse=True
        )
        grads = pa.attend_backward(
            da.from_array(w_out), dq, dk, dv, modded, lse,
            segment_ids=ids, mask_mod=_band_mod, causal=True,
        )  # fmt: skip
        scored = pa.attend(dq, dk, dv, segment_ids=da.from_array(IDS), score_mod=_tilt)
    got, got_modded, got_scored, *got_grads = cluster_client.compute(
        [out, modded, scored, *grads[:3]], sync=True
    )
    np_ids = masks.segment_ids_from_lengths(lengths, total=L)
    ref, _, _ = oracle.attention(q, k, v, causal=True, softcap=5.0)
    ref_modded, _, ref_lse = oracle.attention(
        q, k, v, segment_ids=np_ids, mask_mod=_band_mod, causal=True
    )
    ref_scored, _, _ = oracle.attention(q, k, v, segment_ids=IDS, score_mod=_tilt)
    np.testing.assert_allclose(got, ref, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got_modded, ref_modded, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got_scored, ref_scored, rtol=TOL, atol=TOL)
    ref_grads = pa.attend_backward(
        w_out, q, k, v, ref_modded, ref_lse, segment_ids=np_ids, mask_mod=_band_mod, causal=True
    )
    for name, g, want in zip("qkv", got_grads, ref_grads[:3], strict=True):
        np.testing.assert_allclose(g, want, rtol=TOL, atol=TOL, err_msg=f"d{name}")


def test_auto_runs_attend_per_chunk_where_it_can() -> None:
    """Without a mask, bias, mods, dropout or weights, ``auto`` runs ``attend`` on each
    batch/head chunk's NumPy arrays (the sequence axis joined within each), GQA heads
    chunked to match; the rest takes the portable path, and says why."""
    (q, k, v), (dq, dk, dv) = _arrays("per-chunk", chunks=(1, 2, 16, D))
    assert pa.plan(dq, dk, dv, causal=True).path == "per-chunk:dask"
    assert pa.plan(dq, dk, dv, implementation="portable").path == "portable:dense"
    masked = pa.plan(dq, dk, dv, mask=da.from_array(CASES["mask"]["mask"]))
    assert masked.path == "portable:dense" and "mask or bias" in masked.reason
    with _lazy():
        out, lse = pa.attend(dq, dk, dv, causal=True, softcap=5.0, return_lse=True)
    assert out.chunks[:3] == (*dq.chunks[:2], (L,))
    ref_out, _, ref_lse = oracle.attention(q, k, v, causal=True, softcap=5.0)
    np.testing.assert_allclose(out.compute(), ref_out, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lse.compute(), ref_lse, rtol=TOL, atol=TOL)
