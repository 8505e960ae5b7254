"""ONNX through ndonnx: ``attend`` and the NumPy multi-head module on ``ndx.argument``
inputs whose batch and lengths are symbolic (None in the array API's shape) build with
``ndx.build`` into one ONNX model, which onnxruntime runs at several shapes, none of them
known when the model was built, equal to the independent float64 oracle; so do
``attend_backward``'s gradients and one array of segment ids; what needs the lengths on
the host (a pair of segment ids, mods, dropout, blocks) is refused with a message."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import attend, attend_backward, mha, plan

import oracle
from helpers import randn, rng_for

ndx = pytest.importorskip("ndonnx", reason="ndonnx is a test dependency (the test group)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a test dependency")

TOL = 1e-12
HQ, D = 4, 16
#: (batch, Lq, Lk) of the runs of one model: lengths 1, Lq > Lk (causal rows with no
#: key) and Lq < Lk among them.
SHAPES = [(1, 1, 1), (3, 9, 9), (2, 12, 5), (1, 6, 31)]


def _session(inputs: dict[str, Any], outputs: dict[str, Any]) -> Any:
    model = ndx.build(inputs, outputs)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


CASES: dict[str, tuple[dict[str, Any], int, str | None]] = {
    # name: (options, Hk, extra input: "mask", "bias" or None)
    "plain": ({}, HQ, None),
    "causal": ({"causal": True}, HQ, None),
    "causal-softcap": ({"causal": True, "softcap": 5.0}, HQ, None),
    "window-upper-left": ({"causal": "upper_left", "window": (3, 1)}, HQ, None),
    "window": ({"window": (2, 4), "scale": 0.3}, HQ, None),
    "gqa-causal-softcap": ({"causal": True, "softcap": 5.0}, 2, None),
    "mqa-window": ({"window": 2}, 1, None),
    "gqa-mask-causal": ({"causal": True}, 2, "mask"),
    "gqa-bias": ({}, 2, "bias"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ndonnx_model_with_symbolic_batch_and_lengths(name: str) -> None:
    options, hk, extra = CASES[name]
    f64 = ndx.float64
    q = ndx.argument(shape=("B", HQ, "Lq", D), dtype=f64)
    k = ndx.argument(shape=("B", hk, "Lk", D), dtype=f64)
    v = ndx.argument(shape=("B", hk, "Lk", D), dtype=f64)
    inputs = {"q": q, "k": k, "v": v}
    given = dict(options)
    if extra == "mask":
        inputs["mask"] = given["mask"] = ndx.argument(shape=("B", 1, "Lq", "Lk"), dtype=ndx.bool)
    elif extra == "bias":
        inputs["bias"] = given["bias"] = ndx.argument(shape=(1, HQ, "Lq", "Lk"), dtype=f64)
    chosen = plan(q, k, v, **given)
    assert chosen.path == "portable:dense", chosen
    assert "symbolic" in chosen.reason, chosen.reason
    out, weights, lse = attend(q, k, v, **given, return_weights=True, return_lse=True)
    run = _session(inputs, {"out": out, "weights": weights, "lse": lse})
    for b, lq, lk in SHAPES:
        rng = rng_for("onnx", name, b, lq, lk)
        feeds = {
            "q": randn(rng, (b, HQ, lq, D)),
            "k": randn(rng, (b, hk, lk, D)),
            "v": randn(rng, (b, hk, lk, D)),
        }
        if extra == "mask":
            feeds["mask"] = rng.random((b, 1, lq, lk)) < 0.7
        elif extra == "bias":
            feeds["bias"] = randn(rng, (1, HQ, lq, lk))
        got = run.run(None, feeds)
        want = oracle.attention(**feeds, **options)
        for what, g, w in zip(("out", "weights", "lse"), got, want, strict=True):
            assert g.dtype == np.float64, (what, g.dtype)
            assert g.shape == w.shape, (what, g.shape, w.shape)
            np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL, err_msg=f"{what} {b, lq, lk}")


def test_ndonnx_model_of_the_multi_head_module() -> None:
    """``mha.MultiHeadAttention`` on ndonnx (grouped heads, causal, a key padding mask of
    the symbolic dims) exports with symbolic batch and length; the model equals the
    NumPy module of the same parameters."""
    module = mha.MultiHeadAttention(32, 4, num_kv_heads=2, xp=ndx, dtype=ndx.float64, seed=3)
    reference = mha.MultiHeadAttention(32, 4, num_kv_heads=2, dtype=np.float64, seed=3)
    x = ndx.argument(shape=("B", "L", 32), dtype=ndx.float64)
    keep = ndx.argument(shape=("B", "L"), dtype=ndx.bool)
    run = _session({"x": x, "keep": keep}, {"out": module(x, causal=True, key_padding_mask=keep)})
    for b, length in ((1, 1), (2, 7), (3, 40)):
        rng = rng_for("onnx", "mha", b, length)
        feeds = {"x": randn(rng, (b, length, 32)), "keep": rng.random((b, length)) < 0.8}
        (got,) = run.run(None, feeds)
        want = reference(feeds["x"], causal=True, key_padding_mask=feeds["keep"])
        assert got.shape == (b, length, 32) and got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_ndonnx_static_shapes_and_two_dim_inputs() -> None:
    """Concrete shapes (``ndx.argument`` of fixed sizes) and 2-D ``[L, D]`` inputs of a
    symbolic length build and run too."""
    q2 = ndx.argument(shape=("L", D), dtype=ndx.float64)
    run = _session({"q": q2}, {"out": attend(q2, q2, q2, causal=True)})
    x = randn(rng_for("onnx", "2d"), (11, D))
    (got,) = run.run(None, {"q": x})
    np.testing.assert_allclose(got, oracle.attention(x, x, x, causal=True)[0], rtol=TOL, atol=TOL)

    q = ndx.argument(shape=(1, HQ, 16, D), dtype=ndx.float64)
    kv = ndx.argument(shape=(1, 2, 16, D), dtype=ndx.float64)
    out = attend(q, kv, kv, causal=True, chunk_size=8)  # static lengths: blocks allowed
    run = _session({"q": q, "kv": kv}, {"out": out})
    rng = rng_for("onnx", "static")
    a, b = randn(rng, (1, HQ, 16, D)), randn(rng, (1, 2, 16, D))
    (got,) = run.run(None, {"q": a, "kv": b})
    np.testing.assert_allclose(got, oracle.attention(a, b, b, causal=True)[0], rtol=TOL, atol=TOL)


#: attend_backward's cases on symbolic dims: (options, Hk, extra inputs).
BACKWARD: dict[str, tuple[dict[str, Any], int, tuple[str, ...]]] = {
    "plain": ({}, HQ, ()),
    "gqa-causal-softcap": ({"causal": True, "softcap": 5.0}, 2, ()),
    "mqa-window-mask": ({"window": (2, 3)}, 1, ("mask",)),
    "gqa-upper-left-bias-dlse": ({"causal": "upper_left"}, 2, ("bias", "dlse")),
    "gqa-causal-sinks": ({"causal": True}, 2, ("sinks",)),
    # one array of ids (packed self-attention): Lq == Lk, the ids compared with themselves
    "gqa-causal-segment-ids": ({"causal": True}, 2, ("segment_ids",)),
    "window-segment-ids": ({"window": (2, 1)}, HQ, ("segment_ids",)),
}


@pytest.mark.parametrize("name", list(BACKWARD))
def test_ndonnx_backward_with_symbolic_batch_and_lengths(name: str) -> None:
    """``attend_backward`` on symbolic dims (the whole score matrix: no blocks of unknown
    lengths) builds into the same kind of model; onnxruntime's gradients at several
    shapes equal NumPy's ``attend_backward`` to 1e-12, and at one shape the oracle's
    finite differences."""
    options, hk, extras = BACKWARD[name]
    f64, d = ndx.float64, 8
    q = ndx.argument(shape=("B", HQ, "Lq", d), dtype=f64)
    k = ndx.argument(shape=("B", hk, "Lk", d), dtype=f64)
    v = ndx.argument(shape=("B", hk, "Lk", d), dtype=f64)
    dout = ndx.argument(shape=("B", HQ, "Lq", d), dtype=f64)
    inputs = {"q": q, "k": k, "v": v, "dout": dout}
    symbolic = {
        "mask": ("B", 1, "Lq", "Lk"),
        "bias": (1, HQ, "Lq", "Lk"),
        "dlse": ("B", HQ, "Lq"),
        "sinks": (HQ,),
        "segment_ids": ("B", "Lq"),
    }
    for extra in extras:
        dtype = {"mask": ndx.bool, "segment_ids": ndx.int64}.get(extra, f64)
        inputs[extra] = ndx.argument(shape=symbolic[extra], dtype=dtype)
    given = {n: x for n, x in inputs.items() if n in ("mask", "bias", "sinks", "segment_ids")}
    assert plan(q, k, v, **options, **given).path == "portable:dense"
    out, lse = attend(q, k, v, **options, **given, return_lse=True)
    grads = attend_backward(dout, q, k, v, out, lse, dlse=inputs.get("dlse"), **options, **given)
    names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in ("bias", "sinks") if n in given]
    wanted = dict(zip(names[1:4], grads[:3], strict=True))
    wanted.update({n: getattr(grads, n) for n in names[4:]})
    run = _session(inputs, {"out": out, **wanted})
    for b, lq, lk in SHAPES:
        if "segment_ids" in given and lq != lk:
            continue
        rng = rng_for("onnx-backward", name, b, lq, lk)
        feeds = {
            "q": randn(rng, (b, HQ, lq, d)),
            "k": randn(rng, (b, hk, lk, d)),
            "v": randn(rng, (b, hk, lk, d)),
            "dout": randn(rng, (b, HQ, lq, d)),
        }
        for extra in extras:
            shape = tuple({"B": b, "Lq": lq, "Lk": lk}.get(s, s) for s in symbolic[extra])
            if extra == "mask":
                feeds[extra] = rng.random(shape) < 0.7
            elif extra == "segment_ids":  # sorted: documents of 0 to 4 positions
                feeds[extra] = np.sort(rng.integers(0, 3, shape), axis=-1)
            else:
                feeds[extra] = randn(rng, shape)
        got = dict(zip(names, run.run(names, feeds), strict=True))
        arrays = {n: feeds[n] for n in ("mask", "bias", "sinks", "segment_ids") if n in feeds}
        oracle_out = oracle.attention(feeds["q"], feeds["k"], feeds["v"], **options, **arrays)[0]
        np.testing.assert_allclose(got["out"], oracle_out, rtol=TOL, atol=TOL)
        ref_out, ref_lse = attend(
            feeds["q"], feeds["k"], feeds["v"], **options, **arrays, return_lse=True
        )
        ref = attend_backward(
            feeds["dout"], feeds["q"], feeds["k"], feeds["v"], ref_out, ref_lse,
            dlse=feeds.get("dlse"), **options, **arrays,
        )  # fmt: skip
        want = {"out": ref_out, "dq": ref.dq, "dk": ref.dk, "dv": ref.dv}
        want.update({n: getattr(ref, n) for n in names[4:]})
        for what in names:
            assert got[what].dtype == np.float64 and got[what].shape == want[what].shape, what
            np.testing.assert_allclose(
                got[what], want[what], rtol=TOL, atol=TOL, err_msg=f"{what} {b, lq, lk}"
            )
        if (b, lq, lk) == ((3, 9, 9) if "segment_ids" in given else (2, 12, 5)):
            # (Lq > Lk: causal rows with no key among them)
            fd = oracle.loss_grads_with_bias(
                feeds["q"], feeds["k"], feeds["v"], feeds["dout"], feeds.get("dlse"),
                **options, **arrays,
            )  # fmt: skip
            for what, ref_fd in fd.items():
                np.testing.assert_allclose(got[f"d{what}"], ref_fd, rtol=1e-6, atol=1e-7)


def test_ndonnx_backward_refuses_dropout_on_symbolic_dims() -> None:
    q = ndx.argument(shape=("B", HQ, "L", D), dtype=ndx.float64)
    out, lse = attend(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match=r"`dropout` builds arrays of the call's lengths"):
        attend_backward(q, q, q, q, out, lse, dropout=0.1, rng=np.random.default_rng(0))


def _mod(b: Any, h: Any, i: Any, j: Any) -> Any:
    return i >= j


def _score(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
    return s - 0.1 * (i - j)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"segment_ids": "pair"},
            r"`segment_ids` builds arrays of the call's lengths.*one array of ids.*needs none",
        ),
        ({"score_mod": _score}, r"`score_mod` builds arrays of the call's lengths.*`bias=`"),
        ({"mask_mod": _mod}, r"`mask_mod` builds arrays of the call's lengths.*`mask=`"),
        ({"dropout": 0.1, "rng": np.random.default_rng(0)}, r"`dropout` builds arrays"),
        ({"chunk_size": 8}, r"`chunk_size=8` walks blocks of static shapes"),
    ],
    ids=["segment_ids-pair", "score_mod", "mask_mod", "dropout", "chunk_size"],
)
def test_ndonnx_unknown_lengths_refuse_what_needs_them(options: dict, message: str) -> None:
    q = ndx.argument(shape=("B", HQ, "L", D), dtype=ndx.float32)
    if options.get("segment_ids") == "pair":
        ids = ndx.argument(shape=("B", "L"), dtype=ndx.int64)
        options = {"segment_ids": (ids, ids)}
    with pytest.raises(ValueError, match=message):
        attend(q, q, q, **options)


def test_ndonnx_unknown_heads_are_refused() -> None:
    q = ndx.argument(shape=("B", "H", "L", D), dtype=ndx.float32)
    with pytest.raises(ValueError, match=r"heads \(axis -3\) and feature sizes .* must be known"):
        attend(q, q, q)


def test_ndonnx_symbolic_batch_refuses_chunk_size_and_ranks_are_checked() -> None:
    """A symbolic batch with fixed lengths: ``chunk_size`` (whose blocks need static
    shapes) is refused by attend and plan alike; q and k of different ranks get the rank
    error, not an IndexError."""
    q = ndx.argument(shape=("B", HQ, 16, D), dtype=ndx.float64)
    for call in (attend, plan):
        with pytest.raises(ValueError, match=r"`chunk_size=8` walks blocks of static shapes"):
            call(q, q, q, chunk_size=8)
    k2 = ndx.argument(shape=("L", D), dtype=ndx.float64)
    with pytest.raises(ValueError, match="same number of dims"):
        attend(ndx.argument(shape=("B", HQ, "L", D), dtype=ndx.float64), k2, k2)
