"""Configuration of DAMCHA Qwen2: Qwen2 / Qwen2.5 (grouped-query attention, q/k/v biases) with cross-head metric
attention."""

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config

from .damcha_config import DamchaDecoderConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaQwen2Config(DamchaDecoderConfigMixin, Qwen2Config):
    r"""
    Configuration of a [`DamchaQwen2Model`]: every field of [`Qwen2Config`] plus the DAMCHA metric fields below. Any
    Qwen2 or Qwen2.5 `config.json` loads into it, with the metric fields at their defaults. The metric mixes the
    `num_key_value_heads` key/value heads (`C` is `H_kv x H_kv`) after the biased projections and RoPE; with
    `use_sliding_window`, the layers from `max_window_layers` on keep their window.
    """

    model_type = "damcha_qwen2"

    @classmethod
    def qwen2_5_0_5b(cls, **overrides) -> "DamchaQwen2Config":
        """The Qwen2.5-0.5B shape: width 896, 24 layers, 14 query heads sharing 2 key/value heads (head width 64), q/k/v
        biases, SwiGLU MLP 4864, vocabulary 151936, tied embeddings, RoPE base 1,000,000. The generator (`C` is 2 x 2)
        adds 896*64+64 + 64*4+4 = 57,668 parameters to the 494,032,768 of stock `Qwen2ForCausalLM`
        (`damcha-hf info qwen2.5-0.5b`).
        """
        shape = {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "max_window_layers": 24,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "qwen2.5-0.5b": {
        "head": "DamchaQwen2ForCausalLM",
        "config": "qwen2_5_0_5b",
        "about": "Qwen2.5-0.5B, GQA 14/2 heads, q/k/v biases",
    }
}

__all__ = ["DamchaQwen2Config"]
