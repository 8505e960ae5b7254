"""portable_attention.parallel on one process: the schedule against brute-force masks,
the layouts on every backend, the guarded lse merge, and the errors that need no second
device. (Many devices: test_parallel_jax.py; many ranks: test_parallel_torch.py.)"""

from __future__ import annotations

import importlib
import itertools
import math
from typing import Any

import numpy as np
import portable_attention as pa
import pytest
from portable_attention import masks, parallel
from portable_attention.parallel import _layout, _merge
from portable_attention.parallel._schedule import Block

from conftest import BY_NAME, TOLERANCES, Backend, requires_backend
from helpers import assert_same, randn, rng_for, run_python

NP_XP = pa.masks._namespace(None)


# -- the schedule -------------------------------------------------------------------------


def _global_band(lq: int, lk: int, causal: str | None, window: Any) -> np.ndarray:
    left, right = window if window is not None else (None, None)
    if causal is not None:
        right = 0
    align = "upper_left" if causal == "upper_left" else "lower_right"
    return np.asarray(masks.band(NP_XP, lq, lk, left=left, right=right, align=align))


def _block_band(block: Block) -> np.ndarray:
    """The scores one block's attend call keeps, from its own options."""
    nq, nk = block.rows[1] - block.rows[0], block.cols[1] - block.cols[0]
    if block.causal:
        return np.asarray(masks.causal_mask(nq, nk))
    if block.window is None:
        return np.ones((nq, nk), dtype=bool)
    return np.asarray(masks.window_mask(nq, nk, block.window))


CONFIGS = [
    (None, None),
    ("lower_right", None),
    ("upper_left", None),
    ("lower_right", (5, 0)),
    (None, (3, 7)),
    (None, (0, 0)),
    (None, (None, 4)),
    (None, (6, None)),
    ("upper_left", (2, 9)),
]


def _check_schedule(shards: int, layout: str, lq: int, lk: int, causal: Any, window: Any) -> None:
    plan = parallel.schedule(shards, layout, lq, lk, causal=causal or False, window=window)
    want = _global_band(lq, lk, causal, window)
    covered = np.zeros((lq, lk), dtype=int)
    for step in plan.steps:
        assert len(step.blocks) == shards
        for r in range(shards):
            source = (r - step.shift) % shards
            qp = _layout.positions(lq, shards, layout, r)
            kp = _layout.positions(lk, shards, layout, source)
            got = np.zeros((len(qp), len(kp)), dtype=bool)
            for block in step.blocks[r]:
                keep = _block_band(block)
                assert block.kept == int(keep.sum()) > 0
                cut = got[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]]
                assert not cut.any(), "two blocks of a step overlap"
                cut |= keep
            local = want[np.ix_(qp, kp)] if qp and kp else got
            np.testing.assert_array_equal(got, local, err_msg=f"shard {r}, shift {step.shift}")
            for (i, a), (j, b) in itertools.product(enumerate(qp), enumerate(kp)):
                covered[a, b] += got[i, j]
    # Every kept score is computed exactly once over the ring, no masked one ever.
    np.testing.assert_array_equal(covered, want.astype(int))


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("causal", "window"), CONFIGS)
def test_schedule_reproduces_the_global_band(
    shards: int, layout: str, causal: Any, window: Any
) -> None:
    chunk = 2 * shards
    for lq, lk in ((4 * chunk, 4 * chunk), (2 * chunk, 5 * chunk), (3 * chunk, chunk)):
        _check_schedule(shards, layout, lq, lk, causal, window)


