"""DAMCHA BART: the BART encoder-decoder whose three attentions score with the cross-head metric of `metric.py`.

Only the attention changes; embeddings, MLPs, layer norms, heads, weight names and the cache are BART's, so every
BART checkpoint loads with all weights kept and (the metric generators starting at zero) identical outputs. The
encoder and the decoder each own one generator (stack-wise sharing); the decoder's cross-attention uses the decoder's,
its own, or none (`DamchaBartConfig.cross_attention_metric`). Cross-attention mixes the source's keys once per source
and keeps them, mixed, in the `EncoderDecoderCache`.

Every class inherits its stock class's `__init__` and `forward` (see `damcha_pretrained.py`); the encoder and the
decoder pass their generator down. It relies on BART's attention internals (`BartAttention` with `q_proj/k_proj/
v_proj/out_proj`, `key_value_states` for cross-attention, the cache argument, `past_key_values` before transformers
5.24 and `cache` after, `EncoderDecoderCache.is_updated`, `ALL_ATTENTION_FUNCTIONS`, output recording).
"""

import functools

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bart.modeling_bart import (
    BartAttention,
    BartDecoder,
    BartEncoder,
    BartForCausalLM,
    BartForConditionalGeneration,
    BartForQuestionAnswering,
    BartForSequenceClassification,
    BartModel,
    BartPreTrainedModel,
    eager_attention_forward,
)

from .attention_heads import attended_tokens, project_heads
from .configuration_damcha_bart import DamchaBartConfig
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaAttentionMixin, DamchaPreTrainedMixin, forward_with_cross_head_metric
from .dispatch import cross_head_attention_inputs, cross_head_attention_output
from .transformers_releases import cross_attention_source_cached
from .variants import variant_of


def is_cross_attention_layer(module: nn.Module) -> bool:
    """BART builds its decoder's cross-attention (`encoder_attn`) as a non-causal decoder attention."""
    return module.is_decoder and not module.is_causal


class DamchaBartAttention(DamchaAttentionMixin, BartAttention):
    """BART attention (encoder self-attention, decoder self-attention or cross-attention) with DAMCHA's cross-head
    metric; the metric of the layer's stack comes in as `cross_head_metric`.

    A variant with a per-layer module (talking-heads, DCMHA) gives the layer its `cross_head_mixing`.
    """

    @classmethod
    def converts(cls, module) -> bool:
        return not is_cross_attention_layer(module) or module.config.cross_attention_metric != "none"

    @classmethod
    def adopt_stock_layer(cls, module, config, layer_index: int) -> None:
        super().adopt_stock_layer(module, config, layer_index)
        # The decoder's metric serves its self-attention layers as layers 0..L-1 and its cross-attention as L..2L-1.
        module.metric_layer_index = module.layer_idx + (
            config.decoder_layers if is_cross_attention_layer(module) else 0
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        cross_head_metric: nn.Module | None = None,
        token_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The cache is `cache` from transformers 5.24 on and `past_key_values` before; `output_attentions` is
        # answered by transformers' output recording, which reads the returned weights.
        kwargs.pop("output_attentions", None)
        cache = cache if cache is not None else past_key_values
        query = project_heads(self.q_proj, hidden_states, self.head_dim)
        if key_value_states is not None and cross_attention_source_cached(cache, self.layer_idx):
            key = value = None  # the source's keys and values, mixed, are in the cache
        else:
            source = hidden_states if key_value_states is None else key_value_states
            key, value = (project_heads(projection, source, self.head_dim) for projection in (self.k_proj, self.v_proj))
        config = self.config
        dropout = self.dropout if self.training else 0.0
        query, key, value, eager_attention = cross_head_attention_inputs(
            self,
            hidden_states,
            query,
            key,
            value,
            metric=cross_head_metric,
            default_attention=eager_attention_forward,
            dropout=dropout,
            cache=cache,
            token_mask=token_mask,
            source_states=key_value_states,
            metric_context=config.metric_context if self.is_decoder else config.encoder_context,
            **kwargs,
        )
        # The lookup and its one call stay in this `forward`, as in the stock layer: see `cross_head_attention_inputs`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        attn_output = cross_head_attention_output(self, attn_output, hidden_states)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.out_proj(attn_output), attn_weights


class DamchaBartPreTrainedModel(DamchaPreTrainedMixin, BartPreTrainedModel):
    config_class = DamchaBartConfig
    config: DamchaBartConfig
    damcha_attention_class = DamchaBartAttention


class DamchaBartEncoder(DamchaBartPreTrainedModel, BartEncoder):
    """BART's encoder with DAMCHA self-attention; owns the encoder's metric generator."""

    damcha_layer_stack = True

    @functools.wraps(BartEncoder.forward)
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        if attention_mask is not None and self.config.encoder_context == "sequence":
            # `"sequence"` takes its metric from the mean over the source's real tokens.
            kwargs["token_mask"] = attended_tokens(attention_mask)
        return BartEncoder.forward(
            self, input_ids, attention_mask, inputs_embeds, cross_head_metric=self.cross_head_metric, **kwargs
        )


class DamchaBartDecoder(DamchaBartPreTrainedModel, BartDecoder):
    """BART's decoder with DAMCHA self- and cross-attention; owns the decoder's metric generator(s)."""

    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(BartDecoder.forward)

    @classmethod
    def stack_cross_head_metric(cls, config) -> nn.Module | None:
        # The decoder's cross-attention layers get generators of their own (`cross_attention_metric="own"`) after the
        # self-attention ones, or share them.
        layers = config.decoder_layers
        self_attention = list(range(layers)) if config.metric_sharing == "layer" else [0] * layers
        own = config.cross_attention_metric == "own"
        cross_attention = [index + max(self_attention) + 1 for index in self_attention] if own else self_attention
        return variant_of(config).stack_module(
            config, heads=config.decoder_attention_heads, layer_generators=tuple(self_attention + cross_attention)
        )


class DamchaBartModel(DamchaBartPreTrainedModel, BartModel):
    damcha_stack_container = True


class DamchaBartForConditionalGeneration(DamchaBartPreTrainedModel, BartForConditionalGeneration, GenerationMixin):
    pass


class DamchaBartForSequenceClassification(DamchaBartPreTrainedModel, BartForSequenceClassification):
    pass


class DamchaBartForQuestionAnswering(DamchaBartPreTrainedModel, BartForQuestionAnswering):
    pass


class DamchaBartForCausalLM(DamchaBartPreTrainedModel, BartForCausalLM, GenerationMixin):
    """BART's decoder alone as a language model (its cross-attention layers idle without encoder outputs)."""


DAMCHA_FAMILY = DamchaFamily(
    model_type="bart",
    display_name="BART",
    config_class=DamchaBartConfig,
    heads=(
        DamchaHead("AutoModel", DamchaBartModel, BartModel),
        DamchaHead(
            "AutoModelForSeq2SeqLM",
            DamchaBartForConditionalGeneration,
            BartForConditionalGeneration,
            "text2text-generation",
        ),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaBartForSequenceClassification,
            BartForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForQuestionAnswering",
            DamchaBartForQuestionAnswering,
            BartForQuestionAnswering,
            "question-answering",
        ),
        DamchaHead("AutoModelForCausalLM", DamchaBartForCausalLM, BartForCausalLM, "text-generation"),
    ),
    vision=False,
    encoder_decoder=True,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaBartPreTrainedModel)
