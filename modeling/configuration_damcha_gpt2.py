"""Configuration of DAMCHA GPT-2: GPT-2 with data-adaptive cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import GPT2Config

from .damcha_config import (
    METRIC_OPTIONS_DOCSTRING,
    check_metric_options,
    check_source_model_type,
    validated_after_overrides,
)


@strict
class DamchaGPT2Config(GPT2Config):
    r"""
    Configuration of a [`DamchaGPT2Model`]: every field of [`GPT2Config`] plus the DAMCHA metric fields below.
    Any GPT-2 `config.json` loads into it, with the metric fields at their defaults. `metric_context` defaults to
    `"token"`; `"sequence"` is refused, since it would leak future tokens into a causal model.
    """

    model_type = "damcha_gpt2"

    metric_hidden_size: int = 64
    metric_context: str = "token"
    metric_mask: str = "full"
    metric_sharing: str = "stack"
    cross_head_variant: str = "damcha"
    dcmha_rank: int = 2

    def validate_metric_options(self):
        check_metric_options(self, causal=True)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        check_source_model_type(cls, config_dict.get("model_type"), base_model_type="gpt2")
        # A converted GPT-2 config must be saved as `damcha_gpt2`, so the source's model_type is not carried over.
        config_dict = {key: value for key, value in config_dict.items() if key != "model_type"}
        return validated_after_overrides(super().from_dict(config_dict, **kwargs))


DamchaGPT2Config.__doc__ += METRIC_OPTIONS_DOCSTRING

__all__ = ["DamchaGPT2Config"]