def _documents_mod(lengths: list[int]) -> Any:
    docs = np.repeat(np.arange(len(lengths)), lengths)

    def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (docs[q_idx] == docs[kv_idx]) & (q_idx - kv_idx < 40)

    return mod, docs


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
@pytest.mark.parametrize("shards", [2, 4, 8])
@pytest.mark.parametrize("causal", [None, "lower_right"])
def test_block_plan_prunes_the_schedule_exactly(shards: int, layout: str, causal: Any) -> None:
    """A mask_mod's block plan over the global lengths drops exactly the ring's blocks
    (and steps) where it keeps no score, and marks unmasked exactly the blocks where its
    plan blocks are all full: against the brute-force mask, every score the band and the
    mod keep is still computed once, no dropped block held one, and every unmasked block's
    scores are all kept by the mod."""
    schedule_module = importlib.import_module("portable_attention.parallel._schedule")
    length = 96 * shards // 2
    mod, _docs = _documents_mod([length // 3, length // 2, length - length // 3 - length // 2])
    plan = masks.block_plan(mod, length, length, block_size=7)  # edges off the chunks
    full = schedule_module.schedule(shards, layout, length, length, causal, None)
    pruned = schedule_module.pruned(full, plan.layout)
    q_idx, k_idx = np.arange(length)[:, None], np.arange(length)[None, :]
    want = _global_band(length, length, causal, None) & mod(0, 0, q_idx, k_idx)
    covered = np.zeros((length, length), dtype=int)
    for step in full.steps:
        for r in range(shards):
            source = (r - step.shift) % shards
            qp = np.asarray(_layout.positions(length, shards, layout, r))
            kp = np.asarray(_layout.positions(length, shards, layout, source))
            after = next((s.blocks[r] for s in pruned.steps if s.shift == step.shift), ())
            for block in step.blocks[r]:
                rows, cols = qp[block.rows[0] : block.rows[1]], kp[block.cols[0] : block.cols[1]]
                scores = _block_band(block) & mod(0, 0, rows[:, None], cols[None, :])
                same = [b for b in after if (b.rows, b.cols) == (block.rows, block.cols)]
                if not same:
                    assert not scores.any(), f"a dropped block kept a score (shard {r})"
                    continue
                if not same[0].masked:
                    assert mod(0, 0, rows[:, None], cols[None, :]).all(), "unmasked, not full"
                covered[np.ix_(rows, cols)] += scores
    np.testing.assert_array_equal(covered, want.astype(int))
    if layout == "contiguous" and shards >= 4:  # documents shorter than the ring: blocks go
        assert sum(len(b) for s in pruned.steps for b in s.blocks) < sum(
            len(b) for s in full.steps for b in s.blocks
        )


def test_schedule_random_configurations() -> None:
    rng = rng_for("schedule")
    for _ in range(150):
        shards = int(rng.choice([1, 2, 3, 4, 5, 8]))
        layout = str(rng.choice(parallel.LAYOUTS))
        lq, lk = (2 * shards * int(rng.integers(0, 5)) for _ in range(2))
        causal = [None, "lower_right", "upper_left"][int(rng.integers(3))]
        sides = [None, *range(12)]
        window = None if rng.random() < 0.3 else tuple(sides[int(rng.integers(13))] for _ in "lr")
        _check_schedule(shards, layout, lq, lk, causal, window)


@pytest.mark.parametrize("shards", [2, 4, 8, 16])
def test_zigzag_balances_causal_work(shards: int) -> None:
    zigzag = parallel.schedule(shards, "zigzag", 64 * shards, causal=True)
    contiguous = parallel.schedule(shards, "contiguous", 64 * shards, causal=True)
    assert zigzag.balance() <= 1.05
    assert contiguous.balance() > 1.3  # the busiest shard waits on the others
    # Every shard sees every other's K/V: P - 1 transfers, each step one attend call.
    assert zigzag.transfers == contiguous.transfers == shards - 1
    assert all(len(blocks) == 1 for step in zigzag.steps for blocks in step.blocks)
    # Causal work is half the scores (plus the diagonal), whatever the layout.
    total = sum(map(sum, zigzag.work()))
    assert total == sum(map(sum, contiguous.work())) == (64 * shards) * (64 * shards + 1) // 2


def test_windows_skip_ring_steps() -> None:
    narrow = parallel.schedule(8, "contiguous", 8 * 64, causal=True, window=(30, 0))
    assert [s.shift for s in narrow.steps] == [0, 1]
    assert narrow.transfers == 1
    wide = parallel.schedule(8, "contiguous", 8 * 64, window=(100, 100))
    assert [s.shift for s in wide.steps] == [0, 1, 2, 6, 7]
    assert wide.transfers == 4
    none_left = parallel.schedule(4, "contiguous", 64, 0)  # no keys: nothing to compute
    assert none_left.steps == ()


def test_schedule_errors() -> None:
    with pytest.raises(ValueError, match=r"multiple of 16"):
        parallel.schedule(8, "zigzag", 24)
    with pytest.raises(ValueError, match="`layout`"):
        parallel.schedule(2, "striped", 8)
    with pytest.raises(ValueError, match="`num_shards`"):
        parallel.schedule(0, "zigzag", 8)
    with pytest.raises(ValueError, match="`causal`"):
        parallel.schedule(2, "zigzag", 8, causal="diagonal")


# -- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_reorder_gives_each_shard_its_positions(backend: Backend, shards: int, layout: str) -> None:
    length = 4 * shards
    x = backend.asarray(np.arange(3 * length * 2).reshape(3, length, 2), "float32")
    moved = parallel.reorder(x, shards, layout, axis=1)
    assert type(moved) is type(x) and tuple(moved.shape) == tuple(x.shape)
    got = backend.to_numpy(moved)[0, :, 0] / 2
    split = np.split(got, shards)
    for r in range(shards):
        assert split[r].tolist() == _layout.positions(length, shards, layout, r)
    back = parallel.restore(moved, shards, layout, axis=1)
    assert_same(back, x)
    # The default axis is -2 (the sequence of [..., L, D]).
    np.testing.assert_array_equal(
        backend.to_numpy(parallel.reorder(x, shards, layout)),
        backend.to_numpy(parallel.reorder(x, shards, layout, axis=-2)),
    )


def test_reorder_errors() -> None:
    x = np.zeros((2, 24, 4))
    with pytest.raises(ValueError, match=r"24.*multiple of 16.*layout='contiguous'"):
        parallel.reorder(x, 8, "zigzag")
    with pytest.raises(ValueError, match=r"multiple of 5"):
        parallel.restore(x, 5, "contiguous")
    with pytest.raises(ValueError, match="`layout`"):
        parallel.reorder(x, 2, "random")
    with pytest.raises(ValueError, match="`axis`"):
        parallel.reorder(x, 2, "zigzag", axis=3)
    with pytest.raises(ValueError, match="`num_shards`"):
        parallel.reorder(x, 0, "zigzag")
    with pytest.raises(TypeError, match="`x`"):
        parallel.reorder([1.0, 2.0], 1, "zigzag", axis=0)


def _extract_local(x: np.ndarray, bounds: list[int], rank: int, shards: int) -> np.ndarray:
    """Rank ``rank``'s rows of ``x`` (along axis 0) in ring-flash-attention's varlen
    zigzag convention, written from its description: each document cut into ``2P``
    chunks, chunks ``rank`` and ``2P - 1 - rank`` of each document, document after
    document."""
    parts = []
    for start, stop in itertools.pairwise(bounds):
        chunks = np.split(x[start:stop], 2 * shards)
        parts += [chunks[rank], chunks[2 * shards - 1 - rank]]
    return np.concatenate(parts)


def _documents(key: object, shards: int, count: int, length: int) -> list[int]:
    """``cu_seqlens`` of ``count`` documents of random lengths in multiples of ``2P``."""
    rng = rng_for("documents", key)
    unit = 2 * shards
    sizes = rng.multinomial(length // unit - count, np.ones(count) / count) + 1
    return [0, *np.cumsum(sizes * unit).tolist()]


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
def test_document_zigzag_gives_each_shard_its_positions(backend: Backend, shards: int) -> None:
    """reorder(..., "document_zigzag") from cu_seqlens or segment_ids: shard r's rows are
    ring-flash-attention's per-rank positions; restore inverts it; one permutation per
    batch entry when the ids differ by row."""
    length = 16 * shards
    rows = [_documents((shards, row), shards, 3 + row, length) for row in range(2)]
    x = backend.asarray(np.arange(2 * 3 * length).reshape(2, 3, length), "float32")
    ids = np.stack([np.searchsorted(b[1:], np.arange(length), side="right") for b in rows])
    by_ids = parallel.reorder(
        x, shards, "document_zigzag", axis=-1, segment_ids=backend.asarray(ids)
    )
    by_bounds = parallel.reorder(x[:1, ...], shards, "document_zigzag", axis=-1, cu_seqlens=rows[0])
    assert type(by_ids) is type(x) and tuple(by_ids.shape) == tuple(x.shape)
    got, first = backend.to_numpy(by_ids), backend.to_numpy(by_bounds)
    natural = np.arange(length)
    for row, bounds in enumerate(rows):
        want = np.concatenate([_extract_local(natural, bounds, r, shards) for r in range(shards)])
        np.testing.assert_array_equal(got[row, 1] - got[row, 1, 0], want)
    np.testing.assert_array_equal(first, got[:1])
    back = parallel.restore(
        by_ids, shards, "document_zigzag", axis=-1, segment_ids=backend.asarray(ids)
    )
    assert_same(back, x)


def test_document_zigzag_under_jit() -> None:
    """The permutation is computed from the ids with array-API calls: it traces."""
    jax = pytest.importorskip("jax")
    if "jax" not in BY_NAME:
        pytest.skip("the jax backend is not selected")
    bounds = _documents("jit", 4, 3, 64)
    ids = np.searchsorted(bounds[1:], np.arange(64), side="right")
    x = np.arange(64.0)
    want = np.concatenate([_extract_local(x, bounds, r, 4) for r in range(4)])
    fn = jax.jit(lambda a, i: parallel.reorder(a, 4, "document_zigzag", axis=-1, segment_ids=i))
    np.testing.assert_array_equal(
        np.asarray(fn(jax.numpy.asarray(x), jax.numpy.asarray(ids))), want
    )


def test_document_zigzag_errors() -> None:
    x = np.zeros((2, 16, 4))
    with pytest.raises(ValueError, match=r"id 0 at positions \[0, 3\) has length 3.*multiple of 4"):
        parallel.reorder(x, 2, "document_zigzag", segment_ids=np.repeat([0, 1], [3, 13]))
    with pytest.raises(ValueError, match="id 0 names 2 runs"):
        parallel.reorder(x, 2, "document_zigzag", segment_ids=np.repeat([0, 1, 0], [4, 8, 4]))
    with pytest.raises(ValueError, match="exactly one of them"):
        parallel.reorder(x, 2, "document_zigzag")
    with pytest.raises(ValueError, match="exactly one of them"):
        parallel.restore(x, 2, "document_zigzag", segment_ids=np.zeros(16, int), cu_seqlens=[0, 16])
    with pytest.raises(ValueError, match="`cu_seqlens` must be 1-D integers rising from 0 to"):
        parallel.reorder(x, 2, "document_zigzag", cu_seqlens=[0, 4, 12])
    with pytest.raises(ValueError, match="`cu_seqlens` must be 1-D integers"):
        parallel.reorder(x, 2, "document_zigzag", cu_seqlens=[0.0, 4.5, 16.0])
    with pytest.raises(TypeError, match="must be an integer array, got dtype float64"):
        parallel.reorder(x, 2, "document_zigzag", segment_ids=np.zeros(16))
    with pytest.raises(ValueError, match=r"do not fit `x` of shape \(2, 16, 4\)"):
        parallel.reorder(x, 2, "document_zigzag", segment_ids=np.zeros((3, 16), dtype=int))
    with pytest.raises(TypeError, match="go with layout 'document_zigzag'"):
        parallel.reorder(x, 2, "zigzag", cu_seqlens=[0, 16])
    with pytest.raises(ValueError, match="'document_zigzag' is reorder's and ring_attend's"):
        parallel.schedule(2, "document_zigzag", 16)


# -- the merge -------------------------------------------------------------------------------


def test_merge_of_key_halves_is_attend_over_all_keys(backend: Backend, hp_dtype: str) -> None:
    xp = backend.xp
    rng = rng_for("merge", backend.name, hp_dtype)
    q, k, v = (backend.asarray(randn(rng, s), hp_dtype) for s in [(2, 5, 4), (2, 8, 4), (2, 8, 3)])
    allowed = np.ones((5, 8), dtype=bool)
    allowed[1] = False  # a row with no key at all
    allowed[2, :4] = False  # a row with keys in the second half only
    mask = backend.asarray(allowed)
    out, lse = pa.attend(q, k, v, mask=mask, return_lse=True)
    first = pa.attend(q, k[..., :4, :], v[..., :4, :], mask=mask[..., :4], return_lse=True)
    second = pa.attend(q, k[..., 4:, :], v[..., 4:, :], mask=mask[..., 4:], return_lse=True)
    merged, merged_lse = _merge.merge(xp, *first, *second)
    assert merged.dtype == out.dtype and merged_lse.dtype == lse.dtype  # float64 stays
    # the merge of two halves is one attention over all keys: the table's row for one call
    rtol, atol = TOLERANCES[hp_dtype]
    np.testing.assert_allclose(
        backend.to_numpy(merged), backend.to_numpy(out), rtol=rtol, atol=atol
    )
    got_lse = backend.to_numpy(merged_lse)
    assert np.isneginf(got_lse[:, 1]).all() and not np.isnan(got_lse).any()
    np.testing.assert_array_equal(backend.to_numpy(merged)[:, 1], 0.0)
    finite = ~np.isneginf(got_lse)
    np.testing.assert_allclose(got_lse[finite], backend.to_numpy(lse)[finite], rtol=rtol, atol=atol)


@requires_backend("torch")
def test_merge_of_empty_rows_has_zero_finite_gradients() -> None:
    import torch

    out_a = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    out_b = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    lse_a = torch.tensor([-math.inf, 0.5, -math.inf], dtype=torch.float64, requires_grad=True)
    lse_b = torch.tensor([-math.inf, -math.inf, 1.0], dtype=torch.float64, requires_grad=True)
    xp = BY_NAME["torch"].xp
    out, lse = _merge.merge(xp, out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0], torch.zeros(2, dtype=torch.float64)) and lse[0] == -math.inf
    (out.sum() + lse[1:].sum()).backward()
    for x in (out_a, out_b, lse_a, lse_b):
        assert torch.isfinite(x.grad).all()
    assert torch.equal(out_a.grad[0], torch.zeros(2, dtype=torch.float64))


# -- errors that need no second device ----------------------------------------------------


def test_ring_attend_refuses_other_frameworks() -> None:
    q = np.zeros((1, 2, 8, 4))
    with pytest.raises(TypeError, match=r"JAX arrays.*torch tensors.*attend"):
        parallel.ring_attend(q, q, q)
    with pytest.raises(TypeError, match=r"JAX arrays.*torch tensors"):
        parallel.ulysses_attend(q, q, q)
    with pytest.raises(TypeError, match=r"sharded_attend takes JAX arrays"):
        parallel.sharded_attend(q, q, q, mesh=None, axis="seq")
    with pytest.raises(ValueError, match="`layout`"):
        parallel.ring_attend(q, q, q, layout="ring")
    with pytest.raises(ValueError, match="`method`"):
        parallel.sharded_attend(q, q, q, mesh=None, axis="seq", method="tree")


@requires_backend("torch")
def test_torch_needs_an_initialized_process_group() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - only a stray group of another test
        pytest.skip("a process group is initialized in this process")
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        parallel.ring_attend(q, q, q)
    with pytest.raises(TypeError, match=r"`axis_name` names a JAX mesh axis.*group="):
        parallel.ring_attend(q, q, q, axis_name="seq")


@requires_backend("jax")
def test_jax_needs_a_bound_axis() -> None:
    import jax.numpy as jnp

    q = jnp.zeros((1, 2, 8, 4))
    with pytest.raises(ValueError, match=r"`axis_name` is required.*shard_map"):
        parallel.ring_attend(q, q, q)
    with pytest.raises(ValueError, match=r"'seq'.*not a bound mesh axis.*shard_map"):
        parallel.ring_attend(q, q, q, axis_name="seq")
    with pytest.raises(ValueError, match=r"not a bound mesh axis"):
        parallel.ulysses_attend(q, q, q, axis_name="seq")
    with pytest.raises(TypeError, match=r"`group` is torch.distributed's.*axis_name="):
        parallel.ring_attend(q, q, q, group=object())


def test_heads_check_names_the_counts() -> None:
    parallel._check_heads(8, 2, 4)  # P % Hk == 0: K/V heads repeated
    parallel._check_heads(8, 8, 4)
    with pytest.raises(ValueError, match=r"Hq=6.*P=4"):
        parallel._check_heads(6, 2, 4)
    with pytest.raises(ValueError, match=r"Hk=3.*P=4"):
        parallel._check_heads(12, 3, 4)


def test_frameworks_are_imported_only_when_their_arrays_arrive() -> None:
    out = run_python(
        "import sys\n"
        "import numpy as np\n"
        "from portable_attention import parallel\n"
        "parallel.restore(parallel.reorder(np.zeros((1, 8, 2)), 2, 'zigzag'), 2, 'zigzag')\n"
        "parallel.schedule(4, 'zigzag', 64, causal=True).balance()\n"
        "print(sorted(m for m in ('jax', 'torch', 'portable_attention.parallel._jax',\n"
        "    'portable_attention.parallel._torch') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"
