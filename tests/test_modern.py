"""Issue 18 through ``attend``: ``sinks``, ``segment_ids``, ``score_mod`` and ``mask_mod``
(block plans included) on every backend and every path, against the float64 oracle
(``tests/oracle.py``), alone and combined with each other and with causal, window, mask,
bias, softcap, GQA, lse and weights; packed sequences against each sequence run alone;
gradients (torch autograd, ``jax.grad``/``jit``/``vmap``, ``attend_backward``) against the
oracle's finite differences; what ``plan()`` says; the errors; and that the blocks a block
plan or segment ids rule out are never computed.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np
import pytest
from portable_attention import attend, attend_backward, masks, plan
from portable_attention.masks import BlockPlan, block_plan
from portable_attention.testing import reference_attention

import oracle
from conftest import BACKENDS, BY_NAME, Backend, foreign_array, requires_backend
from helpers import Capture, assert_close, assert_like, check_against_oracle, randn, rng_for

B, HQ, HK, L, D = 2, 4, 2, 24, 8
LQ = 10  # the query length of the (q_ids, kv_ids) cases: fewer queries than keys
CHUNK = 5  # the chunked path's block length, and every block plan's (24 = 4 * 5 + 4)
Q = (B, HQ, L, D)
KV = (B, HK, L, D)
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}

ScoreMod = Callable[..., Any]
Factory = Callable[[dict[str, Any]], Callable[..., Any]]


# ------------------------------------------------------------------------------------------
# Mods written once against the array API: the same function runs on the backend's arrays
# (inside attend) and on NumPy's (inside the oracle). Captured arrays come in a dict ``c``.


def _ns(x: Any) -> Any:
    return array_api_compat.array_namespace(x)


def gather(table: Any, idx: Any) -> Any:
    """``table[idx]`` for a 1-D ``table`` and an integer ``idx`` of any shape."""
    xp = _ns(table)
    flat = xp.reshape(xp.astype(idx, xp.int64), (-1,))
    return xp.reshape(xp.take(table, flat, axis=0), tuple(idx.shape))


def relative_bias(lq: int) -> Factory:
    """A learned relative-position bias per head: ``c["rel"] [Hq, Lq + Lk - 1]``."""

    def make(c: dict[str, Any]) -> ScoreMod:
        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            xp = _ns(score)
            table = c["rel"]
            width = table.shape[-1]
            idx = h * width + (kv_idx - q_idx + (lq - 1))
            return score + xp.astype(gather(xp.reshape(table, (-1,)), idx), score.dtype)

        return score_mod

    return make


def tanh_cap(cap: float) -> Factory:
    def make(c: dict[str, Any]) -> ScoreMod:
        def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            xp = _ns(score)
            return cap * xp.tanh(score / cap)

        return score_mod

    return make


def alibi_by_batch(c: dict[str, Any]) -> ScoreMod:
    """Reads ``b`` and ``h``: ``c["slopes"] [Hq]``, ``c["shift"] [B]``."""

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _ns(score)
        distance = xp.astype(xp.abs(q_idx - kv_idx), score.dtype)
        slope = xp.astype(gather(c["slopes"], h), score.dtype)
        shift = xp.astype(gather(c["shift"], b), score.dtype)
        return score - slope * distance + shift

    return score_mod


def upper_neginf(c: dict[str, Any]) -> ScoreMod:
    """A score_mod that masks (``-inf``) the keys more than 2 past the query."""

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _ns(score)
        return xp.where(kv_idx > q_idx + 2, -xp.inf, score)

    return score_mod


def sliding(w: int) -> Factory:
    def make(c: dict[str, Any]) -> Callable[..., Any]:
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx - kv_idx <= w) & (kv_idx - q_idx <= w)

        return mask_mod

    return make


def causal_mm(c: dict[str, Any]) -> Callable[..., Any]:
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx

    return mask_mod


def document(causal: bool = False) -> Factory:
    """The document mask of ``c["doc"] [L]`` (and causal within it)."""

    def make(c: dict[str, Any]) -> Callable[..., Any]:
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            same = gather(c["doc"], q_idx) == gather(c["doc"], kv_idx)
            return same & (kv_idx <= q_idx) if causal else same

        return mask_mod

    return make


def document_by_batch(c: dict[str, Any]) -> Callable[..., Any]:
    """Reads ``b``: the document mask of ``c["docs"] [B, L]``, one row per batch entry."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        xp = _ns(q_idx)
        flat = xp.reshape(c["docs"], (-1,))
        width = c["docs"].shape[-1]
        return gather(flat, b * width + q_idx) == gather(flat, b * width + kv_idx)

    return mask_mod


def by_head(c: dict[str, Any]) -> Callable[..., Any]:
    """Reads ``h``: even heads are causal, odd heads see a window of 6 either side."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        band = (q_idx - kv_idx <= 6) & (kv_idx - q_idx <= 6)
        return ((h % 2 == 0) & (kv_idx <= q_idx)) | ((h % 2 == 1) & band)

    return mask_mod


def some_rows_empty(c: dict[str, Any]) -> Callable[..., Any]:
    """Masks every key of the queries 3, 10, 17 (shape ``[rows, 1]``: broadcast by attend)."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx % 7 != 3

    return mask_mod


# ------------------------------------------------------------------------------------------
# Inputs


def ids_from_lengths(lengths: Any, total: int | None = None) -> np.ndarray:
    return np.asarray(masks.segment_ids_from_lengths(np.asarray(lengths), total))


def _sinks(shape: tuple[int, ...], *special: tuple[tuple[int, ...], float]) -> Callable:
    def make(rng: np.random.Generator) -> np.ndarray:
        s = randn(rng, shape)
        for index, value in special:
            s[index] = value
        return s

    return make


def _mask_empty_rows(lq: int = L, lk: int = L) -> Callable:
    def make(rng: np.random.Generator) -> np.ndarray:
        m = rng.random((lq, lk)) < 0.6
        m[:, 0] = True
        m[2] = m[lq - 3] = False  # two rows with no key
        return m

    return make


def _bias(shape: tuple[int, ...], neginf: bool = False) -> Callable:
    def make(rng: np.random.Generator) -> np.ndarray:
        b = randn(rng, shape)
        if neginf:
            b[..., 1, :] = -np.inf  # query 1 has no key
            b[..., 4, 3] = -np.inf
        return b

    return make


def _const(value: Any) -> Callable:
    return lambda rng: value


