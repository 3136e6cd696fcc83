"""The DAMCHA ViT denoiser against oracles: a stock transformers ViT encoder with the time token placed by hand and the
patches un-patchified pixel by pixel, the closed form of the sinusoidal features, and plain multi-head attention for
every cross-head variant at its start."""

import json
import math

import pytest
import torch
import transformers
from conftest import (
    denoiser,
    expected_auto_map,
    load_in_fresh_process,
    randomize_cross_head,
    tiny_denoiser_config,
)

import damcha_hf
from damcha_hf.modeling.modeling_damcha_vit_denoiser import sinusoidal_timestep_features

VARIANTS = [
    {"metric_context": "sequence"},
    {"metric_context": "token"},
    {"cross_head_variant": "talking_heads"},
    {"cross_head_variant": "dcmha"},
]


def batch(config, size: int = 3, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    height, width = (config.image_size,) * 2 if isinstance(config.image_size, int) else config.image_size
    pixel_values = torch.randn(size, config.num_channels, height, width, generator=generator)
    return pixel_values, torch.randint(0, 1000, (size,), generator=generator)


def reference_noise(model, pixel_values, timestep) -> torch.Tensor:
    """The denoiser computed from a stock `transformers.ViTModel` holding the same encoder weights: one image at a
    time, with the time token folded into the stock CLS token, and each patch's outputs placed pixel by pixel."""
    config = model.config
    stock_config = transformers.ViTConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    stock = transformers.ViTModel(stock_config, add_pooling_layer=False).eval().to(pixel_values.dtype)
    stock.set_attn_implementation("eager")
    stock.load_state_dict({k.removeprefix("vit."): v for k, v in model.state_dict().items() if k.startswith("vit.")})
    patch_h, patch_w = (config.patch_size,) * 2 if isinstance(config.patch_size, int) else config.patch_size
    channels = config.num_channels
    expected = torch.zeros_like(pixel_values)
    cls_token = stock.embeddings.cls_token.detach().clone()
    for index in range(len(pixel_values)):
        with torch.no_grad():
            stock.embeddings.cls_token.copy_(cls_token + model.time_embedding(timestep[index : index + 1]))
            tokens = stock(pixel_values[index : index + 1]).last_hidden_state[0, 1:]
            patches = model.noise_head(tokens)
        columns = pixel_values.shape[-1] // patch_w
        for patch, values in enumerate(patches):
            row, column = divmod(patch, columns)
            for position, value in enumerate(values):
                # Each patch's vector is (patch row, patch column, channel), as ViT's patch embedding reads a patch.
                pixel_row, rest = divmod(position, patch_w * channels)
                pixel_column, channel = divmod(rest, channels)
                expected[index, channel, row * patch_h + pixel_row, column * patch_w + pixel_column] = value
    return expected


@pytest.mark.parametrize("shape", [{}, {"image_size": (8, 12), "patch_size": (2, 4), "num_channels": 3}])
def test_mha_denoiser_equals_a_stock_vit_with_the_time_token_and_patches_placed_by_hand(shape):
    model = denoiser(cross_head_variant="none", **shape).double()  # float64: rounding far below the tolerance
    pixel_values, timestep = batch(model.config)
    pixel_values = pixel_values.double()
    with torch.no_grad():
        got = model(pixel_values, timestep).sample
    assert got.shape == pixel_values.shape
    torch.testing.assert_close(got, reference_noise(model, pixel_values, timestep), rtol=0, atol=1e-5)


# Talking-heads and DCMHA mix the score maps, which only eager attention materialises.
VARIANT_BACKENDS = [(options, "eager") for options in VARIANTS] + [(options, "sdpa") for options in VARIANTS[:2]]


@pytest.mark.parametrize("options, attn", VARIANT_BACKENDS, ids=lambda value: next(iter(value.values()), "")
                         if isinstance(value, dict) else value)  # fmt: skip
def test_every_cross_head_variant_starts_as_the_mha_denoiser_with_the_same_weights(options, attn):
    model = denoiser(attn=attn, **options)
    mha = damcha_hf.DamchaViTDenoiserModel(tiny_denoiser_config(cross_head_variant="none")).eval()
    mha.set_attn_implementation(attn)
    missing, unexpected = mha.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".cross_head_" in key for key in unexpected) and unexpected
    pixel_values, timestep = batch(model.config)
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values, timestep).sample, mha(pixel_values, timestep).sample,
                                   rtol=0, atol=1e-6)  # fmt: skip
        randomize_cross_head(model, scale=0.3)  # a trained cross-head module: no longer MHA
        assert (model(pixel_values, timestep).sample - mha(pixel_values, timestep).sample).abs().max() > 1e-3


