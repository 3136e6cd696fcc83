"""The transformers contract of the DAMCHA classes, on whichever transformers version is installed.

CI runs this file on both ends of the supported range (`.ci/run`), so each test here must hold on every version the
package claims. Oracles: the stock transformers class each DAMCHA class extends (its modules, attributes and forward
arguments), generation without a cache, one full forward pass, and a ViT that never sees the padded tokens.
"""

import inspect

import pytest
import torch
from conftest import (
    CACHE_ARGUMENT,
    IGNORED_LAYER_ARGUMENTS,
    randomize_cross_head,
    tiny_bart_config,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_damcha_vit_config,
    tiny_token_ids,
    unread_keyword_arguments,
)
from tiny_decoders import STOCK_CONFIGS, tiny_damcha_config
from torch._dynamo.utils import counters
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama
from transformers.models.vit import modeling_vit

import damcha_hf
from damcha_hf import DamchaGPT2LMHeadModel, DamchaViTModel
from damcha_hf.families import FAMILIES
from damcha_hf.modeling import damcha_pretrained, modeling_damcha_gpt2, modeling_damcha_llama, modeling_damcha_vit

# (cross_head_variant, metric_context): every attention a causal DAMCHA model can run.
CAUSAL_SETTINGS = [
    ("damcha", "token"),
    ("damcha", "query"),
    ("talking_heads", "token"),
    ("dcmha", "token"),
    ("none", "token"),
]
SETTING_IDS = [f"{variant}-{context}" if variant == "damcha" else variant for variant, context in CAUSAL_SETTINGS]


def trained_lm(variant, context, **overrides) -> DamchaGPT2LMHeadModel:
    """A tiny LM whose cross-head weights are random and far from their MHA start, as after training (a wide
    initialisation makes the attention scores, and so the cross-head weights, matter to the logits)."""
    config = tiny_damcha_gpt2_config(
        cross_head_variant=variant, metric_context=context, initializer_range=0.2, **overrides
    )
    model = DamchaGPT2LMHeadModel(config).eval()
    randomize_cross_head(model)
    return model


def returned_cache(output):
    return getattr(output, CACHE_ARGUMENT)


def greedy(model, prompt, attention_mask=None, **settings):
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt) if attention_mask is None else attention_mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **settings,
    )


# --- the cache reaches the attention, whatever it is called and however it is wrapped ------------------------------


@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
def test_attention_layer_updates_the_cache_under_either_argument_name(argument):
    model = trained_lm("damcha", "token")
    attention = model.transformer.h[0].attn
    x = torch.randn(2, 5, 32)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        attention(x, cross_head_metric=model.transformer.cross_head_metric, **{argument: cache})
    assert cache.get_seq_length(0) == 5


def test_attention_layer_updates_the_self_attention_part_of_an_encoder_decoder_cache():
    model = trained_lm("damcha", "token", add_cross_attention=True)
    attention = model.transformer.h[1].attn
    cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    with torch.no_grad():
        attention(torch.randn(2, 5, 32), cross_head_metric=model.transformer.cross_head_metric, cache=cache)
    assert cache.self_attention_cache.get_seq_length(1) == 5
    assert cache.cross_attention_cache.get_seq_length(1) == 0


def test_gpt2_attention_receives_no_argument_it_does_not_name(monkeypatch):
    unread = unread_keyword_arguments(monkeypatch, modeling_damcha_gpt2.DamchaGPT2Attention)
    model = trained_lm("damcha", "token")
    prompt = tiny_token_ids(seq=6, lowest=1)
    greedy(model, prompt, output_attentions=True, output_hidden_states=True)
    greedy(model, prompt, cache_implementation="static")
    model.train()
    model(prompt, labels=prompt).loss.backward()
    assert unread <= IGNORED_LAYER_ARGUMENTS, unread - IGNORED_LAYER_ARGUMENTS