@dataclass(frozen=True)
class Case:
    """One call: shapes, static options, and makers of its arrays and mods."""

    id: str
    q: tuple[int, ...] = Q
    k: tuple[int, ...] = KV
    v: tuple[int, ...] = KV
    options: dict[str, Any] = field(default_factory=dict)  # causal, window, softcap, scale
    mask: Callable | None = None
    bias: Callable | None = None
    sinks: Callable | None = None
    segments: Callable | None = None  # rng -> int array, or a pair of them
    captures: Callable | None = None  # rng -> {name: NumPy array} the mods read
    score_mod: Factory | None = None
    mask_mod: Factory | None = None
    block_plan: dict[str, Any] | None = None  # batch=/heads= of masks.block_plan

    def data(self) -> dict[str, Any]:
        rng = rng_for("modern", self.id)
        d: dict[str, Any] = {n: randn(rng, getattr(self, n)) for n in "qkv"}
        for name in ("mask", "bias", "sinks", "segments", "captures"):
            maker = getattr(self, name)
            d[name] = None if maker is None else maker(rng)
        d["w_out"] = randn(rng, (*self.q[:-1], self.v[-1]))
        d["w_lse"] = randn(rng, self.q[:-1])
        return d

    @property
    def modded(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None


def _convert(backend: Backend, x: Any, dtype_name: str) -> Any:
    """NumPy data -> the backend's arrays: floats in ``dtype_name``, ints and bools as they
    are, pairs pairwise."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(_convert(backend, a, dtype_name) for a in x)
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return backend.asarray(x, dtype_name)
    if x.dtype == np.int32:
        return backend.asarray(x, backend.xp.int32)
    return backend.asarray(x)


@dataclass
class Inputs:
    q: Any
    k: Any
    v: Any
    kwargs: dict[str, Any]  # attend's, without path or forms
    oracle_kwargs: dict[str, Any]  # the oracle's, NumPy
    ref: tuple[np.ndarray, np.ndarray, np.ndarray]
    empty: np.ndarray  # [..., Hq, Lq]: rows with no key (the sinks aside)
    sink_rows: np.ndarray | None  # the sinks broadcast to lse's shape
    captured: dict[str, Any]  # the backend's arrays the mods read


def make_inputs(backend: Backend, dtype_name: str, case: Case) -> Inputs:
    d = case.data()
    q, k, v = (backend.asarray(d[n], dtype_name) for n in "qkv")
    captured = {n: _convert(backend, a, dtype_name) for n, a in (d["captures"] or {}).items()}
    np_captured = {n: backend.to_numpy(a) for n, a in captured.items()}
    kwargs: dict[str, Any] = dict(case.options)
    ref_kwargs: dict[str, Any] = dict(case.options)
    for name, key in (("mask", "mask"), ("bias", "bias"), ("sinks", "sinks")):
        if d[name] is not None:
            kwargs[key] = _convert(backend, d[name], dtype_name)
            ref_kwargs[key] = backend.to_numpy(kwargs[key])
    if d["segments"] is not None:
        kwargs["segment_ids"] = _convert(backend, d["segments"], dtype_name)
        ref_kwargs["segment_ids"] = d["segments"]
    if case.score_mod is not None:
        kwargs["score_mod"] = case.score_mod(captured)
        ref_kwargs["score_mod"] = case.score_mod(np_captured)
    if case.mask_mod is not None:
        fn = case.mask_mod(captured)
        if case.block_plan is not None:
            fn = block_plan(fn, case.q[-2], case.k[-2], block_size=CHUNK, like=q, **case.block_plan)
        kwargs["mask_mod"] = fn
        ref_kwargs["mask_mod"] = case.mask_mod(np_captured)
    qn, kn, vn = (backend.to_numpy(x) for x in (q, k, v))
    ref = oracle.attention(qn, kn, vn, **ref_kwargs)
    no_sinks = {n: a for n, a in ref_kwargs.items() if n != "sinks"}
    empty = np.isneginf(oracle.attention(qn, kn, vn, **no_sinks)[2])
    sink_rows = None
    if d["sinks"] is not None:
        heads = case.q[:-2]
        s = ref_kwargs["sinks"].reshape(()) if not heads else ref_kwargs["sinks"]
        sink_rows = np.broadcast_to(np.broadcast_to(s, heads)[..., None], case.q[:-1])
    return Inputs(q, k, v, kwargs, ref_kwargs, ref, empty, sink_rows, captured)


def unpack(result: Any, weights: bool, lse: bool) -> tuple[Any, Any, Any]:
    if not (weights or lse):
        assert not isinstance(result, tuple)
        return result, None, None
    assert isinstance(result, tuple) and len(result) == 1 + weights + lse
    rest = list(result[1:])
    return result[0], rest.pop(0) if weights else None, rest.pop(0) if lse else None


def check_result(
    backend: Backend, dtype_name: str, inp: Inputs, result: tuple[Any, Any, Any]
) -> None:
    """Against the oracle (framework, device, dtype, shape, values, empty rows), and with
    sinks: rows with no key give out 0, weights 0 and lse = the sink exactly."""
    check_against_oracle(backend, dtype_name, inp.q, result, inp.ref)
    out, weights, lse = result
    assert np.all(backend.to_numpy(out)[inp.empty] == 0.0), "out not 0 on rows with no key"
    if weights is not None:
        assert np.all(backend.to_numpy(weights)[inp.empty] == 0.0), "weights on empty rows"
    if lse is not None and inp.sink_rows is not None:
        np.testing.assert_array_equal(
            backend.to_numpy(lse)[inp.empty], inp.sink_rows[inp.empty], err_msg="lse = sink"
        )


# ------------------------------------------------------------------------------------------
# The cases

PAIR_Q = [2, 1, 0, 3, 4]  # queries per segment (10): segment 2 has none
PAIR_K = [5, 0, 3, 1, 15]  # keys per segment (24): segment 1 has none, segment 3 one


def _pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return ids_from_lengths(PAIR_Q), ids_from_lengths(PAIR_K)


def _pair_q_longer(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    # segment 0: 6 queries, 2 keys; segment 1: 4 queries, 22 keys
    return ids_from_lengths([6, 4]), ids_from_lengths([2, 22])


SELF_LENGTHS = [5, 1, 0, 7, 11]  # 24: a length-1 and an empty segment
BATCH_LENGTHS = [[7, 1, 0, 9], [3, 3, 12, 0]]  # per batch row; 17 and 18 of 24: -1 padding


def _self_ids(rng: np.random.Generator) -> np.ndarray:
    return ids_from_lengths(SELF_LENGTHS)


def _batch_ids(rng: np.random.Generator) -> np.ndarray:
    return ids_from_lengths(BATCH_LENGTHS, L)


def random_lengths(rng: np.random.Generator, total: int, n: int) -> list[int]:
    """``n`` random lengths summing to ``total`` (repeated cuts give empty segments)."""
    cuts = np.sort(rng.integers(0, total + 1, size=n - 1))
    return [int(x) for x in np.diff(np.concatenate([[0], cuts, [total]]))]


def _random_self(rng: np.random.Generator) -> np.ndarray:
    return ids_from_lengths(random_lengths(rng, L - 3, 6), L)  # 3 positions of padding


def _random_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return ids_from_lengths(random_lengths(rng, LQ, 5)), ids_from_lengths(random_lengths(rng, L, 5))


def _rel(lq: int, lk: int = L, hq: int = HQ) -> Callable:
    return lambda rng: {"rel": 0.5 * randn(rng, (hq, lq + lk - 1))}


def _doc(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"doc": ids_from_lengths([10, 5, 3, 6])}  # blocks of 5: some full, some partial


def _docs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"docs": ids_from_lengths([[10, 14], [12, 12]])}


def _slopes(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"slopes": np.array([0.5, 0.25, 0.125, 0.0625]), "shift": np.array([0.3, -0.7])}


SQ = (B, HQ, LQ, D)
CASES = [
    # sinks
    Case("sinks_hq", sinks=_sinks((HQ,))),
    Case("sinks_b_hq_causal", sinks=_sinks((B, HQ)), options={"causal": True}),
    Case("sinks_b1_mqa", k=(B, 1, L, D), v=(B, 1, L, 6), sinks=_sinks((B, 1))),
    Case("sinks_empty_rows", mask=_mask_empty_rows(), sinks=_sinks((HQ,))),
    Case(
        "sinks_neginf",
        mask=_mask_empty_rows(),
        sinks=_sinks((HQ,), ((1,), -np.inf), ((3,), -np.inf)),
    ),
    Case("sinks_extreme", sinks=_const(np.array([30.0, -30.0, 0.0, 3.0]))),
    Case("sinks_2d", q=(L, D), k=(L, D), v=(L, D), sinks=_sinks(()), options={"causal": True}),
    Case(
        "sinks_lq_lt_lk_window",
        q=SQ,
        sinks=_sinks((HQ,)),
        options={"causal": True, "window": (3, None)},
    ),
    # segment ids
    Case("seg_self", segments=_self_ids),
    Case("seg_self_causal", segments=_self_ids, options={"causal": True}),
    Case("seg_self_upper_left", segments=_self_ids, options={"causal": "upper_left"}),
    Case("seg_self_window", segments=_self_ids, options={"window": (2, 1)}),
    Case("seg_self_window_causal", segments=_self_ids, options={"window": 3, "causal": True}),
    Case("seg_batch_causal", segments=_batch_ids, options={"causal": True}),
    Case("seg_int32", segments=lambda rng: _self_ids(rng).astype(np.int32)),
    Case("seg_random", segments=_random_self, options={"causal": True, "window": (5, 0)}),
    Case("seg_random_pair", q=SQ, segments=_random_pair, options={"causal": True}),
    Case("seg_pair", q=SQ, segments=_pair),
    Case("seg_pair_causal", q=SQ, segments=_pair, options={"causal": True}),
    Case("seg_pair_upper_left", q=SQ, segments=_pair, options={"causal": "upper_left"}),
    Case("seg_pair_window", q=SQ, segments=_pair, options={"window": (3, 0)}),
    Case("seg_pair_q_longer", q=SQ, segments=_pair_q_longer, options={"causal": True}),
    Case(
        "seg_pair_batch",
        q=SQ,
        segments=lambda rng: (
            ids_from_lengths([[4, 6], [9, 1]]),
            ids_from_lengths([[12, 12], [20, 4]]),
        ),
        options={"causal": True},
    ),
    # score_mod
    Case("sm_relative_bias", captures=_rel(L), score_mod=relative_bias(L)),
    Case("sm_relative_bias_lq_lt_lk", q=SQ, captures=_rel(LQ), score_mod=relative_bias(LQ)),
    Case("sm_tanh", score_mod=tanh_cap(2.0)),
    Case("sm_alibi_b_h", captures=_slopes, score_mod=alibi_by_batch, options={"causal": True}),
    Case("sm_neginf", score_mod=upper_neginf, options={"window": (4, None)}),
    # mask_mod, and block plans of it
    Case("mm_sliding", mask_mod=sliding(4)),
    Case("mm_document", captures=_doc, mask_mod=document()),
    Case("mm_document_batch", captures=_docs, mask_mod=document_by_batch),
    Case("mm_by_head", mask_mod=by_head),
    Case("mm_empty_rows", mask_mod=some_rows_empty),
    Case("mm_causal_lq_lt_lk", q=SQ, mask_mod=causal_mm),
    Case("plan_sliding", mask_mod=sliding(4), block_plan={}),
    Case("plan_document", captures=_doc, mask_mod=document(), block_plan={}),
    Case("plan_document_causal", captures=_doc, mask_mod=document(True), block_plan={}),
    Case("plan_by_batch", captures=_docs, mask_mod=document_by_batch, block_plan={"batch": B}),
    Case("plan_by_head", mask_mod=by_head, block_plan={"heads": HQ}),
    # together, and with everything else
    Case(
        "sinks_segments",
        sinks=_sinks((B, HQ)),
        segments=_batch_ids,
        options={"causal": True},
    ),
    Case(
        "sinks_score_mod_mask_mod",
        sinks=_sinks((HQ,)),
        captures=_rel(L),
        score_mod=relative_bias(L),
        mask_mod=some_rows_empty,
    ),
    Case(
        "segments_plan_softcap",
        segments=_self_ids,
        captures=_doc,
        mask_mod=document(),
        block_plan={},
        options={"softcap": 3.0, "causal": True},
    ),
    Case(
        "all_self",
        mask=_mask_empty_rows(),
        bias=_bias((HQ, L, L), neginf=True),
        sinks=_sinks((B, HQ), ((0, 2), -np.inf)),
        segments=_batch_ids,
        captures=_slopes,
        score_mod=alibi_by_batch,
        mask_mod=sliding(6),
        options={"causal": True, "softcap": 4.0, "scale": 0.5},
    ),
    Case(
        "all_pair_plan",
        q=SQ,
        mask=_mask_empty_rows(LQ, L),
        bias=_bias((1, L)),
        sinks=_sinks((HQ,)),
        segments=_pair,
        captures=_rel(LQ),
        score_mod=relative_bias(LQ),
        mask_mod=causal_mm,
        block_plan={},
        options={"window": (6, 0), "softcap": 5.0},
    ),
    Case(
        "all_upper_left_mqa",
        q=SQ,
        k=(B, 1, L, D),
        v=(B, 1, L, 6),
        bias=_bias((B, HQ, LQ, 1)),
        sinks=_sinks((1, HQ)),
        segments=_pair,
        mask_mod=by_head,
        options={"causal": "upper_left", "window": 2},
    ),
]
BY_ID = {c.id: c for c in CASES}

# Each path of attend: the dense portable core, the chunked one (online softmax over
# blocks of CHUNK; the block plans' block length), and what auto picks.
PATHS = {
    "portable": {"implementation": "portable"},
    "chunked": {"implementation": "portable", "chunk_size": CHUNK},
    "auto": {},
}
FORMS = [(True, True), (False, False), (False, True)]  # (return_weights, return_lse)


#: JAX compiles every call afresh (a new mod is a new function; about a second a call):
#: it runs these cases, one form per path; the other backends run them all.
JAX_IDS = {"plan_by_head", "all_self", "all_pair_plan"}


def _paths_of(b: Backend) -> tuple[str, ...]:
    """auto only where the backend has a kernel of its own to pick (as test_attend's);
    on JAX auto is the portable path here (test_plan_says_the_path checks it)."""
    if b.name in ("numpy", "torch"):
        return ("portable", "chunked", "auto")
    return ("portable", "chunked")


def _forms_of(b: Backend, path: str) -> list[tuple[bool, bool]]:
    if path == "chunked":
        return [(False, False), (False, True)] if b.name != "jax" else [(False, True)]
    return FORMS if b.name != "jax" else [(True, True)]


def expected_path(b: Backend, case: Case, path: str, weights: bool) -> str:
    if path == "chunked":
        return "portable:blockwise"
    scores = math.prod(case.q[:-1]) * case.k[-2]
    if path == "auto" and b.name == "numpy" and not weights and scores >= 1 << 16:
        return "portable:blockwise"  # NumPy's auto from 64K scores on
    if case.block_plan is not None and not weights:
        return "portable:blockwise"  # the plan skips blocks (test_block_plans_match_brute_force)
    return "portable:dense"


def run_case(b: Backend, dtype_name: str, case: Case, path: str) -> None:
    inp = make_inputs(b, dtype_name, case)
    for weights, lse in _forms_of(b, path):
        call = {**inp.kwargs, **PATHS[path], "return_weights": weights, "return_lse": lse}
        assert plan(inp.q, inp.k, inp.v, **call).path == expected_path(b, case, path, weights)
        result = attend(inp.q, inp.k, inp.v, **call)
        check_result(b, dtype_name, inp, unpack(result, weights, lse))


def _params(
    dtypes: tuple[str, ...],
    ids: set[str] | None = None,
    jax_ids: set[str] = JAX_IDS,
    jax_paths: tuple[str, ...] = ("portable", "chunked"),
) -> list[Any]:
    return [
        pytest.param(b, d, case, path, id=f"{b.name}-{d}-{case.id}-{path}")
        for b in BACKENDS
        for d in dtypes
        if d in b.dtypes
        for case in CASES
        if (ids is None or case.id in ids) and (b.name != "jax" or case.id in jax_ids)
        for path in _paths_of(b)
        if b.name != "jax" or path in jax_paths
    ]


@pytest.mark.parametrize(("bk", "dtype_name", "case", "path"), _params(("float64",)))
def test_matches_oracle(bk: Backend, dtype_name: str, case: Case, path: str) -> None:
    with bk.flags():
        run_case(bk, dtype_name, case, path)


FLOAT32_IDS = {
    "sinks_b_hq_causal",
    "sinks_neginf",
    "sinks_extreme",
    "seg_pair_causal",
    "seg_batch_causal",
    "sm_relative_bias_lq_lt_lk",
    "plan_document_causal",
    "all_self",
    "all_pair_plan",
}
HALF_IDS = {"sinks_neginf", "seg_pair_causal", "all_pair_plan"}


@pytest.mark.parametrize(
    ("bk", "dtype_name", "case", "path"),
    _params(("float32",), FLOAT32_IDS, set())
    + _params(("float16",), HALF_IDS, set())
    + _params(("bfloat16",), HALF_IDS, {"seg_pair_causal"}, ("chunked",)),
)
def test_matches_oracle_low_precision(bk: Backend, dtype_name: str, case: Case, path: str) -> None:
    """The tolerance table's float32 and half rows (half computes in float32: lse, the
    score_mod's scores and the sinks' merge)."""
    with bk.flags():
        run_case(bk, dtype_name, case, path)


def test_cases_cover_what_they_claim() -> None:
    """The cases' rows with no key, -inf sinks, segments of length 0 and 1, and the
    public reference agreeing with the oracle on a combined case."""
    np_backend = BY_NAME.get("numpy")
    if np_backend is None:
        pytest.skip("numpy not selected")
    for name in ("sinks_empty_rows", "sinks_neginf", "seg_pair_causal", "mm_empty_rows"):
        inp = make_inputs(np_backend, "float64", BY_ID[name])
        assert inp.empty.any(), name
    neginf = make_inputs(np_backend, "float64", BY_ID["sinks_neginf"])
    assert np.isneginf(neginf.ref[2]).any() and np.isfinite(neginf.ref[2]).any()
    assert 1 in SELF_LENGTHS and 0 in SELF_LENGTHS and 0 in PAIR_Q and 0 in PAIR_K
    assert (_batch_ids(None) == -1).any()
    inp = make_inputs(np_backend, "float64", BY_ID["all_self"])
    public = reference_attention(
        np_backend.to_numpy(inp.q),
        np_backend.to_numpy(inp.k),
        np_backend.to_numpy(inp.v),
        **inp.oracle_kwargs,
    )
    for a, b in zip(public, inp.ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    # the tanh score_mod is the softcap option (after the scale): attend's against it
    tanh = make_inputs(np_backend, "float64", BY_ID["sm_tanh"])
    q, k, v = (np_backend.to_numpy(x) for x in (tanh.q, tanh.k, tanh.v))
    capped = oracle.attention(q, k, v, softcap=2.0)
    np.testing.assert_allclose(tanh.ref[0], capped[0], rtol=1e-12, atol=1e-13)
    got = attend(tanh.q, tanh.k, tanh.v, score_mod=tanh.kwargs["score_mod"], chunk_size=CHUNK)
    assert_close(got, capped[0], "float64")


# ------------------------------------------------------------------------------------------
# plan(): the path and the reason, on every backend and case (no call runs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_says_the_path(backend: Backend, case: Case) -> None:
    """Every path and form of every case: what plan() picks (torch and JAX decline their
    fused kernels, NumPy's auto runs calls of 64K scores and more but the weights' on the
    blockwise path, JAX's declines all); ``implementation="fused"`` raises with the reason
    naming what the kernel does not take."""
    inp = make_inputs(backend, "float64", case)
    q, k, v = inp.q, inp.k, inp.v
    words = (
        "score_mod" if case.modded else "segment ids" if "segment_ids" in inp.kwargs else "sinks"
    )
    for path in ("portable", "chunked", "auto"):
        for weights, _ in FORMS:
            if path == "chunked" and weights:
                continue
            call = {**inp.kwargs, **PATHS[path], "return_weights": weights}
            want = expected_path(backend, case, path, weights)
            if path == "auto" and backend.name != "numpy":
                want = expected_path(backend, case, "portable", weights)
            got = plan(q, k, v, **call)
            assert got.path == want, (path, weights, got)
            if path == "auto" and backend.name in ("torch", "jax"):
                assert words in got.reason, got.reason
    if backend.name in ("torch", "jax"):
        with pytest.raises(ValueError, match=rf"`implementation\b(?s:.*){words}"):
            plan(q, k, v, implementation="fused", **inp.kwargs)


def test_block_plans_match_brute_force(backend: Backend) -> None:
    """Every block plan of the cases: its kept and full blocks are those of the mod's
    dense mask (evaluated here on NumPy over the whole grid), it skips some blocks, and
    one built without ``batch=``/``heads=`` for a mod that reads them is refused (it
    would skip blocks the call needs)."""
    saw_full = False
    for case in CASES:
        if case.block_plan is None:
            continue
        inp = make_inputs(backend, "float64", case)
        p = inp.kwargs["mask_mod"]
        assert isinstance(p, BlockPlan)
        lq, lk = case.q[-2], case.k[-2]
        b, h, qi, ki = oracle.mod_indices(case.q, lk)
        dense = np.asarray(inp.oracle_kwargs["mask_mod"](b, h, qi, ki))
        kept, full = _dense_blocks(np.broadcast_to(dense, (*case.q[:-1], lk)))
        assert set(p.kept) == kept, case.id
        assert set(p.full) == full, case.id
        saw_full = saw_full or bool(full)
        assert p.density < 1, case.id
        assert (p.q_len, p.kv_len, p.block_size) == (lq, lk, CHUNK)
        if case.block_plan:  # built with batch=/heads=: without them, refused
            with pytest.raises(ValueError, match=r"reads `[bh]`.*build the plan with"):
                block_plan(p.mask_mod, lq, lk, block_size=CHUNK, like=inp.q)
    assert saw_full


# ------------------------------------------------------------------------------------------
# Packed sequences: each segment alone


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(lengths)
    return [(int(e - n), int(e)) for n, e in zip(lengths, ends, strict=True)]


PACKED = {
    # id: (query lengths, key lengths or None for one array, options)
    "self": (SELF_LENGTHS, None, {}),
    "self_causal": (SELF_LENGTHS, None, {"causal": True}),
    "self_window_upper_left": (SELF_LENGTHS, None, {"causal": "upper_left", "window": 2}),
    "pair_causal": (PAIR_Q, PAIR_K, {"causal": True}),
    "pair_upper_left": (PAIR_Q, PAIR_K, {"causal": "upper_left"}),
    "pair_window": (PAIR_Q, PAIR_K, {"window": (2, 1)}),
}


def _jit_on_jax(backend: Backend, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``jax.jit`` on JAX (one compile for all its calls, which eager JAX
    would compile op by op for every new shape; and the calls run traced), else ``fn``."""
    if backend.name != "jax":
        return fn
    import jax

    return jax.jit(fn)


@pytest.mark.parametrize("form", list(PACKED))
def test_packed_equals_each_sequence_alone(backend: Backend, form: str) -> None:
    """Packed sequences (segment ids from masks.segment_ids_from_lengths, with sinks)
    give each sequence's attention run alone with the same options, concatenated: out,
    lse, and the weights block by block (0 across segments), on the dense path, the
    chunked one and what auto picks (on JAX: all under one jax.jit)."""
    if backend.name == "jax":
        pytest.skip("JAX compiles each program (seconds): its pair cases and the decode test")
    q_lengths, k_lengths, options = PACKED[form]
    pair = k_lengths is not None
    k_lengths = k_lengths or q_lengths
    rng = rng_for("packed", form)
    lq, lk = sum(q_lengths), sum(k_lengths)
    qn, kn, vn = randn(rng, (B, HQ, lq, D)), randn(rng, (B, HK, lk, D)), randn(rng, (B, HK, lk, 5))
    q, k, v = (backend.asarray(x) for x in (qn, kn, vn))
    sinks = backend.asarray(randn(rng, (HQ,)))
    q_ids = backend.asarray(ids_from_lengths(q_lengths))
    ids = (q_ids, backend.asarray(ids_from_lengths(k_lengths))) if pair else q_ids
    spans = [
        (qs, ks)
        for qs, ks in zip(_bounds(q_lengths), _bounds(k_lengths), strict=True)
        if qs[1] > qs[0]
    ]
    paths = [{}, {"chunk_size": CHUNK}, {"implementation": "portable"}]

    def compute(q: Any, k: Any, v: Any, sinks: Any, ids: Any) -> Any:
        alone = [
            attend(
                q[..., q0:q1, :],
                k[..., k0:k1, :],
                v[..., k0:k1, :],
                sinks=sinks,
                return_weights=True,
                return_lse=True,
                implementation="portable",
                **options,
            )
            for (q0, q1), (k0, k1) in spans
        ]
        packed = [
            attend(
                q,
                k,
                v,
                sinks=sinks,
                segment_ids=ids,
                return_weights="chunk_size" not in extra,
                return_lse=True,
                **options,
                **extra,
            )
            for extra in paths
        ]
        return alone, packed

    alone, packed = _jit_on_jax(backend, compute)(q, k, v, sinks, ids)
    want_out = np.concatenate([backend.to_numpy(a[0]) for a in alone], axis=-2)
    want_lse = np.concatenate([backend.to_numpy(a[2]) for a in alone], axis=-1)
    for extra, got in zip(paths, packed, strict=True):
        out, w, lse = unpack(got, "chunk_size" not in extra, True)
        assert_like(out, q, shape=(B, HQ, lq, 5), dtype=q.dtype)
        np.testing.assert_allclose(backend.to_numpy(out), want_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=1e-12, atol=1e-13)
        if w is not None:
            w_np = backend.to_numpy(w)
            inside = np.zeros(w_np.shape, dtype=bool)
            for ((q0, q1), (k0, k1)), one in zip(spans, alone, strict=True):
                np.testing.assert_allclose(
                    w_np[..., q0:q1, k0:k1], backend.to_numpy(one[1]), rtol=1e-12, atol=1e-13
                )
                inside[..., q0:q1, k0:k1] = True
            assert np.all(w_np[~inside] == 0.0)


def test_packed_batch_rows_are_their_own_packings(backend: Backend) -> None:
    """Batch-dependent ids ``[B, L]`` (with -1 padding): row b of the packed call equals
    the call with row b's ids alone; padding positions attend each other only."""
    if backend.name == "jax":
        pytest.skip("JAX: seg_batch_causal in test_matches_oracle covers [B, L] ids")
    rng = rng_for("packed-batch")
    qn, kn, vn = randn(rng, Q), randn(rng, KV), randn(rng, KV)
    ids = ids_from_lengths(BATCH_LENGTHS, L)
    q, k, v = (backend.asarray(x) for x in (qn, kn, vn))
    for extra in ({}, {"chunk_size": CHUNK}):
        out, lse = attend(
            q, k, v, segment_ids=backend.asarray(ids), causal=True, return_lse=True, **extra
        )
        for row in range(B):
            one = attend(
                q[row : row + 1, ...],
                k[row : row + 1, ...],
                v[row : row + 1, ...],
                segment_ids=backend.asarray(ids[row]),
                causal=True,
                implementation="portable",
            )
            np.testing.assert_allclose(
                backend.to_numpy(out)[row : row + 1], backend.to_numpy(one), rtol=1e-12, atol=1e-13
            )
        # Padding (id -1, the last 7 positions of row 0) is one more segment of its own.
        start = int(np.flatnonzero(ids[0] == -1)[0])
        assert start == L - 7 and np.all(ids[0, start:] == -1)
        pad = attend(
            q[0:1, :, start:, :],
            k[0:1, :, start:, :],
            v[0:1, :, start:, :],
            causal=True,
            implementation="portable",
        )
        np.testing.assert_allclose(
            backend.to_numpy(out)[0:1, :, start:, :], backend.to_numpy(pad), rtol=1e-12, atol=1e-13
        )
        assert np.all(np.isfinite(backend.to_numpy(lse)))


# ------------------------------------------------------------------------------------------
# Decode: the last query alone sees what it saw among all the queries


@pytest.mark.parametrize("path", ["portable", "chunked", "auto"])
def test_decode_step_with_sinks(backend: Backend, path: str) -> None:
    """With sinks and causal lower-right (the KV cache), the last row at Lq=1 equals the
    last row at Lq=N, out and lse; and the last query of each packed segment, with ids
    ``(q_ids, kv_ids)``, equals its row in the packed prefill (on JAX under jax.jit)."""
    if backend.name == "jax" and path != "chunked":
        pytest.skip("JAX compiles each program (seconds): the chunked path stands for it")
    rng = rng_for("decode", path)
    n = 9
    qn, kn, vn = randn(rng, (B, HQ, n, D)), randn(rng, (B, HK, n, D)), randn(rng, (B, HK, n, D))
    q, k, v = (backend.asarray(x) for x in (qn, kn, vn))
    sinks = backend.asarray(randn(rng, (B, HQ)))
    k_lengths = [3, 2, 4]
    kv_ids = backend.asarray(ids_from_lengths(k_lengths))
    lasts = [int(e) - 1 for e in np.cumsum(k_lengths)]
    q_ids = backend.asarray(np.arange(len(k_lengths)))
    kw = {**PATHS[path], "causal": True, "return_lse": True}

    def compute(q: Any, k: Any, v: Any, sinks: Any, q_ids: Any, kv_ids: Any) -> Any:
        xp = _ns(q)
        q_last = xp.concat([q[..., i : i + 1, :] for i in lasts], axis=-2)
        return (
            attend(q, k, v, sinks=sinks, **kw),
            attend(q[..., n - 1 :, :], k, v, sinks=sinks, **kw),
            attend(q, k, v, sinks=sinks, segment_ids=kv_ids, **kw),
            attend(q_last, k, v, sinks=sinks, segment_ids=(q_ids, kv_ids), **kw),
        )

    full, step, prefill, packed_step = (
        tuple(backend.to_numpy(x) for x in r)
        for r in _jit_on_jax(backend, compute)(q, k, v, sinks, q_ids, kv_ids)
    )
    assert step[0].shape == (B, HQ, 1, D)
    tight = {"rtol": 1e-12, "atol": 1e-13}
    np.testing.assert_allclose(step[0], full[0][..., n - 1 :, :], **tight)
    np.testing.assert_allclose(step[1], full[1][..., n - 1 :], **tight)
    np.testing.assert_allclose(packed_step[0], prefill[0][..., lasts, :], **tight)
    np.testing.assert_allclose(packed_step[1], prefill[1][..., lasts], **tight)
    ref = oracle.attention(qn[..., n - 1 :, :], kn, vn, sinks=backend.to_numpy(sinks), causal=True)
    np.testing.assert_allclose(step[0], ref[0], **tight)


# ------------------------------------------------------------------------------------------
# Gradients against the oracle's finite differences (float64, small shapes)


def _doc_small(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"doc": ids_from_lengths([3, 5])}


GRAD_CASES = [
    Case(
        "g_sinks",
        q=(2, 4, 6, 3),
        k=(2, 2, 7, 3),
        v=(2, 2, 7, 2),
        mask=_mask_empty_rows(6, 7),
        sinks=_sinks((2, 4), ((1, 3), -np.inf)),
        options={"causal": True},
    ),
    Case(
        "g_segments",
        q=(2, 2, 6, 3),
        k=(2, 1, 8, 3),
        v=(2, 1, 8, 2),
        sinks=_sinks((2,)),
        segments=lambda rng: (ids_from_lengths([2, 0, 3, 1]), ids_from_lengths([3, 2, 2, 1])),
        options={"causal": True},
    ),
    Case(
        "g_plan",
        q=(1, 2, 8, 3),
        k=(1, 2, 8, 3),
        v=(1, 2, 8, 2),
        sinks=_sinks((2,)),
        captures=_doc_small,
        mask_mod=document(True),
        block_plan={},
    ),
    Case(
        "g_score_mod",
        q=(2, 2, 6, 3),
        k=(2, 2, 6, 3),
        v=(2, 2, 6, 2),
        segments=lambda rng: ids_from_lengths([2, 4]),
        captures=_rel(6, 6, 2),
        score_mod=relative_bias(6),
        options={"window": 3},
    ),
    Case(
        "g_all",
        q=(2, 4, 5, 3),
        k=(2, 2, 7, 3),
        v=(2, 2, 7, 2),
        bias=_bias((4, 5, 7), neginf=True),
        sinks=_sinks((2, 4)),
        segments=lambda rng: (ids_from_lengths([2, 3]), ids_from_lengths([3, 4])),
        captures=_slopes,
        score_mod=alibi_by_batch,
        mask_mod=sliding(3),
        options={"causal": "upper_left", "softcap": 3.0},
    ),
]
GRAD_BY_ID = {c.id: c for c in GRAD_CASES}
_ORACLE_GRADS: dict[str, dict[str, np.ndarray]] = {}


def _loss_np(out: np.ndarray, lse: np.ndarray, d: dict[str, Any]) -> float:
    return float(
        np.sum(out * d["w_out"]) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * d["w_lse"])
    )


def oracle_grads(case: Case) -> dict[str, np.ndarray]:
    """Central differences of the oracle's ``sum(out * w_out) + sum(lse * w_lse)`` (lse
    where finite) in q, k, v, the bias, the sinks and every float array the mods read;
    the sinks' checked against :func:`oracle.sink_grads` too. Cached per case."""
    if case.id in _ORACLE_GRADS:
        return _ORACLE_GRADS[case.id]
    d = case.data()
    arrays = {n: np.array(d[n], dtype=np.float64) for n in "qkv"}
    for name in ("bias", "sinks"):
        if d[name] is not None:
            arrays[name] = np.array(d[name], dtype=np.float64)
    captured = {n: np.array(a) for n, a in (d["captures"] or {}).items()}
    floats = {n: a for n, a in captured.items() if np.issubdtype(a.dtype, np.floating)}
    kwargs: dict[str, Any] = dict(case.options)
    kwargs["mask"] = d["mask"]
    kwargs["segment_ids"] = d["segments"]
    if case.score_mod is not None:
        kwargs["score_mod"] = case.score_mod(captured)
    if case.mask_mod is not None:
        kwargs["mask_mod"] = case.mask_mod(captured)

    def f() -> float:
        out, _, lse = oracle.attention(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            bias=arrays.get("bias"),
            sinks=arrays.get("sinks"),
            **kwargs,
        )
        return _loss_np(out, lse, d)

    grads = {n: oracle.numerical_grad(f, a) for n, a in {**arrays, **floats}.items()}
    if "sinks" in arrays:
        rest = {n: arrays[n] for n in ("bias",) if n in arrays}
        analytic = oracle.sink_grads(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            d["w_out"],
            d["w_lse"],
            sinks=arrays["sinks"],
            **rest,
            **kwargs,
        )
        np.testing.assert_allclose(grads["sinks"], analytic, **GRAD_TOL)
    _ORACLE_GRADS[case.id] = grads
    return grads


def check_grads(case: Case, got: dict[str, np.ndarray]) -> None:
    want = oracle_grads(case)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, g in got.items():
        assert g.shape == want[name].shape, name
        assert np.all(np.isfinite(g)), f"d{name} not finite"
        np.testing.assert_allclose(g, want[name], err_msg=f"d{name}", **GRAD_TOL)


def _grad_names(case: Case) -> list[str]:
    """What gets a gradient: q, k, v, the bias, the sinks, the mods' float arrays."""
    d = case.data()
    names = ["q", "k", "v", *(n for n in ("bias", "sinks") if d[n] is not None)]
    floats = (n for n, a in (d["captures"] or {}).items() if np.issubdtype(a.dtype, np.floating))
    return names + list(floats)


GRAD_PATHS = ("portable", "chunked", "auto")


@requires_backend("torch")
@pytest.mark.parametrize("path", GRAD_PATHS)
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_torch_autograd_matches_oracle(case: Case, path: str) -> None:
    """torch autograd through every path (a score_mod's captured tensors included: the
    chunked path checkpoints each query block)."""
    import torch

    bk = BY_NAME["torch"]
    inp = make_inputs(bk, "float64", case)
    leaves = {"q": inp.q, "k": inp.k, "v": inp.v}
    leaves.update({n: inp.kwargs[n] for n in ("bias", "sinks") if n in inp.kwargs})
    leaves.update({n: t for n, t in inp.captured.items() if t.is_floating_point()})
    assert sorted(leaves) == sorted(_grad_names(case))
    for t in leaves.values():
        t.requires_grad_(True)
    d = case.data()
    out, lse = attend(inp.q, inp.k, inp.v, return_lse=True, **inp.kwargs, **PATHS[path])
    loss = (out * torch.tensor(d["w_out"])).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.tensor(d["w_lse"])).sum()
    loss.backward()
    check_grads(case, {n: t.grad.numpy() for n, t in leaves.items()})
    empty = inp.empty & np.isneginf(inp.ref[2])
    assert np.all(leaves["q"].grad.numpy()[empty] == 0.0)


