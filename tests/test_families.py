"""The contract every DAMCHA architecture meets, run for each family of `damcha_hf.families.FAMILIES`.

A new family plugs in by adding a `FamilyCase` (a tiny stock config and its inputs) to `CASES`; every head its
declaration lists, and every metric context it offers, is then checked against the stock transformers class it
converts from: conversion and loading a stock checkpoint are exact at a zero generator; eager equals SDPA; the
attention maps are probability maps; save/load through the Auto class round-trips exactly; gradient checkpointing
gives the same gradients; a checkpoint loads as remote code without the plugin. Causal families also: generation with
a dynamic or static cache equals generation without one and one full forward pass, future tokens leave past logits
alone, and a left-padded batch generates what each row generates alone.
Per-family files (test_gpt2.py, test_llama.py, test_vit.py) keep what is specific to one architecture.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import transformers
from conftest import TINY_VIT, randomize_cross_head, tiny_bart_config, tiny_gpt2_config, tiny_llama_config
from test_remote_code import load_checkpoints_in_fresh_process
from tiny_decoders import tiny_stock_config
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
    # The attention backends the stock class runs, the last one the default here (stock Gemma 2 refuses SDPA, which
    # cannot soft-cap the logits).
    attn_implementations: tuple[str, ...] = ("eager", "sdpa")


def text_inputs() -> dict:
    return {"input_ids": torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))}


def source_inputs() -> dict:
    """Sources ending in </s>, as BART's sequence classifier needs."""
    inputs = text_inputs()
    inputs["input_ids"][:, -1] = 2
    return inputs


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
    "bart": FamilyCase(damcha_hf.families.BART_FAMILY, lambda: tiny_bart_config(num_labels=3), source_inputs,
                       ("token", "query")),
    "mistral": FamilyCase(damcha_hf.families.MISTRAL_FAMILY, lambda: tiny_stock_config("mistral", num_labels=3),
                          text_inputs, ("token", "query")),
    "qwen2": FamilyCase(damcha_hf.families.QWEN2_FAMILY, lambda: tiny_stock_config("qwen2", num_labels=3),
                        text_inputs, ("token", "query")),
    "qwen3": FamilyCase(damcha_hf.families.QWEN3_FAMILY, lambda: tiny_stock_config("qwen3", num_labels=3),
                        text_inputs, ("token", "query")),
    "phi3": FamilyCase(damcha_hf.families.PHI3_FAMILY, lambda: tiny_stock_config("phi3", num_labels=3),
                       text_inputs, ("token", "query")),
    "gemma2": FamilyCase(damcha_hf.families.GEMMA2_FAMILY, lambda: tiny_stock_config("gemma2", num_labels=3),
                         text_inputs, ("token", "query"), attn_implementations=("eager",)),
}  # fmt: skip
HEADS = [(name, head) for name, case in CASES.items() for head in case.family.heads]
HEAD_BACKENDS = [(name, head, attn) for name, head in HEADS for attn in CASES[name].attn_implementations]
CONTEXTS = [(name, context) for name, case in CASES.items() for context in case.contexts]
SDPA_CONTEXTS = [(name, context) for name, context in CONTEXTS if "sdpa" in CASES[name].attn_implementations]
# Decoder-only generation; an encoder-decoder's is checked in test_bart.py.
CAUSAL_CONTEXTS = [(name, context) for name, context in CONTEXTS
                   if CASES[name].family.causal and not CASES[name].family.encoder_decoder]  # fmt: skip
CAUSAL_BACKENDS = [(name, context, attn) for name, context in CAUSAL_CONTEXTS
                   for attn in CASES[name].attn_implementations]  # fmt: skip
# Every head with the family's first context, and the task head with each other context.
SAVE_CASES = [(name, head, CASES[name].contexts[0]) for name, head in HEADS] + [
    (name, CASES[name].family.task_head, context) for name, context in CONTEXTS if context != CASES[name].contexts[0]
]


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


def in_float64(inputs: dict) -> dict:
    """The batch with its floating-point tensors (pixels) in float64, for a model run in float64."""
    return {key: value.double() if value.is_floating_point() else value for key, value in inputs.items()}


def first_output(outputs) -> torch.Tensor:
    return outputs.logits if getattr(outputs, "logits", None) is not None else outputs[0]


