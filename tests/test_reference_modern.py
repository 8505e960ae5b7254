"""Issue 18's features in the two float64 references: ``sinks``, ``segment_ids``,
``score_mod`` and ``mask_mod``.

Both :func:`portable_attention.testing.reference_attention` (public) and the suite's
oracle (``tests/oracle.py``) are checked against computations written here once more,
each the most literal reading of the contract:

* sinks: "append a sink column to the masked scores, softmax, drop the column", and a
  brute-force loop over every query row in Python floats;
* segment ids: each segment run alone (its queries against its keys, the same causal and
  window), and a loop over (query, key) pairs for ids that are not one run per segment;
* ``score_mod``/``mask_mod``: the equivalent ``bias=``/``mask=``/``window=``, what the mods
  receive, and torch's own ``flex_attention`` (CPU, eager) on the same mods.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from portable_attention.testing import reference_attention

import oracle
from conftest import requires_backend
from helpers import randn, rng_for

RTOL, ATOL = 1e-12, 1e-13


def both(q: Any, k: Any, v: Any, **kwargs: Any) -> list[tuple[np.ndarray, ...]]:
    """``(out, weights, lse)`` of the public reference and of the oracle."""
    return [tuple(reference_attention(q, k, v, **kwargs)), oracle.attention(q, k, v, **kwargs)]


def assert_results(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    for name, a, b in zip(("out", "weights", "lse"), got, want, strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert a.dtype == np.float64, (name, a.dtype)
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)


def qkv(key: object, batch: tuple[int, ...], hq: int, hk: int, lq: int, lk: int, d: int = 3):
    rng = rng_for(*key) if isinstance(key, tuple) else rng_for(key)
    heads_q = (*batch, hq) if hq else batch
    heads_k = (*batch, hk) if hk else batch
    return (
        randn(rng, (*heads_q, lq, d)),
        randn(rng, (*heads_k, lk, d)),
        randn(rng, (*heads_k, lk, d + 1)),
    )


def brute_force(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keep: Callable[[tuple[int, ...], int, int], bool],
    sink: Callable[[tuple[int, ...]], float] | None = None,
    score: Callable[[float, tuple[int, ...], int, int], float] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One query row at a time in Python floats: ``keep(head_index, i, j)``,
    ``sink(head_index)`` and ``score(s, head_index, i, j)`` for every row of
    ``q [..., Hq, Lq, D]`` (``head_index``: the row's index over ``q.shape[:-2]``)."""
    heads, (lq, d) = q.shape[:-2], q.shape[-2:]
    hq, hk, lk = q.shape[-3], k.shape[-3], k.shape[-2]
    out = np.zeros((*heads, lq, v.shape[-1]))
    weights = np.zeros((*heads, lq, lk))
    lse = np.zeros((*heads, lq))
    for head in np.ndindex(*heads):
        kv = (*head[:-1], head[-1] // (hq // hk))
        for i in range(lq):
            logits = {}
            for j in range(lk):
                s = sum(q[(*head, i, c)] * k[(*kv, j, c)] for c in range(d)) / math.sqrt(d)
                s = s if score is None else score(s, head, i, j)
                if keep(head, i, j) and s != -math.inf:
                    logits[j] = s
            extra = [] if sink is None else [sink(head)]
            terms = list(logits.values()) + [x for x in extra if x != -math.inf]
            if not terms:
                lse[(*head, i)] = -math.inf
                continue
            top = max(terms)
            total = sum(math.exp(t - top) for t in terms)
            lse[(*head, i)] = top + math.log(total)
            for j, s in logits.items():
                weights[(*head, i, j)] = math.exp(s - lse[(*head, i)])
                out[(*head, i)] += weights[(*head, i, j)] * v[(*kv, j)]
    return out, weights, lse


def append_column(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, keep: np.ndarray, sinks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sink as one more column of the masked scores, a softmax, the column dropped
    (for finite sinks: every row then has a finite maximum)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    scores = np.where(keep, scores, -np.inf)
    column = np.broadcast_to(np.asarray(sinks)[..., None, None], (*scores.shape[:-1], 1))
    wide = np.concatenate([scores, column], axis=-1)
    top = wide.max(axis=-1, keepdims=True)
    exp = np.exp(wide - top)
    probs = exp / exp.sum(axis=-1, keepdims=True)
    lse = (top + np.log(exp.sum(axis=-1, keepdims=True)))[..., 0]
    weights = probs[..., :-1]
    return weights @ v, weights, lse


# ------------------------------------------------------------------------------------------
# sinks

SINK_CASES = {
    # id: (batch, Hq, Hk, Lq, Lk, sinks shape)
    "gqa-per-head": ((2,), 4, 2, 5, 7, (2, 4)),
    "mqa-heads-only": ((2,), 4, 1, 6, 4, (4,)),
    "one-sink": ((), 3, 3, 4, 4, ()),
    "broadcast-batch": ((2, 1), 2, 2, 3, 5, (1, 1, 2)),
    "2d": ((), 0, 0, 4, 6, ()),
    "2d-one": ((), 0, 0, 3, 3, (1,)),
}


@pytest.mark.parametrize("case", list(SINK_CASES))
def test_sinks_append_a_column_softmax_drop_it(case: str) -> None:
    batch, hq, hk, lq, lk, sink_shape = SINK_CASES[case]
    q, k, v = qkv(("sinks", case), batch, hq, hk, lq, lk)
    rng = rng_for("sinks-values", case)
    sinks = rng.standard_normal(sink_shape) * 2
    mask = rng.random((*q.shape[:-1], lk)) < 0.7
    mask[..., 1, :] = False  # a row with no key: out 0, weights 0, lse = sink
    two_d = q.ndim == 2
    wide_q, wide_k, wide_v = (a[None] for a in (q, k, v)) if two_d else (q, k, v)
    want = append_column(wide_q, wide_k, wide_v, mask, np.broadcast_to(sinks, wide_q.shape[:-2]))
    if two_d:
        want = tuple(a[0] for a in want)
    for got in both(q, k, v, mask=mask, sinks=sinks):
        assert_results(got, want)
        out, weights, lse = got
        assert (out[..., 1, :] == 0).all()
        assert (weights[..., 1, :] == 0).all()
        np.testing.assert_array_equal(
            lse[..., 1],
            np.reshape(sinks, lse.shape[:-1]) if two_d else np.broadcast_to(sinks, lse.shape[:-1]),
        )
        assert (weights.sum(axis=-1) < 1).all()  # the sink takes its share


@pytest.mark.parametrize("case", ["gqa-per-head", "2d"])
def test_sinks_brute_force(case: str) -> None:
    batch, hq, hk, lq, lk, sink_shape = SINK_CASES[case]
    q, k, v = qkv(("sinks-brute", case), batch, hq, hk, lq, lk)
    rng = rng_for("sinks-brute-values", case)
    sinks = rng.standard_normal(sink_shape)
    mask = rng.random((*q.shape[:-1], lk)) < 0.6
    mask[..., 0, :] = False
    two_d = q.ndim == 2
    wide = [a[None] for a in (q, k, v)] if two_d else [q, k, v]
    grid = np.broadcast_to(mask, (*wide[0].shape[:-1], lk))
    heads = np.broadcast_to(sinks, wide[0].shape[:-2])
    want = brute_force(*wide, lambda h, i, j: bool(grid[(*h, i, j)]), lambda h: float(heads[h]))
    if two_d:
        want = tuple(a[0] for a in want)
    for got in both(q, k, v, mask=mask, sinks=sinks):
        assert_results(got, want)


def test_sink_minus_inf_is_no_sink() -> None:
    q, k, v = qkv("sink-neginf", (2,), 4, 2, 5, 6)
    mask = rng_for("sink-neginf-mask").random((2, 4, 5, 6)) < 0.5
    mask[0, 0, 0] = False
    sinks = np.full((4,), -np.inf)
    sinks_partly = np.array([-np.inf, 0.5, -np.inf, 1.0])
    for with_sinks, without in zip(
        both(q, k, v, mask=mask, causal=True, sinks=sinks),
        both(q, k, v, mask=mask, causal=True),
        strict=True,
    ):
        for a, b in zip(with_sinks, without, strict=True):
            np.testing.assert_array_equal(a, b)
        assert with_sinks[2][0, 0, 0] == -np.inf  # no key and no sink: lse -inf
    for partly, without in zip(
        both(q, k, v, mask=mask, sinks=sinks_partly), both(q, k, v, mask=mask), strict=True
    ):
        for a, b in zip(partly, without, strict=True):
            np.testing.assert_array_equal(a[:, [0, 2]], b[:, [0, 2]])
        assert not np.allclose(partly[0][:, 1], without[0][:, 1])


def test_sink_with_no_key_at_all() -> None:
    """``Lk = 0`` and lower-right causal with ``Lq > Lk``: every row (or the early ones)
    is the sink alone: out 0, weights 0, lse = sink."""
    q, k, v = qkv("sink-nokey", (), 2, 2, 3, 0)
    sinks = np.array([0.25, -1.5])
    for out, weights, lse in both(q, k, v, sinks=sinks):
        assert out.shape == (2, 3, 4) and weights.shape == (2, 3, 0)
        assert (out == 0).all()
        np.testing.assert_array_equal(lse, np.repeat(sinks[:, None], 3, axis=1))
    q, k, v = qkv("sink-causal", (), 2, 2, 5, 2)
    for out, weights, lse in both(q, k, v, causal=True, sinks=sinks):
        assert (out[:, :3] == 0).all() and (weights[:, :3] == 0).all()
        np.testing.assert_array_equal(lse[:, :3], np.repeat(sinks[:, None], 3, axis=1))
        assert (lse[:, 3:] > sinks[:, None]).all()


@requires_backend("torch")
def test_reference_takes_sinks_of_any_framework() -> None:
    import torch

    q, k, v = qkv("sink-torch", (), 2, 1, 3, 4)
    sinks = np.array([0.5, -0.25], dtype=np.float32)
    ours = reference_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), sinks=torch.from_numpy(sinks)
    )
    want = reference_attention(q, k, v, sinks=sinks.astype(np.float64))
    assert_results(tuple(ours), tuple(want))


