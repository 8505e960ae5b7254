"""Hugging Face transformers integration: tiny randomly initialised models built from configs
(no download) run with ``attn_implementation="portable"`` and agree with transformers' own
``eager`` and ``sdpa`` on every real (non-padded) position: Llama (grouped-query heads,
left and right padding, float32 and float64, greedy generation with dynamic and static
caches, attention weights, additive 4-D masks, dropout, half precision), Gemma 2 (softcap
and sliding window), Mistral (sliding window), and on transformers >= 5 BERT and T5
(bidirectional attention, ``position_bias``, cross-attention), and gpt-oss (attention sinks,
``s_aux``, alternating sliding-window and full layers, training the sinks) from transformers
4.55 on. Whole models are compared in float64 (``WIDE``), float32 ones relative to eager's
own float32 error (issue 28). Verified on transformers 4.48.3, 4.56.2 and 5.24.0 (gpt-oss on
5.24.0)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import BY_NAME

if "torch" not in BY_NAME:
    pytest.skip("the torch backend is not selected", allow_module_level=True)

# torch is selected: transformers must import (nox installs it with torch); never skipped.
import torch
import transformers
from portable_attention.integrations import transformers as hf
from portable_attention.testing import tolerance
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig

try:  # transformers >= 4.53 builds masks per implementation; older ones additive floats
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as MASKS
except ImportError:
    MASKS = None

NAME = hf.register()
SEQ = 9
# Weights large enough that attention is far from uniform (transformers' default init of
# 0.02 leaves the scores near 0, where a wrong mask would hardly show).
INIT = 0.3
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "initializer_range": INIT,
}
# Whole models are compared in float64, with the table's float64 tolerance (rtol 1e-10,
# atol 1e-12), never float32 with a number that merely passed on one CPU (issue 28). A model
# amplifies the rounding of its operations by a factor that is its own, not the CPU's; the
# float32 runs below show it: logits up to 8.5 in size (Llama, Mistral) are up to 1.8e-5
# from float64, 2e-6 relative, some 35 float32 unit roundoffs (6e-8). The same computation
# in float64 (unit roundoff 1.1e-16) is then some 35 * 1.1e-16 * 8.5 = 3e-14 from exact, 30
# times under the table's atol alone, on any CPU (measured here: 0 to 2e-15). Float32
# results of whole models are bounded relatively: ``assert_float32_as_accurate_as_eager``.
WIDE = torch.float64


def llama() -> LlamaConfig:
    return LlamaConfig(**SMALL)


def gemma2() -> Gemma2Config:
    return Gemma2Config(
        **SMALL,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=2.0,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
    )


def mistral() -> MistralConfig:
    return MistralConfig(**SMALL, sliding_window=3)


def build(config: Any, impl: str, dtype: torch.dtype = torch.float32, **kw: Any) -> Any:
    """The same random weights for every ``impl`` (a copy of the config each: transformers
    writes the implementation into the config it is given); ``kw`` go to ``from_config``.
    That ``NAME`` dispatches to ``attention_forward`` is asserted through transformers'
    public registry (``test_register_is_idempotent_and_returns_the_name``) and by
    ``test_the_registered_name_runs_attention_forward``; transformers shows the chosen
    implementation only in a private config field, which the tests do not read."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, **kw)
    return model.to(dtype).eval()


def batch(padding: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[3, SEQ]`` and the 2-D padding mask (1 = real token)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (3, SEQ), generator=gen)
    am = torch.ones(3, SEQ, dtype=torch.long)
    if padding == "left":
        am[0, :4] = 0
        am[2, :1] = 0
    elif padding == "right":
        am[0, 5:] = 0
        am[1, 8:] = 0
    return ids, am