def hidden_states_of(outputs) -> tuple[torch.Tensor, ...]:
    """Every layer's hidden states: the model's, or an encoder-decoder's encoder's then decoder's."""
    if getattr(outputs, "hidden_states", None) is not None:
        return outputs.hidden_states
    return outputs.encoder_hidden_states + outputs.decoder_hidden_states


def assert_generator_starts_at_zero(model):
    """The generator's output layer is zero (so C = I and the model is MHA) and its input layer random (so gradient
    reaches it once the output layer moves)."""
    generator = {key: tensor for key, tensor in model.state_dict().items() if ".cross_head_metric." in f".{key}"}
    output_layer = [tensor for key, tensor in generator.items() if ".fc_out." in key]
    input_weights = [tensor for key, tensor in generator.items() if key.endswith("fc_in.weight")]
    assert output_layer and all(torch.equal(tensor, torch.zeros_like(tensor)) for tensor in output_layer)
    assert input_weights and all(tensor.std() > 1e-3 for tensor in input_weights)


def assert_same_weights_plus_only_the_generator(stock, damcha):
    stock_state, damcha_state = stock.state_dict(), damcha.state_dict()
    for key, tensor in stock_state.items():
        assert torch.equal(damcha_state[key], tensor), key
    extra = sorted(set(damcha_state) - set(stock_state))
    assert extra and all(".cross_head_metric." in f".{key}" for key in extra), extra


def left_padded(input_ids: torch.Tensor, padding: int = 3) -> torch.Tensor:
    """An attention mask that pads the first `padding` positions of the second row."""
    mask = torch.ones_like(input_ids)
    mask[1, :padding] = 0
    return mask


def trained_model(name: str, head: DamchaHead | None = None, attn: str | None = None, **options):
    """A DAMCHA model of the family's task head (or `head`), converted from a random stock model, with a non-zero
    ("trained") metric generator; `attn` defaults to the family's default backend here."""
    case = CASES[name]
    attn = attn or case.attn_implementations[-1]
    head = head or case.family.task_head
    stock = head.stock_class(case.stock_config()).eval()
    model = damcha_hf.convert_to_damcha(stock, **options).eval()
    model.set_attn_implementation(attn)
    randomize_cross_head(model)
    return model


def test_every_family_has_a_case_and_a_consistent_declaration():
    assert sorted(CASES) == sorted(family.model_type for family in FAMILIES)
    for family in FAMILIES:
        assert family_for_model_type(family.model_type) is family is family_for_model_type(family.damcha_model_type)
        assert family.heads[0].auto_class == "AutoModel" and family.task_head.pipeline_tag
        assert type(transformers.AutoConfig.for_model(family.damcha_model_type)) is family.config_class
        if family.causal:  # generate() checks for GenerationMixin among the direct bases, as in stock classes
            assert transformers.GenerationMixin in family.task_head.model_class.__bases__
        for head in family.heads:
            assert issubclass(head.model_class, head.stock_class)  # DAMCHA classes extend the stock ones
            config = family.config_class(**CASES[family.model_type].stock_config().to_dict())
            if head.auto_class is None:  # as in transformers: no Auto class maps to the stock class either
                assert not any(head.stock_class is cls for cls in stock_auto_classes(head.stock_class))
                continue
            assert type(getattr(transformers, head.auto_class).from_config(config)) is head.model_class


# --- a zero generator is the stock model ------------------------------------------------------------------------------


@pytest.mark.parametrize("sharing", ["stack", "layer"])
@pytest.mark.parametrize("name, head, attn", HEAD_BACKENDS, ids=head_id)
def test_conversion_equals_the_stock_model(name, head, attn, sharing):
    case = CASES[name]
    # float64: the two models' rounding (within 1/14 of the tolerance in float32 on one x86-64 CPU) far below it
    stock = head.stock_class(case.stock_config()).eval().double()
    stock.set_attn_implementation(attn)
    for context in case.contexts:
        damcha = damcha_hf.convert_to_damcha(stock, metric_context=context, metric_sharing=sharing)
        assert type(damcha) is head.model_class and not damcha.training
        assert (damcha.config.metric_context, damcha.config.metric_sharing) == (context, sharing)
        assert damcha.config._attn_implementation == attn
        assert_same_weights_plus_only_the_generator(stock, damcha)
        assert_generator_starts_at_zero(damcha)
        with torch.no_grad():
            expected = stock(**in_float64(case.inputs()), output_hidden_states=True)
            got = damcha(**in_float64(case.inputs()), output_hidden_states=True)
        torch.testing.assert_close(first_output(got), first_output(expected), rtol=0, atol=1e-5)
        for got_hidden, expected_hidden in zip(hidden_states_of(got), hidden_states_of(expected), strict=True):
            torch.testing.assert_close(got_hidden, expected_hidden, rtol=0, atol=1e-5)