@requires_backend("torch")
def test_torch_auto_blockwise_gradients() -> None:
    """auto takes the blockwise path by itself on long sequences (the dense path would
    save over 16 MiB for backward): with sinks and segment ids its gradients equal the
    float64 gradients written out here from the oracle's weights (checked against finite
    differences first, on a small call)."""
    import torch

    rng = rng_for("torch-blockwise")
    n = 1450  # 1 * 1 * 1450 * 1450 float64 scores: just over 16 MiB
    lengths = [700, 1, 0, 500, 249]
    small = {"q": (1, 2, 7, 3), "k": (1, 1, 7, 3), "lengths": [3, 1, 0, 3]}
    for shapes in (small, {"q": (1, 1, n, 4), "k": (1, 1, n, 4), "lengths": lengths}):
        qn, kn, vn = randn(rng, shapes["q"]), randn(rng, shapes["k"]), randn(rng, shapes["k"])
        sn = randn(rng, shapes["q"][1:2])
        ids = ids_from_lengths(shapes["lengths"])
        w_out, w_lse = randn(rng, shapes["q"]), randn(rng, shapes["q"][:-1])
        kw = {"causal": True, "segment_ids": ids}
        want = _analytic_grads(qn, kn, vn, sn, w_out, w_lse, **kw)
        if shapes is small:  # the closed form against finite differences
            numerical = oracle.loss_grads_with_bias(qn, kn, vn, w_out, w_lse, sinks=sn, **kw)
            assert set(numerical) == set(want)
            for name, g in numerical.items():
                np.testing.assert_allclose(want[name], g, err_msg=name, **GRAD_TOL)
            continue
        t = {
            n_: torch.tensor(a, requires_grad=True)
            for n_, a in zip("qkvs", (qn, kn, vn, sn), strict=True)
        }
        call = {"causal": True, "segment_ids": torch.tensor(ids), "sinks": t["s"]}
        assert plan(t["q"], t["k"], t["v"], **call).path == "portable:blockwise"
        out, lse = attend(t["q"], t["k"], t["v"], return_lse=True, **call)
        loss = (out * torch.tensor(w_out)).sum() + (lse * torch.tensor(w_lse)).sum()
        loss.backward()
        for name, key in (("q", "q"), ("k", "k"), ("v", "v"), ("sinks", "s")):
            np.testing.assert_allclose(
                t[key].grad.numpy(), want[name], err_msg=name, rtol=1e-9, atol=1e-10
            )


