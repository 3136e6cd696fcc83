"""DAMCHA's second reading, `metric_form="scores"`: head i scores with sum_j C_ij(z) Q_j K_j^T / sqrt(d_h).

Oracles: a naive loop over every head pair (i, j) with `C` written out from the generator's weights; the stock
transformers model (a fresh or converted model is exact MHA); generation without a cache.
"""

import pytest
import torch
from attention_oracle import oracle_scores_form_attention
from conftest import (
    CACHE_ARGUMENT,
    load_in_fresh_process,
    randomize_cross_head,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_gpt2_config,
    tiny_llama_config,
)
from transformers import DynamicCache, GPT2LMHeadModel, LlamaForCausalLM, StaticCache

import damcha_hf
from damcha_hf.modeling.metric import CrossHeadMetric, MetricScoreMixing
from damcha_hf.modeling.score_mixing import score_mixing_attention

BATCH, SEQ, HIDDEN, HEADS, HEAD_DIM = 2, 6, 24, 4, 5


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scaling = HEAD_DIM**-0.5


@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["full", "diagonal", "offdiagonal"])
@pytest.mark.parametrize("context", ["token", "query", "sequence"])
def test_scores_form_matches_the_head_pair_oracle(context, mask, kv_heads):
    torch.manual_seed(0)
    metric = CrossHeadMetric(HIDDEN, HEADS, metric_hidden_size=8, num_key_value_heads=HEADS)
    randomize_cross_head(torch.nn.ModuleDict({"cross_head_metric": metric}))
    hidden_states = torch.randn(BATCH, SEQ, HIDDEN)
    query = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM)
    key, value = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM), torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM)
    causal = context != "sequence"
    token_mask = torch.tensor([[True] * SEQ, [True] * (SEQ - 2) + [False] * 2]) if context == "sequence" else None
    mixing = MetricScoreMixing(
        metric, layer_idx=0, metric_context=context, metric_mask=mask, num_key_value_heads=kv_heads,
        token_mask=token_mask,
    )  # fmt: skip
    query_weights, key_weights = mixing.dynamic_weights(hidden_states, hidden_states)
    if causal:
        attention_mask = torch.ones(SEQ, SEQ).tril().bool()[None, None].expand(BATCH, 1, SEQ, SEQ)
    else:
        attention_mask = token_mask[:, None, None, :].expand(BATCH, 1, SEQ, SEQ)
    output, _ = score_mixing_attention(
        _Layer().eval(), query, key, value, attention_mask, mixing=mixing, query_weights=query_weights,
        key_weights=key_weights, scaling=HEAD_DIM**-0.5,
    )  # fmt: skip
    expected = oracle_scores_form_attention(query, key, value, hidden_states, metric, context, mask, causal, token_mask)
    real = slice(None) if token_mask is None else token_mask[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(output.transpose(1, 2)[real], expected[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", ["token", "query"])
@pytest.mark.parametrize(
    "stock_class, damcha_config, stock_config",
    [(GPT2LMHeadModel, tiny_damcha_gpt2_config, tiny_gpt2_config), (LlamaForCausalLM, tiny_damcha_llama_config, tiny_llama_config)],
    ids=["gpt2", "llama-gqa"],
)  # fmt: skip
def test_scores_form_converts_exactly_and_generates_the_same_with_and_without_a_cache(
    stock_class, damcha_config, stock_config, context
):
    stock = stock_class(stock_config()).eval()
    ids = torch.randint(3, 97, (2, 7))
    converted = damcha_hf.convert_to_damcha(stock, metric_form="scores", metric_context=context).eval()
    assert converted.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, stock(ids).logits, rtol=0, atol=1e-5)
    randomize_cross_head(converted)
    with torch.no_grad():
        full = converted(ids).logits
        # causal: changing the last token leaves every earlier position's logits unchanged
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 97
        torch.testing.assert_close(converted(changed).logits[:, :-1], full[:, :-1], rtol=0, atol=1e-6)
        assert not torch.allclose(full, stock(ids).logits, atol=1e-3)
        # token by token with a dynamic cache equals the full forward
        cache, steps = DynamicCache(config=converted.config), []
        for position in range(ids.shape[1]):
            step = converted(ids[:, position : position + 1], use_cache=True, **{CACHE_ARGUMENT: cache})
            steps.append(step.logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    prompt = ids[:1, :4]
    generated = {
        name: converted.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=use_cache, **extra)
        for name, use_cache, extra in [
            ("none", False, {}),
            ("dynamic", True, {}),
            ("static", True, {CACHE_ARGUMENT: StaticCache(config=converted.config, max_cache_len=16)}),
        ]
    }
    assert torch.equal(generated["dynamic"], generated["none"]) and torch.equal(generated["static"], generated["none"])


def test_scores_form_refuses_fused_backends_and_allows_multi_query_llama():
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(metric_form="scores"))
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="metric_form='scores'"):
        model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="metric_form='scores'"):
        damcha_hf.DamchaLlamaConfig(**{**tiny_damcha_llama_config().to_dict(), "num_key_value_heads": 1})
    model = damcha_hf.DamchaLlamaForCausalLM(tiny_damcha_llama_config(num_key_value_heads=1, metric_form="scores"))
    assert model.model.cross_head_metric.generators[0].fc_out.out_features == 8 * 8
    with pytest.raises(ValueError, match="metric_form"):
        damcha_hf.DamchaGPT2Config(metric_form="rows")


def test_scores_form_checkpoint_loads_as_remote_code_without_the_plugin(tmp_path):
    model = damcha_hf.DamchaLlamaForCausalLM(tiny_damcha_llama_config(metric_form="scores", metric_context="query"))
    randomize_cross_head(model)
    model.eval().save_pretrained(tmp_path / "checkpoint")
    inputs = {"input_ids": torch.randint(3, 97, (2, 7))}
    with torch.no_grad():
        expected = model(**inputs).logits
    report = load_in_fresh_process(tmp_path / "checkpoint", inputs, ["AutoModelForCausalLM"], tmp_path / "fresh")
    assert report["damcha_hf_importable"] is False
    torch.testing.assert_close(report["logits"], expected, rtol=0, atol=1e-6)
