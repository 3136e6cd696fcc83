"""The contract every DAMCHA architecture meets, run for each family of `damcha_hf.families.FAMILIES`.

A new family plugs in by adding a `FamilyCase` (a tiny stock config and its inputs) to `CASES`; every head its
declaration lists is then checked against the stock transformers class it converts from (outputs equal, eager equals
SDPA, cache equals no cache, save/load through its Auto class, gradient checkpointing, remote code without the plugin).
Per-family files (test_gpt2.py, test_llama.py, test_vit.py) keep what is specific to one architecture.
"""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers
from conftest import TINY_VIT, randomize_metric, tiny_gpt2_config, tiny_llama_config
from test_remote_code import load_in_fresh_process
from transformers.modeling_layers import GradientCheckpointingLayer

import damcha_hf
from damcha_hf.families import FAMILIES, family_for_model_type
from damcha_hf.modeling.damcha_family import DamchaFamily, DamchaHead


@dataclass(frozen=True)
class FamilyCase:
    family: DamchaFamily
    stock_config: Callable[[], transformers.PretrainedConfig]  # a tiny config of the stock architecture
    inputs: Callable[[], dict]  # a batch for any head of the family
    contexts: tuple[str, ...]  # the metric contexts the family offers


def text_inputs() -> dict:
    return {"input_ids": torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))}


def image_inputs() -> dict:
    shape = (2, TINY_VIT["num_channels"], TINY_VIT["image_size"], TINY_VIT["image_size"])
    return {"pixel_values": torch.randn(shape, generator=torch.Generator().manual_seed(0))}


CASES = {
    "gpt2": FamilyCase(damcha_hf.families.GPT2_FAMILY, lambda: tiny_gpt2_config(num_labels=3), text_inputs,
                       ("token", "query")),
    "llama": FamilyCase(damcha_hf.families.LLAMA_FAMILY, lambda: tiny_llama_config(num_labels=3), text_inputs,
                        ("token", "query")),
    "vit": FamilyCase(damcha_hf.families.VIT_FAMILY, lambda: transformers.ViTConfig(**TINY_VIT), image_inputs,
                      ("sequence", "token", "query")),
}  # fmt: skip
HEADS = [(name, head) for name, case in CASES.items() for head in case.family.heads]
CONTEXTS = [(name, context) for name, case in CASES.items() for context in case.contexts]
CAUSAL = [name for name, case in CASES.items() if case.family.causal]


def stock_auto_classes(stock_class) -> list[type]:
    """The model classes transformers' own Auto mappings give for the stock class's `model_type`."""
    from transformers.models.auto import modeling_auto

    model_type = stock_class.config_class.model_type
    found = []
    for name in dir(modeling_auto):
        mapping = getattr(modeling_auto, name)
        if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES") and model_type in mapping:
            found.append(getattr(transformers, mapping[model_type], None))
    return found


def head_id(value):
    return value.model_class.__name__ if isinstance(value, DamchaHead) else value


def first_output(outputs) -> torch.Tensor:
    return outputs.logits if getattr(outputs, "logits", None) is not None else outputs[0]


def trained_model(name: str, head: DamchaHead | None = None, attn: str = "sdpa", **options):
    """A DAMCHA model of the family's task head (or `head`), converted from a random stock model, with a non-zero
    ("trained") metric generator."""
    case = CASES[name]
    head = head or case.family.task_head
    stock = head.stock_class(case.stock_config()).eval()
    model = damcha_hf.convert_to_damcha(stock, **options).eval()
    model.set_attn_implementation(attn)
    randomize_metric(model)
    return model


def test_every_family_has_a_case_and_a_consistent_declaration():
    assert sorted(CASES) == sorted(family.model_type for family in FAMILIES)
    for family in FAMILIES:
        assert family_for_model_type(family.model_type) is family is family_for_model_type(family.damcha_model_type)
        assert family.heads[0].auto_class == "AutoModel" and family.task_head.pipeline_tag
        assert type(transformers.AutoConfig.for_model(family.damcha_model_type)) is family.config_class
        for head in family.heads:
            assert issubclass(head.model_class, head.stock_class)  # DAMCHA classes extend the stock ones
            config = family.config_class(**CASES[family.model_type].stock_config().to_dict())
            if head.auto_class is None:  # as in transformers: no Auto class maps to the stock class either
                assert not any(head.stock_class is cls for cls in stock_auto_classes(head.stock_class))
                continue
            assert type(getattr(transformers, head.auto_class).from_config(config)) is head.model_class