@pytest.mark.parametrize("sink_shape", [(2, 4), (4,), (1, 4), ()])
def test_sink_gradients(sink_shape: tuple[int, ...]) -> None:
    """The oracle's analytic d loss / d sinks equals finite differences (in sinks' shape),
    and the q, k, v gradients with sinks agree between ``loss_grads`` and the dict form."""
    q, k, v = qkv("sink-grad", (2,), 4, 2, 3, 4, d=2)
    rng = rng_for("sink-grad-values", sink_shape)
    sinks = rng.standard_normal(sink_shape)
    w_out, w_lse = rng.standard_normal((2, 4, 3, 3)), rng.standard_normal((2, 4, 3))
    mask = rng.random((2, 4, 3, 4)) < 0.7
    mask[0, 1, 2] = False
    numeric = oracle.loss_grads_with_bias(q, k, v, w_out, w_lse, sinks=sinks, mask=mask)
    analytic = oracle.sink_grads(q, k, v, w_out, w_lse, sinks=sinks, mask=mask)
    assert analytic.shape == np.shape(sinks) == numeric["sinks"].shape
    np.testing.assert_allclose(analytic, numeric["sinks"], rtol=1e-6, atol=1e-8)
    grads = oracle.loss_grads(q, k, v, w_out, w_lse, sinks=sinks, mask=mask)
    for name, g in zip("qkv", grads, strict=True):
        np.testing.assert_array_equal(g, numeric[name])


