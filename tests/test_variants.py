"""The attention-variant registry (`modeling/variants.py`): each `variant_*.py` declaration is what every reader uses.

The configs' fields, docstrings and validation, the recipes' flags, the backends a model accepts, the modules it
builds, what a conversion keeps and what loading refuses are checked here against each variant's declaration, for
every variant the registry lists; a new variant is tested by being listed. What the variants compute is checked
against naive references in test_baselines.py, test_core.py and test_families.py.
"""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY_GPT2, tiny_gpt2_config
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel

import damcha_hf
from damcha_hf.modeling.config_rules import DamchaConfigError
from damcha_hf.modeling.cross_head_variant import ALL_BACKENDS, LAYER_MODULE, STACK_MODULE
from damcha_hf.modeling.damcha_config import METRIC_OPTIONS_DOCSTRING, VARIANT_FIELDS
from damcha_hf.modeling.variants import CROSS_HEAD_VARIANTS, VARIANTS, backends_of, variant_config_fields
from damcha_hf.registration import damcha_config_classes

NAMES = list(CROSS_HEAD_VARIANTS)


def variant_lm(name: str, **overrides) -> damcha_hf.DamchaGPT2LMHeadModel:
    config = damcha_hf.DamchaGPT2Config(**{**TINY_GPT2, "metric_hidden_size": 16, "cross_head_variant": name})
    return damcha_hf.DamchaGPT2LMHeadModel._from_config(config, **overrides)


def test_the_registry_and_the_config_options_import_without_torch():
    code = (
        "import sys\n"
        "from damcha_hf.modeling import damcha_config, variants\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", NAMES)
def test_each_declaration_is_complete_and_its_defaults_pass_its_own_rules(name):
    variant = VARIANTS[name]
    assert variant.name == name
    for attribute in ("display_name", "summary", "description", "config_doc", "reference"):
        assert getattr(variant, attribute).strip(), attribute
    assert f'`"{name}"`' in variant.config_doc
    for field, spec in variant.fields.items():
        assert spec.rule.refusal("Config", field, spec.default) is None, field
        assert spec.help.strip() and spec.doc.strip(), field


def test_every_config_class_has_every_variant_field_with_its_default_and_its_docstring():
    fields = variant_config_fields()
    assert set(VARIANT_FIELDS) == {"cross_head_variant", *fields}
    for config_class in damcha_config_classes():
        config = config_class()
        assert config.cross_head_variant == CROSS_HEAD_VARIANTS[0]
        for field, spec in fields.items():
            if spec.documented_default:  # a family may choose another default where the field is not documented
                assert getattr(config, field) == spec.default, (config_class.__name__, field)
            assert f"    {field} (`{spec.type_name}`" in config_class.__doc__, (config_class.__name__, field)
        assert METRIC_OPTIONS_DOCSTRING in config_class.__doc__


@pytest.mark.parametrize("name", NAMES)
def test_a_variant_fields_rule_refuses_a_bad_value_in_one_line(name):
    for field, spec in VARIANTS[name].fields.items():
        bad = "no-such-choice" if spec.rule.choices else 0
        with pytest.raises(DamchaConfigError, match=f"`{field}`") as refused:
            damcha_hf.DamchaGPT2Config(**{**TINY_GPT2, "cross_head_variant": name, field: bad})
        assert "\n" not in str(refused.value)
    with pytest.raises(DamchaConfigError, match="unknown `cross_head_variant`.*choose one of") as refused:
        damcha_hf.DamchaGPT2Config(cross_head_variant="no_such_variant")
    assert all(repr(known) in str(refused.value) for known in NAMES)


