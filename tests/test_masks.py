"""portable_attention.masks on every backend against hand-written expectations."""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np
import pytest
from portable_attention import masks

from conftest import Backend, requires_backend

T, F = True, False


def check_mask(
    backend: Backend, result: Any, expected: list | np.ndarray, device: Any = None
) -> None:
    expected = np.asarray(expected, dtype=bool)
    sample = backend.asarray(np.zeros(1))
    assert type(result) is type(sample), type(result)
    assert array_api_compat.array_namespace(result) is backend.xp
    assert result.dtype == backend.bool_dtype
    assert tuple(result.shape) == expected.shape
    want_dev = device if device is not None else backend.device
    assert array_api_compat.device(result) == want_dev
    np.testing.assert_array_equal(backend.to_numpy(result), expected)


@pytest.fixture(params=["namespace", "module"])
def xp_arg(request: pytest.FixtureRequest, backend: Backend) -> Any:
    """`xp=` given as the array-API namespace or as the framework's own module."""
    return backend.xp if request.param == "namespace" else backend.module


# ------------------------------------------------------------------------------------------
# causal_mask

CAUSAL_EXPECTED = {
    # (lq, lk, align): expected
    (3, None, "lower_right"): [[T, F, F], [T, T, F], [T, T, T]],
    (3, 3, "upper_left"): [[T, F, F], [T, T, F], [T, T, T]],
    (2, 4, "lower_right"): [[T, T, T, F], [T, T, T, T]],
    (2, 4, "upper_left"): [[T, F, F, F], [T, T, F, F]],
    (4, 2, "lower_right"): [[F, F], [F, F], [T, F], [T, T]],
    (4, 2, "upper_left"): [[T, F], [T, T], [T, T], [T, T]],
    (1, 3, "lower_right"): [[T, T, T]],
    (1, 3, "upper_left"): [[T, F, F]],
}


@pytest.mark.parametrize(("lq", "lk", "align"), list(CAUSAL_EXPECTED), ids=str)
def test_causal_mask(backend: Backend, xp_arg: Any, lq: int, lk: int | None, align: str) -> None:
    args = (lq,) if lk is None else (lq, lk)
    result = masks.causal_mask(*args, align=align, xp=xp_arg)
    check_mask(backend, result, CAUSAL_EXPECTED[(lq, lk, align)])


def test_causal_mask_default_align_is_lower_right(backend: Backend, xp: Any) -> None:
    result = masks.causal_mask(2, 4, xp=xp)
    check_mask(backend, result, CAUSAL_EXPECTED[(2, 4, "lower_right")])


def test_causal_mask_default_xp_is_numpy() -> None:
    result = masks.causal_mask(2, 4)
    assert type(result) is np.ndarray
    assert result.dtype == np.bool_
    np.testing.assert_array_equal(result, CAUSAL_EXPECTED[(2, 4, "lower_right")])


def test_causal_mask_device(backend: Backend) -> None:
    dev = backend.extra.get("other_device", backend.device)
    result = masks.causal_mask(2, 4, xp=backend.xp, device=dev)
    check_mask(backend, result, CAUSAL_EXPECTED[(2, 4, "lower_right")], device=dev)


# ------------------------------------------------------------------------------------------
# window_mask

WINDOW_EXPECTED = {
    # (lq, lk, window, align): expected
    (4, 4, 1, "lower_right"): [
        [T, T, F, F],
        [T, T, T, F],
        [F, T, T, T],
        [F, F, T, T],
    ],
    (3, 5, (1, 0), "lower_right"): [  # p = i + 2
        [F, T, T, F, F],
        [F, F, T, T, F],
        [F, F, F, T, T],
    ],
    (3, 5, (1, 0), "upper_left"): [  # p = i
        [T, F, F, F, F],
        [T, T, F, F, F],
        [F, T, T, F, F],
    ],
    (3, 5, (None, 0), "lower_right"): [
        [T, T, T, F, F],
        [T, T, T, T, F],
        [T, T, T, T, T],
    ],
    (3, 5, (0, None), "upper_left"): [
        [T, T, T, T, T],
        [F, T, T, T, T],
        [F, F, T, T, T],
    ],
    (3, 5, (None, None), "lower_right"): [[T] * 5] * 3,
    (3, 5, 0, "lower_right"): [
        [F, F, T, F, F],
        [F, F, F, T, F],
        [F, F, F, F, T],
    ],
    (4, 2, (0, 1), "lower_right"): [  # p = i - 2
        [F, F],
        [T, F],
        [T, T],
        [F, T],
    ],
}


