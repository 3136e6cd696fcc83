"""What is specific to DAMCHA ViT: the whole classifier against a naive per-head-pair oracle, the per-image metric,
the pooler and old checkpoint key names, PEFT, image sizes and processors, presets and bad input. What every family
must do (conversion, save/load, attention maps, remote code) is in test_families.py."""

import copy
import math

import numpy as np
import pytest
import torch
from attention_oracle import oracle_cross_head
from conftest import randomize_cross_head, tiny_damcha_vit_config, tiny_vit_config
from safetensors.torch import save_file
from transformers import (
    ViTForImageClassification,
    ViTImageProcessor,
    ViTModel,
)

import damcha_hf
from damcha_hf import DamchaViTConfig, DamchaViTForImageClassification, DamchaViTModel
from damcha_hf.cli import main as cli_main

CONTEXTS = ["sequence", "token", "query"]
MASKS = ["full", "diagonal", "offdiagonal"]


def images(batch=3, size=28, channels=1, seed=0):
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(seed))


def vanilla_vit(attn="eager", **overrides):
    model = ViTForImageClassification(tiny_vit_config(**overrides)).eval()
    model.set_attn_implementation(attn)
    return model


def damcha_vit(context="sequence", attn="eager", randomize=True, **overrides):
    model = DamchaViTForImageClassification(tiny_damcha_vit_config(metric_context=context, **overrides)).eval()
    model.set_attn_implementation(attn)
    if randomize:
        randomize_cross_head(model)
    return model


def generator_output_layers(model):
    return [generator.fc_out for generator in model.base_model.cross_head_metric.generators]


# --- the naive oracle -------------------------------------------------------------------------------------------


