"""The fast paths: fused attention backends (flex, flash) and compiled decoding with the static cache.

Each path is checked against the plain one it replaces: flex / flash attention against SDPA on the same weights, and
compiled static-cache generation against eager generation with the dynamic cache (same tokens), with torch._dynamo's
counters showing one graph for every decoding step (no graph break, no recompilation per step).
"""

import pytest
import torch
from conftest import randomize_cross_head, tiny_damcha_gpt2_config, tiny_damcha_vit_config, tiny_token_ids
from torch._dynamo.utils import counters
from transformers import CompileConfig

from damcha_hf import DamchaGPT2LMHeadModel, DamchaViTForImageClassification


def damcha_lm(attn="sdpa", **overrides):
    model = DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(**overrides)).eval()
    model.set_attn_implementation(attn)
    randomize_cross_head(model)
    return model


@torch.no_grad()  # flex attention has no backward on CPU
@pytest.mark.parametrize("variant", ["damcha", "none"])
def test_flex_attention_equals_sdpa_gpt2(variant):
    model = damcha_lm(metric_context="token", cross_head_variant=variant)
    ids = tiny_token_ids(seq=9, lowest=1)
    expected = model(ids).logits
    model.set_attn_implementation("flex_attention")
    assert model.config._attn_implementation == "flex_attention"
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@torch.no_grad()
def test_flex_attention_equals_sdpa_vit_sequence_and_token():
    pixels = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    for context in ("sequence", "token"):
        model = DamchaViTForImageClassification(tiny_damcha_vit_config(metric_context=context)).eval()
        randomize_cross_head(model)
        expected = model(pixel_values=pixels).logits
        model.set_attn_implementation("flex_attention")
        torch.testing.assert_close(model(pixel_values=pixels).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2"])
def test_query_context_refuses_fused_backends_with_the_fix(attn):
    """`"query"` widens the query past the value's head size: refused when the model is built or switched, by name."""
    with pytest.raises(ValueError, match="metric_context='query'.*'eager' or 'sdpa'"):
        DamchaGPT2LMHeadModel._from_config(tiny_damcha_gpt2_config(metric_context="query"), attn_implementation=attn)
    model = damcha_lm(metric_context="query")
    with pytest.raises(ValueError, match="metric_context='query'.*'eager' or 'sdpa'"):
        model.set_attn_implementation(attn)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("variant", ["talking_heads", "dcmha"])
def test_score_mixing_variants_refuse_flex(variant):
    with pytest.raises(ValueError, match=f"cross_head_variant='{variant}'.*attn_implementation='eager'"):
        DamchaGPT2LMHeadModel._from_config(
            tiny_damcha_gpt2_config(cross_head_variant=variant), attn_implementation="flex_attention"
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a CUDA GPU (none on this machine)")
@torch.no_grad()
@pytest.mark.parametrize("context", ["token"])
def test_flash_attention_equals_sdpa_on_gpu(context):
    pytest.importorskip("flash_attn", reason="the flash_attn package is not installed")
    model = damcha_lm(metric_context=context).to("cuda", torch.bfloat16)
    ids = tiny_token_ids(seq=9, lowest=1).cuda()
    expected = model(ids).logits.float()
    model.set_attn_implementation("flash_attention_2")
    torch.testing.assert_close(model(ids).logits.float(), expected, rtol=2e-2, atol=2e-2)


def compile_config() -> CompileConfig:
    # backend="eager": dynamo traces and guards exactly as for inductor (graph breaks and recompilations show up in
    # its counters), without inductor's C++ compilation time; `_compile_all_devices` lets generate() compile on CPU.
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    return config


@torch.no_grad()
@pytest.mark.parametrize("variant", ["damcha", "none"])
def test_compiled_static_cache_decoding_has_one_graph_and_the_eager_tokens(variant):
    model = damcha_lm(metric_context="token", cross_head_variant=variant)
    model.generation_config.eos_token_id = None
    ids = tiny_token_ids(batch=1, seq=5, lowest=1)
    options = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    expected = model.generate(ids, **options)
    torch._dynamo.reset()
    counters.clear()
    first = model.generate(ids, cache_implementation="static", compile_config=compile_config(), **options)
    second = model.generate(ids, cache_implementation="static", compile_config=compile_config(), **options)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    # One graph for the decoding step, traced once, reused by all 2 x 9 decoding steps of both calls.
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["stats"]["calls_captured"] > 0
    assert not counters["graph_break"] and not counters["recompiles"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])  # eager: the key mixing saves a compact key copy
def test_compiled_training_step_is_one_graph_with_eager_gradients(attn):
    """The recomputing generator (a custom autograd Function) and the key mixing trace with fullgraph=True."""
    model = damcha_lm(attn=attn, metric_context="token").train()
    ids = tiny_token_ids(seq=9, lowest=1)

    def gradients(forward):
        model.zero_grad(set_to_none=True)
        forward(input_ids=ids).logits.square().mean().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if "cross_head_metric" in name}

    expected = gradients(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = gradients(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert expected.keys() == compiled.keys() and len(expected) == 4
    for name in expected:
        torch.testing.assert_close(compiled[name], expected[name], rtol=1e-4, atol=1e-6)