@pytest.mark.parametrize(("lq", "lk", "window", "align"), list(WINDOW_EXPECTED), ids=str)
def test_window_mask(
    backend: Backend, xp_arg: Any, lq: int, lk: int, window: Any, align: str
) -> None:
    result = masks.window_mask(lq, lk, window, align=align, xp=xp_arg)
    check_mask(backend, result, WINDOW_EXPECTED[(lq, lk, window, align)])


def test_window_mask_default_align_and_device(backend: Backend) -> None:
    dev = backend.extra.get("other_device", backend.device)
    result = masks.window_mask(3, 5, (1, 0), xp=backend.xp, device=dev)
    check_mask(backend, result, WINDOW_EXPECTED[(3, 5, (1, 0), "lower_right")], device=dev)


def test_window_mask_default_xp_is_numpy() -> None:
    result = masks.window_mask(4, 4, 1)
    assert type(result) is np.ndarray
    np.testing.assert_array_equal(result, WINDOW_EXPECTED[(4, 4, 1, "lower_right")])


@pytest.mark.parametrize("window", [-1, (-1, 0), (0, -2)])
def test_window_mask_negative(window: Any) -> None:
    with pytest.raises(ValueError, match="window"):
        masks.window_mask(3, 3, window)


def test_causal_mask_bad_align() -> None:
    with pytest.raises(ValueError, match="align"):
        masks.causal_mask(3, 3, align="lower_left")


# ------------------------------------------------------------------------------------------
# Builders that take arrays: namespace and device come from the arrays


def test_key_padding_mask(backend: Backend) -> None:
    lengths = backend.asarray(np.array([1, 3, 0, 4]))
    result = masks.key_padding_mask(lengths, 4)
    expected = np.array(
        [[T, F, F, F], [T, T, T, F], [F, F, F, F], [T, T, T, T]], dtype=bool
    ).reshape(4, 1, 1, 4)
    check_mask(backend, result, expected)


def test_padding_mask_from_tokens(backend: Backend) -> None:
    tokens = backend.asarray(np.array([[5, 0, 3, 0], [0, 0, 1, 2], [7, 7, 7, 7]]))
    result = masks.padding_mask_from_tokens(tokens, 0)
    expected = np.array([[T, F, T, F], [F, F, T, T], [T, T, T, T]], dtype=bool).reshape(3, 1, 1, 4)
    check_mask(backend, result, expected)
    result = masks.padding_mask_from_tokens(tokens, 7)
    expected = np.array([[T, T, T, T], [T, T, T, T], [F, F, F, F]], dtype=bool).reshape(3, 1, 1, 4)
    check_mask(backend, result, expected)


def test_segment_mask(backend: Backend) -> None:
    qs = backend.asarray(np.array([[0, 0, 1], [2, 2, 2]]))
    ks = backend.asarray(np.array([[0, 1, 1, 1], [2, 3, 3, 2]]))
    result = masks.segment_mask(qs, ks)
    expected = np.array(
        [
            [[T, F, F, F], [T, F, F, F], [F, T, T, T]],
            [[T, F, F, T], [T, F, F, T], [T, F, F, T]],
        ],
        dtype=bool,
    ).reshape(2, 1, 3, 4)
    check_mask(backend, result, expected)


def test_segment_mask_self(backend: Backend) -> None:
    qs = backend.asarray(np.array([[0, 0, 1], [4, 5, 5]]))
    result = masks.segment_mask(qs)
    expected = np.array(
        [
            [[T, T, F], [T, T, F], [F, F, T]],
            [[T, F, F], [F, T, T], [F, T, T]],
        ],
        dtype=bool,
    ).reshape(2, 1, 3, 3)
    check_mask(backend, result, expected)


