"""Configuration of DAMCHA Phi-3: Phi-3 (fused q/k/v projection, sliding window) with cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import Phi3Config

from .damcha_config import DamchaDecoderConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaPhi3Config(DamchaDecoderConfigMixin, Phi3Config):
    r"""
    Configuration of a [`DamchaPhi3Model`]: every field of [`Phi3Config`] plus the DAMCHA metric fields below. Any
    Phi-3 `config.json` loads into it, with the metric fields at their defaults. The metric mixes the
    `num_key_value_heads` key/value heads (`C` is `H_kv x H_kv`; Phi-3-mini has as many as query heads) taken from
    the fused `qkv_proj` and rotated (partially, with `partial_rotary_factor`), and `sliding_window` keeps its
    meaning.
    """

    model_type = "damcha_phi3"

    @classmethod
    def phi3_mini_4k(cls, **overrides) -> "DamchaPhi3Config":
        """The Phi-3-mini-4k shape: width 3072, 32 layers, 32 heads of width 96 (multi-head: as many key/value heads),
        fused qkv and gate/up projections, MLP 8192, vocabulary 32064, context 4096, sliding window 2047. The
        generator (`C` is 32 x 32) adds 3072*64+64 + 64*1024+1024 = 263,232 parameters to the 3,821,079,552 of stock
        `Phi3ForCausalLM` (`damcha-hf info phi3-mini-4k`).
        """
        shape = {
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 2047,
            "bos_token_id": 1,
            "eos_token_id": 32000,
            "pad_token_id": 32000,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "phi3-mini-4k": {
        "head": "DamchaPhi3ForCausalLM",
        "config": "phi3_mini_4k",
        "about": "Phi-3-mini-4k, 32 heads, fused qkv, sliding window 2047",
    }
}

__all__ = ["DamchaPhi3Config"]