def test_sink_gradient_of_a_minus_inf_sink_is_zero() -> None:
    q, k, v = qkv("sink-grad-neginf", (), 2, 2, 3, 3, d=2)
    rng = rng_for("sink-grad-neginf-values")
    w_out, w_lse = rng.standard_normal((2, 3, 3)), rng.standard_normal((2, 3))
    mask = np.ones((2, 3, 3), dtype=bool)
    mask[0, 1] = False
    sinks = np.array([-np.inf, 0.5])
    grad = oracle.sink_grads(q, k, v, w_out, w_lse, sinks=sinks, mask=mask)
    assert grad[0] == 0 and np.isfinite(grad).all()


def test_sinks_must_broadcast_to_the_heads() -> None:
    q, k, v = qkv("sink-shape", (2,), 4, 2, 3, 3)
    with pytest.raises(ValueError, match="`sinks`"):
        reference_attention(q, k, v, sinks=np.zeros(3))
    with pytest.raises(ValueError, match="`sinks`"):
        reference_attention(q, k, v, sinks=np.zeros((2, 4, 3)))


# ------------------------------------------------------------------------------------------
# segment ids


def packed(lengths: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(lengths)), lengths)


def starts(lengths: list[int]) -> list[int]:
    return [0, *np.cumsum(lengths)[:-1].tolist()] if lengths else []


