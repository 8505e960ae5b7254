"""torch's FlexAttention path (``fused:torch-flex``, ``backends/torch_flex.py``).

Against the independent float64 oracle (``tests/oracle.py``) in float32 with the package's
tolerance table: Flex computes scores, softmax and the weighted sum in float32 as every
float32 path does (its CPU kernel in blocks with an online softmax, whose rounding lies
within the table's ``(1e-4, 1e-5)``, the bound every kernel is held to), and in float16 /
bfloat16 with their rows of the table (scores and softmax in float32, the output rounded
once to the input dtype). No float64 case: Flex's CPU kernel refuses float64, and the
planner then does not take it (tested).

Tests that compile (Flex's first call of each shape and set of mods compiles for 3-7 s on
the CPU) are marked ``compile`` (the nox session ``compile`` runs them); the planner's and
the switch's tests compile nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from portable_attention import attend, masks, plan

import oracle
from conftest import requires_backend
from helpers import assert_close, rng_for, run_python

torch = pytest.importorskip("torch")
torch_flex = pytest.importorskip("portable_attention.backends.torch_flex")

pytestmark = requires_backend("torch")

FLEX = "fused:torch-flex"
#: Flex compiles here (a C++ compiler, an x86 CPU with AVX2, the switch not off).
AVAILABLE = torch_flex.unavailable("cpu") is None
needs_flex = pytest.mark.skipif(not AVAILABLE, reason=f"Flex: {torch_flex.unavailable('cpu')}")


def _tensors(shapes: list[tuple[int, ...]], key: str, dtype: Any = None) -> list[Any]:
    rng = rng_for("flex", key)
    return [torch.tensor(rng.standard_normal(s), dtype=dtype or torch.float32) for s in shapes]


def _slopes(heads: int) -> Any:
    return torch.linspace(0.05, 0.4, heads)


def _alibi(slopes: Any) -> Any:
    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * (q_idx - kv_idx).abs().to(score.dtype)

    return alibi


def _alibi_np(slopes: np.ndarray) -> Any:
    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * np.abs(q_idx - kv_idx)

    return alibi


def _stripes(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx - kv_idx) % 3 != 0


def _sliding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 70)


def _late_rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Rows before 100 see no key (the contract: out 0)."""
    return (q_idx >= 100) & (kv_idx <= q_idx)


# (name, q shape, k shape, v shape, torch options, oracle options); shapes with lengths that
# are not multiples of Flex's 128 (partial last blocks), grouped heads, Lq != Lk.
ids = np.repeat(np.arange(5), [40, 70, 1, 59, 30])  # 200 positions, one of length 1
CASES: list[tuple[str, tuple, tuple, tuple, dict, dict]] = [
    (
        "softcap, causal lower-right, Lq < Lk, GQA",
        (2, 4, 150, 32), (2, 2, 200, 32), (2, 2, 200, 48),
        {"softcap": 5.0, "causal": True}, {"softcap": 5.0, "causal": True},
    ),
    (
        "softcap, window (40, 3) upper-left",
        (1, 2, 200, 16), (1, 2, 200, 16), (1, 2, 200, 16),
        {"softcap": 8.0, "causal": "upper_left", "window": (40, 3)},
        {"softcap": 8.0, "causal": "upper_left", "window": (40, 3)},
    ),
    (
        "segment ids",
        (2, 2, 200, 32), (2, 2, 200, 32), (2, 2, 200, 32),
        {"segment_ids": torch.tensor(ids)}, {"segment_ids": ids},
    ),
    (
        "segment ids, causal (global band)",
        (1, 4, 200, 32), (1, 1, 200, 32), (1, 1, 200, 32),
        {"segment_ids": torch.tensor(ids), "causal": True},
        {"segment_ids": ids, "causal": True},
    ),
    (
        "segment id pairs, causal within segments, window",
        (1, 2, 120, 32), (1, 2, 200, 32), (1, 2, 200, 32),
        {"segment_ids": (torch.tensor(ids[::5].repeat(3)), torch.tensor(ids)), "causal": True,
         "window": (30, 0)},
        {"segment_ids": (ids[::5].repeat(3), ids), "causal": True, "window": (30, 0)},
    ),
    (
        "score_mod (ALiBi, captured slopes), causal",
        (2, 4, 200, 32), (2, 4, 200, 32), (2, 4, 200, 32),
        {"score_mod": _alibi(_slopes(4)), "causal": True},
        {"score_mod": _alibi_np(_slopes(4).numpy().astype(np.float64)), "causal": True},
    ),
    (
        "mask_mod function",
        (1, 2, 200, 32), (1, 2, 200, 32), (1, 2, 200, 32),
        {"mask_mod": _stripes}, {"mask_mod": _stripes},
    ),
    (
        "mask_mod block plan (block_size 64), softcap",
        (1, 2, 200, 32), (1, 2, 200, 32), (1, 2, 200, 32),
        {"mask_mod": masks.block_plan(_sliding, 200, 200, block_size=64), "softcap": 10.0},
        {"mask_mod": _sliding, "softcap": 10.0},
    ),
    (
        "rows with no key (mask_mod), 3-D q",
        (2, 200, 32), (2, 200, 32), (2, 200, 32),
        {"mask_mod": _late_rows}, {"mask_mod": _late_rows},
    ),
]  # fmt: skip