def oracle_forward(model, pixel_values, interpolate_pos_encoding=False):
    """The whole classifier written out by hand from the model's weights.

    Every head pair's scores `Q_i K_j^T` are materialised and weighted by `C`, which is computed from the generator's
    weights directly (context and mask as the config says); then softmax, times `V`, output projection, MLP.
    Only the patch embedding (unchanged ViT code) is taken from the model.
    Returns `(logits, [attention maps per layer])`.
    """
    config = model.config
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    vit = model.vit

    def linear(x, layer):
        return x @ layer.weight.T + layer.bias

    def layer_norm(x, norm):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, config.layer_norm_eps)

    hidden = vit.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
    batch, seq, _ = hidden.shape
    maps = []
    for index, layer in enumerate(vit.layers):
        x = layer_norm(hidden, layer.layernorm_before)
        attention = layer.attention
        q, k, v = (
            linear(x, projection).reshape(batch, seq, heads, head_dim)
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        pair_scores = torch.einsum("btid,bsjd->bijts", q, k)  # every head pair: Q_i[t] . K_j[s]
        sequence = config.metric_context == "sequence"
        cross_head = oracle_cross_head(vit.cross_head_metric, x.mean(dim=1) if sequence else x, heads, heads,
                                       config.metric_mask, index)  # fmt: skip
        if sequence:
            weights = cross_head[:, :, :, None, None]  # C_ij(mean x)
        elif config.metric_context == "token":
            weights = cross_head.permute(0, 2, 3, 1)[:, :, :, None, :]  # C_ij(x_s)
        else:
            weights = cross_head.permute(0, 2, 3, 1)[:, :, :, :, None]  # C_ij(x_t)
        scores = (weights * pair_scores).sum(dim=2) / math.sqrt(head_dim)  # (b, i, t, s)
        probs = scores.softmax(dim=-1)
        maps.append(probs)
        mixed = torch.einsum("bits,bsid->btid", probs, v).reshape(batch, seq, -1)
        hidden = hidden + linear(mixed, attention.o_proj)
        mlp_in = layer_norm(hidden, layer.layernorm_after)
        hidden = hidden + linear(torch.nn.functional.gelu(linear(mlp_in, layer.mlp.fc1)), layer.mlp.fc2)
    hidden = layer_norm(hidden, vit.layernorm)
    return linear(hidden[:, 0], model.classifier), maps


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_matches_oracle_for_every_context_and_mask(context, mask):
    model = damcha_vit(context, metric_mask=mask).double()
    pixels = images().double()
    outputs = model(pixels, output_attentions=True)
    expected_logits, expected_maps = oracle_forward(model, pixels)
    torch.testing.assert_close(outputs.logits, expected_logits, rtol=1e-5, atol=1e-6)
    assert len(outputs.attentions) == len(expected_maps) == 2
    for got, expected in zip(outputs.attentions, expected_maps):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # The oracle is only a real check if C is far from the identity: MHA must give something else.
    mha_logits = oracle_forward(damcha_vit(context, randomize=False).double().requires_grad_(False), pixels)[0]
    assert not torch.allclose(expected_logits, mha_logits, atol=1e-3)


@pytest.mark.parametrize("context", CONTEXTS)
def test_per_layer_generators_match_oracle(context):
    model = damcha_vit(context, metric_sharing="layer").double()
    assert len(model.vit.cross_head_metric.generators) == 2
    pixels = images().double()
    torch.testing.assert_close(model(pixels).logits, oracle_forward(model, pixels)[0], rtol=1e-5, atol=1e-6)


def test_sequence_context_gives_each_image_its_own_metric():
    model = damcha_vit("sequence").double()
    pixels = images(batch=3).double()
    recorded = []
    handle = model.vit.cross_head_metric.register_forward_hook(lambda module, args, output: recorded.append(output))
    batched = model(pixels).logits
    handle.remove()
    assert len(recorded) == 2  # one C per layer
    for cross_head in recorded:
        assert cross_head.shape == (3, 4, 4)  # one H x H matrix per image
        assert not torch.allclose(cross_head[0], cross_head[1], atol=1e-4)
        assert not torch.allclose(cross_head[1], cross_head[2], atol=1e-4)
    # Each image's C depends on that image only: batching changes nothing.
    singles = torch.cat([model(pixels[i : i + 1]).logits for i in range(3)])
    torch.testing.assert_close(batched, singles, rtol=1e-5, atol=1e-6)


# --- conversion: the pooler and old key names ---------------------------------------------------------------------


@pytest.mark.parametrize("add_pooling_layer", [True, False])
def test_converted_vit_base_model_equals_vanilla(add_pooling_layer):
    vanilla = ViTModel(tiny_vit_config(), add_pooling_layer=add_pooling_layer).eval()
    damcha = damcha_hf.convert_to_damcha(vanilla)
    assert isinstance(damcha, DamchaViTModel)
    assert (damcha.pooler is None) == (not add_pooling_layer)
    pixels = images()
    expected, got = vanilla(pixels), damcha(pixels)
    assert (got.last_hidden_state - expected.last_hidden_state).abs().max() < 1e-5
    if add_pooling_layer:
        assert (got.pooler_output - expected.pooler_output).abs().max() < 1e-5


OLD_VIT_NAMES = [  # transformers 5 name -> the name in checkpoints written before it
    ("vit.layers.", "vit.encoder.layer."),
    (".attention.q_proj.", ".attention.attention.query."),
    (".attention.k_proj.", ".attention.attention.key."),
    (".attention.v_proj.", ".attention.attention.value."),
    (".attention.o_proj.", ".attention.output.dense."),
    (".mlp.fc1.", ".intermediate.dense."),
    (".mlp.fc2.", ".output.dense."),
]


def test_checkpoint_with_old_vit_key_names_loads(tmp_path):
    vanilla = vanilla_vit()
    old_state = {}
    for name, parameter in vanilla.state_dict().items():
        for new, old in OLD_VIT_NAMES:
            name = name.replace(new, old)
        old_state[name] = parameter.contiguous()
    assert "vit.encoder.layer.0.attention.attention.query.weight" in old_state
    vanilla.config.save_pretrained(tmp_path)
    save_file(old_state, tmp_path / "model.safetensors", metadata={"format": "pt"})

    damcha = DamchaViTForImageClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    reloaded_vanilla = ViTForImageClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for name, parameter in vanilla.state_dict().items():
        assert torch.equal(damcha.state_dict()[name], parameter), name
    pixels = images()
    torch.testing.assert_close(damcha(pixels).logits, reloaded_vanilla(pixels).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(damcha(pixels).logits, vanilla(pixels).logits, rtol=0, atol=1e-6)


# --- training ---------------------------------------------------------------------------------------------------


def test_one_optimiser_step_lowers_the_loss_and_trains_the_generator():
    model = DamchaViTForImageClassification(tiny_damcha_vit_config()).train()
    pixels, labels = images(batch=8, seed=1), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss = model(pixels, labels=labels).loss
    loss.backward()
    fc_out = generator_output_layers(model)[0]
    assert fc_out.weight.grad.abs().sum() > 0 and fc_out.bias.grad.abs().sum() > 0  # gradients reach G
    assert torch.equal(fc_out.weight, torch.zeros_like(fc_out.weight))
    optimizer.step()
    assert fc_out.weight.abs().sum() > 0  # G has left zero, so C != I from now on
    with torch.no_grad():
        assert model(pixels, labels=labels).loss < loss.detach()


def test_peft_modules_to_save_wrapper_is_the_metric_used():
    peft = pytest.importorskip("peft")
    model = damcha_vit("sequence", attn="sdpa", randomize=False)
    reference = copy.deepcopy(model)
    randomize_cross_head(reference)
    pixels = images()
    before = model(pixels).logits
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["cross_head_metric", "classifier"]),
    )
    wrapper = lora.base_model.model.vit.cross_head_metric
    assert any(p.requires_grad for p in wrapper.modules_to_save["default"].parameters())
    # Only the trainable copy gets the random metric (LoRA starts as the identity): the outputs must follow it.
    wrapper.modules_to_save["default"].load_state_dict(reference.vit.cross_head_metric.state_dict())
    original_output_layer = wrapper.original_module.generators[0].fc_out
    assert torch.equal(original_output_layer.weight, torch.zeros_like(original_output_layer.weight))
    got = lora(pixel_values=pixels).logits
    torch.testing.assert_close(got, reference(pixels).logits, rtol=0, atol=1e-6)
    assert (got - before).abs().max() > 1e-4


