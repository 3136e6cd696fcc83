"""The contract every DAMCHA architecture meets, run for each family of `damcha_hf.families.FAMILIES`.

A new family plugs in by adding a `FamilyCase` (a tiny stock config and its inputs) to `CASES`; every head its
declaration lists, every metric context it offers and every cross-head variant (`CROSS_HEAD_VARIANTS`, DAMCHA in each
`metric_form`) is then checked against the stock transformers class it converts from: conversion and loading a stock
checkpoint are exact at the MHA start, and the variant's parameters change the outputs once moved; eager equals SDPA;
the attention maps are probability maps; save/load through the Auto class round-trips exactly; loading a stock
checkpoint with a variant's options equals `convert_to_damcha`; a load in float32, bfloat16 or float64 has every tensor
in that dtype (as the stock model has), float64 exactly; both gradient-checkpointing modes give the gradients and
auxiliary loss of none; a `torch.compile(fullgraph=True)` forward is one graph; every head's checkpoint loads as remote
code without the plugin; a misspelt or another variant's option is refused in one line. Causal families also, for every
variant: generation with a dynamic or static cache equals generation without one and one full forward pass, future
tokens leave past logits alone, and a left-padded batch generates what each row generates alone. The comparisons run
in float64 (`FLOAT64`, `tolerance`). Per-family files (test_gpt2.py, test_llama.py, test_vit.py, test_bart.py) keep
what is specific to one architecture.
"""

import collections
import dataclasses
import functools
import json
import re
import warnings

import pytest
import torch
import transformers
from conftest import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    load_checkpoints_in_fresh_process,
    load_recipe,
    randomize_cross_head,
    tiny_gpt2_config,
    tiny_llama_config,
)
from family_cases import (
    CASES,
    first_output,
    mixes_score_maps,
    stock_config_for,
    text_inputs,
    trained_model,
)
from transformers.modeling_layers import GradientCheckpointingLayer

import damcha_hf
from damcha_hf.families import FAMILIES, family_for_model_type
from damcha_hf.modeling.colmha import CollaborativeMixing
from damcha_hf.modeling.cross_head_variant import ALL_BACKENDS
from damcha_hf.modeling.damcha_config import CROSS_HEAD_VARIANTS, METRIC_FORMS
from damcha_hf.modeling.damcha_family import DamchaHead
from damcha_hf.modeling.damcha_pretrained import stock_class_of
from damcha_hf.modeling.moa import HeadRouter
from damcha_hf.modeling.variants import VARIANTS, backends_of

HEADS = [(name, head) for name, case in CASES.items() for head in case.family.heads]
HEAD_BACKENDS = [(name, head, attn) for name, head in HEADS for attn in CASES[name].attn_implementations]
CONTEXTS = [(name, context) for name, case in CASES.items() for context in case.contexts]
SDPA_CONTEXTS = [(name, context) for name, context in CONTEXTS if "sdpa" in CASES[name].attn_implementations]


def is_decoder_only(name: str) -> bool:
    """A causal family without an encoder: its generation is checked here, an encoder-decoder's in test_bart.py."""
    return CASES[name].family.causal and not CASES[name].family.encoder_decoder


def family_settings(name: str) -> list[tuple[str, str, str]]:
    """Every attention the family converts to, as (cross_head_variant, metric_form, metric_context): DAMCHA in each
    form of its metric with each context the family offers, every other variant once (its metric fields unused)."""
    contexts = CASES[name].contexts
    return [
        (variant, form, context)
        for variant in CROSS_HEAD_VARIANTS
        for form in (METRIC_FORMS if variant == "damcha" else METRIC_FORMS[:1])
        for context in (contexts if variant == "damcha" else contexts[:1])
    ]


def setting_backends(name: str, variant: str, form: str) -> tuple[str, ...]:
    """The backends both the stock family and the variant run (the variant's declaration says which it keeps)."""
    backends = backends_of(variant, metric_form=form)
    return tuple(attn for attn in CASES[name].attn_implementations if backends == ALL_BACKENDS or attn in backends)


