"""What is specific to DAMCHA GPT-2: its attention layer against a naive per-head-pair oracle, conversion refusals,
training steps, its config checks and presets. What every family must do (conversion, cache, padding, save/load,
remote code) is in test_families.py."""

import pytest
import torch
from attention_oracle import oracle_gpt2_attention_layer
from conftest import randomize_cross_head, tiny_damcha_gpt2_config, tiny_token_ids
from transformers import GPT2Config, GPT2LMHeadModel

import damcha_hf
from damcha_hf import (
    DamchaGPT2Config,
    DamchaGPT2LMHeadModel,
)

CAUSAL_CONTEXTS = ["token", "query"]


def damcha_lm(context="token", attn="sdpa", randomize=True, **overrides):
    config = tiny_damcha_gpt2_config(metric_context=context, **overrides)
    model = DamchaGPT2LMHeadModel(config).eval()
    model.set_attn_implementation(attn)
    if randomize:
        randomize_cross_head(model)
    return model


# --- the attention layer against the oracle -------------------------------------------------------------------


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("mask", ["full", "diagonal", "offdiagonal"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_layer_matches_head_pair_oracle(context, mask, attn):
    model = damcha_lm(context, attn, metric_mask=mask)
    attention = model.transformer.h[0].attn
    x = torch.randn(2, 7, 32)
    causal_mask = torch.full((7, 7), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attention(x, attention_mask=causal_mask, cross_head_metric=model.transformer.cross_head_metric)
        expected = oracle_gpt2_attention_layer(attention, model.transformer.cross_head_metric, x, context, mask)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generator_with_its_own_input_norm_matches_the_oracle(context, attn):
    """`metric_input_norm="layernorm"`: the oracle normalises `z` by the LayerNorm formula, with the norm's random
    gain and bias, before the generator's MLP."""
    model = damcha_lm(context, attn, metric_input_norm="layernorm").double()
    attention, metric = model.transformer.h[0].attn, model.transformer.cross_head_metric
    assert metric.generators[0].input_norm.weight.std() > 0.1  # randomised, not the identity start
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    causal_mask = torch.full((7, 7), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attention(x, attention_mask=causal_mask, cross_head_metric=metric)
        expected = oracle_gpt2_attention_layer(attention, metric, x, context, "full")
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_generator_input_norm_starts_as_the_identity_and_converts_exactly(tmp_path):
    stock = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=32)).eval().double()
    converted = damcha_hf.convert_to_damcha(stock, metric_input_norm="layernorm").eval()
    norm = converted.transformer.cross_head_metric.generators[0].input_norm
    assert torch.equal(norm.weight, torch.ones(32, dtype=torch.float64)) and not norm.bias.any()
    ids = tiny_token_ids(seq=12, lowest=1)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, stock(ids).logits, rtol=1e-12, atol=1e-12)
    randomize_cross_head(converted)
    converted.save_pretrained(tmp_path)
    reloaded = DamchaGPT2LMHeadModel.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert reloaded.config.metric_input_norm == "layernorm"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, converted(ids).logits, rtol=0, atol=0)


# --- conversion refusals -------------------------------------------------------------------------------------


def test_convert_rejects_unsupported_models():
    with pytest.raises(TypeError, match=r"supported: GPT-2 \(gpt2\), Llama \(llama\)"):
        damcha_hf.convert_to_damcha(torch.nn.Linear(2, 2))


def test_from_pretrained_of_another_architecture_fails_at_once(tmp_path):
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=37).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="model_type='bert'"):
        DamchaGPT2LMHeadModel.from_pretrained(tmp_path)


# --- training ---------------------------------------------------------------------------------------------------


def test_one_step_moves_the_generator_and_gradients_reach_it():
    model = damcha_lm("token", randomize=False).train()
    generator = model.transformer.cross_head_metric.generators[0]
    assert generator.fc_out.weight.abs().max() == 0
    ids = tiny_token_ids(batch=4, seq=16, lowest=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert generator.fc_out.weight.grad.abs().max() > 0
    optimizer.step()
    assert generator.fc_out.weight.abs().max() > 0
    # a second step now reaches the generator's first layer too (its gradient flows through the non-zero output)
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert generator.fc_in.weight.grad.abs().max() > 0


def test_bf16_autocast_runs():
    model = damcha_lm("token").train()
    ids = tiny_token_ids(seq=12, lowest=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


# --- causal contexts ----------------------------------------------------------------------------------------------


def test_sequence_context_is_refused_for_causal_models():
    with pytest.raises(Exception, match="future tokens"):
        DamchaGPT2Config(metric_context="sequence")


# --- the metric mask at inference ------------------------------------------------------------------------------


def test_metric_mask_applies_at_inference_to_a_trained_model():
    model = damcha_lm("token")
    ids = tiny_token_ids(seq=12, lowest=1)
    with torch.no_grad():
        full = model(ids).logits
        model.config.metric_mask = "diagonal"
        diagonal = model(ids).logits
        model.config.metric_mask = "offdiagonal"
        offdiagonal = model(ids).logits
    assert (full - diagonal).abs().max() > 1e-3 and (diagonal - offdiagonal).abs().max() > 1e-3


# --- bad configs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_embd=30, n_head=4), "num_attention_heads"),
        (dict(metric_context="keys"), "metric_context"),
        (dict(metric_mask="upper"), "metric_mask"),
        (dict(metric_sharing="block"), "metric_sharing"),
        (dict(metric_hidden_size=0), "metric_hidden_size"),
        (dict(metric_hidden_size=-3), "metric_hidden_size"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(Exception, match=field):
        DamchaGPT2Config(**{**dict(n_embd=32, n_head=4), **overrides})


def test_query_context_refuses_backends_that_cannot_run_it():
    model = damcha_lm("query")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        model(tiny_token_ids(seq=12, lowest=1))


@pytest.mark.parametrize(
    "variant, expected",
    [
        ("damcha", (768 * 64 + 64) + (64 * 12 * 12 + 12 * 12)),  # one stack generator: d -> r -> H*H
        ("talking_heads", 12 * 2 * 12 * 12),  # per layer: an H x H mix before and after the softmax
        ("colmha", 12 * 12 * 768),  # per layer: a mixing vector of all heads' width per head
    ],
)
def test_info_prints_the_cross_head_parameter_count_of_gpt2_small(capsys, variant, expected):
    from damcha_hf.cli import main

    assert main(["info", "--cross-head-variant", variant]) == 0
    printed = capsys.readouterr().out
    assert f"cross-head params:  {expected:,} (" in printed and "124," in printed
    # the variant's own settings, and no other variant's
    assert ("metric_context:" in printed) == (variant == "damcha") and ("colmha_key_dim:" in printed) == (
        variant == "colmha"
    )