# --- images: processors and sizes --------------------------------------------------------------------------------


def test_interpolate_pos_encoding_on_a_larger_image():
    vanilla = vanilla_vit()
    larger = images(batch=2, size=36)
    damcha = damcha_hf.convert_to_damcha(vanilla)
    expected = vanilla(larger, interpolate_pos_encoding=True).logits
    assert (damcha(larger, interpolate_pos_encoding=True).logits - expected).abs().max() < 1e-5
    randomize_cross_head(damcha)
    damcha = damcha.double()
    larger = larger.double()
    got = damcha(larger, interpolate_pos_encoding=True).logits
    torch.testing.assert_close(
        got, oracle_forward(damcha, larger, interpolate_pos_encoding=True)[0], rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="interpolate_pos_encoding=True"):
        damcha(larger)


def test_vit_image_processor_feeds_the_model():
    processor = ViTImageProcessor(
        do_resize=True, size={"height": 28, "width": 28}, do_normalize=True, image_mean=[0.5], image_std=[0.5]
    )
    rng = np.random.default_rng(0)
    same_size = rng.integers(0, 256, (28, 28, 1), dtype=np.uint8)
    larger = rng.integers(0, 256, (40, 40, 1), dtype=np.uint8)
    pixels = processor(images=[same_size, larger], return_tensors="pt", input_data_format="channels_last").pixel_values
    assert pixels.shape == (2, 1, 28, 28)
    expected_first = (torch.from_numpy(same_size).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(pixels[0], expected_first, rtol=0, atol=1e-5)

    vanilla = vanilla_vit()
    damcha = damcha_hf.convert_to_damcha(vanilla)
    assert (damcha(pixels).logits - vanilla(pixels).logits).abs().max() < 1e-5
    randomize_cross_head(damcha)
    assert damcha(pixel_values=pixels).logits.shape == (2, 3)

    rgb_processor = ViTImageProcessor(size={"height": 28, "width": 28})  # 3-channel defaults
    rgb = rgb_processor(images=[np.repeat(same_size, 3, axis=-1)], return_tensors="pt").pixel_values
    with pytest.raises(ValueError, match=r"`num_channels` is 1"):
        damcha(rgb)


# --- presets and bad input ---------------------------------------------------------------------------------------


def test_vit_small_preset_shape_and_generator_share(capsys):
    config = DamchaViTConfig.vit_small_patch16_224(num_labels=1000)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (384, 12, 6)
    assert (config.intermediate_size, config.image_size, config.patch_size) == (1536, 224, 16)
    assert config.metric_context == "sequence"
    with torch.device("meta"):
        model = DamchaViTForImageClassification(config)
    generator = sum(p.numel() for name, p in model.named_parameters() if "cross_head_metric" in name)
    assert generator == (384 * 64 + 64) + (64 * 6 * 6 + 6 * 6)  # d -> r -> H*H, closed form
    assert cli_main(["info", "vit-small"]) == 0
    printed = capsys.readouterr().out
    assert f"{generator:,}" in printed and "DamchaViTForImageClassification" in printed
    assert f"{sum(p.numel() for p in model.parameters()):,}" in printed


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"image_size": 30}, r"`image_size` \(30\) must be divisible by `patch_size` \(4\)"),
        ({"image_size": [28, 30]}, r"`image_size`.*must be divisible by `patch_size`"),
        ({"metric_context": "global"}, "metric_context"),
        ({"metric_mask": "upper"}, "metric_mask"),
        ({"num_attention_heads": 5}, "num_attention_heads"),
    ],
)
def test_bad_config_raises_clear_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_damcha_vit_config(**overrides)


