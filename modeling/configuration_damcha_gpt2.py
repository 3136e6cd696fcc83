"""Configuration of DAMCHA GPT-2: GPT-2 with data-adaptive cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import GPT2Config

from .damcha_config import DamchaConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaGPT2Config(DamchaConfigMixin, GPT2Config):
    r"""
    Configuration of a [`DamchaGPT2Model`]: every field of [`GPT2Config`] plus the DAMCHA metric fields below.
    Any GPT-2 `config.json` loads into it, with the metric fields at their defaults. `metric_context` defaults to
    `"token"`; `"sequence"` is refused, since it would leak future tokens into a causal model.
    """

    model_type = "damcha_gpt2"


__all__ = ["DamchaGPT2Config"]