@needs_flex
@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flex_matches_the_oracle(case: tuple) -> None:
    """``implementation="fused"`` takes Flex for calls SDPA cannot take; float32 within the
    table's tolerance of the float64 oracle, rows with no key 0, inputs untouched."""
    _, qs, ks, vs, options, reference = case
    q, k, v = _tensors([qs, ks, vs], qs.__repr__())
    before = [x.clone() for x in (q, k, v)]
    with torch.no_grad():  # (with grad mode on, a score_mod needs a backward: not Flex's)
        assert plan(q, k, v, implementation="fused", **options).path == FLEX
        out = attend(q, k, v, implementation="fused", **options)
    assert out.dtype == torch.float32
    assert out.shape == (*qs[:-1], vs[-1])
    expected, _, lse = oracle.attention(*(x.double().numpy() for x in (q, k, v)), **reference)
    assert_close(out.numpy(), expected, "float32")
    empty = np.isneginf(lse)
    assert np.all(out.numpy()[empty] == 0)  # rows with no key: exactly 0
    for x, y in zip((q, k, v), before, strict=True):
        assert torch.equal(x, y)


@needs_flex
@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_accumulates_in_float32(dtype: str) -> None:
    """float16/bfloat16 through Flex: the input dtype out, within its row of the table
    (one rounding of an output computed in float32)."""
    q, k, v = _tensors([(1, 2, 200, 32)] * 3, dtype, getattr(torch, dtype))
    with torch.no_grad():
        out = attend(q, k, v, softcap=6.0, causal=True, implementation="fused")
    assert out.dtype == getattr(torch, dtype)
    expected = oracle.attention(*(x.double().numpy() for x in (q, k, v)), softcap=6.0, causal=True)[
        0
    ]
    assert_close(out.float().numpy(), expected, dtype)


@needs_flex
@pytest.mark.compile
def test_auto_takes_flex_for_a_long_narrow_window() -> None:
    """At ``[1, 2, 2048, 32]`` with ``causal=True, window=(255, 0)`` auto runs Flex (SDPA
    would take the band as a dense mask); the result is the oracle's."""
    q, k, v = _tensors([(1, 2, 2048, 32)] * 3, "auto-window")
    chosen = plan(q, k, v, causal=True, window=(255, 0))
    assert chosen.path == FLEX, chosen
    with torch.no_grad():
        out = attend(q, k, v, causal=True, window=(255, 0))
    expected = oracle.attention(
        *(x.double().numpy() for x in (q, k, v)), causal=True, window=(255, 0)
    )[0]
    assert_close(out.numpy(), expected, "float32")