def _analytic_grads(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    sinks: np.ndarray,
    w_out: np.ndarray,
    w_lse: np.ndarray,
    **kwargs: Any,
) -> dict[str, np.ndarray]:
    """The loss's gradients in closed form from the oracle's weights ``P`` (for calls
    without bias, softcap or mods, every row with a key): ``dV = P^T dO``, ``dS = P *
    (dO V^T - delta)`` with ``delta = rowsum(dO * O) - dlse``, ``dQ = scale dS K``, ``dK
    = scale dS^T Q``, ``dsink = -sum_rows exp(sink - lse) delta``; K/V heads summed over
    their query heads."""
    out, p, lse = oracle.attention(q, k, v, sinks=sinks, **kwargs)
    group = q.shape[-3] // k.shape[-3]
    kr, vr = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = np.sum(w_out * out, axis=-1) - w_lse
    ds = p * (w_out @ np.swapaxes(vr, -1, -2) - delta[..., None])
    dq = scale * ds @ kr
    dk = scale * np.swapaxes(ds, -1, -2) @ q
    dv = np.swapaxes(p, -1, -2) @ w_out

    def per_kv_head(x: np.ndarray) -> np.ndarray:
        return x.reshape(*k.shape[:-3], k.shape[-3], group, *x.shape[-2:]).sum(axis=-3)

    share = np.exp(np.asarray(sinks)[..., None] - lse)
    dsinks = -(share * delta).sum(axis=-1)
    dsinks = dsinks.sum(axis=tuple(range(dsinks.ndim - np.ndim(sinks))))
    return {"q": dq, "k": per_kv_head(dk), "v": per_kv_head(dv), "sinks": dsinks}


