"""Hostile inputs: a catalogue of everything a user can get wrong, and what must work.

Part 1, :data:`CATALOGUE`: each case is a call of ``attend`` (and of ``plan``, which
validates the same way) that must raise exactly ``TypeError`` or ``ValueError`` from
this package's own code -- never a backend's exception from deep inside, never a
subclass such as JAX's ``ConcretizationTypeError`` -- whose message names the argument
in backticks and contains the case's hints (what to do, the shapes or dtypes). Each case
runs on every selected backend it applies to.

Cases that tests/test_errors.py already holds are not repeated here; they are listed in
:data:`IN_TEST_ERRORS` and count towards the catalogue
(``test_catalogue_ids_are_unique_and_every_option_has_a_case``).

Part 2: inputs that look hostile but must work and match the float64 oracle:
non-contiguous and negatively strided views, zero-stride (broadcast) views,
``as_strided``, read-only NumPy arrays, and zero-length axes (Lq, Lk, batch, Dv, Dk).
"""

from __future__ import annotations

import inspect
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import portable_attention
import pytest
from portable_attention import attend, masks, plan

import oracle
from conftest import BACKENDS, BY_NAME, Backend, requires_backend
from helpers import assert_close, assert_like, check_against_oracle, randn, rng_for

PACKAGE_DIR = os.path.dirname(os.path.abspath(portable_attention.__file__))
ENTRY_POINTS: dict[str, Callable[..., Any]] = {"attend": attend, "plan": plan}


# ------------------------------------------------------------------------------------------
# Part 1: the catalogue of errors


@dataclass(frozen=True)
class Bad:
    """One wrong call: ``build(backend)`` gives attend's arguments (q, k, v and options)."""

    id: str
    build: Callable[[Backend], dict[str, Any]]
    error: type[Exception]
    names: tuple[str, ...]  # at least one of these appears in backticks
    says: tuple[str, ...] = ()  # every one of these appears in the message
    applies: Callable[[Backend], bool] = lambda b: True