def assert_each_segment_alone(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_lengths: list[list[int]],
    k_lengths: list[list[int]],
    got: tuple[np.ndarray, ...],
    **kwargs: Any,
) -> None:
    """``got`` (of ``q [B, H, Lq, D]`` with per-row segments) equals each segment's
    queries attending its keys alone with ``kwargs``; zero weight across segments."""
    out, weights, lse = got
    for b, (ql, kl) in enumerate(zip(q_lengths, k_lengths, strict=True)):
        covered = np.zeros(weights.shape[-2:], dtype=bool)
        for q0, n_q, k0, n_k in zip(starts(ql), ql, starts(kl), kl, strict=True):
            if n_q == 0:
                continue
            rows, cols = slice(q0, q0 + n_q), slice(k0, k0 + n_k)
            alone = reference_attention(q[b, :, rows], k[b, :, cols], v[b, :, cols], **kwargs)
            np.testing.assert_allclose(out[b, :, rows], alone.out, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(lse[b, :, rows], alone.lse, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(weights[b, :, rows, cols], alone.weights, rtol=RTOL)
            covered[rows, cols] = True
        assert (weights[b][:, ~covered] == 0).all()


SEGMENT_OPTIONS = [
    pytest.param({}, id="no-band"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"causal": "upper_left"}, id="causal-upper-left"),
    pytest.param({"window": 1}, id="window-1"),
    pytest.param({"window": (2, 0)}, id="window-2-0"),
    pytest.param({"window": (None, 1), "causal": "upper_left"}, id="window-upper-left"),
    pytest.param({"window": (1, None), "causal": True}, id="window-causal"),
]


@pytest.mark.parametrize("options", SEGMENT_OPTIONS)
def test_self_segments_are_each_segment_alone(options: dict[str, Any]) -> None:
    lengths = [[3, 1, 0, 4, 2], [1, 1, 6, 0, 2]]  # length 1 and empty segments; L = 10
    q, k, v = qkv(("segments-self", str(options)), (2,), 4, 2, 10, 10)
    ids = np.stack([packed(row) for row in lengths]).astype(np.int32)
    for got in both(q, k, v, segment_ids=ids, **options):
        assert_each_segment_alone(q, k, v, lengths, lengths, got, **options)


@pytest.mark.parametrize("options", SEGMENT_OPTIONS)
def test_pair_segments_are_each_segment_alone(options: dict[str, Any]) -> None:
    """``(q_ids, kv_ids)`` with other lengths per segment for queries and keys: 0 queries,
    0 keys (those queries see nothing), fewer or more queries than keys."""
    q_lengths = [[2, 1, 0, 3, 1], [1, 4, 1, 1, 0]]  # Lq = 7
    k_lengths = [[4, 1, 2, 0, 2], [3, 2, 0, 1, 3]]  # Lk = 9
    q, k, v = qkv(("segments-pair", str(options)), (2,), 2, 2, 7, 9)
    q_ids = np.stack([packed(row) for row in q_lengths])
    kv_ids = np.stack([packed(row) for row in k_lengths])
    for got in both(q, k, v, segment_ids=(q_ids, kv_ids), **options):
        assert_each_segment_alone(q, k, v, q_lengths, k_lengths, got, **options)


@pytest.mark.parametrize("options", SEGMENT_OPTIONS[:4])
def test_segments_brute_force(options: dict[str, Any]) -> None:
    """Ids that are not one run per segment (id 0 in two runs) and padding (-1), on the
    contract's definition: same id, and the band on each position's place in its
    segment (all positions of its id: from the id's first or last position)."""
    q_ids = np.array([0, 0, 1, 1, 1, 0, -1])
    kv_ids = np.array([0, 1, 1, 0, 0, 0, -1, -1])
    q, k, v = qkv(("segments-brute", str(options)), (), 2, 1, 7, 8)
    causal, window = options.get("causal", False), options.get("window")
    left, right = (window, window) if isinstance(window, int) else (window or (None, None))
    right = 0 if causal is not False and right is None else right

    def extents(ids: np.ndarray) -> list[tuple[int, int]]:
        """(first position, one past the last) of each position's id."""
        where = {x: [i for i, y in enumerate(ids) if y == x] for x in set(ids.tolist())}
        return [(where[x][0], where[x][-1] + 1) for x in ids.tolist()]

    def place(i: int, bounds: list[tuple[int, int]]) -> int:
        start, end = bounds[i]
        return i - start if causal == "upper_left" else i - end

    qb, kb = extents(q_ids), extents(kv_ids)

    def keep(head: tuple[int, ...], i: int, j: int) -> bool:
        d = place(j, kb) - place(i, qb)
        if causal is not False and d > 0:
            return False
        return (
            q_ids[i] == kv_ids[j] and (left is None or d >= -left) and (right is None or d <= right)
        )

    want = brute_force(q, k, v, keep)
    for got in both(q, k, v, segment_ids=(q_ids, kv_ids), **options):
        assert_results(got, want)


def test_segment_ids_broadcast_over_batch_and_heads() -> None:
    """1-D ids for 4-D and 5-D q (every batch row alike); ``[1, L]`` ids too; 3-D and 2-D q
    take 1-D ids."""
    ids = packed([2, 3, 1])
    q, k, v = qkv("segments-broadcast", (2, 3), 2, 1, 6, 6)
    per_row = np.broadcast_to(ids, (2, 3, 6))
    for got, want in zip(
        both(q, k, v, segment_ids=ids[None], causal=True),
        both(q, k, v, segment_ids=per_row, causal=True),
        strict=True,
    ):
        assert_results(got, want)
    mask = ids[:, None] == ids[None, :]
    for heads in (0, 2):  # 2-D and 3-D q
        q, k, v = qkv(("segments-small", heads), (), heads, heads, 6, 6)
        for got, want in zip(both(q, k, v, segment_ids=ids), both(q, k, v, mask=mask), strict=True):
            assert_results(got, want)


def test_segment_ids_without_band_are_a_segment_mask() -> None:
    q, k, v = qkv("segments-as-mask", (2,), 2, 2, 5, 7)
    q_ids = np.array([[0, 0, 1, 2, 2], [3, 3, 3, 3, 4]])
    kv_ids = np.array([[0, 1, 1, 1, 2, 2, 2], [4, 4, 3, 3, 3, 5, 5]])
    mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    bias = rng_for("segments-as-mask-bias").standard_normal((2, 2, 5, 7))
    for got, want in zip(
        both(q, k, v, bias=bias, segment_ids=(q_ids, kv_ids)),
        both(q, k, v, bias=bias, mask=mask),
        strict=True,
    ):
        assert_results(got, want)


@requires_backend("torch", "jax")
def test_reference_takes_segment_ids_of_any_framework() -> None:
    import jax.numpy as jnp
    import torch

    q, k, v = qkv("segments-frameworks", (2,), 2, 2, 5, 5)
    ids = np.array([[0, 0, 1, 1, 1], [2, 3, 3, 3, 3]], dtype=np.int32)
    want = reference_attention(q, k, v, segment_ids=ids, causal=True)
    for ids_x in (torch.from_numpy(ids), jnp.asarray(ids)):
        got = reference_attention(q, k, v, segment_ids=ids_x, causal=True)
        assert_results(tuple(got), tuple(want))
    got = reference_attention(
        q, k, v, segment_ids=(torch.from_numpy(ids), jnp.asarray(ids)), causal=True
    )
    assert_results(tuple(got), tuple(want))


def test_segment_ids_errors() -> None:
    q, k, v = qkv("segments-errors", (2,), 2, 2, 4, 5)
    ids = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"Lq == Lk.*\(q_ids, kv_ids\)"):
        reference_attention(q, k, v, segment_ids=ids)
    with pytest.raises(ValueError, match="integer"):
        reference_attention(q, k, v, segment_ids=(ids.astype(float), np.zeros((2, 5), int)))
    with pytest.raises(ValueError, match=r"kv_ids.*\[\*batch, 5\]"):
        reference_attention(q, k, v, segment_ids=(ids, np.zeros((2, 4), int)))
    with pytest.raises(ValueError, match="pair"):
        reference_attention(q, k, v, segment_ids=(ids, ids, ids))
    with pytest.raises(ValueError, match="does not broadcast"):
        reference_attention(q, k, v, segment_ids=(np.zeros((3, 4), int), np.zeros((3, 5), int)))


