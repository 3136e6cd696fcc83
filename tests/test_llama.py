"""What is specific to DAMCHA Llama: grouped-query and multi-head attention against a naive per-head-pair oracle
with RoPE, the metric shapes, the cache size, tied embeddings, presets, the heatmap and card. What every family must do
(conversion, cache, padding, save/load, remote code) is in test_families.py, on grouped-query Llama."""

import json

import pytest
import torch
from attention_oracle import oracle_cross_head, oracle_llama_attention_layer
from conftest import CACHE_ARGUMENT, randomize_cross_head, tiny_damcha_llama_config, tiny_llama_config, tiny_token_ids
from transformers import (
    LlamaForCausalLM,
)

import damcha_hf
from damcha_hf import (
    DamchaLlamaForCausalLM,
)
from damcha_hf.modeling.metric import CrossHeadMetric, cross_head_query_key

CAUSAL_CONTEXTS = ["token", "query"]
KV_HEADS = [8, 2]  # multi-head (8 query heads, 8 key/value heads) and grouped-query (8 query heads, 2 groups)
# The family harness (test_families.py) runs grouped-query Llama (2 groups) through conversion, eager against SDPA and
# the cache; this file adds multi-head Llama for those.
MULTI_HEAD = [8]


def damcha_lm(context="token", attn="sdpa", kv_heads=2, randomize=True, **overrides):
    config = tiny_damcha_llama_config(metric_context=context, num_key_value_heads=kv_heads, **overrides)
    model = DamchaLlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    if randomize:
        randomize_cross_head(model)
    return model


# --- the attention layer against a head-pair oracle ----------------------------------------------------------


@pytest.mark.parametrize("kv_heads", KV_HEADS)
@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("mask", ["full", "diagonal", "offdiagonal"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_layer_matches_head_pair_oracle(kv_heads, context, mask, attn):
    model = damcha_lm(context, attn, kv_heads=kv_heads, metric_mask=mask)
    metric = model.model.cross_head_metric
    rows = 8 if context == "query" else kv_heads
    assert metric.generators[0].fc_out.out_features == rows * kv_heads
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, 6, 64)
    positions = torch.arange(3, 9)  # off zero, so that the rotation matters
    cos_sin = model.model.rotary_emb(x, positions[None])
    causal_mask = torch.full((6, 6), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attention(x, position_embeddings=cos_sin, attention_mask=causal_mask, cross_head_metric=metric)
        base = model.config.rope_parameters["rope_theta"]
        expected = oracle_llama_attention_layer(attention, metric, x, positions, context, mask, base)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_key_mixing_commutes_with_rope():
    """sum_l C_jl R_s K_l = R_s sum_l C_jl K_l: RoPE rotates every head of a position alike, so where it is applied
    relative to the mix does not matter (and the model mixes the rotated keys, which the cache stores)."""
    model = damcha_lm("token", kv_heads=2).double()  # float64: rounding far below the tolerance on any CPU
    metric, rotary = model.model.cross_head_metric, model.model.rotary_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(2, 7, 64, dtype=torch.float64)
    query, key = torch.randn(2, 8, 7, 8, dtype=torch.float64), torch.randn(2, 2, 7, 8, dtype=torch.float64)
    cos, sin = rotary(x, torch.arange(5, 12)[None])
    with torch.no_grad():
        _, mixed_then_rotated = cross_head_query_key(query, key, x, metric, layer_idx=0, metric_context="token")
        _, mixed_then_rotated = apply_rotary_pos_emb(query, mixed_then_rotated, cos, sin)
        _, rotated = apply_rotary_pos_emb(query, key, cos, sin)
        _, rotated_then_mixed = cross_head_query_key(query, rotated, x, metric, layer_idx=0, metric_context="token")
    assert (rotated_then_mixed - rotated).abs().max() > 1e-2  # the metric is far from the identity
    torch.testing.assert_close(rotated_then_mixed, mixed_then_rotated, rtol=1e-5, atol=1e-5)


def test_metric_shapes_follow_the_key_value_heads():
    assert CrossHeadMetric.from_config(tiny_damcha_llama_config()).generators[0].fc_out.out_features == 2 * 2
    query_metric = CrossHeadMetric.from_config(tiny_damcha_llama_config(metric_context="query"))
    assert query_metric(torch.zeros(3, 64)).shape == (3, 8, 2)
    # G = 0: C is the grouped-query assignment, query heads 0-3 read key head 0 and heads 4-7 key head 1
    expected = torch.zeros(8, 2)
    expected[:4, 0] = expected[4:, 1] = 1
    assert torch.equal(query_metric(torch.randn(64)), expected)


# --- conversion of multi-head Llama ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", MULTI_HEAD)
@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_converted_lm_equals_stock_llama(kv_heads, context, attn):
    stock = LlamaForCausalLM(tiny_llama_config(num_key_value_heads=kv_heads)).eval()
    stock.set_attn_implementation(attn)
    damcha = damcha_hf.convert_to_damcha(stock, metric_context=context)
    assert isinstance(damcha, DamchaLlamaForCausalLM) and damcha.config._attn_implementation == attn
    assert damcha.config.num_key_value_heads == kv_heads
    ids = tiny_token_ids(seq=12)
    with torch.no_grad():
        torch.testing.assert_close(damcha(ids).logits, stock(ids).logits, rtol=0, atol=1e-5)


def test_tied_embeddings_stay_tied():
    stock = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True)).eval()
    damcha = damcha_hf.convert_to_damcha(stock)
    assert damcha.lm_head.weight.data_ptr() == damcha.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(
            damcha(tiny_token_ids(seq=12)).logits, stock(tiny_token_ids(seq=12)).logits, rtol=0, atol=1e-5
        )


