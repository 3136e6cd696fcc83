"""DAMCHA GPT-2 against vanilla GPT-2 and a naive per-head-pair oracle."""

import json
import math

import pytest
import torch
from conftest import randomize_metric, tiny_damcha_gpt2_config, tiny_gpt2_config
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2LMHeadModel,
)

import damcha_hf
from damcha_hf import (
    DamchaGPT2Config,
    DamchaGPT2LMHeadModel,
)

CAUSAL_CONTEXTS = ["token", "query"]


def tokens(batch=2, seq=12, seed=0):
    return torch.randint(1, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


def damcha_lm(context="token", attn="sdpa", randomize=True, **overrides):
    config = tiny_damcha_gpt2_config(metric_context=context, **overrides)
    model = DamchaGPT2LMHeadModel(config).eval()
    model.set_attn_implementation(attn)
    if randomize:
        randomize_metric(model)
    return model


# --- the attention layer against the oracle -------------------------------------------------------------------


def oracle_attention(attention, cross_head_metric, x, context, mask):
    """One GPT-2 attention layer written out by hand: every head pair, weighted by C computed from the weights."""
    batch, seq, hidden = x.shape
    heads = attention.num_heads
    head_dim = hidden // heads
    qkv = x @ attention.c_attn.weight + attention.c_attn.bias
    q, k, v = (t.reshape(batch, seq, heads, head_dim) for t in qkv.split(hidden, dim=-1))
    generator = cross_head_metric.generators[0]
    offsets = torch.nn.functional.gelu(x @ generator.fc_in.weight.T + generator.fc_in.bias)
    offsets = (offsets @ generator.fc_out.weight.T + generator.fc_out.bias).reshape(batch, seq, heads, heads)
    eye = torch.eye(heads)
    cross_head = {"full": eye + offsets, "diagonal": eye * (1 + offsets), "offdiagonal": offsets * (1 - eye)}[mask]
    out = torch.zeros(batch, seq, heads, head_dim)
    for b in range(batch):
        for i in range(heads):
            scores = torch.full((seq, seq), float("-inf"))
            for t in range(seq):
                for s in range(t + 1):  # causal
                    weights_at = t if context == "query" else s
                    scores[t, s] = sum(
                        cross_head[b, weights_at, i, j] * (q[b, t, i] @ k[b, s, j]) for j in range(heads)
                    )
            out[b, :, i] = torch.softmax(scores / math.sqrt(head_dim), dim=-1) @ v[b, :, i]
    return out.reshape(batch, seq, hidden) @ attention.c_proj.weight + attention.c_proj.bias


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
        expected = oracle_attention(attention, model.transformer.cross_head_metric, x, context, mask)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# --- conversion: the zero generator is GPT-2 -----------------------------------------------------------------


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("sharing", ["layer"])  # "stack" (the default): test_families.py
def test_converted_lm_equals_vanilla_gpt2(context, sharing):
    vanilla = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    damcha = damcha_hf.convert_to_damcha(vanilla, metric_context=context, metric_sharing=sharing)
    assert isinstance(damcha, DamchaGPT2LMHeadModel) and not damcha.training
    assert damcha.config.metric_context == context
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(damcha(ids).logits, vanilla(ids).logits, rtol=0, atol=1e-5)


def test_from_pretrained_gpt2_folder_keeps_every_weight(tmp_path):
    vanilla = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    vanilla.save_pretrained(tmp_path)
    damcha = DamchaGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    vanilla_state, damcha_state = vanilla.state_dict(), damcha.state_dict()
    for name, tensor in vanilla_state.items():
        torch.testing.assert_close(damcha_state[name], tensor, rtol=0, atol=0)
    extra = sorted(set(damcha_state) - set(vanilla_state))
    assert extra and all(".cross_head_metric." in f".{name}" for name in extra)
    generator = damcha.transformer.cross_head_metric.generators[0]
    assert generator.fc_out.weight.abs().max() == 0 and generator.fc_in.weight.abs().max() > 0
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(damcha(ids).logits, vanilla(ids).logits, rtol=0, atol=1e-5)


def test_convert_rejects_unsupported_models():
    with pytest.raises(TypeError, match="supported: GPT2Model"):
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
    ids = tokens(batch=4, seq=16)
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


@pytest.mark.parametrize("context", ["query"])  # "token" (the default): test_families.py
def test_gradient_checkpointing_gives_the_same_gradients(context):
    model = damcha_lm(context).train()
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable()  # transformers 5's name for gradient_checkpointing_enable
    model(ids, labels=ids).loss.backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, plain[name], rtol=1e-4, atol=1e-6, msg=name)
    assert plain["transformer.cross_head_metric.generators.0.fc_in.weight"].abs().max() > 0


