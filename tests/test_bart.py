"""DAMCHA BART: what is specific to the encoder-decoder (the contract every family meets is `test_families.py`).

Each of the three attentions (encoder self-attention, decoder self-attention, cross-attention) against a naive
per-head-pair reference; generation (greedy, beam, sampled) with the cache against without it and against one
teacher-forced forward pass, for every context and variant with trained cross-head weights; the source's mixed keys
computed once per source; right-padded sources; the config's checks.
"""

import pytest
import torch
import transformers
from attention_oracle import oracle_cross_head
from conftest import randomize_cross_head, tiny_bart_config

import damcha_hf
from damcha_hf.modeling.modeling_damcha_bart import DamchaBartAttention, is_cross_attention_layer

# The decoder's context (with the encoder's and the cross-attention's generator where they differ), both forms of the
# metric, and the score-mixing baselines.
VARIANTS = {
    "token": {"metric_context": "token"},
    "query": {"metric_context": "query"},
    "encoder sequence": {"metric_context": "token", "encoder_metric_context": "sequence"},
    "own cross generator, per layer": {"metric_context": "query", "encoder_metric_context": "token",
                                       "cross_attention_metric": "own", "metric_sharing": "layer"},
    "plain cross-attention": {"metric_context": "token", "cross_attention_metric": "none"},
    "scores token": {"metric_form": "scores", "metric_context": "token"},
    "scores query": {"metric_form": "scores", "metric_context": "query", "encoder_metric_context": "sequence"},
    "talking_heads": {"cross_head_variant": "talking_heads"},
    "dcmha": {"cross_head_variant": "dcmha"},
}  # fmt: skip
DAMCHA_VARIANTS = [name for name, options in VARIANTS.items() if "cross_head_variant" not in options]


def source_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two sources ending in </s> (2); the second right-padded (1) after 6 tokens."""
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = 2
    ids[1, 5] = 2
    ids[1, 6:] = 1
    mask = (ids != 1).long()
    return ids, mask


def trained_bart(attn: str = "eager", **options):
    # Weights 10 times BART's default scale: peaked attention maps, so that mixing them shows in the outputs.
    stock = transformers.BartForConditionalGeneration(tiny_bart_config(init_std=0.2)).eval()
    model = damcha_hf.convert_to_damcha(stock, **options).eval()
    if model.config.cross_head_variant in ("none", "damcha") and model.config.metric_form == "keys":
        model.set_attn_implementation(attn)
    randomize_cross_head(model, scale=0.3)
    return model


# --- each attention against a naive reference ---------------------------------------------------------------------


def naive_attention(layer, x, source, additive_mask, metric, source_mask):
    """One BART attention layer, head pair by head pair: `S_i = sum_j c_ij * (Q_i K_j^T)` ("keys") or
    `sum_j c_ij * (Q_j K_j^T)` ("scores"), `c_ij` of the key token, the query token or the source's real tokens."""
    config = layer.config
    source = x if source is None else source
    batch, queries, _ = x.shape
    keys, heads, width = source.shape[1], layer.num_heads, layer.head_dim
    q, k, v = (projection(states).view(batch, -1, heads, width).transpose(1, 2)
               for projection, states in ((layer.q_proj, x), (layer.k_proj, source), (layer.v_proj, source)))  # fmt: skip
    cross = is_cross_attention_layer(layer)
    context = config.metric_context if layer.is_decoder else (config.encoder_metric_context or config.metric_context)
    per_layer = config.metric_sharing == "layer"
    index = layer.layer_idx if per_layer else 0
    if cross and config.cross_attention_metric == "own":  # after the self-attention layers' generators
        index += config.decoder_layers if per_layer else 1
    if context == "token":
        c = oracle_cross_head(metric, source, heads, heads, config.metric_mask, index)[
            :, None
        ]  # (b, 1, s, H, H): per key
    elif context == "query":
        c = oracle_cross_head(metric, x, heads, heads, config.metric_mask, index)[
            :, :, None
        ]  # (b, t, 1, H, H): per query
    else:
        weights = source_mask.to(source.dtype)[..., None]
        mean = (source * weights).sum(1) / weights.sum(1)
        c = oracle_cross_head(metric, mean, heads, heads, config.metric_mask, index)[:, None, None]  # per source
    scores = torch.zeros(batch, heads, queries, keys, dtype=q.dtype)
    for i in range(heads):
        for j in range(heads):
            pair = q[:, j] @ k[:, j].transpose(-1, -2) if config.metric_form == "scores" else q[:, i] @ k[:, j].mT
            scores[:, i] += c[..., i, j] * pair
    scores = scores * width**-0.5
    if additive_mask is not None:
        scores = scores + additive_mask
    output = scores.softmax(-1) @ v
    return layer.out_proj(output.transpose(1, 2).reshape(batch, queries, -1))