def test_the_plain_variant_converts_from_multi_head_llama():
    """Talking-heads and DCMHA (multi-head only) convert from multi-head Llama in test_families.py."""
    stock = LlamaForCausalLM(tiny_llama_config(num_key_value_heads=8)).eval()
    damcha = damcha_hf.convert_to_damcha(stock, cross_head_variant="none")
    assert damcha.model.cross_head_metric is None
    with torch.no_grad():
        torch.testing.assert_close(
            damcha(tiny_token_ids(seq=12)).logits, stock(tiny_token_ids(seq=12)).logits, rtol=0, atol=1e-5
        )


# --- inference paths of multi-head Llama, the grouped-query cache ----------------------------------------------


@pytest.mark.parametrize("kv_heads", MULTI_HEAD)
@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
def test_eager_equals_sdpa(kv_heads, context):
    eager = damcha_lm(context, "eager", kv_heads=kv_heads)
    sdpa = damcha_lm(context, "sdpa", kv_heads=kv_heads)
    sdpa.load_state_dict(eager.state_dict())
    ids = tiny_token_ids(seq=12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, rtol=1e-4, atol=1e-5)
        a = eager(ids, attention_mask=mask).logits[mask.bool()]
        b = sdpa(ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def generate(model, prompt, **settings):
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=16,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **settings,
    )


@pytest.mark.parametrize("kv_heads", MULTI_HEAD)
@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generate_with_cache_equals_full_forward(kv_heads, context, attn):
    model = damcha_lm(context, attn, kv_heads=kv_heads)  # a non-zero ("trained") generator
    prompt = tiny_token_ids(batch=2, seq=5)
    cached = generate(model, prompt, use_cache=True)
    uncached = generate(model, prompt, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    with torch.no_grad():
        full = model(cached.sequences[:, :-1]).logits[:, prompt.shape[1] - 1 :]
    torch.testing.assert_close(torch.stack(cached.logits, dim=1), full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(uncached.logits, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
def test_cache_keeps_the_grouped_query_size(context):
    model = damcha_lm(context, kv_heads=2)
    with torch.no_grad():
        cache = getattr(model(tiny_token_ids(seq=9), use_cache=True), CACHE_ARGUMENT)
    # (batch, H_kv, seq, d_h): the GQA size (mixed keys for "token", the plain keys for "query")
    assert cache.layers[0].keys.shape == (2, 2, 9, 8) == cache.layers[0].values.shape


# --- bad configs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(metric_context="sequence"), "future tokens"),
        (dict(num_key_value_heads=1), "multi-query"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_key_value_heads=2, cross_head_variant="talking_heads"), "num_key_value_heads"),
        (dict(metric_mask="upper"), "metric_mask"),
        (dict(hidden_size=60), "attention heads"),
    ],
)
def test_bad_configs_name_the_field(overrides, match):
    with pytest.raises(Exception, match=match):  # huggingface_hub's strict-dataclass error wraps the ValueError
        tiny_damcha_llama_config(**overrides)