def max_diff(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> float:
    """Largest |a - b| over the real positions ``real [B, L]`` of ``[B, L, ...]`` tensors."""
    return (a - b)[real.bool()].abs().max().item()


def logits(model: Any, ids: torch.Tensor, am: torch.Tensor | None, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=am, **kw).logits


def assert_agree(
    actual: torch.Tensor, expected: torch.Tensor, real: torch.Tensor, what: object = ""
) -> None:
    """``actual`` within the table's tolerance of ``expected``'s dtype on the real positions
    ``real [B, L]`` of ``[B, L, ...]`` tensors; ``what`` heads the message of a failure."""
    rtol, atol = tolerance(expected.dtype)
    torch.testing.assert_close(
        actual[real.bool()],
        expected[real.bool()],
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: {m}",
    )


# Ours' distance to float64 over eager's, for two runs of the same composed computation: near
# 1 (the shared linear layers dominate both). Measured with torch's AVX-512, AVX2 and default
# kernels (``ATEN_CPU_CAPABILITY``): 0.78 to 1.08 in float32 (sdpa: 1.00), 0.63 to 1.20 in
# bfloat16 and float16; 1.5 leaves room for a ratio of two rounding errors to vary by CPU.
AS_ACCURATE = 1.5


def assert_float32_as_accurate_as_eager(
    ours: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor, real: torch.Tensor
) -> None:
    """float32 logits of a whole model: ``ours`` is no further from the float64 result
    ``ref`` than ``AS_ACCURATE`` times ``theirs`` (the other implementation's float32 logits)
    is, plus the table's float32 atol (one attention call's bound, for a ``theirs`` whose
    error happens to be small). The form is argued, its factor measured with margin (see
    ``AS_ACCURATE``): both models run the same composed
    computation (the same linear layers, norms, rotary embeddings; only the attention kernel
    differs), so each one's distance to float64 is float32's per-operation rounding times
    the same amplification by the model, and a CPU that rounds differently (issue 28: an
    AVX-512 Zen 4; ``ATEN_CPU_CAPABILITY=default`` here) moves both distances together,
    where it breaks any fixed bound on their difference."""
    assert ours.dtype == theirs.dtype == torch.float32
    err = [max_diff(x.double(), ref, real) for x in (ours, theirs)]
    assert err[0] <= AS_ACCURATE * err[1] + tolerance(torch.float32).atol, err


@pytest.fixture
def eager64(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """transformers' eager attention of Llama, Gemma 2 and Mistral calls
    ``softmax(scores, dim=-1, dtype=torch.float32)`` in any dtype: in a float64 model that
    rounds every attention weight to float32 (3.6e-6 on the logits here, as much as all of
    float32's rounding) and turns its float64-minimum mask into -inf (NaN on the rows of
    leading pads, which spreads to their whole sequence through the next layer's keys).
    While this fixture is used a float64 input's softmax asked for in float32 runs in
    float64, so eager's float64 model is a float64 computation; everything else is eager's
    code as it is. Only transformers' own calls are widened; such a request from this
    package (a float64 call rounded to float32) fails the test instead of being hidden.
    Fails if eager made none: the fixture would no longer be needed."""
    plain = torch.nn.functional.softmax
    widened = []

    def softmax(x: torch.Tensor, *args: Any, dtype: Any = None, **kw: Any) -> torch.Tensor:
        if x.dtype == torch.float64 and dtype == torch.float32:
            caller = str(sys._getframe(1).f_globals.get("__name__", ""))
            assert not caller.startswith("portable_attention"), f"{caller} rounds to float32"
            if caller.startswith("transformers"):
                widened.append(caller)
                dtype = torch.float64
        return plain(x, *args, dtype=dtype, **kw)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    yield
    assert widened, "eager asked for no float32 softmax of a float64 input"


def generate_alike(models: list[Any], ids: torch.Tensor, am: Any, **kw: Any) -> torch.Tensor:
    """Greedy generation by each of two float64 ``models`` (the reference first), the equal
    tokens argued rather than a lucky absence of near-ties (in float32 the implementations'
    logits differ by up to 1.4e-4, and gpt-oss's top two were 3e-3 apart at one step).

    The models' float64 logits at every step agree within the table's float64 tolerance
    (argued as for the forward logits); generate rounds them to float32 before its argmax,
    which moves each by at most half a unit of the dtype it returns, ``eps / 2`` relative.
    So the step logits generate returns agree within the table plus ``eps`` relative, which
    is asserted; and at every step the reference's top two are asserted more than twice
    that apart, so the argmax of the other is the same token. Returns the sequences,
    asserted equal."""
    assert all(m.dtype == WIDE for m in models)
    runs = [
        m.generate(
            ids,
            attention_mask=am,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
        for m in models
    ]
    ref, got = (torch.stack(run.logits) for run in runs)  # [steps, B, vocab]
    rtol, atol = tolerance(WIDE)
    rtol += torch.finfo(ref.dtype).eps
    top2 = ref.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 2 * (atol + rtol * ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    return runs[0].sequences


# -- registration ----------------------------------------------------------------------------


def test_register_is_idempotent_and_returns_the_name() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert hf.register() == NAME == "portable"
    assert hf.register("portable_again") == "portable_again"
    assert ALL_ATTENTION_FUNCTIONS[NAME] is hf.attention_forward
    if MASKS is not None:  # transformers >= 4.53: transformers' sdpa boolean mask builder
        assert MASKS[NAME] is MASKS["sdpa"]
    # names transformers dispatches as its own kernels (gpt-oss refuses any name with "sdpa")
    for bad in ("", "sdpa", "eager", "flash_attention_2", "portable_sdpa", "org/kernel"):
        with pytest.raises(ValueError, match="`name`"):
            hf.register(bad)


def test_the_registered_name_runs_attention_forward() -> None:
    """A model built with a registered implementation calls it once per layer per forward;
    here a counting wrapper around ``attention_forward`` registered through transformers'
    public ``AttentionInterface``, whose logits are those of ``NAME``'s model bit for bit."""
    if not hasattr(transformers, "AttentionInterface"):
        pytest.skip("transformers < 4.50 has no AttentionInterface")
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return hf.attention_forward(*args, **kwargs)

    transformers.AttentionInterface.register("portable_counted", counted)
    if MASKS is not None:
        transformers.AttentionMaskInterface.register("portable_counted", MASKS[NAME])
    ids, am = batch("left")
    got = logits(build(llama(), "portable_counted"), ids, am)
    assert len(calls) == SMALL["num_hidden_layers"]
    assert torch.equal(got, logits(build(llama(), NAME), ids, am))


# -- Llama: padding, dtypes, weights, generation ---------------------------------------------


@pytest.mark.usefixtures("eager64")
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_llama_matches_eager_and_sdpa(padding: str | None) -> None:
    """float64 logits agree with eager's and sdpa's within the table; float32 ones (float32
    in, float32 out) are as accurate against float64 as eager's and sdpa's own are."""
    ids, am = batch(padding)
    mask = None if padding is None else am
    wide = logits(build(llama(), NAME, WIDE), ids, mask)
    ours = logits(build(llama(), NAME), ids, mask)
    ref = logits(build(llama(), "eager", WIDE), ids, mask)
    for impl in ("eager", "sdpa"):
        theirs_wide = logits(build(llama(), impl, WIDE), ids, mask)
        assert wide.dtype == theirs_wide.dtype == WIDE
        assert_agree(wide, theirs_wide, am, impl)
        theirs = logits(build(llama(), impl), ids, mask)
        assert theirs.shape == ours.shape == (3, SEQ, SMALL["vocab_size"])
        assert_float32_as_accurate_as_eager(ours, theirs, ref, am)


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_llama_float64_matches_sdpa(padding: str | None) -> None:
    """float64 against sdpa, which needs no ``eager64``. With ``output_attentions`` the
    portable core runs instead of torch's kernel: it agrees too."""
    ids, am = batch(padding)
    mask = None if padding is None else am
    theirs = logits(build(llama(), "sdpa", WIDE), ids, mask)
    ours = build(llama(), NAME, WIDE)
    for kw in ({}, {"output_attentions": True}):
        got = logits(ours, ids, mask, **kw)
        assert got.dtype == WIDE
        assert_agree(got, theirs, am, kw)


@pytest.mark.usefixtures("eager64")
def test_output_attentions_match_eager() -> None:
    """In float64: the weights of layer 1 are those of a composed computation (layer 0's
    rounding reaches them), like the logits."""
    ids, am = batch("left")
    theirs = build(llama(), "eager", WIDE)
    ours = build(llama(), NAME, WIDE)
    with torch.no_grad():
        a = theirs(ids, attention_mask=am, output_attentions=True)
        b = ours(ids, attention_mask=am, output_attentions=True)
        plain = ours(ids, attention_mask=am)
    assert_agree(b.logits, a.logits, am)
    assert_agree(b.logits, plain.logits, am)
    assert len(b.attentions) == len(a.attentions) == SMALL["num_hidden_layers"]
    rows = am.bool()[:, None, :, None].expand(-1, SMALL["num_attention_heads"], -1, SEQ)
    rtol, atol = tolerance(WIDE, "weights")
    for wa, wb in zip(a.attentions, b.attentions, strict=True):
        assert wb.shape == wa.shape == (3, SMALL["num_attention_heads"], SEQ, SEQ)
        assert wb.dtype == WIDE
        torch.testing.assert_close(wb[rows], wa[rows], rtol=rtol, atol=atol)
        if MASKS is not None:
            # query rows with no key to attend (leading pads): 0 here, uniform in eager
            assert torch.all(wb[~rows] == 0)
            assert torch.all(wa[~rows] > 0)
        else:  # transformers < 4.53: the additive mask's finite minimum leaves no row empty
            torch.testing.assert_close(wb, wa, rtol=rtol, atol=atol)


def test_output_attentions_from_config() -> None:
    ids, am = batch("left")
    config = llama()
    config.output_attentions = True
    out = build(config, NAME)(ids, attention_mask=am)
    assert len(out.attentions) == SMALL["num_hidden_layers"]
    assert out.attentions[0].shape == (3, SMALL["num_attention_heads"], SEQ, SEQ)


@pytest.mark.usefixtures("eager64")
@pytest.mark.parametrize("cache", [None, "static"])
def test_llama_greedy_generate_matches_eager(cache: str | None) -> None:
    """Decode steps are one query against all cached keys. The static cache's prefill comes
    with no mask and keys past the prompt that are unfilled slots: upper-left causal.
    float64, the tokens argued by ``generate_alike``."""
    ids, am = batch("left" if cache is None else None)
    kw: dict[str, Any] = {"max_new_tokens": 8, "pad_token_id": 0}
    if cache is not None:
        kw["cache_implementation"] = cache
    models = [build(llama(), impl, WIDE) for impl in ("eager", NAME)]
    assert generate_alike(models, ids, am, **kw).shape == (3, SEQ + 8)


@pytest.mark.usefixtures("eager64")
def test_additive_4d_mask_goes_to_bias() -> None:
    """A 4-D float mask (0 / dtype minimum) given to the model reaches the attention as is
    (transformers passes prepared 4-D masks through): it is added to the scores."""
    ids, am = batch("left")
    allowed = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)) & am.bool()[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=WIDE).masked_fill(~allowed, torch.finfo(WIDE).min)
    theirs = logits(build(llama(), "eager", WIDE), ids, additive)
    for mask in (additive, allowed):
        assert_agree(logits(build(llama(), NAME, WIDE), ids, mask), theirs, am)


# -- sliding window and softcap --------------------------------------------------------------


@pytest.mark.usefixtures("eager64")
@pytest.mark.parametrize("make", [gemma2, mistral], ids=["gemma2", "mistral"])
def test_sliding_window_models_match_eager(make: Any) -> None:
    """Gemma 2: softcap and a window of 4 on its sliding layer; Mistral: a window of 3 on
    every layer; sequences of 9 tokens, so the windows cut keys. float64 (float32: as
    accurate as eager), generation as in ``generate_alike``."""
    ids, am = batch("left")
    theirs, ours = build(make(), "eager", WIDE), build(make(), NAME, WIDE)
    ref = logits(theirs, ids, am)
    assert_agree(logits(ours, ids, am), ref, am)
    narrow = [logits(build(make(), impl), ids, am) for impl in (NAME, "eager")]
    assert_float32_as_accurate_as_eager(*narrow, ref, am)
    # the model's default cache, and a static one whose sliding layers keep a ring of w
    # slots (eager itself fails on that for Gemma 2 in transformers 4.48)
    for cache in (None, "static") if MASKS is not None else (None,):
        kw: dict[str, Any] = {"max_new_tokens": 6, "pad_token_id": 0}
        if cache is not None:
            kw["cache_implementation"] = cache
        generate_alike([theirs, ours], ids, am, **kw)


def test_gemma2_softcap_matters() -> None:
    """The softcap reaches attend: a model with another cap gives other logits."""
    ids, am = batch("left")
    other = gemma2()
    other.attn_logit_softcapping = 0.5
    base = logits(build(gemma2(), NAME), ids, am)
    assert max_diff(logits(build(other, NAME), ids, am), base, am) > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("make", [llama, gemma2], ids=["llama", "gemma2"])
def test_half_precision_as_accurate_as_eager(make: Any, dtype: torch.dtype) -> None:
    """Half-precision models give logits in that dtype, as close to float32 eager as eager
    in that dtype is: within ``AS_ACCURATE`` times (argued there; measured up to 1.20) plus
    1e-3. float32 eager serves as the reference: its own error (2e-5) is under 1/400 of
    these (1e-2 to 0.18)."""
    ids, am = batch("left")
    ref = logits(build(make(), "eager"), ids, am)
    ours = logits(build(make(), NAME, dtype), ids, am)
    theirs = logits(build(make(), "eager", dtype), ids, am)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.isfinite(ours).all()
    assert max_diff(ours.float(), ref, am) <= AS_ACCURATE * max_diff(theirs.float(), ref, am) + 1e-3


# -- encoders and encoder-decoders ------------------------------------------------------------


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="BERT and T5 dispatch through AttentionInterface from transformers 5 on",
)
def test_bert_and_t5_match_eager() -> None:
    """Bidirectional self-attention with a padding mask (BERT), and T5: relative position
    bias (``position_bias``), no score scaling, cross-attention with the encoder's mask.
    float64 (their eager softmaxes in the model's dtype): the last hidden states agree
    within the table's float64 tolerance."""
    ids, am = batch("right")
    small = {"vocab_size": 100, "initializer_range": INIT}
    bert = transformers.BertConfig(
        **small, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    t5 = transformers.T5Config(
        vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
    )
    for config, kw in ((bert, {}), (t5, {"decoder_input_ids": ids[:, :5]})):
        out = {}
        for impl in ("eager", NAME):
            torch.manual_seed(0)
            model = transformers.AutoModel.from_config(
                copy.deepcopy(config), attn_implementation=impl
            )
            with torch.no_grad():
                out[impl] = model.to(WIDE).eval()(ids, attention_mask=am, **kw).last_hidden_state
        real = am if not kw else torch.ones(3, 5, dtype=torch.bool)
        assert out[NAME].dtype == WIDE
        assert_agree(out[NAME], out["eager"], real, type(config))


# -- dropout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [llama, gemma2], ids=["llama-sdpa", "gemma2-portable"])
def test_training_dropout_is_reproducible(make: Any) -> None:
    """In training mode attention dropout runs, from torch's global RNG: the same seed gives
    the same logits and gradients, another seed other logits; eval mode has none. (Llama
    runs torch's fused kernel, Gemma 2's softcap the portable core.)"""
    config = make()
    config.attention_dropout = 0.3
    model = build(config, NAME).train()
    ids, am = batch("left")

    def run(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        model.zero_grad()
        out = model(ids, attention_mask=am).logits
        out[am.bool()].square().mean().backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad
        assert grad is not None
        return out.detach(), grad.clone()

    (a, ga), (b, gb), (c, _) = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert torch.equal(ga, gb)
    assert torch.isfinite(ga).all()
    assert max_diff(a, c, am) > 1e-3
    model.eval()
    assert max_diff(logits(model, ids, am), a, am) > 1e-3


# -- the attention function itself -----------------------------------------------------------


def qkv(lq: int = 5, lk: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return (
        torch.randn(2, 4, lq, 8, generator=gen),
        torch.randn(2, 2, lk, 8, generator=gen),
        torch.randn(2, 2, lk, 8, generator=gen),
    )


def test_attention_forward_layout_and_mask_polarity() -> None:
    module = torch.nn.Module().eval()
    q, k, v = qkv()
    allowed = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    allowed[..., 0] = True
    out, weights = hf.attention_forward(module, q, k, v, allowed, is_causal=False)
    assert weights is None
    assert out.shape == (2, 5, 4, 8)
    assert out.is_contiguous()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(hf.attention_forward(module, q, k, v, additive)[0], ref)
    # position_bias (T5-style) adds to the scores, with or without a mask
    pb = torch.randn(1, 4, 5, 5, generator=torch.Generator().manual_seed(4))
    got = hf.attention_forward(module, q, k, v, allowed, position_bias=pb)[0]
    ref_pb = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=pb.masked_fill(~allowed, float("-inf")), enable_gqa=True
    )
    torch.testing.assert_close(got, ref_pb.transpose(1, 2))


def test_attention_forward_without_mask_is_causal_upper_left() -> None:
    """No mask, ``Lq < Lk`` (a static cache's prefill): upper-left causal as sdpa's
    ``is_causal``; a single query attends to every key; ``is_causal=False`` to all."""
    module = torch.nn.Module().eval()
    q, k, v = qkv(3, 6)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    got = hf.attention_forward(module, q, k, v, None)[0]
    torch.testing.assert_close(got, sdpa(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2))
    got = hf.attention_forward(module, q, k, v, None, is_causal=False)[0]
    torch.testing.assert_close(got, sdpa(q, k, v, enable_gqa=True).transpose(1, 2))
    got = hf.attention_forward(module, q[:, :, :1], k, v, None, is_causal=True)[0]
    torch.testing.assert_close(got, sdpa(q[:, :, :1], k, v, enable_gqa=True).transpose(1, 2))
    # sliding_window without a mask: keys with q - k < w, aligned as the causal mask
    got = hf.attention_forward(module, q, k, v, None, sliding_window=2)[0]
    i, j = torch.arange(3)[:, None], torch.arange(6)[None, :]
    band = (j <= i) & (i - j < 2)
    torch.testing.assert_close(got, sdpa(q, k, v, attn_mask=band, enable_gqa=True).transpose(1, 2))


def test_attention_forward_refuses_what_it_cannot_honour() -> None:
    module = torch.nn.Module().eval()
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"`block_indices`.*sparse block selection"):
        hf.attention_forward(module, q, k, v, None, block_indices=torch.zeros(4))
    with pytest.raises(TypeError, match="`made_up_option`"):
        hf.attention_forward(module, q, k, v, None, made_up_option=3)
    with pytest.raises(TypeError, match="`attention_mask`"):
        hf.attention_forward(module, q, k, v, torch.ones(2, 1, 5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="`sliding_window=2`"):
        hf.attention_forward(module, q, k, v, None, is_causal=False, sliding_window=2)
    # flash-attention metadata and bookkeeping are ignored, as by transformers' sdpa
    out, _ = hf.attention_forward(
        module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5]), position_ids=None, s_aux=None
    )
    assert out.shape == (2, 5, 4, 8)


# -- gpt-oss: attention sinks ----------------------------------------------------------------

GPT_OSS = getattr(transformers, "GptOssConfig", None)
needs_gpt_oss = pytest.mark.skipif(GPT_OSS is None, reason="gpt-oss is in transformers >= 4.55")
# transformers 5.24 runs gpt-oss's experts through torch's grouped GEMM, which has no
# float64 on CPU; its unfused experts ("eager") have. The option is passed from
# transformers 5 on only (4.x releases are not verified with gpt-oss here).
EXPERTS_FLOAT64 = (
    {"experts_implementation": "eager"} if int(transformers.__version__.split(".")[0]) >= 5 else {}
)


def gpt_oss() -> Any:
    """4 layers, sliding-window (4 keys) and full attention alternating; 4 query heads on 2
    key/value heads; a learned sink per query head (``s_aux``); 4 experts, 2 per token."""
    assert GPT_OSS is not None
    return GPT_OSS(
        **{**SMALL, "num_hidden_layers": 4, "intermediate_size": 64},
        head_dim=16,
        sliding_window=4,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def sink_grads(model: Any) -> torch.Tensor:
    """The gradients of every layer's sinks, ``[layers, Hq]``."""
    return torch.stack([layer.self_attn.sinks.grad for layer in model.model.layers])


def assert_within_table(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = tolerance(expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@needs_gpt_oss
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_gpt_oss_matches_eager(padding: str | None) -> None:
    """gpt-oss refuses ``sdpa``; a registered implementation gets ``s_aux`` (the layer's
    ``sinks`` parameter, ``[Hq]``) as ``attend``'s ``sinks=``. The logits agree with eager's
    on *every* position, padded ones too: with a sink no row is empty in eager either (a
    fully masked row puts all its weight on the sink, whose value is 0: output 0, as
    ``attend`` gives for a row with no key), so nothing differs there to leave out.

    float64 (experts unfused: torch's grouped GEMM has no float64 on CPU): within the
    table's float64 tolerance of eager (measured: equal). float32: the table bounds one
    attention call (``test_attention_forward_with_s_aux_matches_gpt_oss_eager``; measured
    3.3e-6 per layer here), not the logits of 4 layers of experts at ``INIT``, which amplify
    any rounding: eager's own float32 logits are 1.8e-4 from float64 (ours 5.3e-5 to
    1.2e-4, and 1.4e-4 from eager's). So float32 must be as accurate as eager against
    float64."""
    config = gpt_oss()
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        build(config, "sdpa")
    ids, am = batch(padding)
    mask = None if padding is None else am
    out = {}
    for impl in ("eager", NAME):
        out[impl, torch.float32] = logits(build(config, impl), ids, mask)
        wide = build(config, impl, torch.float64, **EXPERTS_FLOAT64)
        out[impl, torch.float64] = logits(wide, ids, mask)
    for (_, dtype), got in out.items():
        assert got.dtype == dtype
        assert got.shape == (3, SEQ, SMALL["vocab_size"])
    ref = out["eager", torch.float64]
    assert_within_table(out[NAME, torch.float64], ref)
    err = {
        impl: (out[impl, torch.float32].double() - ref).abs().max().item()
        for impl in (NAME, "eager")
    }
    assert err[NAME] <= 1.5 * err["eager"] + tolerance(torch.float32).atol, err


@needs_gpt_oss
def test_gpt_oss_trains_its_sinks_as_eager_does() -> None:
    """A language-model loss on a left-padded batch: the sinks' gradients (and a projection's)
    match eager's, and one optimizer step through the portable model changes the sinks.

    In float64 (experts unfused, as in ``test_gpt_oss_matches_eager``): these gradients run
    back through the loss, four layers of experts and attention, so their float32 rounding
    is far above the table's one-operation float32 bound, and it differs between CPUs (on
    an AVX-512 Zen 4 machine a float32 ``q_proj`` gradient was 3.4e-5 from eager's, and
    ``ATEN_CPU_CAPABILITY=default`` moves it here). In float64 both sides round at about
    1e-16 per operation, so the table's float64 tolerance is sharp and holds on any CPU."""
    ids, am = batch("left")
    labels = ids.masked_fill(am == 0, -100)
    models = {
        impl: build(gpt_oss(), impl, torch.float64, **EXPERTS_FLOAT64).train()
        for impl in ("eager", NAME)
    }
    for model in models.values():
        model(ids, attention_mask=am, labels=labels).loss.backward()
    ours, theirs = models[NAME], models["eager"]
    assert sink_grads(ours).dtype == torch.float64
    assert_within_table(sink_grads(ours), sink_grads(theirs))
    assert sink_grads(ours).abs().min() > 0  # every head's sink takes part
    q_grad = [m.model.layers[1].self_attn.q_proj.weight.grad for m in (ours, theirs)]
    assert_within_table(*q_grad)

    before = torch.stack([layer.self_attn.sinks.detach().clone() for layer in ours.model.layers])
    torch.optim.SGD(ours.parameters(), lr=0.1).step()
    after = torch.stack([layer.self_attn.sinks.detach() for layer in ours.model.layers])
    torch.testing.assert_close(after, before - 0.1 * sink_grads(ours))
    assert (after - before).abs().min() > 0


@needs_gpt_oss
def test_gpt_oss_greedy_generate_matches_eager() -> None:
    """Decode steps (one query against the cache; a ring of 4 slots on sliding layers).
    float64 (experts unfused; gpt-oss's eager softmaxes in the model's dtype), the tokens
    argued by ``generate_alike``."""
    ids, am = batch("left")
    models = [build(gpt_oss(), impl, WIDE, **EXPERTS_FLOAT64) for impl in ("eager", NAME)]
    seqs = generate_alike(models, ids, am, max_new_tokens=6, pad_token_id=0)
    assert seqs.shape == (3, SEQ + 6)


@needs_gpt_oss
def test_attention_forward_with_s_aux_matches_gpt_oss_eager() -> None:
    """The attention function alone against gpt-oss's ``eager_attention_forward`` (which
    reads ``module.sinks``): outputs, weights (without the sink's column), the gradients of
    the sinks and the query; a query row with no key gives 0 in both."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    config = gpt_oss()
    torch.manual_seed(0)
    module = modeling_gpt_oss.GptOssAttention(config, layer_idx=1).eval()
    torch.nn.init.normal_(module.sinks, std=2.0)  # sinks that matter: weights sum well below 1
    q, k, v = (t.repeat(1, 1, 1, 2) for t in qkv())  # head_dim 16, as the module's
    allowed = torch.tril(torch.ones(5, 5, dtype=torch.bool)).repeat(2, 1, 1, 1)
    allowed[1, :, 2] = False  # a query row with no key to attend
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)

    runs = {}
    for impl in ("eager", NAME):
        module.zero_grad()
        qq = q.clone().requires_grad_()
        if impl == NAME:
            out, weights = hf.attention_forward(
                module,
                qq,
                k,
                v,
                allowed,
                scaling=module.scaling,
                s_aux=module.sinks,
                output_attentions=True,
            )
        else:
            out, weights = modeling_gpt_oss.eager_attention_forward(
                module, qq, k, v, additive, scaling=module.scaling
            )
        out.square().sum().backward()
        runs[impl] = (out, weights, module.sinks.grad.clone(), qq.grad)
    for ours, theirs in zip(runs[NAME], runs["eager"], strict=True):
        assert ours.shape == theirs.shape
        assert_within_table(ours.detach(), theirs.detach())
    out, weights = runs[NAME][:2]
    assert out.shape == (2, 5, 4, 16)
    assert torch.all(out[1, 2] == 0)
    assert torch.all(weights[1, :, 2] == 0)
    assert weights.sum(-1)[0].max() < 0.99  # the sink takes its share of every row
    plain = hf.attention_forward(module, q, k, v, allowed, scaling=module.scaling)[0]
    assert (plain - out.detach()).abs().max() > 1e-2


def test_attention_forward_sinks_layouts_and_dtypes() -> None:
    """``sinks`` as transformers' extra key column ``[B|1, Hq, 1, 1]`` is the same as a
    ``[Hq]`` sink; per query position, or under both names, it is refused. A float32 sink
    stays float32 for a bfloat16 query (``attend`` computes in float32 there) and is cast to
    a float64 query's dtype, its gradient reaching the float32 parameter."""
    module = torch.nn.Module().eval()
    q, k, v = qkv()
    sink = torch.tensor([-1.0, 0.0, 1.0, 2.0])
    ref = hf.attention_forward(module, q, k, v, None, s_aux=sink)[0]
    for column in (sink[None, :, None, None], sink[None, :, None, None].expand(2, -1, -1, -1)):
        torch.testing.assert_close(
            hf.attention_forward(module, q, k, v, None, sinks=column)[0], ref
        )
    assert (ref - hf.attention_forward(module, q, k, v, None)[0]).abs().max() > 1e-2
    with pytest.raises(TypeError, match=r"`sinks` of shape \(2, 4, 5, 1\).*per query"):
        hf.attention_forward(module, q, k, v, None, sinks=torch.zeros(2, 4, 5, 1))
    with pytest.raises(TypeError, match="both `s_aux` and `sinks`"):
        hf.attention_forward(module, q, k, v, None, s_aux=sink, sinks=sink)

    half = hf.attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, s_aux=sink)[
        0
    ]
    assert half.dtype == torch.bfloat16
    rtol, atol = tolerance(torch.bfloat16)
    torch.testing.assert_close(half.float(), ref, rtol=rtol, atol=atol)
    param = sink.clone().requires_grad_()
    wide = hf.attention_forward(module, q.double(), k.double(), v.double(), None, s_aux=param)[0]
    assert wide.dtype == torch.float64
    assert_within_table(wide.float(), ref)
    wide.sum().backward()
    assert param.grad is not None
    assert param.grad.dtype == torch.float32