def test_the_recipes_have_a_flag_for_every_variant_field():
    sys.path.insert(0, "recipes")
    try:
        import recipe_options
    finally:
        sys.path.remove("recipes")
    parser = argparse.ArgumentParser()
    recipe_options.add_metric_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {f"--{field.replace('_', '-')}" for field in VARIANT_FIELDS} <= flags
    for field, spec in VARIANT_FIELDS.items():
        value = spec.rule.choices[-1] if spec.rule.choices else 3
        args = parser.parse_args([f"--{field.replace('_', '-')}", str(value)])
        assert recipe_options.metric_options(args) == {field: value}


@pytest.mark.parametrize("name", NAMES)
def test_a_model_accepts_exactly_the_backends_its_variant_declares(name):
    backends = backends_of(name)
    model = variant_lm(name)
    assert model.config._attn_implementation == ("eager" if backends == ("eager",) else "sdpa")
    if backends == ALL_BACKENDS or "sdpa" in backends:
        assert variant_lm(name, attn_implementation="sdpa").config._attn_implementation == "sdpa"
    else:
        with pytest.raises(ValueError) as refused:
            variant_lm(name, attn_implementation="sdpa")
        assert str(refused.value) == VARIANTS[name].backend_refusal(model.config, "sdpa")


@pytest.mark.parametrize("name", NAMES)
def test_a_model_holds_its_variant_modules_and_nothing_else_beyond_the_stock_weights(name):
    torch.manual_seed(0)
    stock = GPT2LMHeadModel(tiny_gpt2_config())
    variant = VARIANTS[name]
    exact_start = variant.exact_start_fields(stock.config)
    own = {"metric_hidden_size": 16} if name == "damcha" else {}  # another variant refuses DAMCHA's fields
    model = damcha_hf.convert_to_damcha(stock, cross_head_variant=name, **own, **exact_start)
    stack_module = getattr(model.transformer, STACK_MODULE)
    assert (stack_module is None) == (variant.stack_module(model.config) is None)
    layer_modules = [getattr(block.attn, LAYER_MODULE) for block in model.transformer.h]
    expected = variant.layer_module(model.config)
    assert all(type(module) is type(expected) for module in layer_modules)
    added = {key for key in model.state_dict()} - set(stock.state_dict())
    assert all(STACK_MODULE in key or LAYER_MODULE in key for key in added)
    assert bool(added) == (stack_module is not None or expected is not None)


@pytest.mark.parametrize("name", [name for name in NAMES if VARIANTS[name].module_place is not None])
def test_a_layer_whose_variant_module_is_missing_is_refused_not_run_as_plain_attention(name):
    """The layer finds its variant's module where the declaration places it; where it is gone (a layer stack's module
    removed, a layer's replaced by None), the call names the module and the fix instead of computing plain MHA."""
    model = variant_lm(name).eval()
    variant = VARIANTS[name]
    place = variant.module_place
    holder = model.transformer if place == STACK_MODULE else model.transformer.h[0].attn
    assert isinstance(getattr(holder, place), variant.module_class())
    setattr(holder, place, None)
    with pytest.raises(ValueError, match=place) as refused:
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert str(refused.value) == variant.missing_module_refusal(model.transformer.h[0].attn)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", [name for name in NAMES if name != "none"])
def test_loading_a_checkpoint_without_its_variant_weights_is_refused(name, tmp_path):
    model = variant_lm(name)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    kept = {key: tensor for key, tensor in weights.items() if STACK_MODULE not in key and LAYER_MODULE not in key}
    assert len(kept) < len(weights)
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    kind = VARIANTS[name].parameter_kind
    with pytest.raises(ValueError, match=f"lacks {kind} weights.*plain multi-head attention"):
        damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(tmp_path)


def test_the_command_line_offers_every_variant():
    code = (
        "import json\n"
        "from damcha_hf.cli import build_parser\n"
        "parser = build_parser()\n"
        "info = parser._subparsers._group_actions[0].choices['info']\n"
        "(action,) = [a for a in info._actions if '--cross-head-variant' in a.option_strings]\n"
        "print(json.dumps(list(action.choices)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == NAMES