def test_combine(backend: Backend) -> None:
    a = backend.asarray(np.array([[T, F, T], [T, T, F]]))  # [Lq=2, Lk=3]
    b = backend.asarray(np.array([T, T, F, F, T, T]).reshape(2, 1, 1, 3))  # [B=2,1,1,Lk]
    result = masks.combine(a, None, b)
    expected = np.array(
        [
            [[[T, F, F], [T, T, F]]],
            [[[F, F, T], [F, T, F]]],
        ],
        dtype=bool,
    )
    check_mask(backend, result, expected)
    check_mask(backend, masks.combine(a), [[T, F, T], [T, T, F]])
    check_mask(backend, masks.combine(None, a, None), [[T, F, T], [T, T, F]])


def test_combine_all_none() -> None:
    assert masks.combine(None, None) is None
    assert masks.combine(None) is None
    assert masks.combine() is None


def test_combined_masks_in_attend(backend: Backend) -> None:
    """A combined padding/segment/causal mask used in attend() equals the oracle with it."""
    from portable_attention import attend

    import oracle
    from helpers import assert_close, randn, rng_for

    tokens_np = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5]])
    seg_np = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    m = masks.combine(
        masks.padding_mask_from_tokens(backend.asarray(tokens_np), 0),
        masks.segment_mask(backend.asarray(seg_np)),
        masks.causal_mask(5, xp=backend.xp),
    )
    expected = (
        (tokens_np != 0)[:, None, None, :]
        & (seg_np[:, None, :, None] == seg_np[:, None, None, :])
        & np.tril(np.ones((5, 5), dtype=bool))
    )
    check_mask(backend, m, expected)
    rng = rng_for("combined-in-attend")
    qn, kn, vn = (randn(rng, (2, 2, 5, 4)) for _ in range(3))
    q, k, v = (backend.asarray(a) for a in (qn, kn, vn))
    out = attend(q, k, v, mask=m)
    assert_close(backend.to_numpy(out), oracle.attention(qn, kn, vn, mask=expected)[0], "float64")