def qkv(
    b: Backend,
    dtype: str = "float32",
    *,
    hq: int = 4,
    hk: int = 2,
    lq: int = 3,
    lk: int = 5,
    dk: int = 4,
    dv: int = 3,
    lead: tuple[int, ...] = (2,),
    hv: int | None = None,
    lead_v: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """q [lead, hq, lq, dk], k [lead, hk, lk, dk], v [lead_v, hv, lk, dv] (scores [2, 4, 3, 5])."""
    rng = rng_for("hostile", hq, hk, lq, lk, dk, dv, lead, hv, lead_v)
    return {
        "q": b.asarray(randn(rng, (*lead, hq, lq, dk)), dtype),
        "k": b.asarray(randn(rng, (*lead, hk, lk, dk)), dtype),
        "v": b.asarray(randn(rng, (*(lead_v or lead), hv or hk, lk, dv)), dtype),
    }


def _with(**changes: Any) -> Callable[[Backend], dict[str, Any]]:
    """Build the standard q, k, v and replace/add entries (callables get the backend)."""

    def build(b: Backend) -> dict[str, Any]:
        args = qkv(b)
        for name, value in changes.items():
            args[name] = value(b) if callable(value) else value
        return args

    return build


def _cast(which: str, dtype: Any) -> Callable[[Backend], dict[str, Any]]:
    def build(b: Backend) -> dict[str, Any]:
        args = qkv(b)
        data = b.to_numpy(args[which])
        args[which] = b._asarray(data, dtype(b)) if callable(dtype) else b.asarray(data, dtype)
        return args

    return build


def _float8(b: Backend) -> Any:
    return getattr(b.module, "float8_e4m3fn", None)


def _is(*names: str) -> Callable[[Backend], bool]:
    return lambda b: b.name in names


def _has(dtype: str) -> Callable[[Backend], bool]:
    return lambda b: dtype in b.dtypes


def _ones(shape: tuple[int, ...], dtype: str | None = None) -> Callable[[Backend], Any]:
    return lambda b: b.asarray(np.ones(shape), dtype) if dtype else b.asarray(np.ones(shape))


def _bool(shape: tuple[int, ...]) -> Callable[[Backend], Any]:
    return lambda b: b.asarray(np.ones(shape, dtype=bool))


def _other_device(b: Backend) -> Any:
    """A second device of the backend: array_api_strict's device1, torch's meta."""
    if b.name.startswith("array_api_strict"):
        return b.extra["other_device"]
    import torch

    return torch.device("meta")


def _on_other_device(which: str) -> Callable[[Backend], dict[str, Any]]:
    def build(b: Backend) -> dict[str, Any]:
        args = qkv(b)
        if which == "mask":
            x = b.asarray(np.ones((3, 5), dtype=bool))
        elif which == "bias":
            x = b.asarray(np.zeros((3, 5)), "float32")
        else:
            x = args[which]
        dev = _other_device(b)
        args[which] = x.to(dev) if b.name == "torch" else x.to_device(dev)
        return args

    return build


_TWO_DEVICES = _is("torch", "array_api_strict")
_MASK_HINTS = ("bias=", "m != 0", "m == 0", "True = may attend")

CATALOGUE: list[Bad] = [
    # --- non-arrays (Python lists and scalars: tests/test_errors.py) --------------------
    Bad("q_is_None", _with(q=None), TypeError, ("q",), ("xp.asarray",)),
    Bad("k_is_tuple", _with(k=((0.0, 1.0),) * 5), TypeError, ("k",), ("tuple",)),
    Bad(
        "mask_numpy_bool_scalar",
        _with(mask=np.bool_(True)),
        TypeError,
        ("mask",),
        ("NumPy scalar", "xp.asarray"),
    ),
    Bad(
        "bias_numpy_float_scalar",
        _with(bias=np.float32(0.0)),
        TypeError,
        ("bias",),
        ("xp.asarray",),
    ),
    Bad(
        "q_numpy_float_scalar",
        _with(q=np.float64(1.0)),
        TypeError,
        ("q",),
        ("NumPy scalar",),
    ),
    Bad(
        "q_numpy_masked_array",
        _with(q=lambda b: np.ma.masked_array(b.to_numpy(qkv(b)["q"]), mask=False)),
        TypeError,
        ("q",),
        ("MaskedArray", "filled", "mask="),
        _is("numpy"),
    ),
    Bad(
        "q_torch_sparse_coo",
        _with(q=lambda b: qkv(b)["q"].to_sparse()),
        TypeError,
        ("q",),
        ("sparse_coo", "to_dense()"),
        _is("torch"),
    ),
    Bad(
        "mask_torch_sparse",
        _with(mask=lambda b: b.asarray(np.ones((3, 5), dtype=bool)).to_sparse()),
        TypeError,
        ("mask",),
        ("to_dense()",),
        _is("torch"),
    ),
    Bad(
        "bias_torch_sparse_csr",
        _with(bias=lambda b: b.asarray(np.zeros((3, 5)), "float32").to_sparse_csr()),
        TypeError,
        ("bias",),
        ("sparse_csr", "to_dense()"),
        _is("torch"),
    ),
    Bad(
        "q_torch_nested",
        _with(
            q=lambda b: b.module.nested.nested_tensor(
                [b.module.zeros(3, 4)] * 2, layout=b.module.jagged
            )
        ),
        TypeError,
        ("q",),
        ("nested", "to_padded_tensor", "mask="),
        _is("torch"),
    ),
    *[
        Bad(
            f"{which}_torch_nested_strided",  # torch's default layout: no sizes to read
            _with(
                **{
                    which: lambda b: b.module.nested.nested_tensor(
                        [b.module.zeros(2, 4, 8), b.module.zeros(2, 3, 8)]
                    )
                }
            ),
            TypeError,
            (which,),
            ("nested", "to_padded_tensor"),
            _is("torch"),
        )
        for which in ("q", "k")
    ],
    # --- ranks and shapes ----------------------------------------------------------------
    Bad(
        "q_zero_dim",
        _with(q=lambda b: b.asarray(np.array(1.0), "float32")),
        ValueError,
        ("q",),
        ("at least 2 dims", "q ()"),
    ),
    Bad(
        "k_v_heads_differ",
        lambda b: qkv(b, hk=2, hv=4),
        ValueError,
        ("k", "v"),
        ("heads", "(2, 2, 5, 4)", "(2, 4, 5, 3)"),
    ),
    Bad(
        "kv_zero_heads",
        lambda b: qkv(b, hq=0, hk=0),
        ValueError,
        ("k",),
        ("0 heads", "at least one"),
    ),
    Bad(
        "v_batch_differs",
        lambda b: qkv(b, lead=(2,), lead_v=(3,)),
        ValueError,
        ("q", "v"),
        ("leading", "(3, 2, 5, 3)"),
    ),
    Bad(
        "heads_4_over_3",
        lambda b: qkv(b, hq=4, hk=3),
        ValueError,
        ("q", "k"),
        ("multiple", "(4)", "(3)"),
    ),
    Bad(
        "mask_5d_for_4d_scores",
        _with(mask=_bool((2, 2, 4, 3, 5))),
        ValueError,
        ("mask",),
        ("(2, 2, 4, 3, 5)", "(2, 4, 3, 5)"),
    ),
    Bad(
        "bias_lq_lk_swapped",
        _with(bias=_ones((5, 3), "float32")),
        ValueError,
        ("bias",),
        ("(5, 3)", "(2, 4, 3, 5)"),
    ),
    # --- dtypes -----------------------------------------------------------------------------
    Bad(
        "q_float64_kv_float32",
        _cast("q", "float64"),
        TypeError,
        ("q",),
        ("float64", "float32", "cast"),
    ),
    Bad(
        "q_float8",
        lambda b: {n: b._asarray(b.to_numpy(x), _float8(b)) for n, x in qkv(b).items()},
        TypeError,
        ("q",),
        ("8-bit", "astype"),
        lambda b: _float8(b) is not None,
    ),
    Bad(
        "q_uint8",
        _cast("q", "uint8"),
        TypeError,
        ("q",),
        ("uint8", "real floating", "astype"),
    ),
    Bad(
        "mask_float_01",
        _with(mask=lambda b: b.asarray(np.eye(3, 5), "float32")),
        TypeError,
        ("mask",),
        (*_MASK_HINTS, "float32", "(3, 5)"),
    ),
    Bad(
        "mask_int_01",
        _with(mask=lambda b: b.asarray(np.eye(3, 5).astype(np.int64))),
        TypeError,
        ("mask",),
        (*_MASK_HINTS, "int64"),
    ),
    Bad(
        "mask_uint8_01",
        _with(mask=lambda b: b.asarray(np.eye(3, 5), "uint8")),
        TypeError,
        ("mask",),
        (*_MASK_HINTS, "uint8"),
    ),
    Bad(
        "bias_float16_for_float32",
        _with(bias=_ones((3, 5), "float16")),
        TypeError,
        ("bias",),
        ("float16", "float32"),
        _has("float16"),
    ),
    # --- devices -------------------------------------------------------------------------
    Bad("v_other_device", _on_other_device("v"), ValueError, ("v",), ("device",), _TWO_DEVICES),
    Bad(
        "bias_other_device",
        _on_other_device("bias"),
        ValueError,
        ("bias",),
        ("device", "move"),
        _TWO_DEVICES,
    ),
    Bad(
        "mask_other_device",
        _on_other_device("mask"),
        ValueError,
        ("mask",),
        ("device", "move"),
        _is("torch"),  # array_api_strict: tests/test_errors.py::test_different_devices
    ),
    # --- option values -------------------------------------------------------------------
    *[
        Bad(f"scale_{label}", _with(scale=value), ValueError, ("scale",), ("> 0",))
        for label, value in (
            ("nan", math.nan),
            ("inf", math.inf),
            ("minus_inf", -math.inf),
            ("zero", 0.0),
            ("zero_int", 0),
            ("negative", -0.5),
            ("int_beyond_float", 10**400),
        )
    ],
    Bad("softcap_int_beyond_float", _with(softcap=10**400), ValueError, ("softcap",), ("> 0",)),
    Bad("dropout_int_beyond_float", _with(dropout=10**400), ValueError, ("dropout",), ("[0, 1)",)),
    *[
        Bad(f"scale_{label}", _with(scale=value), TypeError, ("scale",), ("float",))
        for label, value in (
            ("bool", True),
            ("str", "0.5"),
            ("complex", 0.5j),
            ("array_of_two", np.array([0.5, 0.5])),
        )
    ],
    *[
        Bad(f"softcap_{label}", _with(softcap=value), TypeError, ("softcap",), ("float",))
        for label, value in (("bool", True), ("str", "30"))
    ],
    *[
        Bad(f"dropout_{label}", _with(dropout=value), TypeError, ("dropout",), ("float",))
        for label, value in (("bool", True), ("str", "0.1"), ("None", None))
    ],
    *[
        Bad(f"chunk_size_{label}", _with(chunk_size=value), ValueError, ("chunk_size",), ("> 0",))
        for label, value in (
            ("zero", 0),
            ("negative", -4),
            ("float", 2.0),
            ("str", "4"),
            ("bool", True),
        )
    ],
    Bad(
        "chunk_size_with_return_weights",
        _with(chunk_size=4, return_weights=True),
        ValueError,
        ("chunk_size",),
        ("return_weights",),
    ),
    *[
        Bad(f"{flag}_{label}", _with(**{flag: value}), TypeError, (flag,), ("True or False",))
        for flag in ("return_weights", "return_lse")
        for label, value in (("int_1", 1), ("str", "yes"), ("None", None))
    ],
    *[
        Bad(f"implementation_{label}", _with(implementation=value), ValueError, ("implementation",))
        for label, value in (("None", None), ("bool", True))
    ],
    *[
        Bad(f"window_{label}", _with(window=value), ValueError, ("window",))
        for label, value in (("bool", True), ("bool_side", (True, 1)), ("dict", {"left": 1}))
    ],
    *[
        Bad(f"rng_{label}", _with(dropout=0.5, rng=value), TypeError, ("rng",))
        for label, value in (
            ("int_seed", 0),
            ("numpy_RandomState", np.random.RandomState(0)),
        )
    ],
    Bad(
        "rng_batch_of_jax_keys",
        _with(dropout=0.5, rng=lambda b: __import__("jax").random.split(b.make_rng(0), 2)),
        TypeError,
        ("rng",),
        ("PRNG key",),
        _is("jax"),
    ),
]

#: Cases of the catalogue that live in tests/test_errors.py (by its test names and ids).
IN_TEST_ERRORS: tuple[str, ...] = (
    *(f"mixed_frameworks_{w}" for w in ("q", "k", "v", "mask", "bias")),
    "torch_q_numpy_k",
    *(
        f"non_array_{w}_{kind}"
        for w in ("q", "k", "v", "mask", "bias")
        for kind in ("list", "scalar")
    ),
    "all_lists",
    "rank_below_two",
    "rank_mismatch_k",
    "rank_mismatch_v",
    "leading_dims_differ",
    "heads_not_divisible",
    "dk_mismatch",
    "lk_mismatch",
    *(
        f"{w}_not_broadcasting_{s}"
        for w in ("mask", "bias")
        for s in ("lk_wrong", "lq_wrong", "heads_wrong", "batch_wrong", "too_many_dims")
    ),
    *(f"{w}_{d}" for w in ("q", "k", "v") for d in ("int", "bool", "complex")),
    "all_int_inputs",
    "k_dtype_differs",
    "v_dtype_differs",
    "half_dtype_mismatch",
    *(f"mask_{d}" for d in ("float32", "float64", "int", "complex")),
    *(f"bias_{d}" for d in ("int", "bool", "complex", "float64")),
    "half_bias_wrong_dtype",
    *(f"dropout_{p}" for p in ("-0.1", "1.0", "1.5", "nan")),
    *(f"softcap_{s}" for s in ("0.0", "-1.0", "inf", "nan")),
    *(f"causal_{c}" for c in ("lower_left", "upper-left", "empty", "True_str")),
    *(f"causal_type_{c}" for c in ("1", "0.0", "None", "list")),
    *(f"implementation_{i}" for i in ("fast", "Portable", "empty", "flash")),
    *(f"window_{w}" for w in ("-1", "(-1,2)", "(2,-1)", "(-3,None)", "3-tuple", "1-tuple")),
    *(f"window_{w}" for w in ("str", "float_side", "float")),
    "rng_wrong_framework",
    "rng_str",
    "jax_dropout_without_rng",
    "different_devices_k",
    "different_devices_mask",
)


#: Cases whose argument is a Python option value checked before any framework code runs
#: (the arrays are valid): their message cannot depend on the framework, so they run on
#: one backend (the first selected); the rest run on every backend they apply to.
FRAMEWORK_FREE = frozenset(
    case.id
    for case in CATALOGUE
    if case.id != "scale_array_of_two"  # an array of the framework: every backend
    and case.id.startswith(
        (
            "scale_",
            "softcap_",
            "dropout_",
            "chunk_size_",
            "return_weights_",
            "return_lse_",
            "implementation_",
            "window_",
        )
    )
)


def _params() -> list[Any]:
    return [
        pytest.param(b, case, id=f"{b.name}-{case.id}")
        for case in CATALOGUE
        for b in (BACKENDS[:1] if case.id in FRAMEWORK_FREE else BACKENDS)
        if case.applies(b)
    ]


def _raised_here(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is in this package's code."""
    tb = err.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(PACKAGE_DIR)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(("bk", "case"), _params())
def test_catalogue(bk: Backend, case: Bad, entry: str) -> None:
    with bk.flags():
        args = case.build(bk)
        fn = ENTRY_POINTS[entry]
        with pytest.raises((TypeError, ValueError)) as info:
            fn(**args)
    err = info.value
    msg = str(err)
    assert type(err) is case.error, f"{type(err).__name__}: {msg}"
    assert _raised_here(err), f"raised outside portable_attention: {msg}"
    assert any(re.search(f"`{re.escape(n)}`", msg) for n in case.names), msg
    for hint in case.says:
        assert hint in msg, f"{hint!r} not in: {msg}"


#: Options whose wrong values are tested beside their subject, in tests/test_modern.py
#: (``test_errors_for_*``): the ones with a signature of their own (the mods) or shapes
#: tied to the heads and segments.
ELSEWHERE = frozenset({"sinks", "segment_ids", "score_mod", "mask_mod"})


def test_catalogue_ids_are_unique_and_every_option_has_a_case() -> None:
    """No id twice (here and in tests/test_errors.py), and every argument of ``attend`` has
    a wrong-value case: in this catalogue (the names its messages must carry), in
    tests/test_errors.py (by the ids listed, which start with the argument's name) or in
    :data:`ELSEWHERE`. A new option without an error case fails here."""
    ids = [c.id for c in CATALOGUE]
    assert len(ids) == len(set(ids))
    assert len(IN_TEST_ERRORS) == len(set(IN_TEST_ERRORS))
    assert not set(ids) & set(IN_TEST_ERRORS)
    named = {n for case in CATALOGUE for n in case.names}
    listed = {i.split("_")[0] for i in IN_TEST_ERRORS}
    options = set(inspect.signature(attend).parameters)
    assert options - named - listed - ELSEWHERE == set()


@requires_backend("jax")
@pytest.mark.parametrize("option", ["scale", "softcap", "dropout"])
def test_traced_option_under_jit(option: str) -> None:
    """A traced float option under jax.jit is our TypeError (not JAX's
    ConcretizationTypeError) and says how to pass it: as a static argument."""
    import jax

    backend = BY_NAME["jax"]
    args = qkv(backend)
    extra = {"rng": backend.make_rng(0)} if option == "dropout" else {}

    def f(value: Any) -> Any:
        return attend(**args, **{option: value}, **extra)

    with pytest.raises(TypeError) as info:
        jax.jit(f)(0.25)
    assert type(info.value) is TypeError
    assert f"`{option}`" in str(info.value) and "static" in str(info.value)
    assert _raised_here(info.value)


@requires_backend("torch")
@pytest.mark.parametrize("which", ["q", "mask"])
def test_torch_sparse_after_dense_call_of_same_shape(which: str) -> None:
    """The call memo (keyed by type, shape, dtype, device) must not take a sparse tensor
    for the dense one of a previous call: the sparse call is still our TypeError."""
    backend = BY_NAME["torch"]
    args = {**qkv(backend), "mask": backend.asarray(np.ones((3, 5), dtype=bool))}
    attend(**args)
    attend(**args)  # memoised now
    args[which] = args[which].to_sparse()
    with pytest.raises(TypeError, match=f"`{which}`.*to_dense") as info:
        attend(**args)
    assert _raised_here(info.value)


def test_inputs_unchanged_after_errors(backend: Backend) -> None:
    """A failing call modifies nothing: arrays compare equal before and after."""
    args = qkv(backend)
    mask = backend.asarray(np.eye(3, 5))
    before = {n: backend.to_numpy(x).copy() for n, x in args.items()}
    with pytest.raises(TypeError):
        attend(**args, mask=mask)
    with pytest.raises(ValueError):
        attend(**args, scale=0.0)
    for n, x in args.items():
        np.testing.assert_array_equal(backend.to_numpy(x), before[n])


# ------------------------------------------------------------------------------------------
# Part 2: hostile-looking inputs that must work

PATHS = ("auto", "portable", "chunked", "fused")


def _attend_on(path: str, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    if path == "fused":
        try:
            plan(q, k, v, implementation="fused", **kwargs)
        except ValueError as err:
            pytest.skip(str(err))
        return attend(q, k, v, implementation="fused", **kwargs)
    if path == "chunked":
        return attend(q, k, v, chunk_size=2, **kwargs)
    return attend(q, k, v, implementation=path, **kwargs)


@requires_backend("numpy")
@pytest.mark.parametrize("path", ["auto", "portable", "chunked"])
def test_numpy_negative_strides_and_read_only(path: str) -> None:
    """Reversed views (``[..., ::-1, :]``, negative strides), a transposed view, a
    zero-stride ``broadcast_to`` view and read-only arrays, for q/k/v/mask/bias."""
    rng = rng_for("hostile", "numpy-views")
    q = randn(rng, (2, 4, 6, 5))[..., ::-1, :]  # negative stride on Lq
    k_base = randn(rng, (2, 2, 5, 7))  # [.., D, L]
    k = np.swapaxes(k_base, -1, -2)[..., ::-1, ::-1]  # transposed, both axes reversed
    v = np.broadcast_to(randn(rng, (2, 1, 7, 3)), (2, 2, 7, 3))  # zero stride on heads
    mask = (rng.random((7, 6)) < 0.7).T[::-1]
    bias = randn(rng, (4, 6, 7))[:, ::-1, ::-1]
    for a in (q, k, mask, bias):
        a.setflags(write=False)
    assert q.strides[-2] < 0 and not v.flags.writeable and v.strides[1] == 0
    before = [a.copy() for a in (q, k, v, mask, bias)]
    out, lse = attend(
        q, k, v, mask=mask, bias=bias, causal=True, return_lse=True,
        **({"chunk_size": 2} if path == "chunked" else {"implementation": path}),
    )  # fmt: skip
    ref = oracle.attention(q, k, v, mask=mask, bias=bias, causal=True)
    check_against_oracle(BY_NAME["numpy"], "float64", q, (out, None, lse), ref)
    for a, b in zip((q, k, v, mask, bias), before, strict=True):
        np.testing.assert_array_equal(a, b)


@requires_backend("numpy")
@pytest.mark.parametrize("path", ["auto", "portable", "chunked"])
def test_numpy_overlapping_windows_as_keys(path: str) -> None:
    """``sliding_window_view`` and ``as_strided`` give read-only views whose rows overlap
    in memory (keys k[j] = x[j : j + 4]): read as they are."""
    rng = rng_for("hostile", "numpy-overlap")
    x = randn(rng, (2, 40))
    k = np.lib.stride_tricks.sliding_window_view(x, 4, axis=-1)[:, None, :30]  # [2,1,30,4]
    v = np.lib.stride_tricks.as_strided(x, shape=(2, 1, 30, 5), strides=(320, 0, 8, 8))
    q = randn(rng, (2, 3, 6, 4))
    assert not k.flags.writeable and v.strides[-2] == 8
    out = attend(
        q, k, v, return_lse=True,
        **({"chunk_size": 7} if path == "chunked" else {"implementation": path}),
    )  # fmt: skip
    ref = oracle.attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
    check_against_oracle(BY_NAME["numpy"], "float64", q, (out[0], None, out[1]), ref)


@requires_backend("numpy")
def test_numpy_read_only_weights_and_dropout() -> None:
    """Read-only inputs on the paths that write the most (weights, dropout)."""
    rng = rng_for("hostile", "numpy-readonly")
    q, k, v = (randn(rng, (2, 3, 4)).astype(np.float32) for _ in range(3))
    for a in (q, k, v):
        a.setflags(write=False)
    out, w = attend(q, k, v, return_weights=True, dropout=0.5, rng=np.random.default_rng(0))
    assert out.flags.writeable and w.flags.writeable  # results are the caller's to edit
    ref = oracle.attention(q, k, v)
    assert_close(w.astype(np.float64), ref[1], "float32", what="weights")


@requires_backend("torch")
@pytest.mark.parametrize("path", PATHS)
def test_torch_non_contiguous_views(path: str) -> None:
    """Transposed, flipped-then-transposed, ``as_strided`` (overlapping windows) and
    ``expand`` (zero-stride) tensors, read without copies by the caller."""
    import torch

    backend = BY_NAME["torch"]
    rng = rng_for("hostile", "torch-views")
    q = torch.from_numpy(randn(rng, (2, 4, 8, 6))).transpose(-1, -2)  # [2, 4, 6, 8]
    base = torch.from_numpy(randn(rng, (2 * 2 * 7 * 8 + 16,)))
    k = base.as_strided((2, 2, 7, 8), (128, 64, 4, 1))  # rows overlap (stride 4 < 8)
    v = torch.from_numpy(randn(rng, (2, 1, 7, 5))).flip(-2).transpose(-1, -2)
    v = v.transpose(-1, -2).expand(2, 2, 7, 5)  # zero stride on heads
    mask = torch.from_numpy(rng.random((7, 6)) < 0.7).t()
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(1) == 0
    assert not mask.is_contiguous()
    before = [x.clone() for x in (q, k, v, mask)]
    out = _attend_on(path, q, k, v, mask=mask)
    ref = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), mask=mask.numpy())
    assert_like(out, q, shape=(2, 4, 6, 5), dtype=torch.float64)
    assert_close(backend.to_numpy(out), ref[0], "float64")
    for x, b in zip((q, k, v, mask), before, strict=True):
        assert torch.equal(x, b)


# --- zero-length axes --------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("q_shape", "k_shape", "dv"),
    [
        ((2, 4, 0, 8), (2, 2, 5, 8), 3),
        ((2, 4, 3, 8), (2, 2, 0, 8), 3),
        ((0, 4, 3, 8), (0, 2, 5, 8), 3),
        ((2, 4, 3, 8), (2, 2, 5, 8), 0),
        ((2, 2, 3, 8), (2, 2, 5, 8), 0),
        ((0, 8), (0, 8), 3),
    ],
    ids=["lq_0", "lk_0", "batch_0", "dv_0", "dv_0_same_heads", "2d_lq_lk_0"],
)
def test_zero_length_axes(
    backend: Backend, path: str, q_shape: tuple, k_shape: tuple, dv: int
) -> None:
    """Empty axes give results of the right shape, dtype and framework: Lk = 0 leaves every
    row with no key (out 0, lse -inf), the others are empty arrays."""
    rng = rng_for("hostile", "zero", q_shape, k_shape, dv)
    qn, kn = randn(rng, q_shape), randn(rng, k_shape)
    vn = randn(rng, (*k_shape[:-1], dv))
    q, k, v = (backend.asarray(a, "float32") for a in (qn, kn, vn))
    kw = {} if path == "fused" else {"return_lse": True}
    result = _attend_on(path, q, k, v, causal=True, **kw)
    out, lse = result if kw else (result, None)
    if k_shape[-2] == 0:  # every row has no key (the oracle cannot reduce over 0 keys)
        lead = q_shape[:-1]
        ref = (np.zeros((*lead, dv)), np.zeros((*lead, 0)), np.full(lead, -np.inf))
    else:
        ref = oracle.attention(qn, kn, vn, causal=True)
    check_against_oracle(backend, "float32", q, (out, None, lse), ref)


