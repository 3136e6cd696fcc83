"""A DAMCHA class changes only what DAMCHA changes: it inherits its stock class's `__init__` and `forward`.

The oracle is the stock transformers class itself: whatever its `__init__` builds (including what a future release
adds) must be on the DAMCHA model, and a converted model must compute what the stock one does.
"""

import warnings

import pytest
import torch
from conftest import (
    randomize_cross_head,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_damcha_vit_config,
    tiny_llama_config,
)
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaForQuestionAnswering, LlamaForTokenClassification
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama
from transformers.models.vit import modeling_vit

import damcha_hf
from damcha_hf.modeling.damcha_pretrained import stock_class_of
from damcha_hf.modeling.transformers_releases import warn_if_untested_transformers


def _with_upstream_addition(monkeypatch, stock_class, name, make):
    """Simulate a transformers release whose `stock_class.__init__` adds `name` (a submodule or attribute)."""
    original = stock_class.__init__

    def patched(self, *args, **kwargs):
        original(self, *args, **kwargs)
        setattr(self, name, make())

    monkeypatch.setattr(stock_class, "__init__", patched)


@pytest.mark.parametrize(
    "model_class, config_factory, patched",
    [
        (
            damcha_hf.DamchaGPT2LMHeadModel,
            tiny_damcha_gpt2_config,
            [
                (modeling_gpt2.GPT2Attention, "h.0.attn"),
                (modeling_gpt2.GPT2Block, "h.1"),
                (modeling_gpt2.GPT2Model, ""),
            ],
        ),
        (
            damcha_hf.DamchaLlamaForSequenceClassification,
            tiny_damcha_llama_config,
            [(modeling_llama.LlamaAttention, "layers.1.self_attn"), (modeling_llama.LlamaModel, "")],
        ),
        (
            damcha_hf.DamchaViTForImageClassification,
            tiny_damcha_vit_config,
            [(modeling_vit.ViTAttention, "layers.0.attention"), (modeling_vit.ViTModel, "")],
        ),
    ],
    ids=["gpt2", "llama", "vit"],
)
def test_what_a_release_adds_in_a_stock_init_is_on_the_damcha_model(monkeypatch, model_class, config_factory, patched):
    for stock_class, _ in patched:
        _with_upstream_addition(monkeypatch, stock_class, "release_submodule", lambda: nn.Linear(2, 3))
        _with_upstream_addition(monkeypatch, stock_class, "release_flag", lambda: "added upstream")
    model = model_class(config_factory())
    base = model.base_model
    for _, path in patched:
        module = base.get_submodule(path)
        assert module.release_flag == "added upstream", path
        assert isinstance(module.release_submodule, nn.Linear), path
        prefix = f"{model.base_model_prefix}.{path}." if path else f"{model.base_model_prefix}."
        assert f"{prefix}release_submodule.weight" in model.state_dict(), path
    # and the DAMCHA parts are there too: the stack's generator and DAMCHA attention layers
    assert base.cross_head_metric is not None
    assert all(
        type(module).__name__.startswith("Damcha")
        for module in base.modules()
        if isinstance(module, stock_class_of(model.damcha_attention_class))
    )


def test_damcha_layers_are_the_stock_layers_the_stock_init_built():
    """Same submodule names, classes (or a DAMCHA subclass) and weights as the stock model built from the same config:
    only the generator is added. GPT-2's cross-attention stays stock."""
    config = tiny_damcha_gpt2_config(add_cross_attention=True)
    damcha = damcha_hf.DamchaGPT2LMHeadModel(config)
    stock = modeling_gpt2.GPT2LMHeadModel(config)
    stock_modules = dict(stock.named_modules())
    for name, module in damcha.named_modules():
        if "cross_head_metric" in name:
            continue
        assert isinstance(module, type(stock_modules[name])), name
    assert type(damcha.transformer.h[0].crossattention) is modeling_gpt2.GPT2Attention
    assert type(damcha.transformer.h[0].attn) is damcha_hf.modeling.modeling_damcha_gpt2.DamchaGPT2Attention
    extra = set(damcha.state_dict()) - set(stock.state_dict())
    assert extra and all(".cross_head_metric." in f".{key}" for key in extra)


@pytest.mark.parametrize("stock_class, fields", [
    (LlamaForQuestionAnswering, ("start_logits", "end_logits")),
    (LlamaForTokenClassification, ("logits",)),
])  # fmt: skip
def test_llama_question_answering_and_token_classification_convert_exactly(tmp_path, stock_class, fields):
    """Every output field the head returns is compared, and the fields are named here, so that a renamed or added
    field fails rather than leaving nothing to compare."""
    stock = stock_class(tiny_llama_config(num_labels=3)).eval()
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        expected = stock(ids)
    converted = damcha_hf.convert_to_damcha(stock).eval()
    stock.save_pretrained(tmp_path / "stock")
    loaded = getattr(damcha_hf, f"Damcha{stock_class.__name__}").from_pretrained(tmp_path / "stock").eval()
    for model in (converted, loaded):
        assert type(model).__name__ == f"Damcha{stock_class.__name__}"
        with torch.no_grad():
            out = model(ids)
        assert tuple(expected.keys()) == tuple(out.keys()) == fields
        for field in fields:
            torch.testing.assert_close(out[field], expected[field], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_class, config_factory", [
    (damcha_hf.DamchaGPT2LMHeadModel, tiny_damcha_gpt2_config),
    (damcha_hf.DamchaLlamaForCausalLM, tiny_damcha_llama_config),
])  # fmt: skip
def test_a_causal_model_refuses_a_sequence_metric_set_after_it_was_built(model_class, config_factory):
    model = model_class(config_factory()).eval()
    model.config.metric_context = "sequence"
    ids = torch.randint(3, 97, (1, 6))
    with pytest.raises(ValueError, match="metric_context"):
        model(ids)
    with pytest.raises(ValueError, match="metric_context"):
        model.generate(ids, max_new_tokens=2, do_sample=False)