@pytest.mark.parametrize("variant", DAMCHA_VARIANTS)
def test_every_attention_equals_the_naive_per_head_pair_reference(variant):
    model = trained_bart(**VARIANTS[variant]).double()  # float64: rounding far below the tolerance on any CPU
    ids, mask = source_batch()
    encoder, decoder = model.model.encoder, model.model.decoder
    checked = []

    def check(layer, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        source = kwargs.get("key_value_states")
        metric = (decoder if layer.is_decoder else encoder).cross_head_metric
        expected = naive_attention(layer, x, source, kwargs.get("attention_mask"), metric, mask)
        torch.testing.assert_close(output[0], expected, rtol=1e-4, atol=1e-5)
        checked.append("cross" if source is not None else "decoder" if layer.is_decoder else "encoder")

    layers = [module for module in model.modules() if isinstance(module, DamchaBartAttention)]
    handles = [layer.register_forward_hook(check, with_kwargs=True) for layer in layers]
    decoder_ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, use_cache=False)
    for handle in handles:
        handle.remove()
    plain_cross = VARIANTS[variant].get("cross_attention_metric") == "none"
    assert sorted(set(checked)) == (["decoder", "encoder"] if plain_cross else ["cross", "decoder", "encoder"])
    assert len(checked) == (4 if plain_cross else 6)


def test_plain_cross_attention_stays_stock_and_own_adds_one_generator_per_stack():
    plain = trained_bart(cross_attention_metric="none")
    assert all(type(layer.encoder_attn) is transformers.models.bart.modeling_bart.BartAttention
               for layer in plain.model.decoder.layers)  # fmt: skip
    for sharing, generators in (("stack", 2), ("layer", 4)):
        own = trained_bart(cross_attention_metric="own", metric_sharing=sharing)
        assert len(own.model.decoder.cross_head_metric.generators) == generators
        assert len(own.model.encoder.cross_head_metric.generators) == generators // 2


# --- generation -------------------------------------------------------------------------------------------------------


def generate(model, ids, mask, **settings):
    return model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, output_logits=True,
                          return_dict_in_generate=True, **settings)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_beam_and_sampled_generation_equal_with_and_without_the_cache(variant):
    # float64: in float32 the cached and uncached logits differed by up to 0.9 of the tolerance on one x86-64 CPU.
    model = trained_bart(**VARIANTS[variant]).double()
    ids, mask = source_batch()
    with torch.no_grad():
        for settings in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}, {"do_sample": True, "top_k": 0}):
            runs = []
            for use_cache in (True, False):
                torch.manual_seed(7)
                runs.append(generate(model, ids, mask, use_cache=use_cache, **settings))
            cached, uncached = runs
            assert torch.equal(cached.sequences, uncached.sequences), settings
            torch.testing.assert_close(torch.stack(cached.logits, 1), torch.stack(uncached.logits, 1),
                                       rtol=1e-4, atol=1e-4)  # fmt: skip
        # Greedy decoding with a static cache (both parts preallocated), and against one teacher-forced forward pass.
        greedy = generate(model, ids, mask, do_sample=False)
        static = generate(model, ids, mask, do_sample=False, cache_implementation="static")
        assert torch.equal(static.sequences, greedy.sequences)
        torch.testing.assert_close(torch.stack(static.logits, 1), torch.stack(greedy.logits, 1), rtol=1e-4, atol=1e-4)
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=greedy.sequences[:, :-1]).logits
        # generate() hands the logits back in float32
        torch.testing.assert_close(torch.stack(greedy.logits, 1), full.float(), rtol=1e-4, atol=1e-4)
        # The cross-head weights move the logits well past the tolerance: a path that dropped them would show.
        stock = transformers.BartForConditionalGeneration(model.config).eval().double()
        stock.load_state_dict(model.state_dict(), strict=False)
        stock_logits = stock(input_ids=ids, attention_mask=mask, decoder_input_ids=greedy.sequences[:, :-1]).logits
        assert (stock_logits - full).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["token", "own cross generator, per layer"])
