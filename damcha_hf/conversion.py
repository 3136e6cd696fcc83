"""Conversion ("upcycling") of pretrained multi-head attention models into their DAMCHA counterparts.

The metric generator starts at zero, so the converted model keeps every weight and computes the same outputs;
fine-tuning then learns the metric.
"""

import torch
from transformers import PreTrainedModel

from .families import FAMILIES, family_for_model_type, supported_architectures
from .modeling.cross_head_variant import LAYER_MODULE, STACK_MODULE
from .modeling.damcha_config import config_keywords, variant_option_refusal
from .modeling.damcha_family import DamchaFamily, DamchaHead
from .modeling.dispatch import attn_implementation_for
from .modeling.variants import variant_of

# stock class -> (its family, the head it converts to), from the family declarations. Exact classes: a subclass may
# add weights the DAMCHA class would drop.
CONVERSIONS: dict[type, tuple[DamchaFamily, DamchaHead]] = {
    head.stock_class: (family, head) for family in FAMILIES for head in family.heads
}


def convert_to_damcha(model: PreTrainedModel, **metric_options) -> PreTrainedModel:
    """Return the DAMCHA counterpart of `model` with every weight copied and the metric generator at zero.

    Args:
        model: the stock class of any head of a DAMCHA family (the keys of `CONVERSIONS`): `GPT2Model`,
            `GPT2LMHeadModel`, `GPT2ForSequenceClassification`, `LlamaModel`, `LlamaForCausalLM`,
            `LlamaForSequenceClassification`, `ViTModel`, `ViTForImageClassification`, ...
        **metric_options: DAMCHA config fields, e.g. `metric_context="query"`, `metric_hidden_size=32`, or
            `cross_head_variant=` any name of `damcha_hf.modeling.variants.VARIANTS` for the baselines.

    The result is on the same device and dtype, in the same train/eval mode, with the same attention implementation
    (eager for a variant that mixes the score maps); its outputs equal the original's to float rounding, except where
    a variant's design cannot start as multi-head attention: ColMHA with a compressed `colmha_key_dim` (fitted to the
    weights; `colmha_reparametrization_error` on each layer says how well) and MoA keeping fewer than every head
    (`moa_top_k`; a warning says so).
    """
    if type(model) not in CONVERSIONS:
        raise TypeError(f"convert_to_damcha: {unsupported_model(model)}.")
    family, head = CONVERSIONS[type(model)]
    config_class, damcha_class = family.config_class, head.model_class
    config_dict = model.config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        config_dict.pop(key, None)
    variant = metric_options.get("cross_head_variant", config_class.cross_head_variant)
    refusal = variant_option_refusal(
        "convert_to_damcha", metric_options, config_keywords(config_class) | set(config_dict), variant=variant
    )
    if refusal:
        raise ValueError(refusal)
    config = config_class(**{**config_dict, **metric_options})
    # Keep the source's attention backend, except for a variant that runs only in eager attention (score mixing), and
    # SDPA where the DAMCHA class cannot run it (Gemma 2, which SDPA cannot soft-cap, though stock Gemma 2 defaulted to
    # SDPA before transformers 5.22): there the DAMCHA class's default, as transformers resolves a refused SDPA.
    source_backend = model.config._attn_implementation
    if attn_implementation_for(config, None) is None and (source_backend != "sdpa" or damcha_class._supports_sdpa):
        config._attn_implementation = source_backend
    parameter = next(model.parameters())
    with torch.device(parameter.device):
        damcha = damcha_class(config, **family.architecture_options(model)).to(parameter.dtype)
    missing, unexpected = damcha.load_state_dict(model.state_dict(), strict=False)
    variant_modules = (f".{STACK_MODULE}.", f".{LAYER_MODULE}.")  # the variant's own: DAMCHA's generator, a mixing
    missing = [key for key in missing if not any(name in f".{key}" for name in variant_modules)]
    if missing or unexpected:
        raise RuntimeError(
            f"convert_to_damcha: weights did not carry over from {type(model).__name__} "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})."
        )
    variant_of(config).after_conversion(damcha, model)
    damcha.train(model.training)
    return damcha


def unsupported_model(model) -> str:
    """Why `model` does not convert, in one sentence naming what does."""
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = family_for_model_type(model_type)
    if family is None or family not in FAMILIES:
        return f"a {name} ({model_type or 'no model_type'}) is not an architecture damcha_hf supports; supported: {supported_architectures()}"
    if model_type == family.damcha_model_type:
        return f"a {name} is a DAMCHA model already; convert the stock {family.display_name} model it came from"
    classes = ", ".join(head.stock_class.__name__ for head in family.heads)
    return f"a {name} is not one of the {family.display_name} classes that convert exactly: {classes}"
