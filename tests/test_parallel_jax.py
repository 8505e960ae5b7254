"""portable_attention.parallel on 8 simulated JAX devices: ring and Ulysses against
single-device ``attend`` (values, lse and gradients), layouts on sharded arrays of
Explicit and Auto meshes, the compiled collectives, and memory that grows linearly in L.

The devices exist only where ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` was
set before JAX was imported: ``nox -s parallel`` does so (and sets
``PORTABLE_ATTENTION_PARALLEL=1``, under which fewer devices fail the run instead of
skipping it).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np
import pytest

from conftest import BY_NAME, TOLERANCES
from helpers import Capture, rng_for

DEVICES = 8
IN_SESSION = os.environ.get("PORTABLE_ATTENTION_PARALLEL") == "1"

if "jax" not in BY_NAME:
    if IN_SESSION:
        msg = "PORTABLE_ATTENTION_PARALLEL=1 but the jax backend is not selected"
        raise RuntimeError(msg)
    pytest.skip("the jax backend is not selected", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import portable_attention as pa  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from portable_attention import parallel  # noqa: E402

if jax.device_count() < DEVICES:
    why = (
        f"needs {DEVICES} JAX devices (has {jax.device_count()}): set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX is imported, "
        "as `nox -s parallel` does"
    )
    if IN_SESSION:
        raise RuntimeError(why)
    pytest.skip(why, allow_module_level=True)

SEQ = P(None, None, "s", None)


@functools.cache
def mesh_of(shards: int, kind: str = "explicit") -> Any:
    types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
    return jax.make_mesh((shards,), ("s",), axis_types=types, devices=jax.devices()[:shards])


def _inputs(
    key: object, dtype: Any, hq: int, hk: int, lq: int, lk: int, *, dk: int = 8, dv: int = 6
) -> tuple[Any, ...]:
    """q, k, v and random cotangents for out and lse (float64 data cast to ``dtype``)."""
    rng = rng_for("parallel-jax", key)
    shapes = [(2, hq, lq, dk), (2, hk, lk, dk), (2, hk, lk, dv), (2, hq, lq, dv), (2, hq, lq)]
    return tuple(jnp.asarray(rng.standard_normal(s)).astype(dtype) for s in shapes)


def _with_vjp(fn: Any) -> Any:
    """``(q, k, v, dout, dlse) -> (out, lse, (dq, dk, dv))`` of ``fn``, jitted."""

    def run(q: Any, k: Any, v: Any, dout: Any, dlse: Any) -> Any:
        (out, lse), pull = jax.vjp(fn, q, k, v)
        return out, lse, pull((dout, dlse.astype(lse.dtype)))

    return jax.jit(run)


def _compare(got: Any, want: Any, dtype: str) -> None:
    """out, lse and gradients: 1e-12 in float64, the dtype's tolerance otherwise; rows
    with no key exactly 0 / -inf, nothing NaN."""
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = want
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
    rtol, atol = (1e-12, 1e-12) if dtype == "float64" else TOLERANCES[dtype]
    as64 = functools.partial(np.asarray, dtype=np.float64)
    empty = np.isneginf(as64(ref_lse))
    np.testing.assert_array_equal(np.isneginf(as64(lse)), empty, err_msg="-inf rows of lse")
    assert not np.isnan(as64(lse)).any() and np.isfinite(as64(out)).all()
    np.testing.assert_array_equal(as64(out)[empty], 0.0)
    np.testing.assert_allclose(as64(out), as64(ref_out), rtol=rtol, atol=atol, err_msg="out")
    lse_tol = (1e-12, 1e-12) if dtype == "float64" else (1e-4, 1e-4)
    np.testing.assert_allclose(
        as64(lse)[~empty], as64(ref_lse)[~empty], rtol=lse_tol[0], atol=lse_tol[1], err_msg="lse"
    )
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert np.isfinite(as64(g)).all(), name
        # A gradient sums over L terms: its error grows with the sum (the atol scales
        # with the reference's magnitude in low precision).
        scale = 1.0 if dtype == "float64" else max(1.0, float(np.abs(as64(r)).max()))
        np.testing.assert_allclose(as64(g), as64(r), rtol=rtol, atol=atol * scale, err_msg=name)


def _reference(options: dict[str, Any]) -> Any:
    return _with_vjp(lambda q, k, v: pa.attend(q, k, v, return_lse=True, **options))


def _check_ring(
    shards: int,
    layout: str,
    options: dict[str, Any],
    *,
    dtype: str = "float64",
    heads: tuple[int, int] = (4, 2),
    lengths: tuple[int, int] = (64, 64),
    kind: str = "explicit",
) -> None:
    mesh = mesh_of(shards, kind)
    arrays = _inputs((shards, layout, repr(options), dtype), jnp.dtype(dtype), *heads, *lengths)
    placed = [
        jax.device_put(x, NamedSharding(mesh, SEQ if x.ndim == 4 else P(None, None, "s")))
        for x in arrays
    ]
    sharded = _with_vjp(
        lambda q, k, v: parallel.sharded_attend(
            q, k, v, mesh=mesh, axis="s", layout=layout, return_lse=True, **options
        )
    )
    got = sharded(*placed)
    assert got[0].sharding.spec == SEQ  # the result stays sharded along the sequence
    _compare(got, _reference(options)(*arrays), dtype)


OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (attend options, shapes)
    "plain": ({}, {}),
    "causal": ({"causal": True}, {}),
    "causal-window": ({"causal": True, "window": (5, 0)}, {}),
    "window": ({"window": (3, 7)}, {}),
    "softcap-scale": ({"causal": True, "softcap": 2.0, "scale": 0.3}, {}),
    "mqa": ({"causal": True}, {"heads": (4, 1)}),
    "empty-rows": ({"causal": True}, {"lengths": (64, 32)}),
    "upper-left": ({"causal": "upper_left", "window": (9, None)}, {"lengths": (32, 64)}),
}
CASES = [
    *[(8, "zigzag", name) for name in OPTIONS],
    *[(8, "contiguous", name) for name in ("plain", "causal-window", "window", "empty-rows")],
    *[(4, "zigzag", name) for name in ("causal-window", "mqa")],
    *[(4, "contiguous", name) for name in ("plain", "upper-left")],
    (2, "zigzag", "upper-left"),
    (2, "contiguous", "causal"),
    *[(1, layout, "causal") for layout in parallel.LAYOUTS],
]


@pytest.mark.parametrize(("shards", "layout", "name"), CASES)
def test_ring_matches_one_device(shards: int, layout: str, name: str) -> None:
    options, shapes = OPTIONS[name]
    _check_ring(shards, layout, options, **shapes)


def _packed_ids(key: object, batch: int, length: int, documents: int) -> Any:
    """``[batch, length]`` segment ids of ``documents`` packed documents of random lengths
    per row (some of length 1, ids increasing along the row)."""
    rng = rng_for("packed", key)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), documents - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
    return jnp.asarray(np.stack(rows), dtype=jnp.int32)


PACKED = {
    "causal": ({"causal": True}, {}),
    "causal-window": ({"causal": True, "window": (5, 0)}, {}),
    "window": ({"window": (3, 7)}, {}),
    "plain-mqa": ({}, {"heads": (4, 1)}),
}


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", parallel.LAYOUTS)
@pytest.mark.parametrize("name", PACKED)
def test_ring_with_segment_ids_matches_one_device(shards: int, layout: str, name: str) -> None:
    """Packed documents on the ring (the ids sharded with the sequence, travelling with
    K/V): out, lse and the gradients of q, k, v equal one device's
    ``attend(segment_ids=...)`` to 1e-12 in float64."""
    options, shapes = PACKED[name]
    ids = _packed_ids((shards, layout, name), 2, 64, 7)
    _check_ring(shards, layout, {**options, "segment_ids": ids}, **shapes)


DOCS = jnp.asarray(np.repeat(np.arange(3), [20, 30, 14]))


def _documents_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A mask_mod of global positions and heads: documents of DOCS, a window per head."""
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx - kv_idx < 9 + h)