#: JAX traces and compiles the custom_vjp's scans of each call (seconds): these cases
#: and paths run there, eagerly and under jit.
JAX_GRADS = [
    ("g_plan", "chunked", False),
    ("g_sinks", "portable", True),
    ("g_segments", "chunked", True),
    ("g_all", "chunked", True),
]


def _jax_loss(case: Case, path: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The loss as a function of the arrays that get gradients (a dict), with the mods
    rebuilt inside from the traced captured arrays."""
    import jax.numpy as jnp

    bk = BY_NAME["jax"]
    inp = make_inputs(bk, "float64", case)
    d = case.data()
    names = _grad_names(case)
    args = {"q": inp.q, "k": inp.k, "v": inp.v, **inp.kwargs, **inp.captured}
    args = {n: args[n] for n in names}
    static = {n: a for n, a in inp.kwargs.items() if n not in args and n != "score_mod"}
    w_out, w_lse = jnp.asarray(d["w_out"]), jnp.asarray(d["w_lse"])

    def loss(a: dict[str, Any]) -> Any:
        captured = {**inp.captured, **{n: a[n] for n in inp.captured if n in a}}
        kw = {**static, **{n: a[n] for n in ("bias", "sinks") if n in a}}
        if case.score_mod is not None:
            kw["score_mod"] = case.score_mod(captured)
        out, lse = attend(a["q"], a["k"], a["v"], return_lse=True, **kw, **PATHS[path])
        return (out * w_out).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse).sum()

    return loss, args


@requires_backend("jax")
@pytest.mark.parametrize(("name", "path", "jit"), JAX_GRADS)
def test_jax_grad_matches_oracle(name: str, path: str, jit: bool) -> None:
    """jax.grad (eager, or under jax.jit) of every input: q, k, v, bias, sinks and the
    arrays the score_mod reads (the custom_vjp closure-converts it)."""
    import jax

    case = GRAD_BY_ID[name]
    loss, args = _jax_loss(case, path)
    grad = jax.grad(loss)
    grads = (jax.jit(grad) if jit else grad)(args)
    check_grads(case, {n: np.asarray(g) for n, g in grads.items()})


@requires_backend("jax")
def test_jax_vmap_of_grad_over_the_batch() -> None:
    """jax.vmap over the batch axis of jax.grad (sinks, pair ids and a score_mod's table
    shared by the examples) gives each example's gradients: the oracle's, row by row."""
    import jax
    import jax.numpy as jnp

    case = GRAD_BY_ID["g_score_mod"]
    d = case.data()
    q, k, v = (jnp.asarray(d[n]) for n in "qkv")
    ids = jnp.asarray(d["segments"])
    table = jnp.asarray(d["captures"]["rel"])
    w_out, w_lse = jnp.asarray(d["w_out"]), jnp.asarray(d["w_lse"])

    def loss(q: Any, k: Any, v: Any, w_out: Any, w_lse: Any) -> Any:
        mod = relative_bias(6)({"rel": table})
        out, lse = attend(
            q, k, v, segment_ids=ids, score_mod=mod, return_lse=True, chunk_size=4, **case.options
        )
        return (out * w_out).sum() + (lse * w_lse).sum()

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, w_out, w_lse)
    want = oracle_grads(case)
    for name, g in zip("qkv", batched, strict=True):
        np.testing.assert_allclose(np.asarray(g), want[name], err_msg=name, **GRAD_TOL)


def test_attend_backward_matches_oracle(backend: Backend) -> None:
    """attend_backward from the oracle's out and lse (so only the backward is tested):
    dq, dk, dv, dbias and dsinks with sinks, segment ids and mask_mod (a block plan
    too), at the chunked block length and at the default one."""
    if backend.name == "jax":
        pytest.skip("JAX: its jitted backward scan is jax.grad's (test_jax_grad_matches_oracle)")
    for case in GRAD_CASES:
        if case.score_mod is not None:
            continue
        inp = make_inputs(backend, "float64", case)
        d = case.data()
        ref_out, _, ref_lse = inp.ref
        out, lse = backend.asarray(ref_out), backend.asarray(ref_lse)
        dlse = backend.asarray(np.where(np.isfinite(ref_lse), d["w_lse"], 0.0))
        dout = backend.asarray(d["w_out"])
        want = oracle_grads(case)
        for chunk in (3, None):
            if case.block_plan is not None and chunk is not None:
                chunk = CHUNK  # a plan's block length is the call's
            g = attend_backward(
                dout, inp.q, inp.k, inp.v, out, lse, dlse=dlse, chunk_size=chunk, **inp.kwargs
            )
            got = {"q": g.dq, "k": g.dk, "v": g.dv, "bias": g.dbias, "sinks": g.dsinks}
            for name, x in got.items():
                if name not in want:
                    assert x is None, name
                    continue
                like = inp.kwargs.get(name, getattr(inp, name, None))
                assert_like(x, inp.q, shape=want[name].shape, dtype=like.dtype, name=name)
                np.testing.assert_allclose(
                    backend.to_numpy(x), want[name], err_msg=f"{case.id} d{name}", **GRAD_TOL
                )


@requires_backend("torch")
def test_torch_gradcheck_chunked_sinks_score_mod() -> None:
    """torch.autograd.gradcheck (float64) on the chunked path with sinks and a score_mod
    reading a captured tensor: every input's gradient, the table's included."""
    import torch

    rng = rng_for("gradcheck")
    q, k, v = (
        torch.tensor(randn(rng, s), requires_grad=True)
        for s in ((1, 2, 4, 3), (1, 1, 5, 3), (1, 1, 5, 2))
    )
    sinks = torch.tensor(randn(rng, (2,)), requires_grad=True)
    table = torch.tensor(0.5 * randn(rng, (2, 8)), requires_grad=True)

    def f(q: Any, k: Any, v: Any, sinks: Any, table: Any) -> Any:
        out, lse = attend(
            q,
            k,
            v,
            sinks=sinks,
            score_mod=relative_bias(4)({"rel": table}),
            causal=True,
            chunk_size=2,
            return_lse=True,
        )
        return out, lse

    assert plan(q, k, v, chunk_size=2, sinks=sinks).path == "portable:blockwise"
    assert torch.autograd.gradcheck(f, (q, k, v, sinks, table), eps=1e-6, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# Errors name the argument


def _small(backend: Backend, lq: int = 6, lk: int = 6) -> tuple[Any, Any, Any]:
    rng = rng_for("errors", lq, lk)
    return tuple(
        backend.asarray(randn(rng, s)) for s in ((2, 4, lq, 3), (2, 2, lk, 3), (2, 2, lk, 3))
    )


def _raises(err: type[Exception], match: str, q: Any, k: Any, v: Any, **kw: Any) -> None:
    """attend, plan and (without a score_mod) attend_backward refuse it the same way."""
    with pytest.raises(err, match=match):
        attend(q, k, v, **kw)
    if "score_mod" in kw or ("mask_mod" in kw and callable(kw["mask_mod"])):
        return  # the mods' results are checked where they run
    with pytest.raises(err, match=match):
        plan(q, k, v, **kw)


def test_errors_for_sinks(backend: Backend) -> None:
    q, k, v = _small(backend)
    _raises(ValueError, r"`sinks`.*\(2, 4\)", q, k, v, sinks=backend.asarray(np.zeros(5)))
    _raises(ValueError, r"`sinks`", q, k, v, sinks=backend.asarray(np.zeros((3, 4))))
    _raises(TypeError, r"`sinks`.*float", q, k, v, sinks=backend.asarray(np.zeros(4, np.int64)))
    _raises(TypeError, r"`sinks`", q, k, v, sinks=backend.asarray(np.zeros(4), "float32"))
    _raises(TypeError, r"`sinks`", q, k, v, sinks=[0.0, 0.0, 0.0, 0.0])
    _raises(TypeError, r"`sinks`", q, k, v, sinks=0.5)
    foreign = foreign_array(backend, np.zeros(4))
    if foreign is not None:
        _raises(TypeError, r"`sinks`", q, k, v, sinks=foreign)


def test_errors_for_segment_ids(backend: Backend) -> None:
    q, k, v = _small(backend)
    ids = np.repeat(np.arange(3), 2)
    _raises(TypeError, r"`segment_ids`.*integer", q, k, v, segment_ids=backend.asarray(ids * 1.0))
    _raises(
        ValueError, r"`segment_ids`.*\[\.\.\., L\]", q, k, v, segment_ids=backend.asarray(ids[:5])
    )
    _raises(
        ValueError,
        r"`segment_ids`",
        q,
        k,
        v,
        segment_ids=backend.asarray(np.zeros((3, 6), np.int64)),
    )
    _raises(ValueError, r"`segment_ids`", q, k, v, segment_ids=backend.asarray(np.int64(0)))
    a = backend.asarray(ids)
    _raises(ValueError, r"`segment_ids`.*pair.*3 items", q, k, v, segment_ids=(a, a, a))
    _raises(ValueError, r"`segment_ids`", q, k, v, segment_ids=(a,))
    _raises(TypeError, r"`segment_ids\[1\]`", q, k, v, segment_ids=(a, backend.asarray(ids * 1.0)))
    _raises(TypeError, r"`segment_ids\[0\]`", q, k, v, segment_ids=(ids.tolist(), a))
    q4, k8, v8 = _small(backend, 4, 8)
    _raises(
        ValueError, r"`segment_ids`.*Lq == Lk.*pair", q4, k8, v8, segment_ids=backend.asarray(ids)
    )
    _raises(
        ValueError,
        r"`segment_ids\[1\]`.*\[\.\.\., Lk\]",
        q4,
        k8,
        v8,
        segment_ids=(backend.asarray(ids[:4]), backend.asarray(ids[:4])),
    )


@pytest.mark.parametrize("path", ["portable", "chunked"])
def test_errors_for_mods(backend: Backend, path: str) -> None:
    """What a score_mod or mask_mod returns is checked on every path: the scores' shape
    and dtype, booleans that broadcast to the block."""
    if backend.name == "jax" and path == "portable":
        pytest.skip("JAX: the chunked path's checks are the same functions")
    q, k, v = _small(backend)
    xp = backend.xp
    kw = PATHS[path]
    _raises(TypeError, r"`score_mod`.*function", q, k, v, score_mod="tanh", **kw)
    _raises(TypeError, r"`mask_mod`.*function", q, k, v, mask_mod=np.ones((6, 6), bool), **kw)
    bad_scores = [
        (ValueError, lambda s, b, h, qi, ki: xp.sum(s, axis=-1, keepdims=True)),  # reduced
        (TypeError, lambda s, b, h, qi, ki: 0.5),  # a Python float
        (TypeError, lambda s, b, h, qi, ki: xp.astype(s, xp.float32)),  # another dtype
        (TypeError, lambda s, b, h, qi, ki: qi - ki),  # the int32 indices
    ]
    for err, score_mod in bad_scores:
        with pytest.raises(err, match=r"`score_mod` must return"):
            attend(q, k, v, score_mod=score_mod, **kw)
    bad_masks = [
        (TypeError, lambda b, h, qi, ki: xp.astype(qi >= ki, xp.float64)),  # floats
        (TypeError, lambda b, h, qi, ki: qi - ki),  # ints
        (TypeError, lambda b, h, qi, ki: True),  # a Python bool
        (ValueError, lambda b, h, qi, ki: xp.concat([h, h]) >= 0),  # 2 * Hq heads
        (ValueError, lambda b, h, qi, ki: xp.concat([qi, qi]) >= ki),  # 2 * rows
    ]
    for err, mask_mod in bad_masks:
        with pytest.raises(err, match=r"`mask_mod`"):
            attend(q, k, v, mask_mod=mask_mod, **kw)


def test_errors_for_block_plans(backend: Backend) -> None:
    q, k, v = _small(backend)
    mod = causal_mm({})
    other = block_plan(mod, 6, 7, block_size=2)
    _raises(ValueError, r"`mask_mod`.*block plan.*q_len=6, kv_len=7", q, k, v, mask_mod=other)
    fits = block_plan(mod, 6, 6, block_size=2)
    _raises(
        ValueError, r"`mask_mod`.*block_size=2.*chunk_size=3", q, k, v, mask_mod=fits, chunk_size=3
    )
    _raises(ValueError, r"batch=3", q, k, v, mask_mod=block_plan(mod, 6, 6, batch=3, block_size=2))
    _raises(ValueError, r"heads=2", q, k, v, mask_mod=block_plan(mod, 6, 6, heads=2, block_size=2))
    with pytest.raises(ValueError, match=r"`block_size`"):
        block_plan(mod, 6, 6, block_size=0)
    with pytest.raises(ValueError, match=r"`q_len`"):
        block_plan(mod, -1, 6)
    with pytest.raises(TypeError, match=r"`mask_mod`.*function"):
        block_plan("causal", 6, 6)
    with pytest.raises(TypeError, match=r"`mask_mod`.*boolean"):
        block_plan(lambda b, h, qi, ki: qi - ki, 6, 6, like=q)
    # the plan's own block length, or chunk_size equal to it, is accepted
    assert plan(q, k, v, mask_mod=fits, chunk_size=2).path == "portable:blockwise"


def test_errors_for_attend_backward(backend: Backend) -> None:
    q, k, v = _small(backend)
    out, lse = attend(q, k, v, return_lse=True)
    with pytest.raises(
        ValueError, match=r"`score_mod`.*attend_backward|attend_backward.*`score_mod`"
    ):
        attend_backward(out, q, k, v, out, lse, score_mod=lambda s, b, h, qi, ki: s)
    with pytest.raises(ValueError, match=r"`sinks`"):
        attend_backward(out, q, k, v, out, lse, sinks=backend.asarray(np.zeros(3)))
    with pytest.raises(TypeError, match=r"`segment_ids`"):
        attend_backward(out, q, k, v, out, lse, segment_ids=backend.asarray(np.zeros(6)))


# ------------------------------------------------------------------------------------------
# Skipped blocks are not computed


def _block_of(q_idx: Any, kv_idx: Any) -> tuple[int, int, int, int]:
    """``(first query, last query, first key, last key)`` of the index arrays of a block."""
    qn, kn = _host(q_idx), _host(kv_idx)
    return int(qn.min()), int(qn.max()), int(kn.min()), int(kn.max())


def _host(x: Any) -> np.ndarray:
    from portable_attention.testing import to_numpy

    return np.asarray(to_numpy(x))


def _grid_blocks(spans: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """Block numbers (of CHUNK) of recorded spans, each a whole block of the grid."""
    blocks = []
    for q0, q1, k0, k1 in spans:
        assert (
            q0 % CHUNK == 0
            and k0 % CHUNK == 0
            and q1 // CHUNK == q0 // CHUNK
            and k1 // CHUNK == k0 // CHUNK
        )
        blocks.append((q0 // CHUNK, k0 // CHUNK))
    return blocks


def _dense_blocks(keep: np.ndarray) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """``(blocks with some key kept, blocks with every key kept)`` of a [..., Lq, Lk] mask."""
    some, every = set(), set()
    lq, lk = keep.shape[-2:]
    for i in range(-(-lq // CHUNK)):
        for j in range(-(-lk // CHUNK)):
            block = keep[..., i * CHUNK : (i + 1) * CHUNK, j * CHUNK : (j + 1) * CHUNK]
            if block.any():
                some.add((i, j))
            if block.all():
                every.add((i, j))
    return some, every


def test_block_plan_skipped_blocks_are_not_computed(backend: Backend) -> None:
    """With a block plan, the forward and attend_backward call the mask_mod on the
    partial blocks only (once each), and a score_mod sees exactly the kept blocks:
    never a skipped one, and the full ones without a mask_mod call."""
    if backend.name == "jax":
        pytest.skip("JAX traces the blocks in a scan: calls do not count blocks there")
    rng = rng_for("skip-plan")
    q, k, v = (backend.asarray(randn(rng, s)) for s in (Q, KV, KV))
    doc = backend.asarray(ids_from_lengths([10, 5, 3, 6]))
    inner = document(True)({"doc": doc})
    mask_calls: list[tuple[int, int, int, int]] = []
    score_calls: list[tuple[int, int, int, int]] = []

    def counted(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        mask_calls.append(_block_of(q_idx, kv_idx))
        return inner(b, h, q_idx, kv_idx)

    def recorded(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        score_calls.append(_block_of(q_idx, kv_idx))
        return score

    p = block_plan(counted, L, L, block_size=CHUNK, like=q)
    docs = ids_from_lengths([10, 5, 3, 6])
    keep = (docs[:, None] == docs[None, :]) & np.tri(L, dtype=bool)
    kept, full = _dense_blocks(keep)
    partial = kept - full
    assert set(p.kept) == kept and set(p.full) == full and full and partial
    assert len(kept) < (-(-L // CHUNK)) ** 2
    mask_calls.clear()
    out, lse = attend(q, k, v, mask_mod=p, score_mod=recorded, return_lse=True)
    assert sorted(_grid_blocks(mask_calls)) == sorted(partial)
    assert sorted(_grid_blocks(score_calls)) == sorted(kept)
    ref = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), mask=keep)
    assert_close(backend.to_numpy(out), ref[0], "float64")
    mask_calls.clear()
    dout = backend.asarray(randn(rng, Q))
    attend_backward(dout, q, k, v, out, lse, mask_mod=p)
    assert sorted(_grid_blocks(mask_calls)) == sorted(partial)


@pytest.mark.parametrize("form", ["function", "block_plan", "score_mod", "score_mod_blocks"])
def test_a_call_keeps_no_mod_alive(backend: Backend, form: str) -> None:
    """FlexAttention's document-mask pattern: a fresh ``mask_mod`` per batch, closing over
    that batch's document ids (or a fresh ``score_mod`` closing over a bias per key, on
    the default path and block by block). Once the calls have returned, nothing of the
    package holds a mod, its block plan or what it captured (on a GPU that would be
    device memory); the calls still agree with the dense mask (or bias)."""
    lq = 16
    q = backend.asarray(randn(rng_for("keeps-no-mod", lq), (1, 2, lq, 4)), "float32")
    alive = []
    for batch in range(4):
        if form.startswith("score_mod"):
            bias_np = np.arange(lq, dtype=np.float32) * 0.1 * (batch + 1)
            capture = Capture(backend.asarray(bias_np, "float32"))

            def score(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, c: Capture = capture) -> Any:
                return s + c.value[kv_idx]

            blocks = {"chunk_size": 8} if form == "score_mod_blocks" else {}
            out = attend(q, q, q, score_mod=score, **blocks)
            dense = attend(q, q, q, bias=backend.asarray(bias_np[None, :], "float32"))
            del score
        else:
            ids_np = np.arange(lq) // (2 + batch)
            capture = Capture(backend.asarray(ids_np))

            def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any, c: Capture = capture) -> Any:
                return c.value[q_idx] == c.value[kv_idx]

            m = mod if form == "function" else block_plan(mod, lq, lq, block_size=8, like=q)
            out = attend(q, q, q, mask_mod=m)
            dense = attend(q, q, q, mask=backend.asarray(ids_np[:, None] == ids_np[None, :]))
            del mod, m
        assert_close(backend.to_numpy(out), backend.to_numpy(dense), "float32")
        alive.append(weakref.ref(capture))
        del capture, out
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)


@requires_backend("jax")
def test_jax_score_mod_gradient_keeps_no_capture_alive() -> None:
    """Under ``jax.grad``, JAX's blockwise path passes the arrays a ``score_mod`` captures
    as explicit inputs of its ``custom_vjp``: they get the gradients of the dense path's
    bias, and nothing holds them once the gradients are computed."""
    import jax
    import jax.numpy as jnp

    lq = 16
    q = jnp.asarray(randn(rng_for("keeps-no-capture", lq), (1, 2, lq, 4)))
    alive = []
    for batch in range(3):
        capture = Capture(jnp.asarray(np.arange(lq) * 0.1 * (batch + 1), q.dtype))

        def loss(q: Any, bias: Any) -> Any:
            def score(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return s + bias[kv_idx]

            return attend(q, q, q, score_mod=score, chunk_size=8).sum()

        def dense(q: Any, bias: Any) -> Any:
            return attend(q, q, q, bias=bias[None, :], implementation="portable").sum()

        got = jax.grad(loss, (0, 1))(q, capture.value)
        want = jax.grad(dense, (0, 1))(q, capture.value)
        assert got[0].dtype == jnp.float64
        for g, w in zip(got, want, strict=True):
            assert_close(np.asarray(g), np.asarray(w), "float64")
        alive.append(weakref.ref(capture))
        del capture, got, want
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)


def test_segment_ids_skip_blocks(backend: Backend) -> None:
    """On the chunked path of an eager framework, blocks whose queries and keys share no
    segment (or that causal masks, within segments) never reach the score_mod: it sees
    exactly the blocks with some pair left."""
    if backend.name == "jax":
        pytest.skip("JAX traces the blocks in a scan: calls do not count blocks there")
    rng = rng_for("skip-segments")
    q, k, v = (backend.asarray(randn(rng, s)) for s in (Q, KV, KV))
    lengths = [3, 9, 1, 0, 11]
    ids = ids_from_lengths(lengths)
    for options in ({}, {"causal": True}, {"window": (2, 0)}):
        seen: list[tuple[int, int, int, int]] = []

        def recorded(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, seen: list = seen) -> Any:
            seen.append(_block_of(q_idx, kv_idx))
            return score

        out = attend(
            q,
            k,
            v,
            segment_ids=backend.asarray(ids),
            score_mod=recorded,
            chunk_size=CHUNK,
            **options,
        )
        keep = oracle.segment_positions(ids, ids, **options)[0]
        some, _ = _dense_blocks(keep)
        assert len(some) < (-(-L // CHUNK)) ** 2, options
        assert sorted(_grid_blocks(seen)) == sorted(some), options
        ref = oracle.attention(
            *(backend.to_numpy(x) for x in (q, k, v)), segment_ids=ids, **options
        )
        assert_close(backend.to_numpy(out), ref[0], "float64")


# ------------------------------------------------------------------------------------------
# torch.compile (the nox session `compile`)


@requires_backend("torch")
@pytest.mark.compile
@pytest.mark.parametrize("feature", ["sinks", "mask_mod"])
def test_torch_compile_equals_eager(feature: str) -> None:
    """torch.compile(fullgraph=True) of attend with sinks (and segment ids), or with a
    mask_mod and a score_mod: out, lse and the gradients equal eager's."""
    import torch

    rng = rng_for("compile", feature)
    arrays = [randn(rng, s) for s in ((1, 2, 8, 4), (1, 1, 8, 4), (1, 1, 8, 4), (2,), (2, 15))]
    ids = torch.tensor(ids_from_lengths([3, 5]))
    window = sliding(3)({})

    def f(q: Any, k: Any, v: Any, sinks: Any, table: Any) -> Any:
        if feature == "sinks":
            kw = {"sinks": sinks, "segment_ids": ids}
        else:
            kw = {"mask_mod": window, "score_mod": relative_bias(8)({"rel": table})}
        return attend(q, k, v, causal=True, return_lse=True, chunk_size=4, **kw)

    def run(fn: Any) -> list[Any]:
        inputs = [torch.tensor(a, requires_grad=True) for a in arrays]
        out, lse = fn(*inputs)
        (out.sum() + lse.sum()).backward()
        return [out.detach(), lse.detach(), *(t.grad for t in inputs)]

    eager = run(f)
    for a, b in zip(run(torch.compile(f, fullgraph=True)), eager, strict=True):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------