def test_vit_attention_receives_no_argument_it_does_not_name(monkeypatch):
    unread = unread_keyword_arguments(monkeypatch, modeling_damcha_vit.DamchaViTAttention)
    model = DamchaViTModel(tiny_damcha_vit_config())
    model.set_attn_implementation("eager")
    mask = torch.ones(2, 50, dtype=torch.long)
    model(torch.randn(2, 1, 28, 28), attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert unread <= IGNORED_LAYER_ARGUMENTS, unread - IGNORED_LAYER_ARGUMENTS


def test_llama_attention_receives_no_argument_it_does_not_name(monkeypatch):
    unread = unread_keyword_arguments(monkeypatch, modeling_damcha_llama.DamchaLlamaAttention)
    model = damcha_hf.DamchaLlamaForCausalLM(tiny_damcha_llama_config()).eval()
    randomize_cross_head(model)
    prompt = tiny_token_ids(seq=6, lowest=1)
    greedy(model, prompt, output_attentions=True, output_hidden_states=True)
    greedy(model, prompt, cache_implementation="static")
    model.train()
    model(prompt, labels=prompt).loss.backward()
    assert unread <= IGNORED_LAYER_ARGUMENTS, unread - IGNORED_LAYER_ARGUMENTS


# --- parity with the upstream classes -------------------------------------------------------------------------------

# (DAMCHA class, the transformers class it extends, constructor keyword arguments of both): the layers each family
# builds, and every head each family declares.
PARITY_PAIRS = [
    (modeling_damcha_gpt2.DamchaGPT2Attention, modeling_gpt2.GPT2Attention, {"layer_idx": 1}),
    (modeling_damcha_llama.DamchaLlamaAttention, modeling_llama.LlamaAttention, {"layer_idx": 1}),
    (modeling_damcha_vit.DamchaViTAttention, modeling_vit.ViTAttention, {"layer_idx": 1}),
    (modeling_damcha_vit.DamchaViTModel, modeling_vit.ViTModel, {"add_pooling_layer": False, "use_mask_token": True}),
] + [
    # The rotary decoders' attention layers (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2).
    (attention, damcha_pretrained.stock_class_of(attention), {"layer_idx": 1})
    for attention in (family.task_head.model_class.damcha_attention_class for family in FAMILIES
                      if family.model_type in STOCK_CONFIGS)
] + [(head.model_class, head.stock_class, {}) for family in FAMILIES for head in family.heads]  # fmt: skip
# What DAMCHA adds: its metric generator and the baselines' mixing modules; the metric and the token mask of
# `"sequence"` handed down with each call; the layer index its ViT layers are built with (it picks the generator).
DAMCHA_MODULES = {"cross_head_metric", "cross_head_mixing"}
DAMCHA_ARGUMENTS = {"cross_head_metric", "token_mask", "layer_idx"}
# `cache` (5.24) and `past_key_values` (5.23) are the same argument; a DAMCHA forward names both.
CACHE_NAMES = {"cache", "past_key_values"}


def _build(cls, kwargs, config):
    # A constructor that takes `**kwargs` gets them all: with the `kernels` package installed, transformers wraps
    # LlamaAttention.__init__ in a `(*args, **kwargs)` function, which hides the names it accepts.
    parameters = inspect.signature(cls.__init__).parameters
    if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        kwargs = {key: value for key, value in kwargs.items() if key in parameters}
    return cls(config, **kwargs)


def _config_for(damcha_class):
    model_type = damcha_class.__module__.rpartition("_damcha_")[2]
    if model_type in STOCK_CONFIGS:
        return tiny_damcha_config(model_type, num_labels=3)
    if damcha_class.__module__.endswith("gpt2"):
        return tiny_damcha_gpt2_config(add_cross_attention=True, num_labels=3)
    if damcha_class.__module__.endswith("llama"):
        return tiny_damcha_llama_config(num_labels=3)
    if damcha_class.__module__.endswith("bart"):
        return damcha_hf.DamchaBartConfig(**tiny_bart_config(num_labels=3).to_dict())
    return tiny_damcha_vit_config(encoder_stride=4)


def _plain_attributes(module) -> dict:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, (int, float, str, bool, tuple, type(None)))
    }


@pytest.mark.parametrize(
    "damcha_class, upstream_class, kwargs",
    PARITY_PAIRS,
    ids=[f"{pair[0].__name__}{'-' + '-'.join(pair[2]) if pair[2] else ''}" for pair in PARITY_PAIRS],
)
def test_damcha_class_keeps_the_modules_attributes_and_forward_of_its_upstream_class(
    damcha_class, upstream_class, kwargs
):
    assert issubclass(damcha_class, upstream_class)
    config = _config_for(damcha_class)
    damcha, upstream = _build(damcha_class, kwargs, config), _build(upstream_class, kwargs, config)

    # Every upstream submodule is there under the same name, of the same class or a DAMCHA subclass of it.
    damcha_modules = dict(damcha.named_modules())
    for name, module in upstream.named_modules():
        assert name in damcha_modules, f"{damcha_class.__name__} lacks `{name}` ({type(module).__name__})"
        assert isinstance(damcha_modules[name], type(module)), name
        for attribute, value in _plain_attributes(module).items():
            assert getattr(damcha_modules[name], attribute, "missing") == value, f"{name}.{attribute}"
    # The same weights (names and shapes), plus only DAMCHA's own.
    damcha_state, upstream_state = damcha.state_dict(), upstream.state_dict()
    assert {name: t.shape for name, t in upstream_state.items()} == {
        name: damcha_state[name].shape for name in upstream_state
    }
    extra = set(damcha_state) - set(upstream_state)
    assert all(DAMCHA_MODULES & set(name.split(".")) for name in extra), extra

    # Every argument of the upstream forward is named by DAMCHA's, in the same order (so positional calls agree).
    def arguments(cls):
        parameters = inspect.signature(cls.forward).parameters.values()
        names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return ["cache" if name in CACHE_NAMES else name for name in names]

    upstream_arguments = arguments(upstream_class)
    damcha_arguments = [name for name in arguments(damcha_class) if name not in DAMCHA_ARGUMENTS]
    assert damcha_arguments[: len(upstream_arguments)] == upstream_arguments
    leftover = set(damcha_arguments[len(upstream_arguments) :]) - CACHE_NAMES
    assert not leftover, leftover


