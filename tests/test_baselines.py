"""The paper's baselines under the same roof: talking-heads, DCMHA and plain MHA (`cross_head_variant`) in DAMCHA GPT-2
and DAMCHA ViT.

Oracles: vanilla `GPT2LMHeadModel` (every variant starts as MHA), and a naive per-head-pair attention written out
below from the papers' formulas, with explicit loops over batch, query, key and head pairs.
"""

import pytest
import torch
from attention_oracle import oracle_score_mixing_layer
from conftest import (
    CACHE_ARGUMENT,
    load_in_fresh_process,
    randomize_cross_head,
    tiny_damcha_gpt2_config,
    tiny_damcha_vit_config,
    tiny_gpt2_config,
    tiny_token_ids,
)
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    GPT2LMHeadModel,
)

from damcha_hf import DamchaGPT2LMHeadModel, DamchaViTForImageClassification

VARIANTS = ["damcha", "talking_heads", "dcmha", "none"]
SCORE_MIXING = ["talking_heads", "dcmha"]


def variant_lm(variant, randomize=True, **overrides) -> DamchaGPT2LMHeadModel:
    model = DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(cross_head_variant=variant, **overrides)).eval()
    if randomize:
        randomize_cross_head(model, scale=0.3)
    return model


def causal_mask(seq):
    return torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]


# --- the attention layer against the oracle ------------------------------------------------------------------


@pytest.mark.parametrize("variant", SCORE_MIXING)
def test_attention_layer_matches_head_pair_oracle(variant):
    model = variant_lm(variant, dcmha_rank=2)
    attention = model.transformer.h[1].attn
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        out, _ = attention(x, attention_mask=causal_mask(6))
        expected = oracle_score_mixing_layer(attention, x, variant)
    assert (
        expected - oracle_score_mixing_layer(variant_lm(variant, randomize=False).transformer.h[1].attn, x, variant)
    ).abs().max() > 1e-2
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_dcmha_rank_changes_the_projections():
    model = variant_lm("dcmha", dcmha_rank=3)
    mixing = model.transformer.h[0].attn.cross_head_mixing
    assert mixing.read_projection.shape[-2:] == (3, 4)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        out, _ = model.transformer.h[0].attn(x, attention_mask=causal_mask(5))
        expected = oracle_score_mixing_layer(model.transformer.h[0].attn, x, "dcmha")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# --- every variant starts as MHA ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_fresh_model_starts_as_mha_and_has_only_its_own_parameters(variant):
    model = variant_lm(variant, randomize=False)
    names = [name for name, _ in model.named_parameters() if "cross_head_" in name]
    vanilla = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    vanilla.load_state_dict(model.state_dict(), strict=False)
    ids = tiny_token_ids(seq=12, lowest=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, vanilla(ids).logits, rtol=0, atol=1e-5)
    expected_prefix = {
        "damcha": ".cross_head_metric.",
        "talking_heads": ".cross_head_mixing.",
        "dcmha": ".cross_head_mixing.",
        "none": None,
    }[variant]
    if expected_prefix is None:
        assert names == []
    else:
        assert names and all(expected_prefix in f".{name}" for name in names)


def test_dcmha_start_is_trainable():
    """The zero-initialised write and gate projections get gradient at the MHA start (the factors are not all zero)."""
    model = variant_lm("dcmha", randomize=False).train()
    ids = tiny_token_ids(seq=12, lowest=1)
    model(ids, labels=ids).loss.backward()
    mixing = model.transformer.h[0].attn.cross_head_mixing
    assert mixing.write_projection.grad.abs().max() > 0
    assert mixing.gate_projection.grad.abs().max() > 0
    assert mixing.base_projection.grad.abs().max() > 0


# --- causality and the KV cache -------------------------------------------------------------------------------


def test_dcmha_cache_stores_key_weights_per_position():
    """Prefill then token-by-token decoding equals one full forward, and the cache keeps DCMHA's key-side weights
    (2 (2R + 1) numbers per head and position) next to the keys."""
    model = variant_lm("dcmha")
    ids = tiny_token_ids(seq=10, lowest=1)
    with torch.no_grad():
        full = model(ids).logits
        prefill = model(ids[:, :6], use_cache=True)
        cache, steps = getattr(prefill, CACHE_ARGUMENT), [prefill.logits]
        for position in range(6, 10):
            step = model(ids[:, position : position + 1], use_cache=True, **{CACHE_ARGUMENT: cache})
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    keys = cache.layers[0].keys
    assert keys.shape == (2, 4, 10, 8 + 2 * (2 * 2 + 1))