# Edge cases of the ids and the sinks


@pytest.mark.parametrize("options", [{"causal": True}, {"causal": "upper_left"}, {"window": 1}])
def test_one_array_of_ids_is_the_pair_of_it(backend: Backend, options: dict[str, Any]) -> None:
    """``segment_ids=ids`` means ``segment_ids=(ids, ids)``, and both the oracle's (and
    the public reference's) reading, also where an id comes back in a later run: equal
    ids, and causal/window on each position's place within its own run."""
    rng = rng_for("repeated-ids", str(options))
    qn, kn, vn = randn(rng, (1, 2, 6, 3)), randn(rng, (1, 1, 6, 3)), randn(rng, (1, 1, 6, 2))
    ids = np.array([0, 0, 1, 1, 0, 0])  # id 0 in two runs
    q, k, v = (backend.asarray(x) for x in (qn, kn, vn))
    want = oracle.attention(qn, kn, vn, segment_ids=ids, **options)
    public = reference_attention(qn, kn, vn, segment_ids=ids, **options)
    np.testing.assert_allclose(public[0], want[0], rtol=1e-12, atol=1e-13)
    a = backend.asarray(ids)
    for extra in PATHS.values():
        pair = attend(q, k, v, segment_ids=(a, a), **options, **extra)
        one = attend(q, k, v, segment_ids=a, **options, **extra)
        assert_close(backend.to_numpy(pair), want[0], "float64", what="out of the pair")
        assert_close(backend.to_numpy(one), want[0], "float64", what=f"out of one array {extra}")