def test_gpt2_attention_names_both_cache_arguments():
    parameters = inspect.signature(modeling_damcha_gpt2.DamchaGPT2Attention.forward).parameters
    assert set(parameters) >= CACHE_NAMES


# --- the cache, stepped by hand, equals the full forward pass ---------------------------------------------------------
# Generation with a dynamic, static or no cache, for every variant and family: test_families.py.


@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
@pytest.mark.parametrize("variant, context", CAUSAL_SETTINGS, ids=SETTING_IDS)
def test_incremental_logits_equal_the_full_forward(variant, context, cache_class):
    # float64: the cached and the full forward sum in different orders; in float32 DCMHA's logits differed by 1.5e-4
    # on one x86-64 CPU and not on another, in float64 by 3e-15, while a cache that lost a step differs by 1e-2.
    model = trained_lm(variant, context).double()
    ids = tiny_token_ids(seq=11, lowest=1)
    if cache_class == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :5], use_cache=True, **{CACHE_ARGUMENT: cache}).logits]
        for position in range(5, ids.shape[1]):
            step = model(ids[:, position : position + 1], use_cache=True, **{CACHE_ARGUMENT: cache})
            assert returned_cache(step) is cache
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    # The cache holds per-head keys in the usual layout ("query" included: its key is not mixed, the full-width key
    # is formed after the update), with DCMHA's key-side weights next to the keys.
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert values.shape[:3] == keys.shape[:3] == (2, 4, 11 if cache_class == "dynamic" else 16)
    assert keys.shape[-1] == 8 + (2 * (2 * 2 + 1) if variant == "dcmha" else 0)


def test_cross_attention_gpt2_generates_with_its_cache():
    """`add_cross_attention=True`: DAMCHA self-attention updates the self-attention part of the EncoderDecoderCache,
    stock cross-attention the other part; cached generation equals uncached, step logits the full forward."""
    model = trained_lm("damcha", "token", add_cross_attention=True)
    prompt = tiny_token_ids(seq=6, lowest=1)
    encoder_states = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = greedy(model, prompt, encoder_hidden_states=encoder_states)
        uncached = greedy(model, prompt, encoder_hidden_states=encoder_states, use_cache=False)
        assert torch.equal(cached.sequences, uncached.sequences)
        torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits), rtol=1e-4, atol=1e-4)

        ids = cached.sequences
        full = model(ids, encoder_hidden_states=encoder_states).logits
        prefill = model(ids[:, :6], encoder_hidden_states=encoder_states, use_cache=True)
        cache, steps = returned_cache(prefill), [prefill.logits]
        assert isinstance(cache, EncoderDecoderCache)
        for position in range(6, ids.shape[1]):
            step = model(
                ids[:, position : position + 1],
                encoder_hidden_states=encoder_states,
                use_cache=True,
                **{CACHE_ARGUMENT: cache},
            )
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    assert cache.self_attention_cache.get_seq_length() == ids.shape[1]
    assert cache.cross_attention_cache.get_seq_length() == 3


