"""Exports with dynamic shapes: ``torch.export`` with ``Dim``s and ``jax.export`` with
``symbolic_shape``. The exported program is right for every value of its dimensions
(checked at lengths other than the example's, ``Lq != Lk`` and rows with no key included,
against the independent float64 oracle); ``plan()`` says why it took the path it took;
``chunk_size`` with a symbolic length is refused with a message."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import attend, plan

import oracle
from conftest import requires_backend
from helpers import randn, rng_for

TOL = 1e-12
#: (options, the path an export with dynamic lengths takes on torch)
OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({}, "fused:torch"),
    ({"causal": True}, "fused:torch"),
    ({"causal": "upper_left", "window": (4, 2)}, "fused:torch"),
    ({"causal": True, "softcap": 20.0}, "portable:dense"),
    ({"window": (8, 0), "scale": 0.3}, "fused:torch"),
]
#: (Lq, Lk) of the calls of the exported program: none is the example's (3, 40).
LENGTHS = [(1, 100), (7, 300), (300, 7), (50, 50)]


def _inputs(lq: int, lk: int, batch: int = 2) -> tuple[np.ndarray, ...]:
    rng = rng_for("export", lq, lk, batch)
    return (
        randn(rng, (batch, 4, lq, 16)),
        randn(rng, (batch, 2, lk, 16)),
        randn(rng, (batch, 2, lk, 16)),
    )


def _oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict[str, Any]) -> np.ndarray:
    return oracle.attention(q, k, v, **options)[0]


@requires_backend("torch")
@pytest.mark.parametrize(("options", "path"), OPTIONS, ids=lambda x: repr(x))
def test_torch_export_with_dynamic_lengths(options: dict[str, Any], path: str) -> None:
    import torch

    plans = []

    class Module(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            plans.append(plan(q, k, v, **options))
            return attend(q, k, v, **options)

    batch, lq = torch.export.Dim("B", max=64), torch.export.Dim("Lq", max=8192)
    lk = torch.export.Dim("Lk", min=2, max=8192)
    dims = {"q": {0: batch, 2: lq}, "k": {0: batch, 2: lk}, "v": {0: batch, 2: lk}}
    example = [torch.from_numpy(x) for x in _inputs(3, 40)]
    program = torch.export.export(Module(), tuple(example), dynamic_shapes=dims)
    assert plans[-1].path == path, plans[-1]
    if path == "portable:dense":
        assert "symbolic" in plans[-1].reason, plans[-1].reason
    run = program.module()
    for n_q, n_k in LENGTHS:
        arrays = _inputs(n_q, n_k, batch=3)
        got = run(*(torch.from_numpy(x) for x in arrays)).numpy()
        np.testing.assert_allclose(got, _oracle(*arrays, options), rtol=TOL, atol=TOL)


@requires_backend("torch")
def test_torch_export_refuses_chunks_of_a_dynamic_length() -> None:
    import torch

    class Module(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            return attend(q, k, v, causal=True, chunk_size=16)

    length = torch.export.Dim("L", min=2, max=4096)
    dims = {name: {2: length} for name in "qkv"}
    q = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"`chunk_size=16` walks blocks of static shapes"):
        torch.export.export(Module(), (q, q, q), dynamic_shapes=dims)
    # Static lengths export with chunks as before.
    program = torch.export.export(Module(), (q, q, q))
    want = oracle.attention(q.numpy(), q.numpy(), q.numpy(), causal=True)[0]
    np.testing.assert_allclose(program.module()(q, q, q).numpy(), want, rtol=TOL, atol=TOL)


@requires_backend("jax")
@pytest.mark.parametrize("options", [o for o, _ in OPTIONS], ids=repr)
def test_jax_export_with_symbolic_shapes(options: dict[str, Any]) -> None:
    import jax
    import jax.numpy as jnp
    from jax import export

    plans = []

    def f(q: Any, k: Any, v: Any) -> Any:
        plans.append(plan(q, k, v, **options))
        return attend(q, k, v, **options)

    b, lq, lk = export.symbolic_shape("B, Lq, Lk")  # one scope for the three
    q_spec = jax.ShapeDtypeStruct((b, 4, lq, 16), jnp.float64)
    k_spec = jax.ShapeDtypeStruct((b, 2, lk, 16), jnp.float64)
    program = export.export(jax.jit(f))(q_spec, k_spec, k_spec)
    assert plans[-1].path == "portable:dense", plans[-1]  # jax.nn is not auto's on the CPU
    assert "symbolic" in plans[-1].reason, plans[-1].reason
    for n_q, n_k in LENGTHS:
        arrays = _inputs(n_q, n_k, batch=3)
        got = np.asarray(program.call(*(jnp.asarray(x) for x in arrays)))
        np.testing.assert_allclose(got, _oracle(*arrays, options), rtol=TOL, atol=TOL)


@requires_backend("jax")
def test_jax_export_gradient_with_symbolic_shapes() -> None:
    """The exported gradient of a loss through ``attend`` (the dense path's autodiff)
    equals the oracle's finite differences at a length the export never saw."""
    import jax
    import jax.numpy as jnp
    from jax import export

    options = {"causal": True, "softcap": 5.0}

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(attend(q, k, v, **options) ** 2)

    spec = jax.ShapeDtypeStruct(export.symbolic_shape("1, 2, L, 8"), jnp.float64)
    program = export.export(jax.jit(jax.grad(loss)))(spec, spec, spec)
    rng = rng_for("export", "grad")
    q, k, v = (randn(rng, (1, 2, 9, 8)) for _ in range(3))
    got = np.asarray(program.call(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))

    def f() -> float:
        return float(np.sum(oracle.attention(q, k, v, **options)[0] ** 2))

    np.testing.assert_allclose(got, oracle.numerical_grad(f, q), rtol=1e-6, atol=1e-6)


def _packed_ids(batch: int, length: int, cuts: tuple[int, ...]) -> np.ndarray:
    ids = np.zeros((batch, length), dtype=np.int64)
    for cut in cuts:
        ids[:, cut:] += 1
    return ids


@requires_backend("torch")
def test_torch_export_segment_ids_and_the_module_with_dynamic_lengths() -> None:
    """Packed documents (segment ids of the traced length) and the torch module, exported
    with a dynamic length, at lengths and packings the example did not have."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention

    class Packed(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any, ids: Any) -> Any:
            return attend(q, k, v, causal=True, segment_ids=ids)

    length = torch.export.Dim("L", min=2, max=4096)
    dims = {"q": {2: length}, "k": {2: length}, "v": {2: length}, "ids": {1: length}}
    q, k, v = (torch.from_numpy(x) for x in _inputs(40, 40))
    ids = torch.from_numpy(_packed_ids(2, 40, (30,)))
    run = torch.export.export(Packed(), (q, k, v, ids), dynamic_shapes=dims).module()
    for n, cuts in ((2, (1,)), (100, (17, 60, 61)), (257, (0, 100))):
        arrays = _inputs(n, n)
        packed = _packed_ids(2, n, cuts)
        got = run(*(torch.from_numpy(x) for x in (*arrays, packed))).numpy()
        want = oracle.attention(*arrays, causal=True, segment_ids=packed)[0]
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)

    torch.manual_seed(0)
    module = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=torch.float64)
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    batch = torch.export.Dim("B", max=64)
    program = torch.export.export(module, (x,), dynamic_shapes=({0: batch, 1: length},))
    for shape in ((1, 2), (3, 77), (2, 300)):
        x2 = torch.randn(*shape, 32, dtype=torch.float64)
        with torch.no_grad():
            np.testing.assert_allclose(
                program.module()(x2).numpy(), module(x2).numpy(), rtol=TOL, atol=TOL
            )


@requires_backend("jax")
def test_jax_export_segment_ids_and_the_module_with_symbolic_shapes() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax import export
    from portable_attention.nn.flax import MultiHeadAttention

    b, length = export.symbolic_shape("B, L")
    spec = jax.ShapeDtypeStruct((b, 2, length, 16), jnp.float64)
    ids_spec = jax.ShapeDtypeStruct((b, length), jnp.int64)

    def packed(q: Any, k: Any, v: Any, ids: Any) -> Any:
        return attend(q, k, v, causal=True, segment_ids=ids)

    program = export.export(jax.jit(packed))(spec, spec, spec, ids_spec)
    rng = rng_for("export", "jax-packed")
    for batch, n, cuts in ((1, 1, ()), (3, 90, (5, 44, 45)), (2, 200, (0, 150))):
        arrays = [randn(rng, (batch, 2, n, 16)) for _ in range(3)]
        ids = _packed_ids(batch, n, cuts)
        got = np.asarray(program.call(*(jnp.asarray(x) for x in (*arrays, ids))))
        want = oracle.attention(*arrays, causal=True, segment_ids=ids)[0]
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)

    module = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=jnp.float64, rngs=nnx.Rngs(0))
    graph, state = nnx.split(module)

    def forward(state: Any, x: Any) -> Any:
        return nnx.merge(graph, state)(x, causal=True)

    x_spec = jax.ShapeDtypeStruct((b, length, 32), jnp.float64)
    state_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    program = export.export(jax.jit(forward))(state_spec, x_spec)
    for shape in ((1, 1), (2, 61), (3, 130)):
        x = jnp.asarray(randn(rng, (*shape, 32)))
        np.testing.assert_allclose(
            np.asarray(program.call(state, x)),
            np.asarray(module(x, causal=True)),
            rtol=TOL,
            atol=TOL,
        )


@requires_backend("torch")
def test_torch_onnx_export_with_a_dynamic_length_runs_in_onnxruntime() -> None:
    """``torch.onnx.export(dynamo=True)`` of ``attend`` (softcap: the portable dense path;
    a window: SDPA with the band as a mask) and of the torch module, with a dynamic
    length, run by onnxruntime at lengths other than the example's."""
    import torch
    from portable_attention.nn.torch import MultiHeadAttention
    from portable_attention.testing import tolerance

    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a test dependency")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    rtol, atol = tolerance("float32")

    def session(module: Any, args: tuple[Any, ...], dims: Any) -> Any:
        program = torch.onnx.export(module, args, dynamic_shapes=dims, dynamo=True)
        return ort.InferenceSession(program.model_proto.SerializeToString())

    length = torch.export.Dim("L", min=2, max=4096)
    for options in ({"causal": True, "softcap": 20.0}, {"window": (8, 0)}):

        class Attend(torch.nn.Module):
            def forward(self, q: Any, k: Any, v: Any, options: Any = options) -> Any:
                return attend(q, k, v, **options)

        example = tuple(torch.from_numpy(x.astype(np.float32)) for x in _inputs(40, 40))
        dims = {name: {2: length} for name in "qkv"}
        run = session(Attend(), example, dims)
        names = [i.name for i in run.get_inputs()]
        for n in (9, 300):
            arrays = [x.astype(np.float32) for x in _inputs(n, n)]
            got = run.run(None, dict(zip(names, arrays, strict=True)))[0]
            want = oracle.attention(*arrays, **options)[0]
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)

    torch.manual_seed(0)  # the module composes three products: compared in float64
    module = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=torch.float64).eval()
    run = session(module, (torch.randn(2, 50, 32, dtype=torch.float64),), ({1: length},))
    x = np.random.default_rng(0).standard_normal((2, 77, 32))
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    got = run.run(None, {run.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@requires_backend("torch")
def test_torch_export_masks_ids_and_chunks_with_a_dynamic_batch() -> None:
    """torch.export names each input's dimension apart, even where inputs share one
    ``Dim``: a mask and segment ids of dynamic batch and lengths still broadcast (their
    equality is a guard the export checks), and ``chunk_size`` runs where only the batch
    is dynamic (the lengths, which its blocks need, are static)."""
    import torch

    batch = torch.export.Dim("B", max=64)
    lq, lk = torch.export.Dim("Lq", min=2, max=4096), torch.export.Dim("Lk", min=2, max=4096)

    class Masked(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any, mask: Any) -> Any:
            return attend(q, k, v, mask=mask, causal=True)

    def masked_inputs(b: int, n_q: int, n_k: int) -> list[np.ndarray]:
        q, k, v = _inputs(n_q, n_k, batch=b)
        return [q, k, v, rng_for("export", "mask", b).random((b, 1, n_q, n_k)) < 0.7]

    dims = {"q": {0: batch, 2: lq}, "k": {0: batch, 2: lk}, "v": {0: batch, 2: lk}}
    dims["mask"] = {0: batch, 2: lq, 3: lk}
    example = tuple(torch.from_numpy(x) for x in masked_inputs(2, 30, 40))
    run = torch.export.export(Masked(), example, dynamic_shapes=dims).module()
    q, k, v, mask = masked_inputs(3, 70, 90)
    got = run(*(torch.from_numpy(x) for x in (q, k, v, mask))).numpy()
    want = oracle.attention(q, k, v, mask=mask, causal=True)[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)

    class Packed(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any, ids: Any) -> Any:
            return attend(q, k, v, causal=True, segment_ids=ids)

    length = torch.export.Dim("L", min=2, max=4096)
    dims = {name: {0: batch, 2: length} for name in "qkv"}
    dims["ids"] = {0: batch, 1: length}
    q, k, v = _inputs(40, 40)
    example = (
        *(torch.from_numpy(x) for x in (q, k, v)),
        torch.from_numpy(_packed_ids(2, 40, (20,))),
    )
    run = torch.export.export(Packed(), example, dynamic_shapes=dims).module()
    arrays = _inputs(77, 77, batch=3)
    ids = _packed_ids(3, 77, (11, 50))
    got = run(*(torch.from_numpy(x) for x in (*arrays, ids))).numpy()
    want = oracle.attention(*arrays, causal=True, segment_ids=ids)[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)

    class Chunked(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            return attend(q, k, v, causal=True, chunk_size=16)

    example = tuple(torch.from_numpy(x) for x in _inputs(64, 64))
    run = torch.export.export(
        Chunked(), example, dynamic_shapes={name: {0: batch} for name in "qkv"}
    ).module()
    arrays = _inputs(64, 64, batch=5)
    got = run(*(torch.from_numpy(x) for x in arrays)).numpy()
    np.testing.assert_allclose(got, _oracle(*arrays, {"causal": True}), rtol=TOL, atol=TOL)
