"""attend() against the float64 oracle, every feature on every backend and floating dtype."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np
import pytest
from portable_attention import attend, masks, plan

import oracle
from conftest import BACKENDS, HALF, Backend, compute_dtype_name
from helpers import assert_close, assert_like, check_against_oracle, randn, rng_for


@dataclass(frozen=True, repr=False)
class Case:
    id: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    mask: tuple[int, ...] | None = None  # shape of a random boolean mask
    mask_empty_rows: bool = False  # force some query rows of the mask to be all False
    mask_all_false: bool = False  # every entry False: every row without a key
    bias: tuple[int, ...] | None = None  # shape of a random float bias
    bias_neginf: float = 0.0  # fraction of -inf entries in the bias
    bias_empty_rows: bool = False  # force some bias rows to be all -inf
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.id

    __repr__ = __str__

    def make(self) -> dict[str, Any]:
        rng = rng_for("case", self.id)
        data: dict[str, Any] = {
            "q": randn(rng, self.q),
            "k": randn(rng, self.k),
            "v": randn(rng, self.v),
            "mask": None,
            "bias": None,
        }
        if self.mask is not None:
            m = rng.random(self.mask) < 0.7
            if self.mask_empty_rows:
                assert len(self.mask) >= 2
                m[..., 1, :] = False  # query row 1 sees nothing (wherever broadcast)
            if self.mask_all_false:
                m[...] = False
            data["mask"] = m
        if self.bias is not None:
            b = randn(rng, self.bias)
            if self.bias_neginf:
                b[rng.random(self.bias) < self.bias_neginf] = -np.inf
            if self.bias_empty_rows:
                assert len(self.bias) >= 2
                b[..., 0, :] = -np.inf
            data["bias"] = b
        return data


B, H, LQ, LK, D = 2, 2, 5, 7, 4

CASES = [
    # shapes and heads
    Case("basic", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D)),
    Case("dk_ne_dv", (B, H, LQ, 4), (B, H, LK, 4), (B, H, LK, 6)),
    Case("lq_eq_lk", (B, H, 6, D), (B, H, 6, D), (B, H, 6, D)),
    Case("lq_gt_lk", (B, H, 7, D), (B, H, 3, D), (B, H, 3, 5)),
    Case("single_key", (B, H, 3, D), (B, H, 1, D), (B, H, 1, D)),
    Case("two_d", (LQ, D), (LK, D), (LK, 3)),
    Case("three_d", (3, LQ, D), (3, LK, D), (3, LK, D)),
    Case("five_d", (2, 3, H, LQ, D), (2, 3, H, LK, D), (2, 3, H, LK, 3)),
    Case("gqa", (B, 8, LQ, D), (B, 2, LK, D), (B, 2, LK, 3)),
    Case("mqa", (B, 8, LQ, D), (B, 1, LK, D), (B, 1, LK, D)),
    # boolean masks, broadcasting from lower ranks
    Case("mask_full", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), mask=(B, H, LQ, LK)),
    Case("mask_2d", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), mask=(LQ, LK)),
    Case("mask_1d", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), mask=(LK,)),
    Case("mask_keypad", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), mask=(B, 1, 1, LK)),
    Case("mask_heads", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), mask=(H, 1, LK)),
    Case("mask_gqa", (B, 8, LQ, D), (B, 2, LK, D), (B, 2, LK, D), mask=(8, LQ, LK)),
    Case("mask_two_d", (LQ, D), (LK, D), (LK, D), mask=(LQ, LK)),
    Case(
        "mask_empty_rows",
        (B, H, LQ, D),
        (B, H, LK, D),
        (B, H, LK, D),
        mask=(B, H, LQ, LK),
        mask_empty_rows=True,
    ),
    Case(
        "mask_all_false", (1, 2, 3, D), (1, 2, 3, D), (1, 2, 3, D), mask=(3, 3), mask_all_false=True
    ),
    # additive float bias, incl. -inf entries and rows
    Case("bias_full", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), bias=(B, H, LQ, LK)),
    Case("bias_2d", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), bias=(LQ, LK)),
    Case("bias_1d", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), bias=(LK,), bias_neginf=0.2),
    Case("bias_keypad", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), bias=(B, 1, 1, LK)),
    Case(
        "bias_neginf",
        (B, H, LQ, D),
        (B, H, LK, D),
        (B, H, LK, D),
        bias=(1, H, LQ, LK),
        bias_neginf=0.3,
        bias_empty_rows=True,
    ),
    Case(
        "mask_and_bias",
        (B, H, LQ, D),
        (B, H, LK, D),
        (B, H, LK, D),
        mask=(B, 1, 1, LK),
        bias=(LQ, LK),
        bias_neginf=0.2,
    ),
    # causal variants with Lq < Lk, Lq > Lk, Lq == Lk
    *[
        Case(
            f"causal_{c}_{lq}x{lk}",
            (B, H, lq, D),
            (B, H, lk, D),
            (B, H, lk, D),
            kwargs={"causal": c},
        )
        for c in (True, "lower_right", "upper_left")
        for lq, lk in ((3, 6), (6, 3), (5, 5))
    ],
    Case("causal_two_d", (6, D), (4, D), (4, D), kwargs={"causal": True}),
    Case("causal_false", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), kwargs={"causal": False}),
    # sliding windows, alone and with causal
    Case("window_int", (B, H, 6, D), (B, H, 8, D), (B, H, 8, D), kwargs={"window": 1}),
    Case("window_zero", (B, H, 6, D), (B, H, 8, D), (B, H, 8, D), kwargs={"window": 0}),
    Case("window_tuple", (B, H, 6, D), (B, H, 8, D), (B, H, 8, D), kwargs={"window": (2, 1)}),
    Case(
        "window_left_none", (B, H, 6, D), (B, H, 8, D), (B, H, 8, D), kwargs={"window": (None, 1)}
    ),
    Case(
        "window_right_none", (B, H, 6, D), (B, H, 8, D), (B, H, 8, D), kwargs={"window": (1, None)}
    ),
    Case(
        "window_both_none",
        (B, H, 6, D),
        (B, H, 8, D),
        (B, H, 8, D),
        kwargs={"window": (None, None)},
    ),
    Case("window_lq_gt_lk", (B, H, 8, D), (B, H, 4, D), (B, H, 4, D), kwargs={"window": (1, 0)}),
    Case(
        "window_causal",
        (B, H, 6, D),
        (B, H, 8, D),
        (B, H, 8, D),
        kwargs={"window": (2, 3), "causal": True},
    ),
    Case(
        "window_causal_upper_left",
        (B, H, 6, D),
        (B, H, 8, D),
        (B, H, 8, D),
        kwargs={"window": (2, None), "causal": "upper_left"},
    ),
    Case(
        "window_causal_lq_gt_lk",
        (B, H, 7, D),
        (B, H, 4, D),
        (B, H, 4, D),
        kwargs={"window": 1, "causal": "lower_right"},
    ),
    # softcap and scale
    Case(
        "softcap",
        (B, H, LQ, D),
        (B, H, LK, D),
        (B, H, LK, D),
        kwargs={"softcap": 0.7, "scale": 3.0},
    ),
    Case(
        "softcap_bias",
        (B, H, LQ, D),
        (B, H, LK, D),
        (B, H, LK, D),
        bias=(LQ, LK),
        kwargs={"softcap": 1.5},
    ),
    Case("scale", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), kwargs={"scale": 0.3}),
    Case("scale_large", (B, H, LQ, D), (B, H, LK, D), (B, H, LK, D), kwargs={"scale": 4.0}),
    # everything at once
    Case(
        "everything",
        (2, 1, 8, 6, D),
        (2, 1, 2, 9, D),
        (2, 1, 2, 9, 3),
        mask=(2, 1, 1, 1, 9),
        bias=(8, 6, 9),
        bias_neginf=0.1,
        kwargs={"causal": True, "window": (4, 1), "softcap": 2.0, "scale": 0.5},
    ),
]


def _inputs(backend: Backend, dtype_name: str, case: Case, bias_dtype: str | None = None):
    data = case.make()
    dt = backend.dtype(dtype_name)
    q, k, v = (backend.asarray(data[n], dt) for n in "qkv")
    mask = None if data["mask"] is None else backend.asarray(data["mask"])
    bias = None
    if data["bias"] is not None:
        bias = backend.asarray(data["bias"], bias_dtype or dtype_name)
    ref = oracle.attention(
        backend.to_numpy(q),
        backend.to_numpy(k),
        backend.to_numpy(v),
        mask=data["mask"],
        bias=None if bias is None else backend.to_numpy(bias),
        **case.kwargs,
    )
    return (q, k, v), {"mask": mask, "bias": bias, **case.kwargs}, ref


# Each path attend() has: what `auto` picks, the portable core, the framework's fused kernel
# (where plan() says it applies; elsewhere "fused" must raise), and the chunked core
# (online softmax over blocks: `chunk_size`, no weights).
PATHS = {
    "auto": {"implementation": "auto"},
    "portable": {"implementation": "portable"},
    "fused": {"implementation": "fused"},
    "chunked": {"implementation": "portable", "chunk_size": 3},
}
# (return_weights, return_lse)
FORMS = [(True, True), (False, False), (False, True)]


def check_case(
    backend: Backend, dtype_name: str, case: Case, path: str, bias_dtype: str | None = None
) -> None:
    (q, k, v), kwargs, ref = _inputs(backend, dtype_name, case, bias_dtype)
    ran = 0
    for return_weights, return_lse in FORMS:
        if path == "chunked" and return_weights:
            continue
        call = {
            **kwargs,
            **PATHS[path],
            "return_weights": return_weights,
            "return_lse": return_lse,
        }
        if path == "fused":
            try:
                p = plan(q, k, v, **call)
            except ValueError:
                with pytest.raises(ValueError, match=r"`implementation\b"):
                    attend(q, k, v, **call)
                continue
            assert p.path.startswith("fused"), p
        if path == "auto" and plan(q, k, v, **call).path == "portable:dense":
            # the very runner the `portable` parameter runs on this case (JAX on the CPU
            # below 512 queries, weights on torch): nothing of its own to run
            assert plan(q, k, v, **{**call, **PATHS["portable"]}).path == "portable:dense"
            continue
        result = attend(q, k, v, **call)
        ran += 1
        if return_weights or return_lse:
            assert isinstance(result, tuple)
            assert len(result) == 1 + return_weights + return_lse
            out, rest = result[0], list(result[1:])
        else:
            assert not isinstance(result, tuple)
            out, rest = result, []
        weights = rest.pop(0) if return_weights else None
        lse = rest.pop(0) if return_lse else None
        check_against_oracle(backend, dtype_name, q, (out, weights, lse), ref)
    if path not in ("fused", "auto"):
        assert ran


# The chunked path runs on a subset of the cases that still covers every feature (eager jax
# pays a compile per block shape, so all cases would be slow).
CHUNKED_IDS = {
    "mask_all_false",
    "basic",
    "dk_ne_dv",
    "lq_gt_lk",
    "two_d",
    "five_d",
    "gqa",
    "mqa",
    "mask_2d",
    "mask_empty_rows",
    "bias_neginf",
    "mask_and_bias",
    "causal_True_3x6",
    "causal_True_6x3",
    "causal_upper_left_6x3",
    "window_tuple",
    "window_left_none",
    "window_lq_gt_lk",
    "window_causal_upper_left",
    "softcap_bias",
    "scale_large",
    "everything",
}


def _paths_of(b: Backend, paths: tuple[str, ...]) -> tuple[str, ...]:
    """The paths of ``paths`` that run code of their own on ``b``: everywhere the portable
    one; ``auto`` where it can pick a native or fused kernel (NumPy, torch, JAX, CuPy);
    ``fused`` where the framework has a fused kernel. On array_api_strict ``auto`` is the
    portable path and ``fused`` refuses (both checked below and in test_plan.py), so those
    cases would run the portable ones again."""
    keep = {"portable", "chunked"}
    if b.name in ("numpy", "torch", "jax", "cupy"):
        keep.add("auto")
    if b.name in ("torch", "jax", "cupy"):
        keep.add("fused")
    return tuple(p for p in paths if p in keep)


def _oracle_params(dtypes: tuple[str, ...], cases: list[Case], paths: tuple[str, ...]) -> list:
    return [
        pytest.param(b, d, case, path, id=f"{b.name}-{d}-{case.id}-{path}")
        for b in BACKENDS
        for d in dtypes
        if d in b.dtypes
        for case in cases
        for path in _paths_of(b, paths)
        if path != "chunked" or case.id in CHUNKED_IDS
    ]


@pytest.mark.parametrize(
    ("bk", "dtype_name", "case", "path"),
    _oracle_params(("float32", "float64"), CASES, ("auto", "portable", "fused")),
)
def test_matches_oracle(bk: Backend, dtype_name: str, case: Case, path: str) -> None:
    with bk.flags():
        check_case(bk, dtype_name, case, path)


def test_auto_is_the_portable_path_where_no_kernel_applies() -> None:
    """Where ``test_matches_oracle`` runs only the portable path (array_api_strict), auto
    plans it for every case, and ``fused`` refuses."""
    for b in BACKENDS:
        if _paths_of(b, ("auto",)):
            continue
        with b.flags():
            for case in CASES:
                (q, k, v), kwargs, _ = _inputs(b, "float32", case)
                assert plan(q, k, v, **kwargs).path == "portable:dense", (b, case.id)
                with pytest.raises(ValueError, match=r"`implementation\b"):
                    plan(q, k, v, implementation="fused", **kwargs)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in CHUNKED_IDS], ids=lambda c: c.id)
def test_matches_oracle_chunked(backend: Backend, case: Case) -> None:
    """The blocked online softmax, in float32 (and in the half dtypes below, computed in
    float32), where its rescaling errors would show; float64 would only add time."""
    check_case(backend, "float32", case, "chunked")


# float16/bfloat16 (computed in float32, returned in the input dtype; lse float32): a
# representative subset of the cases, to keep the suite fast.
HALF_IDS = {
    "basic",
    "dk_ne_dv",
    "two_d",
    "five_d",
    "gqa",
    "mask_empty_rows",
    "bias_neginf",
    "mask_and_bias",
    "causal_True_6x3",
    "causal_upper_left_3x6",
    "window_causal",
    "softcap_bias",
    "scale_large",
    "everything",
}
HALF_CASES = [c for c in CASES if c.id in HALF_IDS]


@pytest.mark.parametrize(
    ("bk", "dtype_name", "case", "path"), _oracle_params(HALF, HALF_CASES, tuple(PATHS))
)
def test_matches_oracle_half(bk: Backend, dtype_name: str, case: Case, path: str) -> None:
    with bk.flags():
        check_case(bk, dtype_name, case, path)


def test_case_subsets_name_cases_that_exist() -> None:
    """A renamed or removed case must not drop silently out of the subsets."""
    ids = {c.id for c in CASES}
    assert ids >= HALF_IDS
    assert ids >= CHUNKED_IDS


def test_cases_cover_empty_rows() -> None:
    """The case list really exercises rows with no key (guards the test data itself)."""
    with_empty = []
    for case in CASES:
        data = case.make()
        _, _, lse = oracle.attention(
            data["q"], data["k"], data["v"], mask=data["mask"], bias=data["bias"], **case.kwargs
        )
        if np.isneginf(lse).any():
            with_empty.append(case.id)
    for needed in (
        "mask_all_false",
        "mask_empty_rows",
        "bias_neginf",
        "causal_True_6x3",
        "causal_lower_right_6x3",
        "window_lq_gt_lk",
        "window_causal_lq_gt_lk",
        "causal_two_d",
    ):
        assert needed in with_empty
    assert "causal_upper_left_6x3" not in with_empty


@pytest.mark.parametrize("path", ["auto", "portable"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in ("bias_full", "bias_neginf", "softcap_bias")], ids=str
)
def test_half_inputs_accept_float32_bias(
    backend: Backend, half_dtype: str, case: Case, path: str
) -> None:
    """bias may be in q's dtype (tested above) or in the compute dtype, float32."""
    check_case(backend, half_dtype, case, path, bias_dtype=compute_dtype_name(half_dtype))