def test_the_config_selects_the_attention_of_every_layer():
    for options, mixing in [({}, None), ({"cross_head_variant": "talking_heads"}, "TalkingHeads"),
                            ({"cross_head_variant": "dcmha"}, "DynamicHeadComposition"), ({"cross_head_variant": "none"}, None)]:  # fmt: skip
        model = damcha_hf.DamchaViTDenoiserModel(tiny_denoiser_config(**options))
        assert type(model.vit) is damcha_hf.DamchaViTModel
        layers = [module for module in model.modules() if hasattr(module, "cross_head_mixing")]
        assert len(layers) == model.config.num_hidden_layers
        names = {type(layer.cross_head_mixing).__name__ if layer.cross_head_mixing is not None else None
                 for layer in layers}  # fmt: skip
        assert len(names) == 1 and (mixing is None or mixing in names.pop())
        assert (model.vit.cross_head_metric is not None) == (model.config.cross_head_variant == "damcha")


def test_a_fresh_denoiser_predicts_zero_noise_and_the_generator_learns():
    model = damcha_hf.DamchaViTDenoiserModel(tiny_denoiser_config()).train()
    pixel_values, timestep = batch(model.config)
    noise = torch.randn_like(pixel_values)
    output = model(pixel_values, timestep, labels=noise)
    assert torch.equal(output.sample, torch.zeros_like(pixel_values))
    torch.testing.assert_close(output.loss, (noise**2).mean())
    output.loss.backward()
    assert model.noise_head.weight.grad.abs().sum() > 0
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # the head moves off zero; now the generator gets gradient
    model.zero_grad()
    model(pixel_values, timestep, labels=noise).loss.backward()
    generator_grads = [
        p.grad for name, p in model.named_parameters() if "cross_head_metric" in name and "fc_out" in name
    ]
    assert generator_grads and all(grad is not None and grad.abs().sum() > 0 for grad in generator_grads)


def test_the_timestep_changes_the_prediction_and_one_number_means_the_whole_batch():
    model = denoiser()
    pixel_values, _ = batch(model.config)
    with torch.no_grad():
        early, late = (model(pixel_values, step).sample for step in (10, 900))
        per_image = model(pixel_values, torch.full((len(pixel_values),), 10)).sample
    assert (early - late).abs().max() > 1e-3
    torch.testing.assert_close(early, per_image, rtol=0, atol=0)
    with pytest.raises(ValueError, match="`timestep` must be one number or a \\(batch_size,\\) tensor"):
        model(pixel_values, torch.tensor([1, 2]))


def test_sinusoidal_features_follow_their_closed_form():
    steps = torch.tensor([0.0, 1.0, 37.0, 999.0])
    features = sinusoidal_timestep_features(steps, 8, 10000.0)
    for row, step in enumerate(steps.tolist()):
        for k in range(4):
            frequency = 10000.0 ** (-k / 4)
            assert features[row, k].item() == pytest.approx(math.cos(step * frequency), abs=1e-5)
            assert features[row, 4 + k].item() == pytest.approx(math.sin(step * frequency), abs=1e-5)


@pytest.mark.parametrize(
    "field, value, message",
    [("time_embedding_size", 15, "`time_embedding_size` must be an even integer"),
     ("time_max_period", 1.0, "`time_max_period` must be a number above 1"),
     ("metric_context", "sideways", "unknown `metric_context`"),
     ("num_attention_heads", 5, "`num_attention_heads` \\(5\\) must divide `hidden_size`")],
)  # fmt: skip
def test_bad_config_fields_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_denoiser_config(**{field: value})


def test_save_load_round_trip_through_the_auto_class(tmp_path):
    model = denoiser(metric_context="token")
    randomize_cross_head(model, scale=0.3)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is damcha_hf.DamchaViTDenoiserModel
    ignored = ("_name_or_path", "transformers_version")
    saved, original = (
        {key: value for key, value in config.to_dict().items() if key not in ignored}
        for config in (loaded.config, model.config)
    )
    assert saved == original and saved["time_embedding_size"] == 16 and saved["metric_context"] == "token"
    pixel_values, timestep = batch(model.config)
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values, timestep).sample, model(pixel_values, timestep).sample)
    assert type(transformers.AutoConfig.from_pretrained(tmp_path)) is damcha_hf.DamchaViTDenoiserConfig


def test_checkpoint_loads_with_trust_remote_code_without_the_plugin(tmp_path):
    model = denoiser(metric_context="sequence", attn="sdpa")
    randomize_cross_head(model, scale=0.3)
    model.save_pretrained(tmp_path / "denoiser")
    auto_map = json.loads((tmp_path / "denoiser" / "config.json").read_text())["auto_map"]
    assert (
        auto_map
        == expected_auto_map(damcha_hf.DamchaViTDenoiserConfig)
        == {
            "AutoConfig": "configuration_damcha_vit_denoiser.DamchaViTDenoiserConfig",
            "AutoModel": "modeling_damcha_vit_denoiser.DamchaViTDenoiserModel",
        }
    )
    pixel_values, timestep = batch(model.config)
    with torch.no_grad():
        expected = model(pixel_values, timestep).sample
    inputs = {"pixel_values": pixel_values, "timestep": timestep}
    report = load_in_fresh_process(tmp_path / "denoiser", inputs, ["AutoModel"], tmp_path / "fresh")
    assert report["damcha_hf_importable"] is False and report["plugin_modules"] == []
    module, name = report["classes"]["AutoModel"]
    assert module.startswith("transformers_modules.") and name == "DamchaViTDenoiserModel"
    assert torch.equal(report["logits"], expected)