SETTINGS = [(name, *setting) for name in CASES for setting in family_settings(name)]
# Every family with every variant at its defaults (DAMCHA in its first form and the family's first context).
VARIANT_SETTINGS = [(name, variant) for name in CASES for variant in CROSS_HEAD_VARIANTS]
CAUSAL_SETTINGS = [setting for setting in SETTINGS if is_decoder_only(setting[0])]
CAUSAL_SETTING_BACKENDS = [(*setting, attn) for setting in CAUSAL_SETTINGS for attn in setting_backends(*setting[:3])]
CAUSAL_CONTEXTS = [(name, context) for name, context in CONTEXTS if is_decoder_only(name)]
# Every head with the family's first context, and the task head with every other setting.
SAVE_CASES = [(name, head, "damcha", METRIC_FORMS[0], CASES[name].contexts[0]) for name, head in HEADS] + [
    (name, CASES[name].family.task_head, *setting)
    for name, *setting in SETTINGS
    if tuple(setting) != ("damcha", METRIC_FORMS[0], CASES[name].contexts[0])
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


# float64 throughout: two paths that compute the same thing differ by float64 rounding (about 1e-15 of the logits'
# size), far below these tolerances on any CPU, while a path that loses a token, a step or the cross-head mixing
# differs by 1e-3 or more.
FLOAT64 = {"rtol": 1e-10, "atol": 1e-10}
# The stock eager attention of the rotary decoders and ViT takes its softmax in float32 even in a float64 model
# (`eager_softmax_in_float32`): its probabilities are rounded to float32 (half an ulp, 6e-8 of each), which the layers
# carry into the logits at about 1e-6; where that attention runs, 100 float32 ulps.
EAGER_FLOAT32_SOFTMAX = {"rtol": 100 * torch.finfo(torch.float32).eps, "atol": 100 * torch.finfo(torch.float32).eps}
# generate() hands back its logits in float32 whatever the model's dtype: float64 results that agree to 1e-15 may
# round to neighbouring float32 numbers, one float32 ulp apart.
GENERATED_LOGITS = {"rtol": 2 * torch.finfo(torch.float32).eps, "atol": 1e-6}


def in_float64(inputs: dict) -> dict:
    """The batch with its floating-point tensors (pixels) in float64, for a model run in float64."""
    return {key: value.double() if value.is_floating_point() else value for key, value in inputs.items()}


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


def right_padded(input_ids: torch.Tensor, padding: int = 3) -> torch.Tensor:
    """An attention mask that pads the last `padding` positions of the second row."""
    mask = torch.ones_like(input_ids)
    mask[1, -padding:] = 0
    return mask


@functools.cache
def eager_softmax_in_float32(name: str) -> bool:
    """Whether the family's stock eager attention takes its softmax in float32 in a float64 model: then every
    attention probability it returns is a float32 number."""
    with torch.random.fork_rng(), torch.no_grad():  # leaves the random numbers of the test that asks first alone
        stock = CASES[name].family.task_head.stock_class(CASES[name].stock_config()).eval().double()
        stock.set_attn_implementation("eager")
        outputs = stock(**in_float64(CASES[name].inputs()), output_attentions=True)
    maps = outputs.encoder_attentions if CASES[name].family.encoder_decoder else outputs.attentions
    return all(torch.equal(probabilities, probabilities.float().double()) for probabilities in maps)


def tolerance(name: str, *backends: str, variant: str = "damcha", form: str = METRIC_FORMS[0]) -> dict:
    """The tolerance of a float64 comparison whose sides run `backends`: float64 rounding, unless one of them is the
    family's stock eager attention with its float32 softmax (score-mixing variants run their own, in float64)."""
    stock_eager = "eager" in backends and not mixes_score_maps(variant, form)
    return EAGER_FLOAT32_SOFTMAX if stock_eager and eager_softmax_in_float32(name) else FLOAT64


@functools.cache
def pads_on_the_left_in_float64(name: str, attn: str) -> bool:
    """Whether the stock model runs a left-padded batch in float64. The rotary decoders' eager attention takes its
    softmax in float32, where float64's mask minimum becomes -inf, so that a padded position, which sees no token,
    gets NaN, and every later position of its row with it."""
    with torch.random.fork_rng(), torch.no_grad():
        stock = CASES[name].family.task_head.stock_class(CASES[name].stock_config()).eval().double()
        stock.set_attn_implementation(attn)
        ids = text_inputs()["input_ids"]
        return not stock(ids, attention_mask=left_padded(ids)).logits.isnan().any()


def has_cross_head_parameters(model) -> bool:
    return any("cross_head_" in key for key, _ in model.named_parameters())


def setting_options(variant: str, form: str, context: str) -> dict:
    """The conversion's options: DAMCHA's form and context for DAMCHA only (another variant refuses them)."""
    metric = {"metric_form": form, "metric_context": context} if variant == "damcha" else {}
    return {"cross_head_variant": variant, **metric}


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
        torch.testing.assert_close(first_output(got), first_output(expected), **tolerance(name, attn))
        for got_hidden, expected_hidden in zip(hidden_states_of(got), hidden_states_of(expected), strict=True):
            torch.testing.assert_close(got_hidden, expected_hidden, **tolerance(name, attn))


@pytest.mark.parametrize("name, variant, form, context", SETTINGS)
def test_every_cross_head_variant_converts_exactly_and_its_parameters_change_the_outputs(name, variant, form, context):
    case = CASES[name]
    stock = case.family.task_head.stock_class(stock_config_for(name, variant)).eval().double()
    exact_start = VARIANTS[variant].exact_start_fields(stock.config)  # MoA keeps every head
    damcha = damcha_hf.convert_to_damcha(stock, **setting_options(variant, form, context), **exact_start)
    assert type(damcha) is case.family.task_head.model_class
    assert (damcha.config.cross_head_variant, damcha.config.metric_form) == (variant, form)
    # The source's attention backend is kept, except where the variant mixes the score maps: eager is all that runs it.
    expected_backend = "eager" if mixes_score_maps(variant, form) else stock.config._attn_implementation
    assert damcha.config._attn_implementation == expected_backend
    inputs = in_float64(case.inputs())
    if "input_ids" in inputs:  # and the second row padded: on the left where the stock backend can in float64
        padded = left_padded if pads_on_the_left_in_float64(name, stock.config._attn_implementation) else right_padded
        inputs["attention_mask"] = padded(inputs["input_ids"])
    kept = inputs["attention_mask"].bool() if "input_ids" in inputs and not case.family.encoder_decoder else ...
    with torch.no_grad():
        expected = first_output(stock(**inputs))
        within = tolerance(name, stock.config._attn_implementation)  # the DAMCHA side: stock's backend or its own
        torch.testing.assert_close(first_output(damcha(**inputs))[kept], expected[kept], **within)
        # Moved off their start, the variant's parameters change the outputs (a plain model has none to move).
        randomize_cross_head(damcha)
        moved = first_output(damcha(**inputs))
    # "Changed" is judged against the comparison's own tolerance: ten times beyond what counted as equal above.
    assert ((moved - expected)[kept].abs().max() > 10 * within["atol"]) == has_cross_head_parameters(damcha)


# The families whose stock config declares the head width (`head_dim`) apart from `hidden_size / num_attention_heads`.
HEAD_DIM_SETTINGS = [
    (name, variant)
    for name, case in CASES.items()
    if "head_dim" in {field.name for field in dataclasses.fields(type(case.stock_config()))}
    for variant in CROSS_HEAD_VARIANTS
]


def test_the_families_with_a_free_head_width_are_the_grouped_query_decoders_that_declare_one():
    assert sorted({name for name, _ in HEAD_DIM_SETTINGS}) == ["gemma2", "llama", "mistral", "qwen3"]


# (hidden_size, num_attention_heads, head_dim): 8 heads of width 16 on a width 8 does not divide (stock Qwen3 runs it;
# the other families' stock configs refuse it), and 4 heads of width 16 on a width of 32 (every one of them runs it).
HEAD_WIDTHS = [(36, 8, 16), (32, 4, 16)]


@pytest.mark.parametrize("shape", HEAD_WIDTHS, ids=str)
@pytest.mark.parametrize("name, variant", HEAD_DIM_SETTINGS)
def test_a_head_width_apart_from_the_model_width_converts_exactly_where_the_stock_model_runs(name, variant, shape):
    """Where the stock config takes the shape, every variant converts and starts as the stock model; where it refuses
    the shape, so does the DAMCHA config."""
    hidden_size, heads, head_dim = shape
    config = stock_config_for(name, variant).to_dict()
    # Multi-head where the variant needs it, else two key/value heads (grouped-query attention).
    kv_heads = heads if config["num_key_value_heads"] == config["num_attention_heads"] else 2
    config.update(hidden_size=hidden_size, num_attention_heads=heads, head_dim=head_dim, num_key_value_heads=kv_heads)
    stock_config_class = type(stock_config_for(name, variant))
    # The stock attention the harness's configs ask for (eager for Gemma 2, whose SDPA drops the soft-cap before 5.22).
    config["attn_implementation"] = stock_config_for(name, variant)._attn_implementation
    try:
        stock_config = stock_config_class(**config)
    except Exception as refusal:  # the stock config's own validation
        with pytest.raises(ValueError, match=re.escape(str(refusal.__cause__ or refusal).splitlines()[-1].strip())):
            CASES[name].family.config_class(**config)
        return
    stock = CASES[name].family.task_head.stock_class(stock_config).eval().double()
    exact_start = VARIANTS[variant].exact_start_fields(stock.config)
    damcha = damcha_hf.convert_to_damcha(stock, **setting_options(variant, METRIC_FORMS[0], "token"), **exact_start)
    assert (damcha.config.hidden_size, damcha.config.head_dim) == (hidden_size, head_dim)
    inputs = CASES[name].inputs()
    with torch.no_grad():
        expected = first_output(stock(**inputs))
        within = tolerance(name, stock.config._attn_implementation)
        torch.testing.assert_close(first_output(damcha(**inputs)), expected, **within)
        randomize_cross_head(damcha)  # and the variant's parameters act
        moved = first_output(damcha(**inputs))
    assert ((moved - expected).abs().max() > 10 * within["atol"]) == has_cross_head_parameters(damcha)


# RoPE scalings set on a built config without the family's other RoPE keys (Phi-3's `partial_rotary_factor`), as
# transformers' own RoPE-scaling tests set them: the stock model builds from such a config without validating it again.
LATE_ROPE_SCALINGS = [{"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                      {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}]  # fmt: skip
ROTARY_FAMILIES = [name for name in CASES if hasattr(CASES[name].stock_config(), "rope_parameters")]


@pytest.mark.parametrize("scaling", LATE_ROPE_SCALINGS, ids=lambda scaling: scaling["rope_type"])
@pytest.mark.parametrize("name", ROTARY_FAMILIES)
def test_a_config_changed_after_construction_builds_where_the_stock_model_builds(name, scaling):
    """Building a model checks the DAMCHA fields again (they may have been set since), and leaves the stock fields to
    the stock model, as the stock class does: the same RoPE, the same outputs."""
    case = CASES[name]
    stock_config = case.stock_config()
    config = case.family.config_class(**stock_config.to_dict())
    stock_config.rope_parameters, config.rope_parameters = dict(scaling), dict(scaling)
    stock = case.family.task_head.stock_class(stock_config).eval().double()
    damcha = case.family.task_head.model_class(config).eval().double()
    damcha.load_state_dict(stock.state_dict(), strict=False)
    inputs = case.inputs()
    with torch.no_grad():
        torch.testing.assert_close(first_output(damcha(**inputs)), first_output(stock(**inputs)),
                                   **tolerance(name, stock.config._attn_implementation))  # fmt: skip
    config.num_key_value_heads = 1  # what DAMCHA's fields cannot run with, set on a built config: refused at build
    with pytest.raises(ValueError, match="num_key_value_heads"):
        case.family.task_head.model_class(config)


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_loading_a_stock_checkpoint_keeps_every_weight_and_equals_the_stock_model(name, context, tmp_path):
    case = CASES[name]
    head = case.family.task_head
    stock = head.stock_class(case.stock_config()).eval()
    stock.save_pretrained(tmp_path)
    damcha = head.model_class.from_pretrained(tmp_path, metric_context=context).eval()
    stock, damcha = stock.double(), damcha.double()
    assert damcha.config.model_type == case.family.damcha_model_type and damcha.config.metric_context == context
    assert_same_weights_plus_only_the_generator(stock, damcha)
    assert_generator_starts_at_zero(damcha)
    with torch.no_grad():
        torch.testing.assert_close(first_output(damcha(**in_float64(case.inputs()))),
                                   first_output(stock(**in_float64(case.inputs()))),
                                   **tolerance(name, stock.config._attn_implementation))  # fmt: skip


# Each variant's own fields off their defaults (ColMHA compressed, so that its weights are fitted; MoA sparse, which
# no conversion starts exactly from and which warns so). DAMCHA's form and context vary over the settings instead.
VARIANT_OPTIONS = {
    "damcha": {"metric_hidden_size": 12, "metric_mask": "diagonal", "metric_input_norm": "layernorm"},
    "talking_heads": {},
    "dcmha": {"dcmha_rank": 3},
    "colmha": {"colmha_key_dim": 8},
    "moa": {"moa_top_k": 2, "moa_balance_loss_coef": 0.05, "moa_z_loss_coef": 0.002},
    "none": {},
}


def saved_options(variant: str, form: str, context: str) -> dict:
    """What a save case builds its model with: the setting and every option of the variant off its default (DAMCHA
    with one generator per layer too), so that a field lost on the way shows."""
    own = {"metric_sharing": "layer", **VARIANT_OPTIONS["damcha"]} if variant == "damcha" else VARIANT_OPTIONS[variant]
    return {**setting_options(variant, form, context), **own}


def test_the_variant_options_cover_every_variant_field():
    """Every field of every variant is saved and reloaded off its default by some save case of every family."""
    assert VARIANT_OPTIONS.keys() == VARIANTS.keys()
    for variant, options in VARIANT_OPTIONS.items():
        assert set(options) <= set(VARIANTS[variant].fields), variant
    for name in CASES:
        saved = [saved_options(*setting) for case, _, *setting in SAVE_CASES if case == name]
        for variant in VARIANTS.values():
            for field, spec in variant.fields.items():
                assert any(options.get(field, spec.default) != spec.default for options in saved), (name, field)


MISSPELT_OPTIONS = {"cross_head_varient": "cross_head_variant", "metric_contex": "metric_context",
                    "moa_topk": "moa_top_k", "colmha_keydim": "colmha_key_dim", "dcmha_ranks": "dcmha_rank"}  # fmt: skip


def option_calls(tmp_path):
    """Every call that takes variant options, as (its name in a refusal, options -> the call), on GPT-2 and Llama."""
    gpt2, llama = transformers.GPT2LMHeadModel(tiny_gpt2_config()), transformers.LlamaForCausalLM(tiny_llama_config())
    gpt2.save_pretrained(tmp_path / "gpt2")
    return [
        ("convert_to_damcha", lambda **options: damcha_hf.convert_to_damcha(gpt2, **options)),
        ("convert_to_damcha", lambda **options: damcha_hf.convert_to_damcha(llama, **options)),
        ("DamchaGPT2LMHeadModel.from_pretrained",
         lambda **options: damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", **options)),
        ("DamchaGPT2Config", lambda **options: damcha_hf.DamchaGPT2Config(**options)),
    ]  # fmt: skip


def test_a_misspelt_variant_option_is_refused_naming_the_field_it_misspells(tmp_path):
    for caller, call in option_calls(tmp_path):
        for wrong, right in MISSPELT_OPTIONS.items():
            variant = next((name for name, variant in VARIANTS.items() if right in variant.fields), "moa")
            with pytest.raises(ValueError) as refusal:
                call(cross_head_variant=variant, **{wrong: 3}) if wrong != "cross_head_varient" else call(
                    **{wrong: variant}
                )
            message = str(refusal.value)
            assert message == f"{caller}: unknown option `{wrong}`; did you mean `{right}`?", message


def test_another_variants_field_is_refused_naming_the_variant_that_reads_it(tmp_path):
    """`convert_to_damcha` and `from_pretrained` refuse a field, set off its default, that the variant they build does
    not read (a config, which holds every variant's fields, takes it: a saved config of one variant loads as another)."""
    for caller, call in option_calls(tmp_path)[:3]:
        for variant in VARIANTS:
            for owner in VARIANTS.values():
                if owner.name == variant or not owner.fields:
                    continue
                field = next(iter(owner.fields))
                given = {"metric_context": "query", "metric_hidden_size": 12}.get(field) or VARIANT_OPTIONS[owner.name][
                    field
                ]
                with pytest.raises(ValueError) as refusal:
                    call(cross_head_variant=variant, **{field: given})
                message = str(refusal.value)
                assert message.startswith(f"{caller}: `{field}` is a field of `cross_head_variant={owner.name!r}`")
                assert f"(`cross_head_variant={variant!r}`)" in message and "\n" not in message
    # At its default another variant's field changes nothing (a saved config carries every variant's fields).
    for _, call in option_calls(tmp_path)[:3]:
        assert (
            call(cross_head_variant="damcha", colmha_key_dim=None, moa_top_k=None, dcmha_rank=2).config.dcmha_rank == 2
        )
    # Without `cross_head_variant`, the variant is the checkpoint's (a stock one: the default, DAMCHA).
    with pytest.raises(ValueError, match="`moa_top_k` is a field of `cross_head_variant='moa'`"):
        option_calls(tmp_path)[2][1](moa_top_k=2)
    # A stock config field, and a variant's own, keep working.
    config = damcha_hf.DamchaGPT2Config(cross_head_variant="colmha", colmha_key_dim=8, num_labels=5, n_embd=48)
    assert (config.colmha_key_dim, config.num_labels, config.n_embd) == (8, 5, 48)


# Every variant of the families whose attention projections differ in layout (GPT-2's fused Conv1D, Llama's grouped
# q/k/v, ViT's query/key, Phi-3's fused qkv) in the default suite, the other families in the slow one.
LAYOUT_VARIANT_SETTINGS = [
    pytest.param(name, variant, marks=() if name in ("gpt2", "llama", "vit", "phi3") else pytest.mark.slow)
    for name, variant in VARIANT_SETTINGS
]


@pytest.mark.parametrize("name, variant", LAYOUT_VARIANT_SETTINGS)
def test_loading_a_stock_checkpoint_with_variant_options_is_convert_to_damcha(name, variant, tmp_path):
    """`from_pretrained(<stock folder>, **options)` converts as `convert_to_damcha(stock, **options)` does: the same
    weights (ColMHA's compression fitted to the checkpoint, the fit's error recorded on each layer), the same outputs
    and the same warning (MoA keeping fewer heads than the source)."""
    case = CASES[name]
    head = case.family.task_head
    options = {"cross_head_variant": variant, **VARIANT_OPTIONS[variant]}
    stock = head.stock_class(stock_config_for(name, variant)).eval()
    stock.save_pretrained(tmp_path)
    warns = VARIANTS[variant].exact_start_fields(stock.config) != {}
    with warnings.catch_warnings(record=True) as converting:
        warnings.simplefilter("always")
        converted = damcha_hf.convert_to_damcha(stock, **options).eval()
        loaded = head.model_class.from_pretrained(tmp_path, **options).eval()
    moa_warnings = [str(warning.message) for warning in converting if "moa_top_k" in str(warning.message)]
    assert [message.split(": ", 1)[0] for message in moa_warnings] == (
        ["convert_to_damcha", f"{head.model_class.__name__}.from_pretrained"] if warns else []
    )
    assert len({message.split(": ", 1)[1] for message in moa_warnings}) == (1 if warns else 0)
    assert {key: getattr(loaded.config, key) for key in options} == options
    assert loaded.state_dict().keys() == converted.state_dict().keys()
    # A parameter that starts at random numbers (DAMCHA's generator input, DCMHA's projections: those that differ between
    # two models built under other seeds) differs between two conversions; every other one is the same, and with the
    # random ones copied over, so are the outputs.
    starts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        starts.append(head.model_class(converted.config).state_dict())
    random_start = {key for key, tensor in starts[0].items()
                    if ".cross_head_" in f".{key}" and not torch.equal(starts[1][key], tensor)}  # fmt: skip
    assert bool(random_start) == (variant in ("damcha", "dcmha")), random_start
    for key, tensor in converted.state_dict().items():
        if key not in random_start:
            assert torch.equal(loaded.state_dict()[key], tensor), key
    with torch.no_grad():
        for key in random_start:
            loaded.get_parameter(key).copy_(converted.get_parameter(key))
    fitted = [module.colmha_reparametrization_error for module in converted.modules()
              if hasattr(module, "colmha_reparametrization_error")]  # fmt: skip
    assert fitted == [module.colmha_reparametrization_error for module in loaded.modules()
                      if hasattr(module, "colmha_reparametrization_error")]  # fmt: skip
    assert bool(fitted) == (variant == "colmha") and all(0 < error < 1 for error in fitted)
    inputs = case.inputs()
    with torch.no_grad():
        assert torch.equal(first_output(loaded(**inputs)), first_output(converted(**inputs)))


# --- inference paths --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, context", SDPA_CONTEXTS)
def test_eager_equals_sdpa(name, context):
    model = trained_model(name, attn="eager", metric_context=context)
    inputs = in_float64(CASES[name].inputs())
    masks = [None]
    if "input_ids" in inputs:  # left padding where the stock eager attention can take it in float64
        padded = left_padded if pads_on_the_left_in_float64(name, "eager") else right_padded
        masks.append(padded(inputs["input_ids"]))
    for mask in masks:
        kept = slice(None) if mask is None else mask.bool()
        with torch.no_grad():
            model.set_attn_implementation("eager")
            eager = first_output(model(**inputs, attention_mask=mask))[kept]
            model.set_attn_implementation("sdpa")
            sdpa = first_output(model(**inputs, attention_mask=mask))[kept]
        torch.testing.assert_close(sdpa, eager, **tolerance(name, "eager", "sdpa"))


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_attention_maps_are_probability_maps(name, context):
    model = trained_model(name, attn="eager", metric_context=context)
    inputs = in_float64(CASES[name].inputs())
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
            ones = torch.ones(2, config.num_attention_heads, length, dtype=torch.float64)
            # A sum of `length` probabilities, each rounded to the softmax's dtype.
            eps = torch.finfo(torch.float32 if eager_softmax_in_float32(name) else torch.float64).eps
            torch.testing.assert_close(attention.sum(-1), ones, rtol=0, atol=length * eps)
            if causal:
                assert torch.all(attention.triu(1) == 0)


# The fields a DAMCHA layer reads per call beyond what its stock layer reads: those that may change on a built model
# (the metric's context, or BART's encoder's, a property over `encoder_metric_context` and `metric_context`; its form;
# its mask, the inference-time ablation).
PER_CALL_METRIC_FIELDS = {"metric_context", "encoder_context", "encoder_metric_context", "metric_form", "metric_mask"}


def config_reads_of_first_attention_call(model, attention_class: type, inputs: dict) -> collections.Counter:
    """Every config attribute the first `attention_class` layer of `model` reads during one forward, with counts."""
    layer = next(module for module in model.modules() if type(module) is attention_class)
    config_class, reads, inside = type(model.config), collections.Counter(), []
    read = config_class.__getattribute__

    def counting(config, key):
        if inside and not key.startswith("__"):
            reads[key] += 1
        return read(config, key)

    hooks = [
        layer.register_forward_pre_hook(lambda *_: inside.append(True)),
        layer.register_forward_hook(lambda *_: inside.clear()),
    ]
    config_class.__getattribute__ = counting
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        del config_class.__getattribute__
        for hook in hooks:
            hook.remove()
    return reads


@pytest.mark.parametrize("name", list(CASES))
def test_a_layer_call_reads_the_config_as_the_stock_layer_does_plus_the_metric_fields_once(name):
    """The variant and everything fixed at construction are bound to the layer; a call reads what the stock layer reads
    (its backend for the attention function's lookup, its window) and the metric fields that may change on a built
    model, each once: no second read of the backend, no field re-read by a hook."""
    case = CASES[name]
    head = case.family.task_head
    stock = head.stock_class(stock_config_for(name, "damcha")).eval()
    model = damcha_hf.convert_to_damcha(head.stock_class(stock_config_for(name, "damcha")).eval()).eval()
    attention_class = model.damcha_attention_class
    for config_class in {type(model.config), type(stock.config)}:
        assert "__getattribute__" not in config_class.__dict__  # the spy is the only override
    stock_reads = config_reads_of_first_attention_call(stock, stock_class_of(attention_class), case.inputs())
    reads = config_reads_of_first_attention_call(model, attention_class, case.inputs())
    assert stock_reads, "the spy saw the stock layer read nothing: it is not watching the layer"
    extra = reads - stock_reads
    assert set(extra) <= PER_CALL_METRIC_FIELDS and set(extra.values()) == {1}, (stock_reads, reads)
    assert {"metric_form", "metric_mask"} <= set(extra)  # read per call, so a change on the built model takes effect


# --- causal families: the cache, causality, padding -------------------------------------------------------------------


def generate(model, prompt, attention_mask, **settings):
    """Greedy decoding of 12 tokens (never fewer: a row that stopped early would end the comparison there)."""
    return model.generate(prompt, attention_mask=attention_mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True, **settings)  # fmt: skip


@pytest.mark.parametrize("name, variant, form, context, attn", CAUSAL_SETTING_BACKENDS)
def test_generation_with_a_dynamic_or_static_cache_equals_without_and_the_full_forward(name, variant, form, context,
                                                                                       attn):  # fmt: skip
    model = trained_model(name, attn=attn, **setting_options(variant, form, context))
    prompt = CASES[name].inputs()["input_ids"][:, :6]
    # Left-padded where the stock model can pad in float64; the other backends' padding is checked in float32 below.
    pads = mixes_score_maps(variant, form) or pads_on_the_left_in_float64(name, attn)
    mask = left_padded(prompt, padding=2) if pads else torch.ones_like(prompt)
    within = tolerance(name, attn, variant=variant, form=form)
    within = GENERATED_LOGITS if within is FLOAT64 else within
    with torch.no_grad():
        uncached = generate(model, prompt, mask, use_cache=False)
        dynamic = generate(model, prompt, mask)
        static = generate(model, prompt, mask, cache_implementation="static")
        uncached_logits = torch.stack(uncached.logits, 1)
        for cached in (dynamic, static):
            assert torch.equal(cached.sequences, uncached.sequences)
            torch.testing.assert_close(torch.stack(cached.logits, 1), uncached_logits, **within)
        # The unpadded row against one forward pass over what it generated.
        full = model(uncached.sequences[:1, :-1]).logits[0, prompt.shape[1] - 1 :]
        torch.testing.assert_close(uncached_logits[0], full.float(), **within)
        # The cross-head parameters move the logits far past the tolerance, so a cache path that dropped them would
        # show (a plain model has none).
        stock = CASES[name].family.task_head.stock_class(stock_config_for(name, variant)).eval().double()
        stock.load_state_dict(model.state_dict(), strict=False)
        moved = (stock(prompt[:1]).logits[0, -1] - full[0]).abs().max()
        assert (moved > 1e-3) == has_cross_head_parameters(model)


@pytest.mark.parametrize("name, variant, form, context", CAUSAL_SETTINGS)
def test_future_tokens_do_not_change_past_logits(name, variant, form, context):
    model = trained_model(name, **setting_options(variant, form, context))
    ids = CASES[name].inputs()["input_ids"]
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 97
    with torch.no_grad():
        original, altered = model(ids).logits, model(changed).logits
    within = tolerance(name, model.config._attn_implementation, variant=variant, form=form)
    torch.testing.assert_close(original[:, :5], altered[:, :5], **within)
    assert (original[:, 5:] - altered[:, 5:]).abs().max() > 1e-3


# Where upstream's eager attention cannot pad in float64 (`pads_on_the_left_in_float64`), the padded batch runs in
# float32, whose rounding between the padded and the unpadded computation reaches about 1e-5 of the logits.
FLOAT32_PATHS = {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("name, variant, form, context", CAUSAL_SETTINGS)
def test_left_padded_batch_generates_what_each_row_generates_alone(name, variant, form, context):
    model = trained_model(name, **setting_options(variant, form, context))
    float64 = mixes_score_maps(variant, form) or pads_on_the_left_in_float64(name, model.config._attn_implementation)
    model = model.to(torch.float64 if float64 else torch.float32)
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
                                   **(GENERATED_LOGITS if float64 else FLOAT32_PATHS))  # fmt: skip


# --- save and load ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, head, variant, form, context", SAVE_CASES, ids=head_id)
def test_save_and_load_through_the_auto_class_round_trips_exactly(name, head, variant, form, context, tmp_path):
    options = saved_options(variant, form, context)
    model = trained_model(name, head, dtype=torch.float32, **options)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    saved_config = json.loads((tmp_path / "config.json").read_text())
    assert saved_config["model_type"] == CASES[name].family.damcha_model_type
    assert {key: saved_config[key] for key in options} == options
    loader = getattr(transformers, head.auto_class) if head.auto_class else head.model_class
    loaded = loader.from_pretrained(tmp_path).eval()
    assert type(loaded) is head.model_class
    # What the variant's options make of the model is what comes back: ColMHA compressed (its query and key maps
    # narrower than all heads' width), MoA sparse (each router keeping fewer heads than there are).
    if variant == "colmha":
        maps = [module.query_compression for module in loaded.modules() if isinstance(module, CollaborativeMixing)]
        assert maps and all(m is not None and m.shape[1] == options["colmha_key_dim"] < m.shape[0] for m in maps)
    if variant == "moa":
        routers = [module for module in loaded.modules() if isinstance(module, HeadRouter)]
        assert routers and all(router.top_k == options["moa_top_k"] < router.num_heads for router in routers)
    # Every config field comes back, except where the config was loaded from.
    assert {**loaded.config.to_dict(), "_name_or_path": ""} == {**model.config.to_dict(), "_name_or_path": ""}
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    inputs = CASES[name].inputs()
    with torch.no_grad():
        assert torch.equal(first_output(loaded(**inputs)), first_output(model(**inputs)))


@functools.cache
def stock_tensor_dtypes(name: str, variant: str, dtype: torch.dtype, folder) -> dict[str, torch.dtype]:
    """The dtype of every parameter and buffer of the family's stock task head loaded with `dtype` (some stay float32
    whatever is asked, such as rotary frequencies)."""
    stock = CASES[name].family.task_head.stock_class(stock_config_for(name, variant))
    stock.save_pretrained(folder / f"stock-{name}-{variant}")
    loaded = type(stock).from_pretrained(folder / f"stock-{name}-{variant}", dtype=dtype)
    return {key: tensor.dtype for key, tensor in [*loaded.named_parameters(), *loaded.named_buffers()]}


@pytest.mark.parametrize("name, variant", LAYOUT_VARIANT_SETTINGS)
def test_a_load_in_each_dtype_has_every_tensor_in_it_and_float64_round_trips_exactly(name, variant, tmp_path):
    """`from_pretrained(dtype=...)`: the variant's parameters and buffers in the dtype asked for, every other tensor in
    the dtype the stock model gets; a float64 checkpoint loads without rounding."""
    case = CASES[name]
    head = case.family.task_head
    options = {**setting_options(variant, METRIC_FORMS[0], case.contexts[0]), **VARIANT_OPTIONS[variant]}
    # Built from its config (a conversion would fit ColMHA's compression, which a load does not), in float64, its
    # cross-head parameters moved off their start.
    config = case.family.config_class(**{**stock_config_for(name, variant).to_dict(), **options})
    model = head.model_class(config).eval()
    randomize_cross_head(model)
    model = model.double()
    model.save_pretrained(tmp_path / "damcha")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        loaded = head.model_class.from_pretrained(tmp_path / "damcha", dtype=dtype)
        stock = stock_tensor_dtypes(name, variant, dtype, tmp_path)
        tensors = dict([*loaded.named_parameters(), *loaded.named_buffers()])
        assert has_cross_head_parameters(loaded) == any(".cross_head_" in f".{key}" for key in tensors)
        for key, tensor in tensors.items():
            expected = dtype if ".cross_head_" in f".{key}" else stock[key]
            assert tensor.dtype == expected, (key, tensor.dtype, dtype)
    for key, tensor in model.state_dict().items():  # `loaded` is the float64 one
        assert torch.equal(loaded.state_dict()[key], tensor), key
    # The outputs to the rounding of what stays float32 in a float64 load (rotary frequencies, as in the stock model;
    # `.to(torch.float64)` converted them in `model`).
    inputs = in_float64(CASES[name].inputs())
    with torch.no_grad():
        torch.testing.assert_close(first_output(loaded.eval()(**inputs)), first_output(model(**inputs)),
                                   **EAGER_FLOAT32_SOFTMAX)  # fmt: skip


# --- training ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, context", CONTEXTS)
def test_gradient_checkpointing_gives_the_same_gradients(name, context):
    model = trained_model(name, metric_context=context).train()
    inputs = in_float64(CASES[name].inputs())
    labels = inputs["input_ids"] if CASES[name].family.causal else torch.tensor([0, 2])

    def gradients():
        model.zero_grad()
        model(**inputs, labels=labels).loss.backward()
        return {
            key: parameter.grad.clone() for key, parameter in model.named_parameters() if parameter.grad is not None
        }

    plain = gradients()
    enable_activation_checkpointing(model)
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    checkpointed = gradients()
    within = tolerance(name, model.config._attn_implementation)
    assert plain.keys() == checkpointed.keys()
    metric_gradients = [gradient for key, gradient in plain.items() if "cross_head_metric" in key]
    assert metric_gradients and all(gradient.abs().max() > 0 for gradient in metric_gradients)  # reaches G
    for key, gradient in plain.items():
        torch.testing.assert_close(checkpointed[key], gradient, **within, msg=key)


@pytest.mark.parametrize("name, variant", VARIANT_SETTINGS)
def test_both_checkpointing_modes_give_the_gradients_and_auxiliary_loss_of_no_checkpointing(name, variant):
    """Reentrant checkpointing runs each layer's first forward without autograd, so whatever a layer records on the
    side (MoA's router loss) must still reach the loss with its gradient."""
    model = trained_model(name, **setting_options(variant, METRIC_FORMS[0], CASES[name].contexts[0])).train()
    inputs = in_float64(CASES[name].inputs())
    labels = inputs["input_ids"] if CASES[name].family.causal else torch.tensor([0, 2])

    def run():
        model.zero_grad()
        output = model(**inputs, labels=labels)
        output.loss.backward()
        gradients = {key: parameter.grad.clone() for key, parameter in model.named_parameters()
                     if parameter.grad is not None}  # fmt: skip
        return output, gradients

    plain_output, plain = run()
    reports = VARIANTS[variant].reports_auxiliary_loss
    assert (getattr(plain_output, "aux_loss", None) is not None) == reports
    cross_head = [key for key in plain if "cross_head_" in key]
    assert bool(cross_head) == has_cross_head_parameters(model) and all(
        plain[key].abs().max() > 0 for key in cross_head
    )
    within = tolerance(name, model.config._attn_implementation, variant=variant)
    for reentrant in (False, True):
        enable_activation_checkpointing(model, use_reentrant=reentrant)
        output, checkpointed = run()
        disable_activation_checkpointing(model)
        assert checkpointed.keys() == plain.keys(), reentrant
        torch.testing.assert_close(output.loss, plain_output.loss, **within)
        if reports:
            assert output.aux_loss.requires_grad, reentrant
            torch.testing.assert_close(output.aux_loss, plain_output.aux_loss, **within)
        for key, gradient in plain.items():
            torch.testing.assert_close(checkpointed[key], gradient, **within, msg=f"{key} (reentrant: {reentrant})")


# Every variant of two families in the default suite (dynamo traces each model for a few seconds), the rest in the slow.
COMPILED_VARIANT_SETTINGS = [
    pytest.param(name, variant, marks=() if name in ("gpt2", "llama") else pytest.mark.slow)
    for name, variant in VARIANT_SETTINGS
]


@pytest.mark.parametrize("name, variant", COMPILED_VARIANT_SETTINGS)
def test_every_variant_compiles_into_one_graph_with_the_eager_outputs(name, variant):
    """`torch.compile(fullgraph=True)` (backend "eager": dynamo traces as for inductor, a graph break fails, without
    inductor's C++ build) of a forward: the outputs and MoA's auxiliary loss equal the eager ones. The forward is one
    graph; MoA's loss is reported by a forward hook on the model, which torch compiles as a graph of its own."""
    from torch._dynamo.utils import counters

    model = trained_model(name, **setting_options(variant, METRIC_FORMS[0], CASES[name].contexts[0]))
    inputs = in_float64(CASES[name].inputs())
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.no_grad():
        expected = model(**inputs)
        compiled = torch.compile(model, fullgraph=True, backend=recording_backend)(**inputs)
    assert not counters["graph_break"]
    reports = VARIANTS[variant].reports_auxiliary_loss
    assert len(graphs) == (2 if reports else 1)
    # The forward's graph holds every layer; the hook's adds the recorded losses only (no matrix product).
    matrix_products = [sum("linear" in str(node.target) or "matmul" in str(node.target) or "addmm" in str(node.target)
                           for node in graph.graph.nodes) for graph in graphs]  # fmt: skip
    assert matrix_products[0] > 0 and all(count == 0 for count in matrix_products[1:]), matrix_products
    torch.testing.assert_close(first_output(compiled), first_output(expected), **FLOAT64)
    if VARIANTS[variant].reports_auxiliary_loss:
        torch.testing.assert_close(compiled.aux_loss, expected.aux_loss, **FLOAT64)


# --- remote code ------------------------------------------------------------------------------------------------------


def test_checkpoints_load_with_remote_code_without_the_plugin(tmp_path):
    """A checkpoint of each context each family offers, and each head's own checkpoint, all loaded in one fresh
    interpreter without the plugin. A head's own checkpoint computes what the plugin's model computes (the generic heads
    build their base model with `AutoModel.from_config`, which must resolve the config class remote code loaded)."""
    checkpoints, expected = [], []  # expected: (family, what, its heads, its logits), one per checkpoint
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
            # A non-identity C: the copied metric code must run.
            model = trained_model(name, dtype=torch.float32, metric_context=context)
            folder = tmp_path / f"{name}-{context}"
            model.save_pretrained(folder)
            with torch.no_grad():
                logits = first_output(model(**inputs))
            stock = task_head.stock_class.from_pretrained(folder).eval()
            with torch.no_grad():  # the stock class reads the same weights: the copied metric code makes the difference
                assert not torch.allclose(first_output(stock(**inputs)), logits, atol=1e-5)
            checkpoints.append((folder, inputs, [head.auto_class for head in heads]))
            expected.append((name, context, heads, logits))
        for head in case.family.heads:
            if head is task_head or head.auto_class is None:  # covered above; loads by its own class, not remote code
                continue
            model = trained_model(name, head, dtype=torch.float32)
            folder = tmp_path / head.model_class.__name__
            model.save_pretrained(folder)
            with torch.no_grad():
                outputs = first_output(model(**inputs))
            checkpoints.append((folder, inputs, [head.auto_class]))
            expected.append((name, head.model_class.__name__, [head], outputs))
    reports = load_checkpoints_in_fresh_process(checkpoints, tmp_path / "fresh")
    for (name, what, heads, logits), report in zip(expected, reports, strict=True):
        assert report["damcha_hf_importable"] is False and report["plugin_modules"] == []
        for head in heads:
            module, class_name = report["classes"][head.auto_class]
            assert class_name == head.model_class.__name__ and module.startswith("transformers_modules."), name
            assert module.endswith("." + head.model_class.__module__.rsplit(".", 1)[-1])  # the copied model file
        assert torch.equal(report["logits"], logits), (name, what)


# --- an architecture no family declares -------------------------------------------------------------------------------


def unsupported_models():
    """A stock OPT and a stock Falcon language model from tiny random configs."""
    opt_config = transformers.OPTConfig(vocab_size=97, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                        num_attention_heads=2, word_embed_proj_dim=16)  # fmt: skip
    falcon_config = transformers.FalconConfig(vocab_size=97, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    return [transformers.OPTForCausalLM(opt_config), transformers.FalconForCausalLM(falcon_config)]


def test_an_unsupported_model_gets_one_line_naming_the_supported_families(tmp_path, capsys):
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