# ------------------------------------------------------------------------------------------
# Return forms


@pytest.mark.parametrize(
    ("return_weights", "return_lse"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_return_forms(
    backend: Backend, float_dtype: str, return_weights: bool, return_lse: bool
) -> None:
    data = CASES[0].make()
    dt = backend.dtype(float_dtype)
    q, k, v = (backend.asarray(data[n], dt) for n in "qkv")
    ref_out, ref_w, ref_lse = oracle.attention(*(backend.to_numpy(a) for a in (q, k, v)))
    result = attend(q, k, v, return_weights=return_weights, return_lse=return_lse)

    if not (return_weights or return_lse):
        assert not isinstance(result, tuple)
        out = result
        parts = {}
    else:
        assert isinstance(result, tuple)
        assert len(result) == 1 + return_weights + return_lse
        out = result[0]
        rest = list(result[1:])
        parts = {}
        if return_weights:
            parts["weights"] = rest.pop(0)
        if return_lse:
            parts["lse"] = rest.pop(0)

    assert_like(out, q, shape=ref_out.shape, dtype=dt, name="out")
    assert_close(backend.to_numpy(out), ref_out, float_dtype)
    if "weights" in parts:
        assert_like(parts["weights"], q, shape=ref_w.shape, dtype=dt, name="weights")
        assert_close(backend.to_numpy(parts["weights"]), ref_w, float_dtype, what="weights")
    if "lse" in parts:
        lse_dt = backend.dtype(compute_dtype_name(float_dtype))
        assert_like(parts["lse"], q, shape=ref_lse.shape, dtype=lse_dt, name="lse")
        assert_close(backend.to_numpy(parts["lse"]), ref_lse, float_dtype, what="lse")


def test_defaults_are_plain_attention(backend: Backend, hp_dtype: str) -> None:
    """Explicit defaults give exactly what no options give."""
    data = CASES[0].make()
    q, k, v = (backend.asarray(data[n], hp_dtype) for n in "qkv")
    plain = backend.to_numpy(attend(q, k, v))
    explicit = attend(
        q,
        k,
        v,
        mask=None,
        bias=None,
        causal=False,
        window=None,
        scale=None,
        softcap=None,
        dropout=0.0,
        rng=None,
        return_weights=False,
        return_lse=False,
        implementation="auto",
    )
    np.testing.assert_array_equal(backend.to_numpy(explicit), plain)
    portable = attend(q, k, v, implementation="portable")
    assert_close(backend.to_numpy(portable), plain, hp_dtype)


def test_mask_builders_agree_with_options(backend: Backend) -> None:
    """causal=/window= and the same constraint as a mask from `masks` give the same result."""
    hp_dtype = "float64"
    rng = rng_for("builders-vs-options")
    q, k, v = (backend.asarray(randn(rng, s), hp_dtype) for s in ((2, 6, 4), (2, 8, 4), (2, 8, 4)))
    for align in ("lower_right", "upper_left"):
        m = masks.causal_mask(6, 8, align=align, xp=backend.xp)
        a = backend.to_numpy(attend(q, k, v, causal=align))
        b = backend.to_numpy(attend(q, k, v, mask=m))
        assert_close(a, b, hp_dtype)
    m = masks.window_mask(6, 8, (2, 1), xp=backend.xp)
    a = backend.to_numpy(attend(q, k, v, window=(2, 1)))
    b = backend.to_numpy(attend(q, k, v, mask=m))
    assert_close(a, b, hp_dtype)


def test_non_contiguous_inputs(backend: Backend) -> None:
    """Transposed and strided inputs (views, where the framework has views) read correctly."""
    rng = rng_for("strided")
    base = randn(rng, (2, 6, 3, 8))  # [B, L, H, D] layout, viewed as [B, H, L, D]
    qn, kn, vn = base, randn(rng, (2, 7, 3, 8)), randn(rng, (2, 7, 3, 8))
    xp = backend.xp
    q, k, v = (xp.permute_dims(backend.asarray(a), (0, 2, 1, 3)) for a in (qn, kn, vn))
    q = q[..., ::2]
    k = k[..., ::2]
    ref = oracle.attention(
        qn.transpose(0, 2, 1, 3)[..., ::2],
        kn.transpose(0, 2, 1, 3)[..., ::2],
        vn.transpose(0, 2, 1, 3),
    )[0]
    assert_close(backend.to_numpy(attend(q, k, v)), ref, "float64")


def test_result_on_non_default_device() -> None:
    """array_api_strict has several devices: results stay on the inputs' device."""
    pytest.importorskip("array_api_strict")
    import array_api_strict as xs

    from conftest import BY_NAME

    if "array_api_strict" not in BY_NAME:
        pytest.skip("array_api_strict not selected")
    dev = xs.Device("device1")
    rng = rng_for("device1")
    q, k, v = (xs.asarray(randn(rng, (2, 3, 4)), device=dev) for _ in range(3))
    mask = xs.asarray(np.tril(np.ones((3, 3), dtype=bool)), device=dev)
    out, w, lse = attend(q, k, v, mask=mask, return_weights=True, return_lse=True)
    for a in (out, w, lse):
        assert a.device == dev
        assert array_api_compat.array_namespace(a) is xs


@pytest.mark.parametrize("path", ["auto", "portable"])
def test_larger_shapes(backend: Backend, path: str) -> None:
    """About a million scores: enough for kernels that split the queries into blocks (or
    threads) to cross block boundaries, with a row-dependent mask, empty rows and -inf bias."""
    rng = rng_for("larger")
    lq, lk = 1100, 1024
    qn, kn, vn = randn(rng, (1, lq, 8)), randn(rng, (1, lk, 8)), randn(rng, (1, lk, 4))
    mask_np = rng.random((lq, lk)) < 0.9
    mask_np[[0, 700, 1099]] = False  # empty rows in the first, a middle and the last block
    bias_np = randn(rng, (lq, lk))
    bias_np[5, :] = -np.inf
    q, k, v = (backend.asarray(a, "float32") for a in (qn, kn, vn))
    qn, kn, vn = (backend.to_numpy(a) for a in (q, k, v))
    impl = {"implementation": path}
    # no mask: the unmasked fast path
    out, lse = attend(q, k, v, return_lse=True, **impl)
    ref = oracle.attention(qn, kn, vn)
    check_against_oracle(backend, "float32", q, (out, None, lse), ref)
    # mask + bias + causal
    mask, bias = backend.asarray(mask_np), backend.asarray(bias_np, "float32")
    out, lse = attend(q, k, v, mask=mask, bias=bias, causal=True, return_lse=True, **impl)
    ref = oracle.attention(qn, kn, vn, mask=mask_np, bias=backend.to_numpy(bias), causal=True)
    assert np.isneginf(ref[2][0, [0, 5, 700, 1099]]).all()
    check_against_oracle(backend, "float32", q, (out, None, lse), ref)