@pytest.mark.parametrize("causal", [False, True])
def test_results_are_the_callers_after_the_next_call(backend: Backend, causal: bool) -> None:
    """Where the framework can, the weights' call writes its steps in place (the weights
    take the scores' memory) and the blockwise path accumulates in buffers kept from call
    to call: what a call returns is the caller's, never a buffer that the next call (of
    the same shapes, or smaller) writes again; its inputs are unchanged."""
    rng = rng_for("hostile", "results-kept")
    arrays = [randn(rng, (2, 3, 5, 4)) for _ in range(4)]
    q, q2, k, v = (backend.asarray(a, "float32") for a in arrays)
    _, weights = attend(q, k, v, return_weights=True, causal=causal)
    out = attend(q, k, v, chunk_size=2, causal=causal)
    kept = backend.to_numpy(weights), backend.to_numpy(out)
    attend(q2, k, v, return_weights=True, causal=causal)
    attend(q2, k, v, chunk_size=2, causal=causal)
    attend(q2[..., :2, :], k, v, chunk_size=2, causal=causal)
    np.testing.assert_array_equal(backend.to_numpy(weights), kept[0])
    np.testing.assert_array_equal(backend.to_numpy(out), kept[1])
    ref = oracle.attention(arrays[0], arrays[2], arrays[3], causal=causal)
    assert_close(kept[0], ref[1], "float32", what="weights")
    assert_close(kept[1], ref[0], "float32")
    for given, a in zip((q, k, v), (arrays[0], arrays[2], arrays[3]), strict=True):
        np.testing.assert_array_equal(backend.to_numpy(given), a.astype(np.float32))


