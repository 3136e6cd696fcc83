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


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {"gpt2-small": {"head": "DamchaGPT2Model", "about": "GPT-2 small, 12 layers, width 768"}}

__all__ = ["DamchaGPT2Config"]
