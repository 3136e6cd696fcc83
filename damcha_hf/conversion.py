"""Conversion ("upcycling") of pretrained multi-head attention models into their DAMCHA counterparts.

The metric generator starts at zero, so the converted model keeps every weight and computes the same outputs;
fine-tuning then learns the metric.
"""

import torch
from transformers import (
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    PreTrainedModel,
    ViTForImageClassification,
    ViTModel,
)

from .modeling.configuration_damcha_gpt2 import DamchaGPT2Config
from .modeling.configuration_damcha_llama import DamchaLlamaConfig
from .modeling.configuration_damcha_vit import DamchaViTConfig
from .modeling.damcha_attention import eager_attn_implementation_for
from .modeling.modeling_damcha_gpt2 import (
    DamchaGPT2ForSequenceClassification,
    DamchaGPT2LMHeadModel,
    DamchaGPT2Model,
)
from .modeling.modeling_damcha_llama import (
    DamchaLlamaForCausalLM,
    DamchaLlamaForSequenceClassification,
    DamchaLlamaModel,
)
from .modeling.modeling_damcha_vit import DamchaViTForImageClassification, DamchaViTModel

# source class -> (DAMCHA config class, DAMCHA model class). Exact classes: a subclass may add weights we would drop.
CONVERSIONS: dict[type, tuple[type, type]] = {
    GPT2Model: (DamchaGPT2Config, DamchaGPT2Model),
    GPT2LMHeadModel: (DamchaGPT2Config, DamchaGPT2LMHeadModel),
    GPT2ForSequenceClassification: (DamchaGPT2Config, DamchaGPT2ForSequenceClassification),
    LlamaModel: (DamchaLlamaConfig, DamchaLlamaModel),
    LlamaForCausalLM: (DamchaLlamaConfig, DamchaLlamaForCausalLM),
    LlamaForSequenceClassification: (DamchaLlamaConfig, DamchaLlamaForSequenceClassification),
    ViTModel: (DamchaViTConfig, DamchaViTModel),
    ViTForImageClassification: (DamchaViTConfig, DamchaViTForImageClassification),
}


def _architecture_options(model: PreTrainedModel) -> dict:
    """Constructor arguments that decide which weights the model has, so the DAMCHA copy has the same ones."""
    if isinstance(model, ViTModel):
        return {
            "add_pooling_layer": model.pooler is not None,
            "use_mask_token": model.embeddings.mask_token is not None,
        }
    return {}


def convert_to_damcha(model: PreTrainedModel, **metric_options) -> PreTrainedModel:
    """Return the DAMCHA counterpart of `model` with every weight copied and the metric generator at zero.

    Args:
        model: a `GPT2Model`, `GPT2LMHeadModel`, `GPT2ForSequenceClassification`, `LlamaModel`,
            `LlamaForCausalLM`, `LlamaForSequenceClassification`, `ViTModel` or `ViTForImageClassification` (the keys
            of `CONVERSIONS`).
        **metric_options: DAMCHA config fields, e.g. `metric_context="query"`, `metric_hidden_size=32`, or
            `cross_head_variant="talking_heads"` / `"dcmha"` / `"none"` for the baselines (all start as MHA too).

    The result is on the same device and dtype, in the same train/eval mode, with the same attention implementation
    (eager for talking-heads and DCMHA); its outputs equal the original's to float rounding.
    """
    if type(model) not in CONVERSIONS:
        supported = ", ".join(cls.__name__ for cls in CONVERSIONS)
        raise TypeError(f"convert_to_damcha: cannot convert a {type(model).__name__}; supported: {supported}.")
    config_class, damcha_class = CONVERSIONS[type(model)]
    config_dict = model.config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        config_dict.pop(key, None)
    config = config_class(**{**config_dict, **metric_options})
    # Keep the source's attention backend, except for talking-heads / DCMHA, which run only in eager attention.
    if eager_attn_implementation_for(config, None) is None:
        config._attn_implementation = model.config._attn_implementation
    parameter = next(model.parameters())
    with torch.device(parameter.device):
        damcha = damcha_class(config, **_architecture_options(model)).to(parameter.dtype)
    missing, unexpected = damcha.load_state_dict(model.state_dict(), strict=False)
    new_modules = (".cross_head_metric.", ".cross_head_mixing.")  # DAMCHA's generator, talking-heads / DCMHA mixing
    missing = [key for key in missing if not any(name in f".{key}" for name in new_modules)]
    if missing or unexpected:
        raise RuntimeError(
            f"convert_to_damcha: weights did not carry over from {type(model).__name__} "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})."
        )
    damcha.train(model.training)
    return damcha