@needs_flex
@pytest.mark.compile
def test_training_on_the_cpu_runs_the_blockwise_backward() -> None:
    """Flex has no CPU backward: where q, k or v require grad, auto runs the blockwise
    path (gradients as the oracle's finite differences), and ``fused`` raises."""
    qs = (1, 2, 40, 8)
    q, k, v = (x.double().requires_grad_(True) for x in _tensors([qs] * 3, "grad"))
    ids_t = torch.tensor(np.repeat([0, 1, 2], [10, 25, 5]))
    # The plan takes Flex for this call class without autograd (ask for it: the call is
    # small); with it, plan() and attend() both refuse "fused" ...
    qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    with torch.no_grad():
        assert plan(qf, kf, vf, segment_ids=ids_t, implementation="fused").path == FLEX
    with pytest.raises(ValueError, match="no CPU backward"):
        plan(qf, kf, vf, segment_ids=ids_t, implementation="fused")
    with pytest.raises(ValueError, match="no backward on the CPU"):
        attend(qf, kf, vf, segment_ids=ids_t, implementation="fused")
    # ... and auto, where it takes Flex, runs blockwise for gradients: same as the oracle.
    out = torch_flex.KERNEL.run(
        _call(qf, kf, vf, segment_ids=ids_t), qf, kf, vf, None, None, None, _mods(ids_t)
    )[0]
    w = torch.tensor(rng_for("flex", "w").standard_normal((*qs[:-1], qs[-1])))
    (out.double() * w).sum().backward()
    expected = oracle.loss_grads(
        *(x.detach().numpy() for x in (q, k, v)), w.numpy(), segment_ids=ids_t.numpy()
    )
    for got, want in zip((qf.grad, kf.grad, vf.grad), expected, strict=True):
        assert_close(got.double().numpy(), want, "float32", what="gradient")


def _call(q: Any, k: Any, v: Any, **arrays: Any) -> Any:
    from portable_attention._options import options
    from portable_attention._spec import validate_call

    return validate_call(q, k, v, options(), **arrays)


def _mods(segment_ids: Any) -> Any:
    from portable_attention._mods import Mods

    return Mods(q_ids=segment_ids, kv_ids=segment_ids)


# -- the planner: no compilation ---------------------------------------------------------