MODS = {
    "function": lambda: _documents_window,
    "plan": lambda: pa.masks.block_plan(_documents_window, 64, 64, heads=4, block_size=8),
}


def _some_rows_empty(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Rows 3, 10, 17, ... keep no key; the others their document's."""
    return (q_idx % 7 != 3) & (DOCS[q_idx] == DOCS[kv_idx])


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", parallel.LAYOUTS)
@pytest.mark.parametrize("mod", MODS)
def test_ring_with_mask_mod_matches_one_device(shards: int, layout: str, mod: str) -> None:
    """A mask_mod on the ring sees global positions and heads: out, lse and the gradients
    of q, k, v equal one device's ``attend(mask_mod=...)`` to 1e-12 in float64; a block
    plan of the global lengths also drops the ring's empty blocks (same values)."""
    _check_ring(shards, layout, {"causal": True, "mask_mod": MODS[mod]()})


@pytest.mark.parametrize("shards", [2, 8])
@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_ring_mask_mod_with_a_window_and_rows_with_no_key(shards: int, layout: str) -> None:
    """A window with a mask_mod that leaves rows without any key (GQA): those rows give
    out 0 and lse -inf on every shard, the rest equal one device's."""
    plan = pa.masks.block_plan(_some_rows_empty, 64, 64, block_size=8)
    _check_ring(shards, layout, {"window": (6, 2), "mask_mod": plan}, heads=(4, 1))


def test_ring_mask_mod_with_segment_ids_and_sinks() -> None:
    ids = _packed_ids("mod-ids", 2, 64, 5)
    options = {"mask_mod": MODS["plan"](), "segment_ids": ids, "sinks": jnp.linspace(0, 1, 4)}
    _check_ring(4, "zigzag", options)


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_ring_with_score_mod_and_traced_captures(shards: int, layout: str) -> None:
    """A score_mod (ALiBi of global positions, slopes per global head) and a mask_mod
    that closes over a jit argument: JAX's autodiff differentiates the ring, so the loss
    and the gradients of q, k, v and of the captured slopes equal one device's to 1e-12
    in float64."""
    q, k, v, *_ = _inputs(("score", shards, layout), jnp.float64, 4, 2, 64, 64)
    slopes = jnp.asarray([0.1, 0.2, 0.3, 0.4])

    def loss(att: Any) -> Any:
        def value(q: Any, k: Any, v: Any, slopes: Any, docs: Any) -> Any:
            def alibi(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)

            def documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return docs[q_idx] == docs[kv_idx]

            out, lse = att(q, k, v, causal=True, score_mod=alibi, mask_mod=documents)
            return (out**2).sum() + jnp.where(jnp.isinf(lse), 0.0, lse).sum()

        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2, 3)))

    want, want_grads = loss(functools.partial(pa.attend, return_lse=True))(q, k, v, slopes, DOCS)
    mesh = mesh_of(shards)
    ring = functools.partial(
        parallel.sharded_attend, mesh=mesh, axis="s", layout=layout, return_lse=True
    )
    placed = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        got, grads = loss(ring)(*placed, slopes, DOCS)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-12)
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), grads, want_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=1e-12, atol=1e-12, err_msg=name
        )


