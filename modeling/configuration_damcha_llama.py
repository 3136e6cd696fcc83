"""Configuration of DAMCHA Llama: Llama (and grouped-query Llama-style decoders) with cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .damcha_config import SCORE_MIXING_VARIANT_NAMES, DamchaConfigMixin, one_line_config_errors


@one_line_config_errors
@strict
class DamchaLlamaConfig(DamchaConfigMixin, LlamaConfig):
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

    def validate_key_value_heads(self):
        check_key_value_heads(self)

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


def check_key_value_heads(config: DamchaLlamaConfig) -> None:
    """Refuse head layouts the cross-head variants cannot run, naming the field and the fix."""
    name = type(config).__name__
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(
            f"{name}: `num_key_value_heads` ({kv_heads}) must divide `num_attention_heads` ({heads}) (grouped-query "
            "attention); pick a divisor, or leave it unset for multi-head attention."
        )
    variant = config.cross_head_variant
    if variant == "damcha" and config.metric_form == "keys" and kv_heads == 1 and heads > 1:
        raise ValueError(
            f"{name}: `num_key_value_heads=1` (multi-query attention) leaves DAMCHA no key/value heads to mix across "
            "(`C` would be 1 x 1, a per-token rescaling of the one key, not a cross-head metric). Use a checkpoint "
            "with `num_key_value_heads` >= 2, `metric_form='scores'` (which mixes the query heads' score maps), or "
            "`cross_head_variant='none'` for the plain model."
        )
    if variant in SCORE_MIXING_VARIANT_NAMES and kv_heads != heads:
        raise ValueError(
            f"{name}: `cross_head_variant={variant!r}` mixes the score maps of all query heads, which this plugin "
            f"implements for multi-head attention only, but `num_key_value_heads` ({kv_heads}) is not "
            f"`num_attention_heads` ({heads}). Use `cross_head_variant='damcha'` or `'none'` for grouped-query "
            f"models, or set `num_key_value_heads={heads}`."
        )


__all__ = ["DamchaLlamaConfig"]