# ------------------------------------------------------------------------------------------
# score_mod and mask_mod


def test_score_mod_is_a_bias() -> None:
    """A relative-position bias per head, and a per-batch offset: as ``bias=``."""
    q, k, v = qkv("score-mod-bias", (2, 3), 4, 2, 5, 6)
    slopes = np.array([0.5, -0.25, 1.0, 0.125])
    offsets = np.arange(6.0).reshape(2, 3) / 7

    def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return s + slopes[h] * (ki - qi) + offsets.reshape(-1)[b]

    i, j = np.arange(5)[:, None], np.arange(6)[None, :]
    bias = slopes[:, None, None] * (j - i) + offsets[..., None, None, None]
    for got, want in zip(
        both(q, k, v, score_mod=score_mod, softcap=2.0, causal=True),
        both(q, k, v, bias=bias, softcap=2.0, causal=True),
        strict=True,
    ):
        assert_results(got, want)


def test_mask_mod_is_a_window_and_a_mask() -> None:
    q, k, v = qkv("mask-mod-window", (2,), 2, 1, 4, 7)
    offset = 7 - 4  # lower-right: query i's aligned key is i + (Lk - Lq)

    def sliding(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (ki <= qi + offset) & (ki >= qi + offset - 2)

    for got, want in zip(
        both(q, k, v, mask_mod=sliding), both(q, k, v, window=(2, 0)), strict=True
    ):
        assert_results(got, want)
    lengths = np.array([3, 7])

    def padding(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return ki < lengths[b]

    mask = np.arange(7)[None, :] < lengths[:, None, None, None]
    for got, want in zip(
        both(q, k, v, mask_mod=padding, causal=True),
        both(q, k, v, mask=mask, causal=True),
        strict=True,
    ):
        assert_results(got, want)


def test_mods_run_in_order_after_softcap_and_bias_and_minus_inf_masks() -> None:
    q, k, v = qkv("mods-order", (), 2, 2, 3, 4)
    bias = rng_for("mods-order-bias").standard_normal((2, 3, 4))
    seen: dict[str, np.ndarray] = {}

    def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
        seen["score"] = s.copy()
        return np.where((qi == 1) | (ki == 0), -np.inf, s)  # row 1 empty, key 0 masked

    ref = reference_attention(q, k, v, score_mod=score_mod, bias=bias, softcap=1.5, scale=0.7)
    scores = 1.5 * np.tanh(0.7 * (q @ np.swapaxes(k, -1, -2)) / 1.5) + bias
    np.testing.assert_allclose(seen["score"], scores, rtol=1e-15)
    assert (ref.out[:, 1] == 0).all() and (ref.lse[:, 1] == -np.inf).all()
    assert (ref.weights[..., 0] == 0).all()
    for got in both(q, k, v, score_mod=score_mod, bias=bias, softcap=1.5, scale=0.7):
        assert_results(got, tuple(ref))


@pytest.mark.parametrize(
    ("batch", "hq"), [((2, 3), 4), ((2,), 3), ((), 2), ((), 0)], ids=["5d", "4d", "3d", "2d"]
)
def test_what_the_mods_receive(batch: tuple[int, ...], hq: int) -> None:
    q, k, v = qkv(("mods-receive", batch), batch, hq, 1 if hq else 0, 3, 5)
    two_d = q.ndim == 2
    nb = len(batch)
    calls = []

    def check_indices(b: Any, h: Any, qi: Any, ki: Any) -> None:
        for x in (b, h, qi, ki):
            assert isinstance(x, np.ndarray) and x.dtype == np.int32, (type(x), x.dtype)
        np.testing.assert_array_equal(qi, np.arange(3).reshape(3, 1))
        np.testing.assert_array_equal(ki, np.arange(5).reshape(1, 5))
        if two_d:
            assert b.shape == h.shape == (1, 1) and (b == 0).all() and (h == 0).all()
        else:
            assert b.shape == (*batch, 1, 1, 1), b.shape
            np.testing.assert_array_equal(b.reshape(-1), np.arange(math.prod(batch)))
            assert h.shape == (*([1] * nb), hq, 1, 1), h.shape
            np.testing.assert_array_equal(h.reshape(-1), np.arange(hq))

    def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
        assert isinstance(s, np.ndarray) and s.dtype == np.float64
        assert s.shape == ((3, 5) if two_d else (*batch, hq, 3, 5)), s.shape
        check_indices(b, h, qi, ki)
        calls.append("score_mod")
        return s

    def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        check_indices(b, h, qi, ki)
        calls.append("mask_mod")
        return qi >= 0

    for got, want in zip(
        both(q, k, v, score_mod=score_mod, mask_mod=mask_mod), both(q, k, v), strict=True
    ):
        assert_results(got, want)
    assert calls == ["score_mod", "mask_mod"] * 2


def test_mod_errors() -> None:
    q, k, v = qkv("mods-errors", (), 2, 2, 3, 3)
    with pytest.raises(TypeError, match="`score_mod` must be a callable"):
        reference_attention(q, k, v, score_mod=np.zeros(3))
    with pytest.raises(TypeError, match="`mask_mod` must be a callable"):
        reference_attention(q, k, v, mask_mod=True)
    with pytest.raises(ValueError, match="`mask_mod` must return a boolean"):
        reference_attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi - ki)
    with pytest.raises(ValueError, match=r"`score_mod`.*does not broadcast"):
        reference_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s[..., :2])