def test_ring_score_mod_under_checked_vma_is_refused() -> None:
    """Inside a shard_map with check_vma=True, JAX's autodiff would sum a captured
    array's gradient inside the ring's branches on some shards only: a clear error."""
    mesh = mesh_of(4)
    q = jax.device_put(jnp.ones((1, 2, 64, 8)), NamedSharding(mesh, SEQ))

    def local(q: Any) -> Any:
        return parallel.ring_attend(q, q, q, axis_name="s", causal=True, score_mod=_halve)

    ring = jax.shard_map(local, mesh=mesh, in_specs=(SEQ,), out_specs=SEQ)  # check_vma=True
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="check_vma=False"):
        jax.jit(ring)(q)


def _halve(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score * 0.5


def _document_ids(key: object, shards: int, length: int, documents: int) -> np.ndarray:
    """``[2, length]`` ids of ``documents`` packed documents per row, each of a random
    length in multiples of ``2P`` (the per-document zigzag layout's condition)."""
    rng = rng_for("documents", key)
    unit = 2 * shards
    rows = []
    for _ in range(2):
        sizes = rng.multinomial(length // unit - documents, np.ones(documents) / documents) + 1
        rows.append(np.repeat(np.arange(documents), sizes * unit))
    return np.stack(rows).astype(np.int32)


DOCUMENTS = {
    "causal": ({"causal": True}, (4, 2)),
    "causal-softcap-mqa": ({"causal": True, "softcap": 3.0}, (4, 1)),
    "plain": ({}, (4, 2)),
    "upper-left-sinks": ({"causal": "upper_left", "sinks": jnp.linspace(-1.0, 2.0, 4)}, (4, 2)),
}


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("name", DOCUMENTS)
def test_ring_in_document_zigzag_matches_one_device(shards: int, name: str) -> None:
    """The per-document zigzag layout: global arrays reordered by their ids, a user's own
    shard_map around ``ring_attend(layout="document_zigzag")``, restored: out, lse and
    the gradients of q, k, v equal one device's ``attend(segment_ids=...)`` to 1e-12 in
    float64 (different packings in the two batch rows)."""
    options, (hq, hk) = DOCUMENTS[name]
    mesh = mesh_of(shards)
    length = 32 * shards
    ids = _document_ids((shards, name), shards, length, 4)
    arrays = _inputs(("documents", shards, name), jnp.float64, hq, hk, length, length)
    layout = {"num_shards": shards, "layout": "document_zigzag", "segment_ids": ids}
    moved = [parallel.reorder(x, **layout, axis=-1 if x.ndim == 3 else -2) for x in arrays]
    local_ids = parallel.reorder(ids, **layout, axis=-1)
    ids_spec = P(None, "s")
    placed = [
        jax.device_put(x, NamedSharding(mesh, SEQ if x.ndim == 4 else P(None, None, "s")))
        for x in moved
    ]
    placed_ids = jax.device_put(local_ids, NamedSharding(mesh, ids_spec))

    def local(q: Any, k: Any, v: Any, i: Any) -> Any:
        return parallel.ring_attend(
            q, k, v, axis_name="s", layout="document_zigzag", segment_ids=i, return_lse=True,
            **options,
        )  # fmt: skip

    ring = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(SEQ, SEQ, SEQ, ids_spec),
        out_specs=(SEQ, P(None, None, "s")),
        check_vma=False,
    )
    with jax.set_mesh(mesh):
        out, lse, grads = _with_vjp(lambda q, k, v: ring(q, k, v, placed_ids))(*placed)
    back = (
        parallel.restore(np.asarray(out), **layout),
        parallel.restore(np.asarray(lse), **layout, axis=-1),
        tuple(parallel.restore(np.asarray(g), **layout) for g in grads),
    )
    want = _reference({**options, "segment_ids": jnp.asarray(ids)})(*arrays)
    _compare(back, want, "float64")


def test_document_zigzag_with_two_batch_axes() -> None:
    """Ids ``[B2, L]`` with q ``[B1, B2, H, L, D]`` align with q's batch axes from the
    right, as ``attend`` aligns them (here B1 == B2, where aligning from the left would
    give each row another row's documents)."""
    mesh = mesh_of(2)
    ids = _document_ids("two-axes", 2, 64, 3)
    rng = rng_for("parallel-jax", "two-axes")
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 2, 64, 8))) for _ in range(3))
    layout = {"num_shards": 2, "layout": "document_zigzag"}
    # One permutation per entry of B2 (the ids' rows), shared by B1 and the heads.
    moved = [
        jnp.stack([parallel.reorder(x[:, b], **layout, segment_ids=ids[b]) for b in range(2)], 1)
        for x in (q, k, v)
    ]
    local_ids = parallel.reorder(ids, **layout, axis=-1, segment_ids=ids)
    seq5 = P(None, None, None, "s", None)

    def local(q: Any, k: Any, v: Any, i: Any) -> Any:
        return parallel.ring_attend(
            q, k, v, axis_name="s", layout="document_zigzag", causal=True, segment_ids=i
        )

    ring = jax.shard_map(
        local, mesh=mesh, in_specs=(seq5, seq5, seq5, P(None, "s")), out_specs=seq5,
        check_vma=False,
    )  # fmt: skip
    placed = [jax.device_put(x, NamedSharding(mesh, seq5)) for x in moved]
    out = np.asarray(ring(*placed, jax.device_put(local_ids, NamedSharding(mesh, P(None, "s")))))
    back = np.stack(
        [parallel.restore(out[:, b], **layout, segment_ids=ids[b]) for b in range(2)], 1
    )
    want = pa.attend(q, k, v, causal=True, segment_ids=jnp.asarray(ids))
    np.testing.assert_allclose(back, np.asarray(want), rtol=1e-12, atol=1e-12)


