"""Configuration of DAMCHA Qwen3: Qwen3 (grouped-query attention, per-head q/k RMSNorm) with cross-head metric
attention."""

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

from .damcha_config import DamchaDecoderConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaQwen3Config(DamchaDecoderConfigMixin, Qwen3Config):
    r"""
    Configuration of a [`DamchaQwen3Model`]: every field of [`Qwen3Config`] plus the DAMCHA metric fields below. Any
    Qwen3 (dense) `config.json` loads into it, with the metric fields at their defaults. The metric mixes the
    `num_key_value_heads` key/value heads (`C` is `H_kv x H_kv`) after the per-head q/k RMSNorm and RoPE, so the keys
    it mixes are normalised as stock Qwen3's are; `head_dim` need not be `hidden_size / num_attention_heads`.
    """

    model_type = "damcha_qwen3"

    @classmethod
    def qwen3_0_6b(cls, **overrides) -> "DamchaQwen3Config":
        """The Qwen3-0.6B shape: width 1024, 28 layers, 16 query heads of width 128 sharing 8 key/value heads, q/k
        RMSNorm, SwiGLU MLP 3072, vocabulary 151936, tied embeddings, RoPE base 1,000,000. The generator (`C` is
        8 x 8) adds 1024*64+64 + 64*64+64 = 69,760 parameters to the 596,049,920 of stock `Qwen3ForCausalLM`
        (`damcha-hf info qwen3-0.6b`).
        """
        shape = {
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True,
            "attention_bias": False,
            "use_sliding_window": False,
            "max_window_layers": 28,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "qwen3-0.6b": {
        "head": "DamchaQwen3ForCausalLM",
        "config": "qwen3_0_6b",
        "about": "Qwen3-0.6B, GQA 16/8 heads of width 128, q/k norms",
    }
}

__all__ = ["DamchaQwen3Config"]