# --- save, load, Auto, the backend error, bad configs ---------------------------------------------------------


@pytest.mark.parametrize("variant", SCORE_MIXING)
def test_non_eager_backend_is_refused_with_the_fix(variant, tmp_path):
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        DamchaGPT2LMHeadModel._from_config(
            tiny_damcha_gpt2_config(cross_head_variant=variant), attn_implementation="sdpa"
        )
    model = DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(cross_head_variant=variant))
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=f"cross_head_variant='{variant}'.*attn_implementation='sdpa'"):
        model.set_attn_implementation("sdpa")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attn_implementation"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    # A config switched behind the model's back fails at the forward, not silently.
    model.config._attn_implementation_internal = "sdpa"
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        model(tiny_token_ids(seq=12, lowest=1))


@pytest.mark.parametrize("variant", ["damcha", "none"])
def test_other_variants_keep_sdpa(variant):
    model = DamchaGPT2LMHeadModel._from_config(
        tiny_damcha_gpt2_config(cross_head_variant=variant), attn_implementation="sdpa"
    ).eval()
    assert model.config._attn_implementation == "sdpa"
    randomize_cross_head(model, scale=0.3)
    eager = DamchaGPT2LMHeadModel._from_config(model.config, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    ids = tiny_token_ids(seq=12, lowest=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"cross_head_variant": "talking-heads"}, "cross_head_variant"),
        ({"cross_head_variant": "mha"}, "cross_head_variant"),
        ({"dcmha_rank": 0}, "dcmha_rank"),
    ],
)
def test_bad_variant_options_name_the_field(overrides, field):
    with pytest.raises(Exception, match=field):
        tiny_damcha_gpt2_config(**overrides)


def test_dcmha_checkpoint_loads_as_remote_code_without_the_plugin(tmp_path):
    """The variant's modules are copied next to the weights (its declaration imports them), and the checkpoint runs
    there."""

    model = variant_lm("dcmha")
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    shipped = {path.name for path in folder.glob("*.py")}
    assert {"variant_dcmha.py", "dcmha.py", "score_mixing.py"} <= shipped and "metric.py" not in shipped
    inputs = {"input_ids": tiny_token_ids(seq=9, lowest=1)}
    with torch.no_grad():
        expected = model(**inputs).logits
    report = load_in_fresh_process(folder, inputs, ["AutoModelForCausalLM"], tmp_path / "fresh")
    assert report["damcha_hf_importable"] is False
    assert report["classes"]["AutoModelForCausalLM"][1] == "DamchaGPT2LMHeadModel"
    torch.testing.assert_close(report["logits"], expected, rtol=0, atol=1e-6)


# --- ViT: the same variants on DamchaViT ------------------------------------------------------------------------


def images(batch=2, seed=0):
    return torch.randn(batch, 1, 16, 16, generator=torch.Generator().manual_seed(seed))


def variant_vit(variant, randomize=True, **overrides) -> DamchaViTForImageClassification:
    config = tiny_damcha_vit_config(image_size=16, cross_head_variant=variant, **overrides)
    model = DamchaViTForImageClassification(config).eval()
    if randomize:
        randomize_cross_head(model, scale=0.3)
    return model


@pytest.mark.parametrize("variant", SCORE_MIXING)
def test_vit_attention_layer_matches_head_pair_oracle(variant):
    model = variant_vit(variant)
    attention = model.vit.layers[1].attention
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        out, _ = attention(x)
        expected = oracle_score_mixing_layer(attention, x, variant, causal=False)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", SCORE_MIXING)
def test_vit_checkpoint_refuses_a_backend_that_cannot_run_it(variant, tmp_path):
    model = variant_vit(variant)
    assert model.config._attn_implementation == "eager"
    model.save_pretrained(tmp_path)
    assert type(AutoModelForImageClassification.from_pretrained(tmp_path)) is DamchaViTForImageClassification
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        AutoModelForImageClassification.from_pretrained(tmp_path, attn_implementation="sdpa")