def test_document_zigzag_errors_on_the_ring() -> None:
    mesh = mesh_of(2)
    x = jnp.zeros((1, 2, 16, 4))
    ids = jnp.asarray(np.repeat([0, 1], [8, 8]), dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"takes `segment_ids`.*and no `window`"):
        parallel.ring_attend(x, x, x, axis_name="s", layout="document_zigzag", causal=True)
    with pytest.raises(ValueError, match=r"takes `segment_ids`.*and no `window`"):
        parallel.ring_attend(
            x, x, x, axis_name="s", layout="document_zigzag", segment_ids=ids, window=(4, 0)
        )
    # A shard's ids read on the host (not traced): each document's two chunks.
    odd = jnp.asarray(np.repeat([0, 1], [7, 9]), dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"id 0 at positions \[0, 7\) has length 7"):
        parallel.ring_attend(x, x, x, axis_name="s", layout="document_zigzag", segment_ids=odd)
    with pytest.raises(ValueError, match="no `window`, `score_mod` or `mask_mod`"):
        parallel.ring_attend(
            x, x, x, axis_name="s", layout="document_zigzag", segment_ids=ids,
            mask_mod=lambda b, h, i, j: i >= j,
        )  # fmt: skip
    with pytest.raises(ValueError, match="'document_zigzag' is reorder's and ring_attend's"):
        parallel.sharded_attend(x, x, x, mesh=mesh, axis="s", layout="document_zigzag")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring_low_precision(dtype: str) -> None:
    _check_ring(8, "zigzag", {"causal": True}, dtype=dtype, lengths=(128, 128))


def test_ring_on_an_auto_mesh() -> None:
    _check_ring(8, "zigzag", {"causal": True, "window": (20, 0)}, kind="auto")