def test_combine_names_the_mask_that_does_not_fit(backend: Backend) -> None:
    a = backend.asarray(np.ones((3, 1), dtype=bool))
    b = backend.asarray(np.ones((2, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"`masks\[2\]`.*\(2, 4\)"):
        masks.combine(a, None, b)
    f = backend.asarray(np.ones((3, 1)), "float32")
    with pytest.raises(TypeError, match=r"`masks\[1\]`.*boolean"):
        masks.combine(a, f)


def test_lengths_take_numpy_integers() -> None:
    """Lengths read off a NumPy shape or array (``numpy.int64``) are ints, as window sides are."""
    np.testing.assert_array_equal(
        masks.causal_mask(np.int64(3), np.int32(4)), masks.causal_mask(3, 4)
    )
    with pytest.raises(ValueError, match="`lq` must be an int >= 0"):
        masks.causal_mask(np.float64(3.0))


# ------------------------------------------------------------------------------------------
# segment_ids_from_lengths / segment_ids_from_cu_seqlens


def check_ids(backend: Backend, result: Any, expected: list | np.ndarray) -> None:
    """Integer ids of the backend's framework, namespace and device, default integer dtype."""
    expected = np.asarray(expected, dtype=np.int64)
    sample = backend.asarray(np.zeros(1))
    assert type(result) is type(sample), type(result)
    assert array_api_compat.array_namespace(result) is backend.xp
    assert result.dtype == backend.xp.arange(1).dtype, result.dtype
    assert tuple(result.shape) == expected.shape, tuple(result.shape)
    assert array_api_compat.device(result) == backend.device
    np.testing.assert_array_equal(backend.to_numpy(result), expected)


LENGTHS_EXPECTED = {
    # id: (lengths, total, expected ids)
    "one-row": ([2, 0, 3], None, [0, 0, 2, 2, 2]),
    "length-one": ([1, 1, 1], None, [0, 1, 2]),
    "padding": ([1, 2], 5, [0, 1, 1, -1, -1]),
    "leading-empty": ([0, 0, 2], 3, [2, 2, -1]),
    "all-empty": ([0, 0], None, []),
    "no-segments": (np.zeros(0, dtype=int), 2, [-1, -1]),
    "batched": (
        [[1, 2, 0, 1], [3, 0, 0, 0], [0, 0, 0, 0]],
        None,  # the longest row: 4
        [[0, 1, 1, 3], [0, 0, 0, -1], [-1, -1, -1, -1]],
    ),
    "batched-total": ([[2, 1], [1, 1]], 4, [[0, 0, 1, -1], [0, 1, -1, -1]]),
    "batch-dims": (
        [[[1, 1], [2, 0]], [[0, 2], [1, 0]]],
        None,
        [[[0, 1], [0, 0]], [[1, 1], [0, -1]]],
    ),
    "no-rows": (np.zeros((0, 3), dtype=int), 2, np.zeros((0, 2), dtype=int)),
}


@pytest.mark.parametrize("case", list(LENGTHS_EXPECTED))
def test_segment_ids_from_lengths(backend: Backend, case: str) -> None:
    lengths, total, expected = LENGTHS_EXPECTED[case]
    result = masks.segment_ids_from_lengths(backend.asarray(np.asarray(lengths), "int32"), total)
    check_ids(backend, result, expected)


@pytest.mark.parametrize("case", [c for c in LENGTHS_EXPECTED if c != "no-rows"])
def test_segment_ids_from_cu_seqlens_agree_with_lengths(backend: Backend, case: str) -> None:
    """``cu_seqlens = [0, cumsum(lengths)]`` gives the ids of ``lengths`` (each row)."""
    lengths, total, _ = LENGTHS_EXPECTED[case]
    want = masks.segment_ids_from_lengths(np.asarray(lengths), total)
    lengths = np.asarray(lengths)
    rows = int(np.prod(lengths.shape[:-1]))  # one row per batch row
    lengths, want = lengths.reshape(rows, lengths.shape[-1]), want.reshape(rows, want.shape[-1])
    for row, ids in zip(lengths, want, strict=True):
        cu = backend.asarray(np.concatenate([[0], np.cumsum(row)]), "int32")
        check_ids(backend, masks.segment_ids_from_cu_seqlens(cu, want.shape[-1]), ids)
        if total is None and want.shape[0] == 1:  # the default total: cu_seqlens[-1]
            check_ids(backend, masks.segment_ids_from_cu_seqlens(cu), ids)


def test_segment_ids_from_cu_seqlens(backend: Backend) -> None:
    cu = backend.asarray(np.array([0, 2, 2, 5, 6]), "int32")
    check_ids(backend, masks.segment_ids_from_cu_seqlens(cu), [0, 0, 2, 2, 2, 3])
    check_ids(backend, masks.segment_ids_from_cu_seqlens(cu, 8), [0, 0, 2, 2, 2, 3, -1, -1])
    only_zero = backend.asarray(np.array([0]), "int32")
    check_ids(backend, masks.segment_ids_from_cu_seqlens(only_zero), [])
    check_ids(backend, masks.segment_ids_from_cu_seqlens(only_zero, 2), [-1, -1])


def test_segment_ids_from_lengths_in_attention() -> None:
    """The ids of both helpers drive the oracle's segment ids as the block mask would."""
    import oracle

    q_ids = masks.segment_ids_from_cu_seqlens(np.array([0, 2, 5], dtype=np.int32), 6)
    kv_ids = masks.segment_ids_from_lengths(np.array([3, 1]), 6)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 3)), np.eye(6)[None]
    got = oracle.attention(q, k, np.repeat(v, 2, 0), segment_ids=(q_ids, kv_ids))
    mask = masks.segment_mask(q_ids[None], kv_ids[None])[0]
    want = oracle.attention(q, k, np.repeat(v, 2, 0), mask=mask)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-14)
    assert (got[1][:, :2, 3:] == 0).all() and (got[1][:, 5, :4] == 0).all()  # padding: -1