@needs_flex
def test_plan_says_why_flex_runs() -> None:
    """auto's reason names Flex, the blocks it computes, the measurements and the first
    call's compilation; SDPA's refusal comes first."""
    x = torch.zeros(1, 8, 4096, 64)
    narrow = plan(x, x, x, causal=True, window=(255, 0))
    assert narrow.path == FLEX
    assert narrow.reason.startswith("on the CPU SDPA takes the window as a dense mask")
    assert "FlexAttention (compiled) runs this call" in narrow.reason
    assert "computing only the 9% of its blocks" in narrow.reason
    assert "compiles it (3-7 s on the CPU)" in narrow.reason
    assert "auto runs portable:blockwise instead" in narrow.reason
    packed = plan(x, x, x, segment_ids=torch.arange(4096) // 512)
    assert packed.path == FLEX
    assert "blocks where the segment ids meet" in packed.reason
    bp = masks.block_plan(_sliding, 4096, 4096)
    assert plan(x, x, x, mask_mod=bp).path == FLEX


@needs_flex
def test_plan_keeps_the_portable_path_where_flex_is_not_faster() -> None:
    """Small calls, a mask_mod given as a function, and calls that compute most blocks
    stay on the portable path, each with its reason."""
    x = torch.zeros(1, 8, 4096, 64)
    small = torch.zeros(1, 8, 512, 64)
    got = plan(small, small, small, segment_ids=torch.arange(512) // 64)
    assert got.path.startswith("portable"), got
    assert "from which Flex's saving repays its first call's compilation" in got.reason
    got = plan(x, x, x, mask_mod=_sliding)
    assert got.path == "portable:blockwise", got
    assert "pass masks.block_plan(mask_mod, ...)" in got.reason
    got = plan(x, x, x, softcap=30.0)
    assert got.path.startswith("portable"), got
    assert "Flex would compute 100% of the blocks" in got.reason


def test_fused_raises_where_flex_cannot_serve() -> None:
    """float64, return_lse and sinks on the CPU (Flex's CPU kernel has no float64 and
    returns no lse), a mask array with a mod: ``fused`` raises with Flex's reason, and
    auto takes the portable path."""
    q = torch.zeros(1, 2, 64, 16, dtype=torch.float64)
    for options, words in (
        ({"softcap": 3.0}, "not float64"),
        ({"softcap": 3.0, "return_lse": True}, "returns no lse"),
        ({"sinks": torch.zeros(2), "causal": True}, "no lse to merge the sinks with"),
        ({"mask_mod": _stripes, "mask": torch.ones(64, 64, dtype=torch.bool)}, "no mask"),
    ):
        x = q if "not float64" in words else q.float()
        if not AVAILABLE:
            words = "FlexAttention"
        with pytest.raises(ValueError, match=words):
            plan(x, x, x, implementation="fused", **options)
        assert plan(x, x, x, **options).path.startswith("portable")


def test_switch_turns_flex_off() -> None:
    """``PORTABLE_ATTENTION_FLEX=0`` (the documented switch, as where inductor cannot
    compile): auto takes the next path and says so; ``fused`` raises with the reason."""
    code = """
import torch
from portable_attention import attend, plan
x = torch.zeros(1, 8, 4096, 64)
p = plan(x, x, x, causal=True, window=(255, 0))
print(p.path)
print(p.reason)
try:
    plan(x, x, x, softcap=3.0, implementation="fused")
except ValueError as err:
    print(err)
q = torch.randn(1, 2, 300, 16)
out = attend(q, q, q, softcap=3.0, segment_ids=torch.arange(300) // 100)
print(out.shape)
"""
    import os

    os.environ[torch_flex.SWITCH] = "0"
    try:
        lines = run_python(code).splitlines()
    finally:
        del os.environ[torch_flex.SWITCH]
    assert lines[0] == "portable:blockwise"
    assert (
        "not fused:torch-flex: FlexAttention is turned off (PORTABLE_ATTENTION_FLEX='0')"
        in (lines[1])
    )
    assert "FlexAttention is turned off" in lines[2]
    assert lines[3] == "torch.Size([1, 2, 300, 16])"


@needs_flex
@pytest.mark.compile
def test_auto_goes_on_where_flex_fails_to_compile(tmp_path: Any) -> None:
    """Where inductor cannot build Flex's kernel at run time (here a C++ compiler that
    fails, ``CXX=/bin/false``, and an empty inductor cache), an ``auto`` call planned on
    Flex still returns the contract's answer (the blockwise path), warns once, and
    ``plan()`` says why from then on."""
    code = """
import warnings
import numpy as np
import torch
from portable_attention import attend, plan
q = torch.randn(1, 8, 1024, 16, generator=torch.Generator().manual_seed(0))
print(plan(q, q, q, causal=True, window=(127, 0)).path)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = attend(q, q, q, causal=True, window=(127, 0))
print(sum("compiling FlexAttention failed" in str(w.message) for w in caught))
np.save(OUT, out.numpy())
np.save(INPUT, q.numpy())
p = plan(q, q, q, causal=True, window=(127, 0))
print(p.path)
print(p.reason)
"""
    import os

    saved = {name: os.environ.get(name) for name in ("CXX", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(CXX="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    try:
        paths = f"OUT = {str(tmp_path / 'out.npy')!r}\nINPUT = {str(tmp_path / 'q.npy')!r}\n"
        lines = run_python(paths + code).splitlines()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert lines[0] == "fused:torch-flex"
    assert lines[1] == "1"
    assert lines[2] == "portable:blockwise"
    assert "compiling FlexAttention failed in this process" in lines[3]
    x = np.load(tmp_path / "q.npy").astype(np.float64)
    expected = oracle.attention(x, x, x, causal=True, window=(127, 0))[0]
    assert_close(np.load(tmp_path / "out.npy"), expected, "float32")


@needs_flex
@pytest.mark.compile
@pytest.mark.parametrize("form", ["function", "block plan"])
def test_a_flex_call_keeps_no_mod_alive(form: str) -> None:
    """FlexAttention's document-mask pattern through Flex: a fresh ``mask_mod`` per batch,
    closing over that batch's ids. Once the calls have returned, neither the package's
    caches (the compiled functions are keyed by the mods' code, never the functions) nor
    torch.compile's hold a mod or what it captured."""
    import gc
    import weakref

    from helpers import Capture

    lq = 200
    (q,) = _tensors([(1, 2, lq, 16)], "keeps-no-mod")
    alive = []
    for batch in range(3):
        ids_np = np.arange(lq) // (20 + 10 * batch)
        capture = Capture(torch.tensor(ids_np))

        def mod(b: Any, h: Any, q_idx: Any, kv_idx: Any, c: Capture = capture) -> Any:
            return c.value[q_idx] == c.value[kv_idx]

        m = mod if form == "function" else masks.block_plan(mod, lq, lq, like=q)
        assert plan(q, q, q, mask_mod=m, softcap=4.0, implementation="fused").path == FLEX
        with torch.no_grad():
            out = attend(q, q, q, mask_mod=m, softcap=4.0, implementation="fused")
        expected = oracle.attention(
            *(q.double().numpy(),) * 3, mask=ids_np[:, None] == ids_np[None, :], softcap=4.0
        )[0]
        assert_close(out.numpy(), expected, "float32")
        alive.append(weakref.ref(capture))
        del capture, mod, m, out
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)


@needs_flex
@pytest.mark.compile
def test_a_compiled_caller_takes_the_path_before_flex() -> None:
    """``torch.compile(fullgraph=True)`` of a caller whose eager call takes Flex: while it
    traces, Flex is not planned (the blockwise path's custom operator runs instead), and
    the results agree."""
    q, k, v = _tensors([(1, 8, 1024, 32)] * 3, "compiled-caller")
    assert plan(q, k, v, softcap=5.0, causal=True).path == FLEX

    def call(a: Any, b: Any, c: Any) -> Any:
        return attend(a, b, c, softcap=5.0, causal=True)

    with torch.no_grad():
        eager = call(q, k, v)
        torch._dynamo.reset()  # a fresh trace, not one cached by an earlier test
        compiled = torch.compile(call, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


@needs_flex
def test_plan_says_where_autograd_hands_flex_calls_to_the_blockwise_path() -> None:
    """plan() names the path attend runs: with tensors that require grad on the CPU, the
    blockwise path (Flex has no CPU backward), Flex under torch.no_grad();
    implementation="fused" raises there, as attend does."""
    q = torch.randn(1, 8, 4096, 64, requires_grad=True)
    ids = (torch.arange(4096) // 512)[None]
    training = plan(q, q, q, causal=True, segment_ids=ids)
    assert training.path == "portable:blockwise"
    assert "no CPU backward" in training.reason
    with torch.no_grad():
        assert plan(q, q, q, causal=True, segment_ids=ids).path == "fused:torch-flex"
    with pytest.raises(ValueError, match="no CPU backward"):
        plan(q, q, q, causal=True, segment_ids=ids, implementation="fused")
    with pytest.raises(ValueError, match="no backward on the CPU"):
        attend(q, q, q, causal=True, segment_ids=ids, implementation="fused")