# ------------------------------------------------------------------------------------------
# everything at once: the two references agree


@pytest.mark.parametrize("causal", [False, True, "upper_left"])
def test_all_features_together(causal: bool | str) -> None:
    q, k, v = qkv(("together", causal), (2,), 4, 2, 6, 8)
    rng = rng_for("together-values", causal)
    mask = rng.random((2, 1, 6, 8)) < 0.8
    bias = rng.standard_normal((4, 6, 8)) / 2
    sinks = rng.standard_normal((2, 4))
    q_ids = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    kv_ids = np.array([[0, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 6]])

    def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return s - 0.125 * np.abs(qi - ki) * (h + 1)

    def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
        return (h != 3) | (ki % 2 == 0)

    options = {
        "mask": mask,
        "bias": bias,
        "sinks": sinks,
        "softcap": 3.0,
        "causal": causal,
        "window": (3, 1),
        "segment_ids": (q_ids, kv_ids),
        "score_mod": score_mod,
        "mask_mod": mask_mod,
    }
    ref, orc = both(q, k, v, **options)
    assert_results(ref, orc)
    # and as plain masks and biases (the segment band written out by the oracle)
    keep = mask & oracle.segment_positions(q_ids, kv_ids, causal=causal, window=(3, 1))
    keep = keep & ((np.arange(4) != 3)[:, None, None] | (np.arange(8) % 2 == 0))
    plain_bias = bias - 0.125 * np.abs(np.arange(6)[:, None] - np.arange(8)) * np.arange(
        1, 5
    ).reshape(4, 1, 1)
    got = reference_attention(
        q, k, v, mask=keep, bias=plain_bias, sinks=sinks, softcap=3.0, causal=False
    )
    # the softcap applies before the bias in both: the same scores
    assert_results(tuple(got), ref)