def _own_shard_map(mesh: Any, layout: str, check_vma: bool, **options: Any) -> Any:
    """A user's own shard_map around ring_attend, on arrays reordered by the user."""

    def local(q: Any, k: Any, v: Any) -> Any:
        return parallel.ring_attend(
            q, k, v, axis_name="s", layout=layout, return_lse=True, **options
        )

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(SEQ, SEQ, SEQ),
        out_specs=(SEQ, P(None, None, "s")),
        check_vma=check_vma,
    )


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_users_own_shard_map(layout: str) -> None:
    mesh = mesh_of(8)
    options = {"causal": True, "softcap": 3.0}
    q, k, v, dout, dlse = _inputs(("own", layout), jnp.float64, 4, 2, 64, 64)
    permuted = [parallel.reorder(x, 8, layout) for x in (q, k, v, dout)]
    permuted.append(parallel.reorder(dlse, 8, layout, axis=-1))
    placed = [
        jax.device_put(x, NamedSharding(mesh, SEQ if x.ndim == 4 else P(None, None, "s")))
        for x in permuted
    ]
    # Forward under the default check_vma=True (small blocks: attend's dense path).
    out, lse = jax.jit(_own_shard_map(mesh, layout, True, **options))(*placed[:3])
    ref_out, ref_lse = pa.attend(q, k, v, return_lse=True, **options)
    np.testing.assert_allclose(np.asarray(parallel.restore(out, 8, layout)), ref_out, atol=1e-12)
    np.testing.assert_allclose(
        np.asarray(parallel.restore(lse, 8, layout, axis=-1)), ref_lse, atol=1e-12
    )
    # Gradients (check_vma=True: test_own_shard_map_under_check_vma).
    got = _with_vjp(_own_shard_map(mesh, layout, False, **options))(*placed)
    back = (
        parallel.restore(got[0], 8, layout),
        parallel.restore(got[1], 8, layout, axis=-1),
        tuple(parallel.restore(g, 8, layout) for g in got[2]),
    )
    _compare(back, _reference(options)(q, k, v, dout, dlse), "float64")


@pytest.mark.parametrize("what", ["gradient", "blockwise-forward"])
def test_own_shard_map_under_check_vma(what: str) -> None:
    """A user's own ``shard_map`` with JAX's default ``check_vma=True``: the blockwise
    scans' carries are typed as varying over the axis, so long shards (attend's blockwise
    path) compile and gradients equal one device's."""
    mesh = mesh_of(8)
    if what == "blockwise-forward":  # blocks large enough for attend's blockwise path
        x = jax.ShapeDtypeStruct((1, 8, 8192, 64), jnp.float32, sharding=NamedSharding(mesh, SEQ))
        jax.jit(_own_shard_map(mesh, "contiguous", True, causal=True)).lower(x, x, x).compile()
        return
    q, k, v, dout, dlse = _inputs("vma", jnp.float64, 4, 2, 64, 64)
    placed = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v, dout)]
    placed.append(jax.device_put(dlse, NamedSharding(mesh, P(None, None, "s"))))
    got = _with_vjp(_own_shard_map(mesh, "contiguous", True, causal=True))(*placed)
    back = (
        parallel.restore(got[0], 8, "contiguous"),
        parallel.restore(got[1], 8, "contiguous", axis=-1),
        tuple(parallel.restore(g, 8, "contiguous") for g in got[2]),
    )
    _compare(back, _reference({"causal": True})(q, k, v, dout, dlse), "float64")


def _compiled(fn: Any, *shapes: Any) -> Any:
    return jax.jit(fn).lower(*shapes).compile()


def test_compiled_ring_permutes_and_never_gathers() -> None:
    mesh = mesh_of(8)
    x = jax.ShapeDtypeStruct((1, 4, 256, 16), jnp.float32, sharding=NamedSharding(mesh, SEQ))

    def ring(q: Any, k: Any, v: Any) -> Any:
        return parallel.sharded_attend(q, k, v, mesh=mesh, axis="s", causal=True)

    def ring_vjp(q: Any, k: Any, v: Any, dout: Any) -> Any:
        return jax.vjp(ring, q, k, v)[1](dout)

    for text in (_compiled(ring, x, x, x).as_text(), _compiled(ring_vjp, x, x, x, x).as_text()):
        assert "collective-permute" in text
        for gather in ("all-gather", "all-to-all", "all-reduce"):
            assert gather not in text, gather
    heads = jax.ShapeDtypeStruct((1, 8, 256, 16), jnp.float32, sharding=NamedSharding(mesh, SEQ))
    ulysses = _compiled(
        lambda q, k, v: parallel.sharded_attend(q, k, v, mesh=mesh, axis="s", method="ulysses"),
        heads,
        heads,
        heads,
    ).as_text()
    assert "all-to-all" in ulysses and "all-gather" not in ulysses