@pytest.mark.parametrize("name, head", HEADS, ids=head_id)
def test_conversion_equals_the_stock_model(name, head):
    case = CASES[name]
    stock = head.stock_class(case.stock_config()).eval()
    for context in case.contexts:
        damcha = damcha_hf.convert_to_damcha(stock, metric_context=context)
        assert type(damcha) is head.model_class and damcha.config.metric_context == context
        with torch.no_grad():
            expected, got = first_output(stock(**case.inputs())), first_output(damcha(**case.inputs()))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_eager_equals_sdpa(name, context):
    model = trained_model(name, attn="eager", metric_context=context)
    inputs = CASES[name].inputs()
    with torch.no_grad():
        eager = first_output(model(**inputs))
        model.set_attn_implementation("sdpa")
        sdpa = first_output(model(**inputs))
    torch.testing.assert_close(sdpa, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("context", ["token", "query"])
def test_generation_with_the_cache_equals_without(name, context):
    model = trained_model(name, metric_context=context)
    prompt = CASES[name].inputs()["input_ids"][:, :5]
    settings = dict(
        max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    cached = model.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=True, **settings)
    uncached = model.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=False, **settings)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits, 1), torch.stack(uncached.logits, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, head", HEADS, ids=head_id)
def test_save_and_load_through_the_auto_class_round_trips_exactly(name, head, tmp_path):
    model = trained_model(name, head, metric_sharing="layer", metric_mask="diagonal")
    model.save_pretrained(tmp_path)
    loader = getattr(transformers, head.auto_class) if head.auto_class else head.model_class
    loaded = loader.from_pretrained(tmp_path).eval()
    assert type(loaded) is head.model_class
    assert (loaded.config.metric_sharing, loaded.config.metric_mask) == ("layer", "diagonal")
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    inputs = CASES[name].inputs()
    with torch.no_grad():
        assert torch.equal(first_output(loaded(**inputs)), first_output(model(**inputs)))


@pytest.mark.parametrize("name", CASES)
def test_gradient_checkpointing_gives_the_same_gradients(name):
    model = trained_model(name, metric_context=CASES[name].contexts[0]).train()
    inputs = CASES[name].inputs()
    labels = inputs["input_ids"] if CASES[name].family.causal else torch.tensor([0, 2])

    def gradients():
        model.zero_grad()
        model(**inputs, labels=labels).loss.backward()
        return {
            key: parameter.grad.clone() for key, parameter in model.named_parameters() if parameter.grad is not None
        }

    plain = gradients()
    model.activation_checkpointing_enable()  # transformers 5's name for gradient_checkpointing_enable
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys()
    metric_gradients = [gradient for key, gradient in plain.items() if "cross_head_metric" in key]
    assert metric_gradients and all(gradient.abs().max() > 0 for gradient in metric_gradients)  # reaches G
    for key, gradient in plain.items():
        torch.testing.assert_close(checkpointed[key], gradient, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", CASES)
def test_checkpoint_loads_with_remote_code_without_the_plugin(name, tmp_path):
    model = trained_model(name)  # a non-identity C, so the copied metric code must really run
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    inputs = CASES[name].inputs()
    with torch.no_grad():
        expected = first_output(model(**inputs))
    heads = [model_head for model_head in CASES[name].family.heads if model_head.model_class is type(model)]
    heads += [other for other in CASES[name].family.heads if other not in heads]
    heads = [head for head in heads if head.auto_class]  # remote code loads through an Auto class
    stock = CASES[name].family.head_of(type(model)).stock_class.from_pretrained(folder).eval()
    with torch.no_grad():  # the stock class reads the same weights: the copied metric code must make the difference
        assert not torch.allclose(first_output(stock(**inputs)), expected, atol=1e-3)
    report = load_in_fresh_process(folder, inputs, [head.auto_class for head in heads], tmp_path / "fresh")
    assert report["damcha_hf_importable"] is False and report["plugin_modules"] == []
    for head in heads:
        module, class_name = report["classes"][head.auto_class]
        assert class_name == head.model_class.__name__ and module.startswith("transformers_modules.")
        assert module.endswith("." + head.model_class.__module__.rsplit(".", 1)[-1])  # the copied model file
    assert torch.equal(report["logits"], expected)