@pytest.mark.parametrize(("lq", "lk"), [(4, 0), (0, 4), (0, 0)])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (2, 0)}])
def test_pair_ids_without_queries_or_keys(
    backend: Backend, lq: int, lk: int, options: dict[str, Any]
) -> None:
    """``(q_ids, kv_ids)`` with no queries or no keys (an empty KV cache, an empty chunk of
    queries), with sinks: the oracle's result (rows with no key: out 0, lse = the sink)
    on every path, causal and window included."""
    if backend.name == "jax" and "causal" not in options:
        pytest.skip("JAX compiles each call (seconds): causal takes the code of the window")
    rng = rng_for("pair-empty", lq, lk)
    qn, kn, vn = randn(rng, (2, 4, lq, 3)), randn(rng, (2, 2, lk, 3)), randn(rng, (2, 2, lk, 2))
    sn = randn(rng, (4,))
    q_ids, kv_ids = np.zeros(lq, np.int64), np.zeros(lk, np.int64)
    want = oracle.attention(qn, kn, vn, sinks=sn, segment_ids=(q_ids, kv_ids), **options)
    q, k, v = (backend.asarray(x) for x in (qn, kn, vn))
    ids = (backend.asarray(q_ids), backend.asarray(kv_ids))
    for extra in PATHS.values():
        out, lse = attend(
            q, k, v, sinks=backend.asarray(sn), segment_ids=ids, return_lse=True, **options, **extra
        )
        assert_like(out, q, shape=(2, 4, lq, 2), dtype=q.dtype, name="out")
        np.testing.assert_array_equal(backend.to_numpy(out), want[0])
        np.testing.assert_allclose(backend.to_numpy(lse), want[2], rtol=1e-12, atol=0)