# backend "eager": dynamo traces the whole decoding step (fullgraph: a graph break fails) without inductor's C++ build;
# "inductor" (slow: minutes of C++ compilation on a CPU) is what users get by default.
COMPILE_BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.slow)]
# DAMCHA in the default suite; the baselines' compiled decoding (about 5 s each) in the slow one.
COMPILED_SETTINGS = [
    pytest.param(*setting, id=name, marks=() if setting[0] == "damcha" else pytest.mark.slow)
    for setting, name in zip(CAUSAL_SETTINGS, SETTING_IDS, strict=True)
]


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("variant, context", COMPILED_SETTINGS)
def test_compiled_static_cache_generation_equals_dynamic_cache_generation(variant, context, backend):
    from transformers import CompileConfig

    model = trained_lm(variant, context)
    prompt = tiny_token_ids(seq=6, lowest=1)
    compile_config = CompileConfig(fullgraph=True, backend=backend, mode=None if backend == "eager" else "default")
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told otherwise
    torch._dynamo.reset()
    with torch.no_grad():
        dynamic = greedy(model, prompt)
        counters.clear()
        compiled = greedy(model, prompt, cache_implementation="static", compile_config=compile_config)
    # generate() really ran the decoding step compiled (it falls back to eager where it decides not to compile).
    assert counters["stats"]["unique_graphs"] >= 1 and counters["stats"]["calls_captured"] > 0
    assert torch.equal(compiled.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(dynamic.logits), rtol=1e-4, atol=1e-4)


# --- ViT "sequence" honours a padding mask ---------------------------------------------------------------------------


def _padding_mask(batch=2, seq=50, padded=(7, 19)):
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row, count in enumerate(padded):
        mask[row, seq - count :] = 0
    return mask


def _as_4d_mask(mask, form):
    keys = mask[:, None, None, :].bool().expand(-1, 1, mask.shape[1], -1)
    if form == "bool":
        return keys
    return torch.zeros(keys.shape).masked_fill(~keys, torch.finfo(torch.float32).min)


# Eager attention adds the mask to the scores, so it takes 2D and additive masks only (as in stock ViT); the "scores"
# form of the metric runs on eager attention only.
@pytest.mark.parametrize(
    "attn, mask_form, metric_form",
    [("eager", "2d", "keys"), ("eager", "float", "keys"), ("sdpa", "2d", "keys"), ("sdpa", "float", "keys"),
     ("sdpa", "bool", "keys"), ("eager", "2d", "scores"), ("eager", "float", "scores")],
)  # fmt: skip
def test_vit_sequence_metric_with_padding_equals_the_model_without_the_padded_tokens(attn, mask_form, metric_form):
    """Oracle: the same layers run on the kept tokens alone, one image at a time, without a mask."""
    model = DamchaViTModel(tiny_damcha_vit_config(metric_context="sequence", metric_form=metric_form)).eval()
    model.set_attn_implementation(attn)
    randomize_cross_head(model)
    pixels = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    mask = _padding_mask()
    with torch.no_grad():
        given = mask if mask_form == "2d" else _as_4d_mask(mask, mask_form)
        masked = model(pixels, attention_mask=given).last_hidden_state
        unmasked = model(pixels).last_hidden_state
        embeddings = model.embeddings(pixels)
        for row in range(2):
            hidden = embeddings[row : row + 1, mask[row].bool()]
            for layer in model.layers:
                hidden = layer(hidden, None, cross_head_metric=model.cross_head_metric)
            expected = model.layernorm(hidden)
            torch.testing.assert_close(masked[row : row + 1, mask[row].bool()], expected, rtol=1e-4, atol=1e-5)
    # The padded tokens matter without the mask, so the test tells a mean that includes them.
    kept = mask.bool()
    assert (masked[kept] - unmasked[kept]).abs().max() > 1e-3


def test_vit_sequence_metric_mean_ignores_the_values_of_padded_tokens():
    model = DamchaViTModel(tiny_damcha_vit_config(metric_context="sequence")).eval()
    randomize_cross_head(model)
    layer = model.layers[0].attention
    x = torch.randn(2, 9, 32)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[:, 6:] = False
    changed = x.clone()
    changed[:, 6:] = torch.randn(2, 3, 32) * 10
    additive = torch.zeros(2, 1, 9, 9).masked_fill(~mask[:, None, None, :], torch.finfo(torch.float32).min)
    with torch.no_grad():
        a, _ = layer(x, additive, cross_head_metric=model.cross_head_metric, token_mask=mask)
        b, _ = layer(changed, additive, cross_head_metric=model.cross_head_metric, token_mask=mask)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-6)


def test_vit_config_refuses_heads_that_do_not_divide_the_width_where_stock_vit_accepts_them():
    """A deliberate difference (see DamchaViTConfig's docstring): stock ViT runs such a config with another head count
    than it names; DAMCHA's C is num_attention_heads x num_attention_heads, so it must be exact."""
    from transformers import ViTConfig, ViTModel

    stock = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=37, image_size=8, patch_size=4))
    assert stock.layers[0].attention.head_dim * stock.config.num_attention_heads != 32
    with pytest.raises(Exception, match=r"`num_attention_heads` \(12\) must divide `hidden_size` \(32\).*8 or 16"):
        tiny_damcha_vit_config(hidden_size=32, num_attention_heads=12)