@requires_backend("numpy")
def test_numpy_weights_take_the_scores_memory() -> None:
    """NumPy's weights call allocates the weights and little more: its peak (traced by
    tracemalloc) is under 1.5x the weights' bytes, where a functional softmax holds the
    scores, their exps and the weights at once (3x: 392 MiB at [1, 8, 2048, 64])."""
    import tracemalloc

    rng = rng_for("hostile", "weights-memory")
    q, k, v = (randn(rng, (1, 4, 512, 32)).astype(np.float32) for _ in range(3))
    attend(q[:, :, :8], k, v, return_weights=True)  # (imports, caches)
    tracemalloc.start()
    try:
        _, weights = attend(q, k, v, return_weights=True, causal=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * weights.nbytes, (peak, weights.nbytes)


@pytest.mark.parametrize("path", PATHS)
def test_dk_zero_means_every_score_is_zero(backend: Backend, path: str) -> None:
    """Dk = 0 is allowed and means what the math says: ``q @ k^T`` is an empty sum, so
    every score is 0 (bias and masks still apply) and each query averages the values of
    the keys it may see: out = mean of those V rows, lse = log(their count) (+ bias).
    The default scale 1/sqrt(0) would be inf; with Dk = 0 it is taken as 1 (it multiplies
    zeros either way). The oracle is not used: its 1/sqrt(0) * 0 is NaN."""
    rng = rng_for("hostile", "dk0")
    q = backend.asarray(np.zeros((2, 4, 3, 0)), "float64")
    k = backend.asarray(np.zeros((2, 2, 5, 0)), "float64")
    vn = randn(rng, (2, 2, 5, 3))
    v = backend.asarray(vn, "float64")
    mask_np = rng.random((3, 5)) < 0.6
    mask_np[0] = [True, False, False, False, False]
    mask_np[2] = False  # no key
    kw = {} if path == "fused" else {"return_lse": True}
    result = _attend_on(path, q, k, v, mask=backend.asarray(mask_np), **kw)
    out, lse = result if kw else (result, None)
    assert_like(out, q, shape=(2, 4, 3, 3), dtype=q.dtype)
    counts = mask_np.sum(-1)
    means = np.einsum("qk,bhkd->bhqd", mask_np / np.maximum(counts, 1)[:, None], vn)
    want = np.repeat(means, 2, axis=1)  # query head h uses kv head h // 2
    assert_close(backend.to_numpy(out), want, "float64")
    if lse is not None:
        want_lse = np.where(counts > 0, np.log(np.maximum(counts, 1)), -np.inf)
        np.testing.assert_array_equal(backend.to_numpy(lse), np.broadcast_to(want_lse, (2, 4, 3)))


def test_numpy_number_options_work_like_python_ones(backend: Backend) -> None:
    """NumPy integers for ``window``/``chunk_size``, NumPy floats and 0-d arrays for
    ``scale``/``softcap`` and NumPy bools for ``causal``/``return_*`` give the Python
    values' result (configs loaded with NumPy hold such values); NumPy bools stay refused
    for ``window``."""
    args = qkv(backend)
    python = {"window": (2, 1), "chunk_size": 2, "scale": 0.25, "softcap": 3.0}
    numpy_ = {
        "window": (np.int64(2), np.int32(1)),
        "chunk_size": np.int64(2),
        "scale": np.float32(0.25),
        "softcap": np.array(3.0),
    }
    want = attend(**args, **python, return_lse=True)
    got = attend(**args, **numpy_, return_lse=np.True_)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(g), backend.to_numpy(w))
    assert plan(**args, **numpy_) == plan(**args, **python)
    for flag in (np.True_, np.False_):
        np.testing.assert_array_equal(
            backend.to_numpy(attend(**args, causal=flag)),
            backend.to_numpy(attend(**args, causal=bool(flag))),
        )
    with pytest.raises(ValueError, match="`window`"):
        attend(**args, window=np.True_)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "window",
    [2**63, (2**70, None), (None, 2**64), (0, 2**63)],
    ids=["2e63", "left", "right", "0_2e63"],
)
def test_huge_window_is_unbounded(backend: Backend, path: str, window: Any) -> None:
    """Window sides beyond any distance on the grid (2**63 and more) act as unbounded: no
    int64 wrap-around (torch used to keep no key at 2**63) and no OverflowError."""
    args = qkv(backend, "float64")
    left, right = (window, window) if isinstance(window, int) else window
    small = (None if left is None else min(left, 8), None if right is None else min(right, 8))
    want = _attend_on(path, **args, window=small)
    got = _attend_on(path, **args, window=window)
    np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(want))
    built = masks.window_mask(3, 5, window, xp=backend.xp)
    np.testing.assert_array_equal(
        backend.to_numpy(built), backend.to_numpy(masks.window_mask(3, 5, small, xp=backend.xp))
    )