@pytest.mark.parametrize("sink_shape", [(), (1,)])
def test_attend_backward_two_d_q_sinks(backend: Backend, sink_shape: tuple[int, ...]) -> None:
    """2-D q (one implicit head) takes sinks of shape () or (1,): attend_backward's dsinks
    is an array of the sinks' framework, shape and dtype, equal to the oracle's."""
    if backend.name == "jax":
        pytest.skip("JAX: its jitted backward scan is jax.grad's (test_jax_grad_matches_oracle)")
    rng = rng_for("2d-sinks", sink_shape)
    qn, kn, vn, sn = (
        randn(rng, (5, 3)),
        randn(rng, (7, 3)),
        randn(rng, (7, 2)),
        randn(rng, sink_shape),
    )
    w_out, w_lse = randn(rng, (5, 2)), randn(rng, (5,))
    q, k, v, sinks = (backend.asarray(x) for x in (qn, kn, vn, sn))
    out, lse = attend(q, k, v, sinks=sinks, causal=True, return_lse=True, chunk_size=2)
    g = attend_backward(
        backend.asarray(w_out),
        q,
        k,
        v,
        out,
        lse,
        dlse=backend.asarray(w_lse),
        sinks=sinks,
        causal=True,
        chunk_size=2,
    )
    want = oracle.loss_grads_with_bias(qn, kn, vn, w_out, w_lse, sinks=sn, causal=True)
    assert_like(g.dsinks, sinks, shape=sink_shape, dtype=sinks.dtype, name="dsinks")
    np.testing.assert_allclose(backend.to_numpy(g.dsinks), want["sinks"], **GRAD_TOL)
    np.testing.assert_allclose(backend.to_numpy(g.dq), want["q"], **GRAD_TOL)


def test_dropout_with_sinks_and_segment_ids(backend: Backend) -> None:
    """``dropout=0`` with an rng changes nothing; with ``dropout > 0`` on the chunked path,
    attend_backward (replaying the forward's rng) gives the derivative of the forward,
    sinks and segment ids included (central differences of attend itself)."""
    if backend.name == "jax":
        pytest.skip("JAX: a key per call; its dropout replay is test_blockwise's")
    rng = rng_for("dropout-sinks")
    qn, kn, vn = randn(rng, (1, 2, 6, 3)), randn(rng, (1, 1, 6, 3)), randn(rng, (1, 1, 6, 2))
    sn = randn(rng, (2,))
    w_out, w_lse = randn(rng, (1, 2, 6, 2)), randn(rng, (1, 2, 6))
    ids = backend.asarray(ids_from_lengths([2, 4]))
    kw = {"segment_ids": ids, "causal": True, "chunk_size": 2, "return_lse": True}
    arrays = [qn.copy(), kn.copy(), vn.copy(), sn.copy()]

    def forward(p: float, seed: int | None = 0) -> tuple[Any, ...]:
        q, k, v, s = (backend.asarray(a) for a in arrays)
        r = None if seed is None else backend.make_rng(seed)
        return q, k, v, s, *attend(q, k, v, sinks=s, dropout=p, rng=r, **kw)

    plain = forward(0.0, None)
    zero = forward(0.0)
    for a, b in zip(plain[4:], zero[4:], strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    q, k, v, s, out, lse = forward(0.4)
    g = attend_backward(
        backend.asarray(w_out),
        q,
        k,
        v,
        out,
        lse,
        dlse=backend.asarray(w_lse),
        sinks=s,
        dropout=0.4,
        rng=backend.make_rng(0),
        segment_ids=ids,
        causal=True,
        chunk_size=2,
    )

    def loss() -> float:
        *_, out, lse = forward(0.4)
        return _loss_np(
            backend.to_numpy(out), backend.to_numpy(lse), {"w_out": w_out, "w_lse": w_lse}
        )

    for got, a in zip((g.dq, g.dk, g.dv, g.dsinks), arrays, strict=True):
        np.testing.assert_allclose(
            backend.to_numpy(got), oracle.numerical_grad(loss, a), **GRAD_TOL
        )


@requires_backend("torch")
def test_torch_score_mod_with_every_block_masked_gives_zero_gradients() -> None:
    """A checkpointed score_mod call whose blocks are all masked: out 0, and q, k, v
    still get (zero) gradients, as on every other path."""
    import torch

    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    out = attend(
        q, q, q, mask_mod=lambda b, h, a, c: a < 0, score_mod=lambda s, *_: s, chunk_size=2
    )
    out.sum().backward()
    assert q.grad is not None and not q.grad.any() and not out.any()