def test_memory_per_device_is_linear_in_length() -> None:
    mesh = mesh_of(8)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return parallel.sharded_attend(q, k, v, mesh=mesh, axis="s", causal=True).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    temps = []
    for length in (8192, 16384):
        x = jax.ShapeDtypeStruct((1, 1, length, 64), jnp.float32, sharding=NamedSharding(mesh, SEQ))
        temps.append(_compiled(grad, x, x, x).memory_analysis().temp_size_in_bytes)
    assert temps[1] <= 2.2 * temps[0], temps


# -- layouts on sharded arrays ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_reorder_of_sharded_arrays(kind: str) -> None:
    mesh = mesh_of(8, kind)
    x = jnp.arange(2 * 3 * 64 * 4, dtype=jnp.float32).reshape(2, 3, 64, 4)
    placed = jax.device_put(x, NamedSharding(mesh, SEQ))
    want = parallel.reorder(np.asarray(x), 8, "zigzag")
    for fn in (parallel.reorder, jax.jit(parallel.reorder, static_argnums=(1, 2))):
        moved = fn(placed, 8, "zigzag")
        np.testing.assert_array_equal(np.asarray(moved), want)
        back = parallel.restore(moved, 8, "zigzag")
        np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    # Its gradient (the transposed ppermutes): the cotangent restored.
    weights = rng_for("reorder-grad").standard_normal(x.shape).astype(np.float32)
    placed_weights = jax.device_put(weights, NamedSharding(mesh, SEQ))
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(parallel.reorder(x, 8, "zigzag") * w)))
    np.testing.assert_array_equal(
        np.asarray(grad(placed, placed_weights)), parallel.restore(weights, 8, "zigzag")
    )
    eager = parallel.reorder(placed, 8, "zigzag")
    assert eager.sharding.spec == SEQ  # moved between the shards, not gathered
    text = (
        jax.jit(parallel.reorder, static_argnums=(1, 2))
        .lower(placed, 8, "zigzag")
        .compile()
        .as_text()
    )
    if kind == "explicit":  # the type says where the shards are: ppermute between them
        assert "collective-permute" in text and "all-gather" not in text


# -- Ulysses --------------------------------------------------------------------------------


def _ulysses(mesh: Any, **options: Any) -> Any:
    return lambda q, k, v: parallel.sharded_attend(
        q, k, v, mesh=mesh, axis="s", method="ulysses", return_lse=True, **options
    )


@pytest.mark.parametrize(
    ("shards", "heads", "layout"),
    [
        (8, (8, 8), "contiguous"),
        (4, (8, 2), "zigzag"),
        (4, (4, 1), "contiguous"),
        (2, (4, 4), "zigzag"),
    ],
)
def test_ulysses_matches_one_device(shards: int, heads: tuple[int, int], layout: str) -> None:
    mesh = mesh_of(shards)
    options = {"causal": True, "window": (11, 0), "softcap": 4.0}
    arrays = _inputs(("ulysses", shards, heads), jnp.float64, *heads, 64, 64)
    got = _with_vjp(_ulysses(mesh, layout=layout, **options))(*arrays)
    _compare(got, _reference(options)(*arrays), "float64")


def test_ulysses_mask_bias_and_weights() -> None:
    mesh = mesh_of(4)
    q, k, v, dout, _ = _inputs("ulysses-mask", jnp.float64, 8, 4, 32, 32)
    rng = rng_for("ulysses-mask-data")
    mask = jnp.asarray(rng.random((1, 8, 32, 32)) > 0.3).at[:, :, 3].set(False)  # empty rows
    bias = jnp.asarray(rng.standard_normal((8, 32, 32)))
    options = {"mask": mask, "bias": bias, "return_weights": True}

    def ours(q: Any, k: Any, v: Any, bias: Any) -> Any:
        opts = {**options, "bias": bias}
        return parallel.sharded_attend(q, k, v, mesh=mesh, axis="s", method="ulysses", **opts)

    def ref(q: Any, k: Any, v: Any, bias: Any) -> Any:
        return pa.attend(q, k, v, **{**options, "bias": bias})

    (out, weights), pull = jax.vjp(ours, q, k, v, bias)
    (ref_out, ref_w), ref_pull = jax.vjp(ref, q, k, v, bias)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-12)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_w), atol=1e-12)
    assert not np.asarray(out)[:, :, 3].any()  # the rows the mask empties
    cotangents = (dout, jnp.ones_like(weights))
    for name, g, r in zip(
        ["q", "k", "v", "bias"], pull(cotangents), ref_pull(cotangents), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-12, err_msg=name)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_sinks_segments_and_mods(method: str) -> None:
    """Sinks on both methods (values and gradients of q, k, v and the sinks); Ulysses
    with packed segment ids, a score_mod and a mask_mod that read the global head
    number, against one device."""
    mesh = mesh_of(4)
    q, k, v, dout, _ = _inputs(("modern", method), jnp.float64, 8, 2, 48, 48)
    sinks = jnp.asarray(rng_for("modern-sinks").standard_normal(8))
    options: dict[str, Any] = {"causal": True}
    if method == "ulysses":
        ids = jnp.repeat(jnp.arange(5), jnp.asarray([7, 1, 0, 30, 10]), total_repeat_length=48)
        slopes = jnp.linspace(0.1, 0.8, 8)
        options |= {
            "segment_ids": ids,
            "score_mod": lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki),
            "mask_mod": lambda b, h, qi, ki: (h < 6) | (qi - ki < 9),
        }

    def ours(q: Any, k: Any, v: Any, sinks: Any) -> Any:
        return parallel.sharded_attend(
            q, k, v, mesh=mesh, axis="s", method=method, sinks=sinks, **options
        )

    def ref(q: Any, k: Any, v: Any, sinks: Any) -> Any:
        return pa.attend(q, k, v, sinks=sinks, **options)

    with jax.set_mesh(mesh):
        out, pull = jax.vjp(ours, q, k, v, sinks)
        grads = pull(dout)
    ref_out, ref_pull = jax.vjp(ref, q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-12)
    for name, g, r in zip(["q", "k", "v", "sinks"], grads, ref_pull(dout), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-12, err_msg=name)