# (cross_head_variant, metric_form): every attention a family converts to; talking-heads and DCMHA mix the score maps
# of all query heads, which is offered for multi-head attention only.
VARIANTS = [("damcha", "keys"), ("damcha", "scores"), ("talking_heads", "keys"), ("dcmha", "keys"), ("none", "keys")]


@pytest.mark.parametrize("variant, form", VARIANTS, ids=["damcha-keys", "damcha-scores", "talking_heads", "dcmha",
                                                         "none"])  # fmt: skip
@pytest.mark.parametrize("name", CASES)
def test_every_cross_head_variant_converts_exactly(name, variant, form):
    case = CASES[name]
    head = case.family.task_head
    config = case.stock_config()
    if variant in ("talking_heads", "dcmha") and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads
    stock = head.stock_class(config).eval()
    for context in case.contexts if variant == "damcha" else case.contexts[:1]:
        damcha = damcha_hf.convert_to_damcha(
            stock, cross_head_variant=variant, metric_form=form, metric_context=context
        )
        assert type(damcha) is head.model_class and damcha.config.cross_head_variant == variant
        with torch.no_grad():
            torch.testing.assert_close(first_output(damcha(**case.inputs())), first_output(stock(**case.inputs())),
                                       rtol=0, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_loading_a_stock_checkpoint_keeps_every_weight_and_equals_the_stock_model(name, context, tmp_path):
    case = CASES[name]
    head = case.family.task_head
    stock = head.stock_class(case.stock_config()).eval()
    stock.save_pretrained(tmp_path)
    damcha = head.model_class.from_pretrained(tmp_path, metric_context=context).eval()
    stock, damcha = stock.double(), damcha.double()  # float64: the two models' rounding far below the tolerance
    assert damcha.config.model_type == case.family.damcha_model_type and damcha.config.metric_context == context
    assert_same_weights_plus_only_the_generator(stock, damcha)
    assert_generator_starts_at_zero(damcha)
    with torch.no_grad():
        torch.testing.assert_close(first_output(damcha(**in_float64(case.inputs()))),
                                   first_output(stock(**in_float64(case.inputs()))), rtol=0, atol=1e-5)  # fmt: skip


# --- inference paths --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, context", SDPA_CONTEXTS)
def test_eager_equals_sdpa(name, context):
    model = trained_model(name, attn="eager", metric_context=context)
    inputs = CASES[name].inputs()
    masks = [None]
    if "input_ids" in inputs:
        masks.append(left_padded(inputs["input_ids"]))
    for mask in masks:
        kept = slice(None) if mask is None else mask.bool()
        with torch.no_grad():
            model.set_attn_implementation("eager")
            eager = first_output(model(**inputs, attention_mask=mask))[kept]
            model.set_attn_implementation("sdpa")
            sdpa = first_output(model(**inputs, attention_mask=mask))[kept]
        torch.testing.assert_close(sdpa, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_attention_maps_are_probability_maps(name, context):
    model = trained_model(name, attn="eager", metric_context=context)
    inputs = CASES[name].inputs()
    config = model.config
    if "input_ids" in inputs:
        length = inputs["input_ids"].shape[1]
    else:
        length = (config.image_size // config.patch_size) ** 2 + 1  # the patches and the CLS token
    with torch.no_grad():
        outputs = model(**inputs, output_attentions=True, output_hidden_states=True)
    causal = CASES[name].family.causal
    if CASES[name].family.encoder_decoder:  # the encoder's, the decoder's (causal) and the cross-attention's maps
        maps = [(outputs.encoder_attentions, False), (outputs.decoder_attentions, True),
                (outputs.cross_attentions, False)]  # fmt: skip
        assert len(outputs.decoder_attentions) == len(outputs.cross_attentions) == config.decoder_layers
    else:
        maps = [(outputs.attentions, causal)]
        assert len(outputs.attentions) == len(outputs.hidden_states) - 1
    assert len(maps[0][0]) == config.num_hidden_layers
    for attentions, causal in maps:
        for attention in attentions:
            assert attention.shape == (2, config.num_attention_heads, length, length)
            torch.testing.assert_close(attention.sum(-1), torch.ones(2, config.num_attention_heads, length))
            if causal:
                assert torch.all(attention.triu(1) == 0)


# --- causal families: the cache, causality, padding -------------------------------------------------------------------


def generate(model, prompt, attention_mask, **settings):
    return model.generate(prompt, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **settings)  # fmt: skip


@pytest.mark.parametrize("name, context, attn", CAUSAL_BACKENDS)
def test_generation_with_a_dynamic_or_static_cache_equals_without_and_the_full_forward(name, context, attn):
    model = trained_model(name, attn=attn, metric_context=context)
    prompt = CASES[name].inputs()["input_ids"][:, :6]
    mask = left_padded(prompt, padding=2)
    with torch.no_grad():
        uncached = generate(model, prompt, mask, use_cache=False)
        dynamic = generate(model, prompt, mask)
        static = generate(model, prompt, mask, cache_implementation="static")
        uncached_logits = torch.stack(uncached.logits, 1)
        for cached in (dynamic, static):
            assert torch.equal(cached.sequences, uncached.sequences)
            torch.testing.assert_close(torch.stack(cached.logits, 1), uncached_logits, rtol=1e-4, atol=1e-4)
        # The unpadded row against one forward pass over what it generated.
        full = model(uncached.sequences[:1, :-1]).logits[0, prompt.shape[1] - 1 :]
        torch.testing.assert_close(uncached_logits[0], full, rtol=1e-4, atol=1e-4)
        # The generator moves the logits by ten times the tolerance above, so a cache path that dropped it would show.
        stock = CASES[name].family.task_head.stock_class(CASES[name].stock_config()).eval()
        stock.load_state_dict(model.state_dict(), strict=False)
        assert (stock(prompt[:1]).logits[0, -1] - uncached_logits[0, 0]).abs().max() > 1e-3


@pytest.mark.parametrize("name, context", CAUSAL_CONTEXTS)
def test_future_tokens_do_not_change_past_logits(name, context):
    model = trained_model(name, metric_context=context)
    ids = CASES[name].inputs()["input_ids"]
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 97
    with torch.no_grad():
        original, altered = model(ids).logits, model(changed).logits
    torch.testing.assert_close(original[:, :5], altered[:, :5], rtol=0, atol=1e-5)
    assert (original[:, 5:] - altered[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("name, context", CAUSAL_CONTEXTS)
def test_left_padded_batch_generates_what_each_row_generates_alone(name, context):
    model = trained_model(name, metric_context=context)
    ids = CASES[name].inputs()["input_ids"]
    short, long = ids[:1, :4], ids[1:, :7]
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(short)], 1),
                      torch.ones_like(long)])  # fmt: skip
    padded = generate(model, batch, mask)
    for row, single in enumerate((short, long)):
        alone = generate(model, single, torch.ones_like(single))
        assert torch.equal(padded.sequences[row, 7:], alone.sequences[0, single.shape[1] :])
        torch.testing.assert_close(torch.stack(padded.logits, 1)[row], torch.stack(alone.logits, 1)[0],
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


# --- save and load ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, head, context", SAVE_CASES, ids=head_id)
def test_save_and_load_through_the_auto_class_round_trips_exactly(name, head, context, tmp_path):
    model = trained_model(name, head, metric_context=context, metric_sharing="layer", metric_mask="diagonal",
                          metric_hidden_size=12)  # fmt: skip
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    saved_config = json.loads((tmp_path / "config.json").read_text())
    assert saved_config["model_type"] == CASES[name].family.damcha_model_type
    saved_options = {key: saved_config[key] for key in ("metric_context", "metric_sharing", "metric_mask",
                                                        "metric_hidden_size")}  # fmt: skip
    assert saved_options == {"metric_context": context, "metric_sharing": "layer", "metric_mask": "diagonal",
                             "metric_hidden_size": 12}  # fmt: skip
    loader = getattr(transformers, head.auto_class) if head.auto_class else head.model_class
    loaded = loader.from_pretrained(tmp_path).eval()
    assert type(loaded) is head.model_class
    # Every config field comes back, except where the config was loaded from.
    assert {**loaded.config.to_dict(), "_name_or_path": ""} == {**model.config.to_dict(), "_name_or_path": ""}
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    inputs = CASES[name].inputs()
    with torch.no_grad():
        assert torch.equal(first_output(loaded(**inputs)), first_output(model(**inputs)))


# --- training ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_gradient_checkpointing_gives_the_same_gradients(name, context):
    model = trained_model(name, metric_context=context).train()
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


# --- remote code ------------------------------------------------------------------------------------------------------


def test_checkpoints_load_with_remote_code_without_the_plugin(tmp_path):
    """A checkpoint of each context each family offers, all loaded in one fresh interpreter without the plugin."""
    checkpoints, expected = [], []  # expected: (family, context, its heads, its logits), one per checkpoint
    for name, case in CASES.items():
        task_head = case.family.task_head
        # Every head with an Auto class (remote code loads through one) that reads the task head's checkpoint: the
        # same base-model prefix (stock LlamaForQuestionAnswering keeps its base model under another name).
        heads = [task_head] + [
            head
            for head in case.family.heads
            if head is not task_head and head.auto_class
            and head.model_class.base_model_prefix == task_head.model_class.base_model_prefix
        ]  # fmt: skip
        inputs = case.inputs()
        for context in case.contexts:
            model = trained_model(name, metric_context=context)  # a non-identity C: the copied metric code must run
            folder = tmp_path / f"{name}-{context}"
            model.save_pretrained(folder)
            with torch.no_grad():
                logits = first_output(model(**inputs))
            stock = task_head.stock_class.from_pretrained(folder).eval()
            with torch.no_grad():  # the stock class reads the same weights: the copied metric code makes the difference
                assert not torch.allclose(first_output(stock(**inputs)), logits, atol=1e-5)
            checkpoints.append((folder, inputs, [head.auto_class for head in heads]))
            expected.append((name, context, heads, logits))
    reports = load_checkpoints_in_fresh_process(checkpoints, tmp_path / "fresh")
    for (name, context, heads, logits), report in zip(expected, reports, strict=True):
        assert report["damcha_hf_importable"] is False and report["plugin_modules"] == []
        for head in heads:
            module, class_name = report["classes"][head.auto_class]
            assert class_name == head.model_class.__name__ and module.startswith("transformers_modules."), name
            assert module.endswith("." + head.model_class.__module__.rsplit(".", 1)[-1])  # the copied model file
        assert torch.equal(report["logits"], logits), (name, context)


# --- an architecture no family declares -------------------------------------------------------------------------------


def unsupported_models():
    """A stock OPT and a stock Falcon language model from tiny random configs."""
    opt_config = transformers.OPTConfig(vocab_size=97, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                        num_attention_heads=2, word_embed_proj_dim=16)  # fmt: skip
    falcon_config = transformers.FalconConfig(vocab_size=97, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    return [transformers.OPTForCausalLM(opt_config), transformers.FalconForCausalLM(falcon_config)]


def test_an_unsupported_model_gets_one_line_naming_the_supported_families(tmp_path, capsys):
    from test_recipes import load_recipe

    supported = [f"{family.display_name} ({family.model_type})" for family in FAMILIES]
    for model in unsupported_models():
        with pytest.raises(TypeError) as error:
            damcha_hf.convert_to_damcha(model)
        message = str(error.value)
        assert "\n" not in message and f"a {type(model).__name__} ({model.config.model_type})" in message
        assert message.endswith(f"supported: {', '.join(supported)}.")

        folder = tmp_path / model.config.model_type
        model.config.save_pretrained(folder)
        with pytest.raises(SystemExit) as exit_info:
            load_recipe("finetune_lora").parse_args(["--base", str(folder), "--output-dir", str(tmp_path / "run")])
        error_lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and f"a '{model.config.model_type}' checkpoint" in error_lines[-1]
        decoders = [name for name in supported if name != "BART (bart)"]
        assert f"this recipe adapts {', '.join(decoders)} checkpoints" in error_lines[-1]
        assert not (tmp_path / "run").exists()