def test_a_plain_model_of_a_multi_query_checkpoint_is_allowed():
    config = tiny_damcha_llama_config(num_key_value_heads=1, cross_head_variant="none")
    assert DamchaLlamaForCausalLM(config).model.cross_head_metric is None


def test_info_tinyllama_preset_counts_the_generator_against_stock_tinyllama(capsys):
    from transformers import LlamaConfig

    from damcha_hf.cli import main

    assert main(["info", "tinyllama"]) == 0
    printed = capsys.readouterr().out
    shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4)  # fmt: skip
    with torch.device("meta"):
        stock = LlamaForCausalLM(LlamaConfig(**shape)).num_parameters()
    generator = (2048 * 64 + 64) + (64 * 4 * 4 + 4 * 4)  # d -> r -> H_kv * H_kv
    assert f"parameters:         {stock + generator:,}" in printed
    assert f"cross-head params:  {generator:,} (" in printed


# --- the metric heatmap and the model card --------------------------------------------------------------------


@pytest.mark.parametrize("context, shape", [("token", (2, 2)), ("query", (8, 2))])
def test_metric_map_of_a_grouped_query_model(context, shape, tmp_path):
    from damcha_hf.metric_map import compute_metric_map, write_metric_map

    model = damcha_lm(context, kv_heads=2)
    ids = tiny_token_ids(batch=1, seq=10)
    metric_map = compute_metric_map(model, {"input_ids": ids})
    assert metric_map.matrices.shape == (2, *shape) and metric_map.tokens_seen == [10, 10]
    # naive: the generator on each layer's normalised attention input, averaged over tokens
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for layer in range(2):
        x = model.model.layers[layer].input_layernorm(hidden[layer])[0]
        expected = oracle_cross_head(model.model.cross_head_metric, x, *shape)
        torch.testing.assert_close(metric_map.matrices[layer], expected.mean(0), rtol=1e-4, atol=1e-5)
    assert all(0.05 < mass < 1 for mass in metric_map.offdiagonal_mass)
    assert write_metric_map(model, tmp_path / "c.png").panels == 2

    converted = damcha_hf.convert_to_damcha(LlamaForCausalLM(tiny_llama_config()).eval(), metric_context=context)
    assert compute_metric_map(converted).offdiagonal_mass == [0.0, 0.0]  # C is the plain-GQA assignment


def test_hub_checkpoint_and_card_of_a_llama_model(tmp_path):
    from damcha_hf.data import byte_level_tokenizer
    from damcha_hf.hub import save_hub_checkpoint

    model = damcha_lm("token", kv_heads=2)
    folder = save_hub_checkpoint(model, tmp_path / "llama", tokenizer_or_processor=byte_level_tokenizer(),
                                 heatmap_inputs=tiny_token_ids(batch=1, seq=8))  # fmt: skip
    card = (folder / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "- llama" in card
    assert "A Llama model (DamchaLlamaForCausalLM)" in card and "AutoTokenizer" in card
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_damcha_llama.DamchaLlamaConfig",
        "AutoModel": "modeling_damcha_llama.DamchaLlamaModel",
        "AutoModelForCausalLM": "modeling_damcha_llama.DamchaLlamaForCausalLM",
        "AutoModelForSequenceClassification": "modeling_damcha_llama.DamchaLlamaForSequenceClassification",
        "AutoModelForQuestionAnswering": "modeling_damcha_llama.DamchaLlamaForQuestionAnswering",
        "AutoModelForTokenClassification": "modeling_damcha_llama.DamchaLlamaForTokenClassification",
    }
    assert (folder / "metric_heatmap.png").is_file() and (folder / "damcha_family.py").is_file()