def test_sharded_call_keeps_no_mod_alive() -> None:
    """A fresh ``mask_mod`` per call through ``sharded_attend`` (Ulysses): once the calls
    have returned, nothing of the package holds the mod or what it captured (the compiled
    function's cache had kept both); each call still agrees with one device."""
    import gc
    import weakref

    mesh = mesh_of(4)
    q, k, v, _, _ = _inputs("sharded-mods", jnp.float64, 8, 4, 32, 32)
    alive = []
    for shift in (3, 9):
        capture = Capture(shift)

        def mod(b: Any, h: Any, qi: Any, ki: Any, c: Capture = capture) -> Any:
            return qi - ki < c.value

        with jax.set_mesh(mesh):
            out = parallel.sharded_attend(
                q, k, v, mesh=mesh, axis="s", method="ulysses", mask_mod=mod
            )
        want = pa.attend(q, k, v, mask_mod=mod)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-12)
        alive.append(weakref.ref(capture))
        del capture, mod, out, want
    gc.collect()
    assert [r() is None for r in alive] == [True, True]


def test_ulysses_takes_a_pair_of_segment_ids() -> None:
    """``segment_ids=(q_ids, kv_ids)`` through ``sharded_attend``: each array of the pair
    placed on the mesh (replicated), the result that of one device."""
    mesh = mesh_of(4)
    q, k, v, _, _ = _inputs("ulysses-pair", jnp.float64, 8, 4, 32, 32)
    q_ids = jnp.repeat(jnp.arange(4), 8)
    kv_ids = jnp.repeat(jnp.arange(4), jnp.asarray([4, 12, 8, 8]), total_repeat_length=32)
    options = {"segment_ids": (q_ids, kv_ids), "causal": True}
    with jax.set_mesh(mesh):
        out = parallel.sharded_attend(q, k, v, mesh=mesh, axis="s", method="ulysses", **options)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(pa.attend(q, k, v, **options)), atol=1e-12
    )


