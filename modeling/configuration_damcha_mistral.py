"""Configuration of DAMCHA Mistral: Mistral (grouped-query attention, sliding window) with cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import MistralConfig

from .damcha_config import DamchaDecoderConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaMistralConfig(DamchaDecoderConfigMixin, MistralConfig):
    r"""
    Configuration of a [`DamchaMistralModel`]: every field of [`MistralConfig`] plus the DAMCHA metric fields below.
    Any Mistral `config.json` loads into it, with the metric fields at their defaults. As in DAMCHA Llama, the metric
    mixes the `num_key_value_heads` key/value heads (`C` is `H_kv x H_kv`); `sliding_window` keeps its meaning: each
    query sees the last `sliding_window` positions, mixed keys included, since the mixing is over heads at one
    position.
    """

    model_type = "damcha_mistral"

    @classmethod
    def mistral_7b(cls, **overrides) -> "DamchaMistralConfig":
        """The Mistral-7B-v0.1 shape: width 4096, 32 layers, 32 query heads sharing 8 key/value heads (head width 128),
        SwiGLU MLP 14336, vocabulary 32000, sliding window 4096. The generator (`C` is 8 x 8) adds 4096*64+64 +
        64*64+64 = 266,368 parameters to the 7,241,732,096 of stock `MistralForCausalLM` (`damcha-hf info mistral-7b`).
        """
        shape = {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 4096,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "mistral-7b": {
        "head": "DamchaMistralForCausalLM",
        "config": "mistral_7b",
        "about": "Mistral-7B-v0.1, GQA 32/8 heads, sliding window 4096",
    }
}

__all__ = ["DamchaMistralConfig"]