def test_bf16_autocast_runs():
    model = damcha_lm("token").train()
    ids = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


# --- causality ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
def test_future_tokens_do_not_change_past_logits(context):
    model = damcha_lm(context)
    ids = tokens(batch=1, seq=16)
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 7) % 97
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-5)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3


def test_sequence_context_is_refused_for_causal_models():
    with pytest.raises(Exception, match="future tokens"):
        DamchaGPT2Config(metric_context="sequence")


# --- inference paths --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
def test_eager_equals_sdpa(context):
    eager = damcha_lm(context, "eager")
    sdpa = damcha_lm(context, "sdpa")
    sdpa.load_state_dict(eager.state_dict())
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, rtol=1e-4, atol=1e-5)
        a = eager(ids, attention_mask=mask).logits[mask.bool()]
        b = sdpa(ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
@pytest.mark.parametrize("attn", ["eager"])  # SDPA: test_families.py (cache equals no cache)
def test_generate_with_cache_equals_full_forward(context, attn):
    model = damcha_lm(context, attn)
    prompt = tokens(batch=2, seq=6)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=24,
        do_sample=False,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    no_cache = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=24,
        do_sample=False,
        use_cache=False,
        pad_token_id=0,
    )
    assert torch.equal(out.sequences, no_cache)
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, prompt.shape[1] - 1 :]
    torch.testing.assert_close(torch.stack(out.logits, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("context", CAUSAL_CONTEXTS)
def test_left_padded_batch_generates_like_unpadded_rows(context):
    model = damcha_lm(context, "sdpa")
    short, long = tokens(batch=1, seq=4, seed=1), tokens(batch=1, seq=7, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.cat(
        [torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(short)], 1), torch.ones_like(long)]
    )
    settings = dict(
        max_new_tokens=20, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    padded = model.generate(batch, attention_mask=mask, **settings)
    for row, single in enumerate((short, long)):
        alone = model.generate(single, attention_mask=torch.ones_like(single), **settings)
        assert torch.equal(padded.sequences[row, 7:], alone.sequences[0, single.shape[1] :])
        torch.testing.assert_close(
            torch.stack(padded.logits, 1)[row], torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4
        )


def test_output_attentions_returns_the_maps():
    model = damcha_lm("token", "eager")
    ids = tokens(seq=9)
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    assert len(out.attentions) == model.config.n_layer
    for attention in out.attentions:
        assert attention.shape == (2, 4, 9, 9)
        torch.testing.assert_close(attention.sum(-1), torch.ones(2, 4, 9))
        assert torch.all(attention.triu(1) == 0)


def test_metric_mask_applies_at_inference_to_a_trained_model():
    model = damcha_lm("token")
    ids = tokens()
    with torch.no_grad():
        full = model(ids).logits
        model.config.metric_mask = "diagonal"
        diagonal = model(ids).logits
        model.config.metric_mask = "offdiagonal"
        offdiagonal = model(ids).logits
    assert (full - diagonal).abs().max() > 1e-3 and (diagonal - offdiagonal).abs().max() > 1e-3


# --- persistence and registration -------------------------------------------------------------------------------


@pytest.mark.parametrize("context", ["query"])  # "token" (the default), every head: test_families.py
def test_save_and_load_round_trip_exactly(tmp_path, context):
    model = damcha_lm(context, metric_sharing="layer", metric_mask="diagonal", metric_hidden_size=12)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    saved = load_file(tmp_path / "model.safetensors")
    assert "transformer.cross_head_metric.generators.1.fc_out.weight" in saved
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "damcha_gpt2" and config["metric_context"] == context
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is DamchaGPT2LMHeadModel
    assert (loaded.config.metric_sharing, loaded.config.metric_mask, loaded.config.metric_hidden_size) == (
        "layer",
        "diagonal",
        12,
    )
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_lm_lists_generation_mixin_as_a_direct_base():
    from transformers import GenerationMixin

    assert GenerationMixin in DamchaGPT2LMHeadModel.__bases__


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
        model(tokens())


@pytest.mark.parametrize(
    "variant, expected",
    [
        ("damcha", (768 * 64 + 64) + (64 * 12 * 12 + 12 * 12)),  # one stack generator: d -> r -> H*H
        ("talking_heads", 12 * 2 * 12 * 12),  # per layer: an H x H mix before and after the softmax
    ],
)
def test_info_prints_the_cross_head_parameter_count_of_gpt2_small(capsys, variant, expected):
    from damcha_hf.cli import main

    assert main(["info", "--cross-head-variant", variant]) == 0
    printed = capsys.readouterr().out
    assert f"cross-head params:  {expected:,} (" in printed and "124," in printed