def test_bad_inputs_raise_clear_errors(tmp_path):
    model = damcha_vit("sequence")
    with pytest.raises(ValueError, match=r"3 channels but the config's `num_channels` is 1"):
        model(images(channels=3))
    with pytest.raises(ValueError, match=r"`image_size` is 28x28.*interpolate_pos_encoding"):
        model(images(size=32))
    with pytest.raises(ValueError, match="multiple of `patch_size`"):
        model(images(size=30), interpolate_pos_encoding=True)
    with pytest.raises(ValueError, match=r"\(batch, num_channels, height, width\)"):
        model(torch.randn(1, 28, 28))
    # A checkpoint of another architecture is refused at config load.
    damcha_hf.DamchaGPT2Config(n_embd=32, n_layer=1, n_head=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='damcha_gpt2'"):
        DamchaViTConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("context", ["sequence", "token"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_training_step_equals_the_unfused_key_path(attn, context):
    """`"sequence"` and `"token"` ViT layers hand their key projection to the core, which projects and mixes the key in one step
    (keeping one key-sized tensor per layer less for backward); with the projections swapped for a class the core
    does not read as plain weights (as a PEFT adapter is), the same model takes the unfused path: equal logits and
    equal gradients for every parameter."""

    class NotPlainLinear(torch.nn.Linear):
        pass

    model = damcha_vit(context, attn=attn).train()
    pixels, labels = images(), torch.tensor([0, 1, 2])
    unfused = copy.deepcopy(model)
    for layer in unfused.vit.layers:
        plain = layer.attention.k_proj
        layer.attention.k_proj = NotPlainLinear(plain.in_features, plain.out_features)
        layer.attention.k_proj.load_state_dict(plain.state_dict())
    results, saved_bytes = [], []
    for candidate in (model, unfused):
        weights = {p.untyped_storage().data_ptr() for p in candidate.parameters()}
        storages = {}

        def keep(tensor, weights=weights, storages=storages):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        torch.manual_seed(0)  # the same dropout masks
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            output = candidate(pixel_values=pixels, labels=labels)
        output.loss.backward()
        results.append((output.logits.detach(), {n: p.grad for n, p in candidate.named_parameters()}))
        saved_bytes.append(sum(storages.values()))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    config = model.config
    tokens = (config.image_size // config.patch_size) ** 2 + 1
    key_bytes = pixels.shape[0] * tokens * config.hidden_size * 4
    assert saved_bytes[1] - saved_bytes[0] >= config.num_hidden_layers * key_bytes