def test_the_source_keys_are_mixed_once_per_source_and_kept_in_the_cache(variant):
    model = trained_bart(**VARIANTS[variant])
    ids, mask = source_batch()
    source_calls = []
    metric = model.model.decoder.cross_head_metric
    hook = metric.register_forward_hook(lambda module, args, output: source_calls.append(args[0].shape[1]))
    with torch.no_grad():
        out = generate(model, ids, mask, do_sample=False, use_cache=True)
    hook.remove()
    layers = model.config.decoder_layers
    if VARIANTS[variant]["metric_context"] == "token":
        # The decoder's generator reads the 9 source tokens once per cross-attention layer, at the first step only.
        assert source_calls.count(ids.shape[1]) == layers
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    cross = cache.cross_attention_cache
    encoder_output = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    for index, layer in enumerate(model.model.decoder.layers):
        attention = layer.encoder_attn
        plain_keys = attention.k_proj(encoder_output).view(2, 9, 4, 8).transpose(1, 2)
        stored = cross.layers[index].keys
        assert stored.shape == plain_keys.shape
        if VARIANTS[variant]["metric_context"] == "token":  # the cache holds the mixed keys K~
            assert (stored - plain_keys).abs().max() > 1e-3
        else:  # "query" mixes the queries: the cache holds the plain keys
            torch.testing.assert_close(stored, plain_keys)


@pytest.mark.parametrize("variant", ["token", "encoder sequence", "scores query", "dcmha"])
def test_a_right_padded_source_generates_what_it_generates_alone(variant):
    model = trained_bart(**VARIANTS[variant]).double()  # float64: rounding far below the tolerance on any CPU
    ids, mask = source_batch()
    with torch.no_grad():
        batched = generate(model, ids, mask, do_sample=False)
        alone = generate(model, ids[1:, :6], mask[1:, :6], do_sample=False)
    assert torch.equal(batched.sequences[1], alone.sequences[0])
    torch.testing.assert_close(torch.stack(batched.logits, 1)[1], torch.stack(alone.logits, 1)[0],
                               rtol=1e-4, atol=1e-4)  # fmt: skip


# --- the config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"metric_context": "sequence"}, "metric_context='sequence'"),
        ({"encoder_metric_context": "sentence"}, "unknown `encoder_metric_context`"),
        ({"cross_attention_metric": "shared"}, "unknown `cross_attention_metric`"),
        ({"decoder_attention_heads": 2}, "`encoder_attention_heads` \\(4\\) and `decoder_attention_heads` \\(2\\)"),
    ],
)
def test_the_config_names_the_field_and_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        damcha_hf.DamchaBartConfig(**{**tiny_bart_config().to_dict(), **options})


def test_the_encoder_takes_sequence_while_the_decoder_is_causal():
    config = damcha_hf.DamchaBartConfig(**tiny_bart_config().to_dict(), encoder_metric_context="sequence")
    assert (config.encoder_context, config.metric_context) == ("sequence", "token")
    assert damcha_hf.DamchaBartConfig(**tiny_bart_config().to_dict()).encoder_context == "token"


# --- inspect ----------------------------------------------------------------------------------------------------------


def test_the_metric_map_names_each_stack_and_gives_the_cross_attention_its_own_matrices():
    from damcha_hf.metric_map import compute_metric_map

    model = trained_bart(metric_context="token", cross_attention_metric="own")
    ids = source_batch()[0][:1]
    metric_map = compute_metric_map(model, {"input_ids": ids})
    assert metric_map.layer_names == ["encoder 0", "encoder 1", "decoder 0", "decoder 1",
                                      "cross-attention 0", "cross-attention 1"]  # fmt: skip
    with torch.no_grad():  # "token" cross-attention: C of each source token, from the cross-attention's generator (1)
        source = model.get_encoder()(input_ids=ids).last_hidden_state[0]
        expected = oracle_cross_head(model.model.decoder.cross_head_metric, source, 4, 4, layer=1).mean(0)
    for name in ("cross-attention 0", "cross-attention 1"):
        torch.testing.assert_close(metric_map.matrices[metric_map.layer_names.index(name)], expected)
    assert metric_map.tokens_seen == [ids.shape[1]] * 6


def test_info_shows_the_encoder_decoder_settings_and_the_bart_base_count(capsys):
    from damcha_hf.cli import main as cli_main

    assert cli_main(["info", "bart-base"]) == 0
    printed = capsys.readouterr().out
    # bart-base has 139,420,416 weights; one generator per stack adds 2 x (768 x 64 + 64 + 64 x 144 + 144) = 117,152.
    assert "parameters:         139,537,568" in printed and "cross-head params:  117,152 (" in printed
    assert "encoder_context:    token" in printed and "cross_attention:    decoder" in printed