def test_ulysses_dropout_draws_per_shard() -> None:
    mesh = mesh_of(4)
    q, k, v, _, _ = _inputs("ulysses-dropout", jnp.float32, 8, 8, 32, 32)

    def run(key: Any) -> Any:
        return parallel.sharded_attend(
            q, k, v, mesh=mesh, axis="s", method="ulysses", dropout=0.5, rng=key
        )

    a, b, c = run(jax.random.key(0)), run(jax.random.key(0)), run(jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # Each shard holds two heads of eight: their keep masks differ between shards.
    per_head = np.asarray(a)
    assert not np.array_equal(per_head[:, 0], per_head[:, 2])


def _committed(x: Any, where: str, mesh: Any) -> Any:
    """``x`` committed to one device of the mesh, to one outside it, or to another mesh."""
    if where == "another mesh":
        other = jax.make_mesh((8,), ("t",), axis_types=(AxisType.Explicit,))
        spec = P(*([None] * (x.ndim - 2)), "t", None) if x.ndim > 1 else P()  # the sequence
        return jax.device_put(x, NamedSharding(other, spec))
    device = jax.devices()[0 if where == "a device of the mesh" else DEVICES - 1]
    return jax.device_put(x, device)


@pytest.mark.parametrize("where", ["a device of the mesh", "a device off it", "another mesh"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_committed_arrays_are_placed_on_the_mesh(method: str, kind: str, where: str) -> None:
    """Arrays committed elsewhere (``jax.device_put(x, jax.devices()[0])``, a device the
    mesh does not hold, another mesh), q, k, v and the array options alike, are moved
    onto the mesh: forward, ``jax.vjp`` and ``jax.vmap`` equal one device's."""
    mesh = mesh_of(4, kind)
    q, k, v, dout, _ = _inputs(("committed", method), jnp.float64, 4, 4, 64, 64)
    ids = jnp.repeat(jnp.arange(2), 32)
    sinks = jnp.linspace(-1.0, 1.0, 4)
    options = {"causal": True, "sinks": sinks, "segment_ids": ids}
    moved = [_committed(x, where, mesh) for x in (q, k, v, sinks, ids)]
    assert all(x.committed for x in moved)

    def sharded(q: Any, k: Any, v: Any) -> Any:
        return parallel.sharded_attend(
            q, k, v, mesh=mesh, axis="s", method=method, causal=True,
            sinks=moved[3], segment_ids=moved[4],
        )  # fmt: skip

    out, pull = jax.vjp(sharded, *moved[:3])
    want, want_pull = jax.vjp(lambda q, k, v: pa.attend(q, k, v, **options), q, k, v)
    assert out.sharding == NamedSharding(mesh, SEQ)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-12, atol=1e-12)
    for name, g, r in zip(("dq", "dk", "dv"), pull(dout), want_pull(dout), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-12, err_msg=name)
    batched = jax.vmap(sharded)(*(x[None] for x in moved[:3]))
    np.testing.assert_allclose(np.asarray(batched[0]), np.asarray(want), atol=1e-12)


# -- errors ---------------------------------------------------------------------------------


def test_errors() -> None:
    mesh = mesh_of(8)
    q = jnp.zeros((1, 8, 24, 4))
    with pytest.raises(ValueError, match=r"24.*multiple of 16.*layout='contiguous'"):
        parallel.sharded_attend(q, q, q, mesh=mesh, axis="s", causal=True)
    with pytest.raises(ValueError, match=r"multiple of 8"):
        parallel.sharded_attend(
            q[:, :, :20], q[:, :, :20], q[:, :, :20], mesh=mesh, axis="s", layout="contiguous"
        )
    with pytest.raises(ValueError, match=r"`axis='t'` is not an axis of the mesh"):
        parallel.sharded_attend(q, q, q, mesh=mesh, axis="t")
    with pytest.raises(TypeError, match=r"does not take \['mask'\].*ulysses"):
        parallel.sharded_attend(q, q, q, mesh=mesh, axis="s", mask=jnp.ones((24, 24), bool))
    with pytest.raises(TypeError, match="`axis=`"):
        parallel.sharded_attend(q, q, q, mesh=mesh, axis="s", axis_name="s")
    q6 = jnp.zeros((1, 6, 32, 4))
    with pytest.raises(ValueError, match=r"Hq=6, Hk=6, P=8"):
        parallel.sharded_attend(q6, q6, q6, mesh=mesh, axis="s", method="ulysses")

    def wrong_axis(q: Any) -> Any:
        return parallel.ring_attend(q, q, q, axis_name="seq")

    with pytest.raises(ValueError, match=r"'seq'.*not a bound mesh axis"):
        jax.shard_map(wrong_axis, mesh=mesh, in_specs=SEQ, out_specs=SEQ)(
            jax.device_put(jnp.zeros((1, 2, 32, 4)), NamedSharding(mesh, SEQ))
        )

    def misspelled(q: Any) -> Any:  # an option attend does not take, named
        return parallel.ulysses_attend(q, q, q, axis_name="s", casual=True)

    with pytest.raises(TypeError, match=r"unexpected keyword.*'casual'.*causal"):
        jax.shard_map(misspelled, mesh=mesh, in_specs=SEQ, out_specs=SEQ)(
            jax.device_put(jnp.zeros((1, 8, 32, 4)), NamedSharding(mesh, SEQ))
        )


def test_ring_axis_of_a_two_dimensional_mesh() -> None:
    """The ring runs over one mesh axis; another shards the batch."""
    mesh = jax.make_mesh((2, 4), ("b", "s"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v, _, _ = _inputs("2d", jnp.float64, 4, 2, 64, 64)
    spec = P("b", None, "s", None)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]

    def local(q: Any, k: Any, v: Any) -> Any:
        return parallel.ring_attend(q, k, v, axis_name="s", layout="contiguous", causal=True)

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(*placed)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(pa.attend(q, k, v, causal=True)), atol=1e-12
    )
    assert re.search("s", str(out.sharding.spec))
