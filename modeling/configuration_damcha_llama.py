"""Configuration of DAMCHA Llama: Llama (and grouped-query Llama-style decoders) with cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .damcha_config import DamchaDecoderConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaLlamaConfig(DamchaDecoderConfigMixin, LlamaConfig):
    r"""
    Configuration of a [`DamchaLlamaModel`]: every field of [`LlamaConfig`] plus the DAMCHA metric fields below. Any
    Llama `config.json` (Llama 2/3, TinyLlama, SmolLM, ...) loads into it, with the metric fields at their defaults.
    `metric_context` defaults to `"token"`; `"sequence"` is refused, since it would leak future tokens into a causal
    model.

    Grouped-query attention (`num_key_value_heads < num_attention_heads`): the metric mixes the `num_key_value_heads`
    key/value heads, so `C` is `H_kv x H_kv` (`H x H_kv` for `metric_context="query"`) and the KV cache keeps the GQA
    size. A single key/value head (multi-query attention) leaves nothing to mix and is refused for
    `cross_head_variant="damcha"`. `"talking_heads"` and `"dcmha"` mix the score maps of the query heads and are
    offered for multi-head configs (`num_key_value_heads == num_attention_heads`) only.
    """

    model_type = "damcha_llama"

    @classmethod
    def tinyllama_1_1b(cls, **overrides) -> "DamchaLlamaConfig":
        """The TinyLlama-1.1B shape: width 2048, 22 layers, 32 query heads sharing 4 key/value heads (head width 64),
        SwiGLU MLP 5632, vocabulary 32000, context 2048. Any field can be overridden (fewer layers for a quick run:
        `num_hidden_layers=2`). With the defaults the metric generator (`C` is 4 x 4) adds 2048*64+64 + 64*16+16 =
        132,176 parameters to the 1,100,048,384 of `DamchaLlamaForCausalLM` (`damcha-hf info tinyllama`).
        """
        shape = {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "tinyllama": {
        "head": "DamchaLlamaForCausalLM",
        "config": "tinyllama_1_1b",
        "about": "TinyLlama-1.1B, GQA 32/4 heads",
    }
}

__all__ = ["DamchaLlamaConfig"]