def _checkpoint_without_generator(tmp_path):
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config())
    randomize_cross_head(model)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = {key: value for key, value in load_file(weights).items() if "cross_head_metric" not in key}
    save_file(state, weights, metadata={"format": "pt"})
    return tmp_path


def test_missing_generator_weights_are_refused_by_default(tmp_path):
    with pytest.raises(ValueError, match="lacks metric-generator weights"):
        damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(_checkpoint_without_generator(tmp_path))


def test_missing_generator_weights_are_loading_info_when_it_is_asked_for(tmp_path):
    folder = _checkpoint_without_generator(tmp_path)
    with pytest.warns(UserWarning, match="lacks metric-generator weights"):
        model, info = damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert {key for key in info["missing_keys"] if "cross_head_metric" in key} == {
        key for key in model.state_dict() if "cross_head_metric" in key
    }


def test_untested_transformers_releases_get_one_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in ("5.16.1", "5.20.0", "5.25.3"):  # the oldest tested release, one between, a newer patch
            assert warn_if_untested_transformers(version) is False
    for version in ("5.99.0", "5.26.0", "5.16.0", "5.15.2", "6.0.0.dev0", "5.25.0rc1"):
        with pytest.warns(UserWarning, match=f"this is transformers {version}"):
            assert warn_if_untested_transformers(version) is True


@pytest.mark.parametrize("model_class", [damcha_hf.DamchaGPT2Model, damcha_hf.DamchaGPT2LMHeadModel])
def test_gpt2_residual_projections_get_the_stock_scaled_init(model_class):
    """GPT-2 initialises `c_proj` with std initializer_range / sqrt(2 n_layer), from its stock `_init_weights`."""
    config = tiny_damcha_gpt2_config(n_layer=8, n_embd=256, n_head=4)
    base = model_class(config).base_model
    scaled = config.initializer_range / (2 * config.n_layer) ** 0.5
    for layer in base.h:
        for projection in (layer.attn.c_proj, layer.mlp.c_proj):
            assert projection.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert layer.attn.c_attn.weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)


def test_generating_past_gpt2_positions_names_the_limit():
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(n_positions=16)).eval()
    prompt = torch.randint(3, 97, (1, 10))
    assert model.generate(prompt, max_new_tokens=6, do_sample=False).shape[1] == 16  # up to the limit works
    with pytest.raises(ValueError, match=r"16 positions .*max_new_tokens=6"):
        model.generate(prompt, max_new_tokens=7, do_sample=False)
    with pytest.raises(ValueError, match="shorten the prompt"):
        model.generate(torch.randint(3, 97, (1, 16)), max_new_tokens=1, do_sample=False)


def test_every_damcha_model_class_takes_its_stock_classs_init_arguments():
    """transformers reads a model's `__init__` signature (its model tests build ViTModel with `use_mask_token=True`
    where the signature names it): each DAMCHA class's `__init__` shows its stock class's parameters."""
    import inspect

    from damcha_hf.families import FAMILIES

    for family in FAMILIES:
        for head in family.heads:
            damcha, stock = head.model_class, head.stock_class
            if stock is None:  # no transformers counterpart (the ViT denoiser)
                continue
            assert inspect.signature(damcha.__init__) == inspect.signature(stock.__init__), damcha.__name__
    assert "use_mask_token" in inspect.signature(damcha_hf.DamchaViTModel.__init__).parameters


def test_every_damcha_model_class_runs_its_stock_classs_forward_unwrapped():
    """No variant wraps a model class: each DAMCHA class's `forward` is the very function of its stock class, or, for a
    layer stack, that function handed the stack's module (`forward_with_cross_head_metric`, the same for every variant).
    MoA's loss is reported by forward hooks on a built MoA model instead, so a model of another variant has no hook."""
    from damcha_hf.families import FAMILIES

    for family in FAMILIES:
        for head in family.heads:
            damcha, stock = head.model_class, head.stock_class
            if stock is None:
                continue
            stack = damcha.__dict__.get("damcha_layer_stack", False)
            forward = damcha.forward.__wrapped__ if stack else damcha.forward
            assert forward is stock.forward, damcha.__name__
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    moa = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(cross_head_variant="moa"))
    assert len(moa._forward_hooks) == len(moa.transformer._forward_hooks) == 1  # the head and its base model, once