# ------------------------------------------------------------------------------------------
# torch's FlexAttention (CPU, eager: it warns that it materializes the scores) on one mod


def _flex(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> tuple[Any, Any]:
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    mask_mod = kwargs.pop("mask_mod", None)
    if mask_mod is not None:
        kwargs["block_mask"] = create_block_mask(
            mask_mod, None, None, q.shape[-2], k.shape[-2], device="cpu"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = flex_attention(
            *(torch.from_numpy(a) for a in (q, k, v)),
            enable_gqa=q.shape[-3] != k.shape[-3],
            return_aux=AuxRequest(lse=True),
            **kwargs,
        )
    return out.numpy(), aux.lse.numpy()


def _causal_window(b: Any, h: Any, qi: Any, ki: Any) -> Any:
    # Written with operators only: the same function runs on NumPy and torch indices.
    return (ki <= qi) & (qi - ki <= 2)


def _relative(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
    # 0.125 and small ints are exact in float32, which torch's int * float gives
    return s + 0.125 * (ki - qi) - 0.25 * h


@requires_backend("torch")
@pytest.mark.parametrize(
    "mods",
    [
        pytest.param({"mask_mod": _causal_window}, id="mask_mod"),
        pytest.param({"score_mod": _relative}, id="score_mod"),
        pytest.param({"mask_mod": _causal_window, "score_mod": _relative}, id="both"),
    ],
)
def test_against_torch_flex_attention(mods: dict[str, Any]) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = qkv(("flex", str(mods)), (2,), 4, 2, 6, 6)
    out, lse = _flex(q, k, v, **mods)
    ref = reference_attention(q, k, v, **mods)
    np.testing.assert_allclose(out, ref.out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref.lse, rtol=1e-10, atol=1e-12)
    if "mask_mod" in mods:  # the same band through the options
        np.testing.assert_allclose(
            reference_attention(q, k, v, causal=True, window=(2, 0)).out,
            reference_attention(q, k, v, mask_mod=_causal_window).out,
            rtol=RTOL,
        )
