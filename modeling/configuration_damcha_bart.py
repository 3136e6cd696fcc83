"""Configuration of DAMCHA BART: the BART encoder-decoder with data-adaptive cross-head metric attention."""

from huggingface_hub.dataclasses import strict
from transformers import BartConfig

from .damcha_config import METRIC_CONTEXTS, METRIC_FIELD_RULES, DamchaConfigMixin, choice_rule, one_line_config_errors

CROSS_ATTENTION_METRICS = ("decoder", "own", "none")


@one_line_config_errors
@strict
class DamchaBartConfig(DamchaConfigMixin, BartConfig):
    r"""
    Configuration of a [`DamchaBartModel`]: every field of [`BartConfig`] plus the DAMCHA metric fields below. Any BART
    `config.json` loads into it, with the metric fields at their defaults.

    DAMCHA runs in all three attentions of the encoder-decoder, with one metric generator per stack (the paper shares
    it stack-wise):

    - the encoder's self-attention, bidirectional: `encoder_metric_context` (`"sequence"` allowed: one `C` per source
      from the mean over its real tokens, so padding leaves it unchanged);
    - the decoder's self-attention, causal: `metric_context` (`"token"` or `"query"`; `"sequence"` is refused, since it
      would leak future tokens);
    - the decoder's cross-attention over the encoder output, in the decoder's `metric_context`: under `"token"` its
      `C` comes from each source token and the mixed source keys are computed once per source and kept in the
      `EncoderDecoderCache`; under `"query"` from each target token. `cross_attention_metric` says which generator.

    The talking-heads and DCMHA baselines (`cross_head_variant`) run in the same three attentions, each layer with its
    own mixing module, as in the decoders.

    Args:
        encoder_metric_context (`str`, *optional*):
            The `metric_context` of the encoder's self-attention; None (the default) takes `metric_context`.
        cross_attention_metric (`str`, *optional*, defaults to `"decoder"`):
            The cross-attention layers' metric. `"decoder"`: the decoder stack's generator, which they belong to, so
            stack-wise sharing holds as the paper states it and no weights are added; with `"query"` it reads target
            tokens in both of the decoder's attentions. `"own"`: a generator of their own (one more per stack, or per
            layer under `metric_sharing="layer"`), since under `"token"` cross-attention reads encoder outputs, a
            different distribution from the decoder's tokens. `"none"`: cross-attention stays plain multi-head
            attention (for every `cross_head_variant`).

    Stricter than [`BartConfig`]: the encoder and the decoder must have the same number of attention heads, since a
    cross-attention layer mixes the decoder's heads with a generator of the decoder's shape.
    """

    model_type = "damcha_bart"
    damcha_causal = True  # `metric_context` is the decoder's
    damcha_field_rules = {
        **METRIC_FIELD_RULES,
        "encoder_metric_context": choice_rule(METRIC_CONTEXTS, none_means="the decoder's `metric_context`"),
        "cross_attention_metric": choice_rule(CROSS_ATTENTION_METRICS),
    }

    encoder_metric_context: str | None = None
    cross_attention_metric: str = "decoder"

    @property
    def encoder_context(self) -> str:
        """The encoder's self-attention context."""
        return self.encoder_metric_context or self.metric_context

    def validate_encoder_decoder_options(self):
        name = type(self).__name__
        if self.cross_head_variant != "none" and self.encoder_attention_heads != self.decoder_attention_heads:
            raise ValueError(
                f"{name}: `encoder_attention_heads` ({self.encoder_attention_heads}) and `decoder_attention_heads` "
                f"({self.decoder_attention_heads}) must be equal for `cross_head_variant={self.cross_head_variant!r}`; "
                "set both to the same count (every released BART checkpoint has them equal)."
            )

    @classmethod
    def bart_base(cls, **overrides) -> "DamchaBartConfig":
        """bart-base's shape: width 768, 6 encoder and 6 decoder layers, 12 heads, FFN 3072, vocabulary 50,265."""
        shape = {
            "d_model": 768,
            "encoder_layers": 6,
            "decoder_layers": 6,
            "encoder_attention_heads": 12,
            "decoder_attention_heads": 12,
            "encoder_ffn_dim": 3072,
            "decoder_ffn_dim": 3072,
        }
        return cls(**{**shape, **overrides})


# `damcha-hf info`'s presets of this family, the architecture at a published size: name -> the head it builds, the
# config classmethod (none: the class's defaults) and its overrides, and what it is. A literal, so that `info --help`
# reads it without importing transformers (`damcha_hf.commands.info.declared_presets`).
INFO_PRESETS = {
    "bart-base": {
        "head": "DamchaBartForConditionalGeneration",
        "config": "bart_base",
        "about": "encoder-decoder, 6+6 layers, width 768",
    }
}

__all__ = ["DamchaBartConfig"]