@requires_backend("jax")
def test_segment_ids_under_jax_jit() -> None:
    import jax
    import jax.numpy as jnp

    lengths, _, expected = LENGTHS_EXPECTED["batched"]
    from_lengths = jax.jit(masks.segment_ids_from_lengths, static_argnames="total")
    result = from_lengths(jnp.asarray(lengths, dtype=jnp.int32), total=4)
    np.testing.assert_array_equal(np.asarray(result), expected)
    from_cu = jax.jit(masks.segment_ids_from_cu_seqlens, static_argnames="total")
    result = from_cu(jnp.asarray([0, 2, 2, 5], dtype=jnp.int32), total=6)
    np.testing.assert_array_equal(np.asarray(result), [0, 0, 2, 2, 2, -1])
    with pytest.raises(ValueError, match=r"`total` is required when `lengths` is traced"):
        jax.jit(masks.segment_ids_from_lengths)(jnp.asarray(lengths))
    with pytest.raises(ValueError, match=r"`total` is required when `cu_seqlens` is traced"):
        jax.jit(masks.segment_ids_from_cu_seqlens)(jnp.asarray([0, 2]))
    # concrete JAX arrays outside a trace are checked like any other
    with pytest.raises(ValueError, match="`lengths` must be >= 0"):
        masks.segment_ids_from_lengths(jnp.asarray([2, -1]))


def test_segment_ids_from_lengths_errors(backend: Backend) -> None:
    with pytest.raises(TypeError, match=r"`lengths` must be an integer array.*float"):
        masks.segment_ids_from_lengths(backend.asarray(np.array([1.0, 2.0])))
    with pytest.raises(ValueError, match=r"`lengths` must have shape \[\*batch, n\]"):
        masks.segment_ids_from_lengths(backend.asarray(np.array(3)))
    with pytest.raises(ValueError, match=r"`lengths` must be >= 0.*-2"):
        masks.segment_ids_from_lengths(backend.asarray(np.array([[1, 2], [3, -2]])))
    lengths = backend.asarray(np.array([[1, 2], [3, 2]]))
    with pytest.raises(ValueError, match=r"`total` \(4\) is smaller than the longest row"):
        masks.segment_ids_from_lengths(lengths, 4)
    for total in (-1, 2.5, True):
        with pytest.raises(ValueError, match="`total` must be an int >= 0"):
            masks.segment_ids_from_lengths(lengths, total)  # type: ignore[arg-type]


def test_segment_ids_from_cu_seqlens_errors(backend: Backend) -> None:
    with pytest.raises(TypeError, match="`cu_seqlens` must be an integer array"):
        masks.segment_ids_from_cu_seqlens(backend.asarray(np.array([0.0, 2.0])))
    for bad in (np.zeros((2, 3), dtype=int), np.zeros(0, dtype=int), np.array(0)):
        with pytest.raises(ValueError, match=r"`cu_seqlens` must have shape \[n \+ 1\]"):
            masks.segment_ids_from_cu_seqlens(backend.asarray(bad))
    with pytest.raises(ValueError, match=r"`cu_seqlens` must start at 0.*got 1"):
        masks.segment_ids_from_cu_seqlens(backend.asarray(np.array([1, 3])))
    with pytest.raises(ValueError, match=r"non-decreasing.*got 4 then 3 at index 2"):
        masks.segment_ids_from_cu_seqlens(backend.asarray(np.array([0, 4, 3, 5])))
    with pytest.raises(ValueError, match=r"`total` \(4\) is smaller than `cu_seqlens\[-1\]`"):
        masks.segment_ids_from_cu_seqlens(backend.asarray(np.array([0, 2, 5])), 4)
    with pytest.raises(TypeError, match="`cu_seqlens`"):
        masks.segment_ids_from_cu_seqlens([0, 2, 5])
