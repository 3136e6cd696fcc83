"""Configuration of DAMCHA Gemma 2: Gemma 2 (alternating local and global layers, soft-capped logits) with cross-head
metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import Gemma2Config

from .damcha_config import DamchaDecoderConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaGemma2Config(DamchaDecoderConfigMixin, Gemma2Config):
    r"""
    Configuration of a [`DamchaGemma2Model`]: every field of [`Gemma2Config`] plus the DAMCHA metric fields below. Any
    Gemma 2 `config.json` loads into it, with the metric fields at their defaults. The metric mixes the
    `num_key_value_heads` key/value heads (`C` is `H_kv x H_kv`); the scores of the mixed keys are scaled by
    `query_pre_attn_scalar ** -0.5` and soft-capped at `attn_logit_softcapping` as stock Gemma 2 scales and caps its
    heads', and the layers `layer_types` marks `"sliding_attention"` keep their `sliding_window`.
    """

    model_type = "damcha_gemma2"

    @classmethod
    def gemma2_2b(cls, **overrides) -> "DamchaGemma2Config":
        """The Gemma-2-2B shape: width 2304, 26 layers alternating local (window 4096) and global attention, 8 query
        heads of width 256 sharing 4 key/value heads, logits soft-capped at 50 (attention) and 30 (final), MLP 9216,
        vocabulary 256000, tied embeddings. The generator (`C` is 4 x 4) adds 2304*64+64 + 64*16+16 = 148,560
        parameters to the 2,614,341,888 of stock `Gemma2ForCausalLM` (`damcha-hf info gemma2-2b`).
        """
        shape = {
            "vocab_size": 256000,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "gemma2-2b": {
        "head": "DamchaGemma2ForCausalLM",
        "config": "gemma2_2b",
        "about": "Gemma-2-2B, GQA 8/4 heads of width 256, soft-capped, local/global",
    }
}

__all__ = ["DamchaGemma2Config"]
