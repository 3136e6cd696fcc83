"""DAMCHA Llama: Llama whose self-attention scores with the data-adaptive cross-head metric of `damcha_attention`.

Only the self-attention changes; embeddings, RMSNorms, MLPs, rotary embeddings, heads, weight names and the cache are
Llama's, so every Llama checkpoint (grouped-query ones included) loads with all weights kept and (the metric generator
starting at zero) identical outputs. The keys are mixed after the rotary embedding, which is what the cache stores;
mixing across heads commutes with the rotation (see `damcha_attention`), and with grouped-query attention the mix runs
over the key/value heads, so the cache keeps its GQA size.

Tested with transformers 5.23 and 5.24, whose Llama internals (`LlamaAttention` with `q_proj/k_proj/v_proj/o_proj`, the cache
argument, named `past_key_values` in 5.23 and `cache` in 5.24, `ALL_ATTENTION_FUNCTIONS`, output recording) this file
relies on.
"""

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_damcha_llama import DamchaLlamaConfig
from .damcha_attention import (
    CrossHeadMetric,
    build_cross_head_mixing,
    cross_head_attention,
)
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric, stack_cross_head_metric


class DamchaLlamaAttention(LlamaAttention):
    """Llama self-attention with DAMCHA's cross-head metric; the metric comes in as `cross_head_metric`.

    For `cross_head_variant="talking_heads"` / `"dcmha"` the layer owns its head-mixing module, `cross_head_mixing`.
    """

    def __init__(self, config: DamchaLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx=layer_idx)
        self.num_heads = config.num_attention_heads
        self.cross_head_mixing = build_cross_head_mixing(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cross_head_metric: CrossHeadMetric | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The cache is `cache` from transformers 5.24 on and `past_key_values` before (the decoder layer passes it by
        # name); `output_attentions` is answered by transformers' output recording, which reads the returned weights.
        kwargs.pop("output_attentions", None)
        head_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (
            projection(hidden_states).view(head_shape).transpose(1, 2)
            for projection in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        attn_output, attn_weights = cross_head_attention(
            self,
            hidden_states,
            query,
            key,
            value,
            attention_mask,
            metric=cross_head_metric,
            default_attention=eager_attention_forward,
            dropout=self.attention_dropout if self.training else 0.0,
            cache=cache,
            past_key_values=past_key_values,
            **kwargs,
        )
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DamchaLlamaDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention is `DamchaLlamaAttention`; built directly, never from a plain layer."""

    def __init__(self, config: DamchaLlamaConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = DamchaLlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DamchaLlamaPreTrainedModel(DamchaPreTrainedMixin, LlamaPreTrainedModel):
    config_class = DamchaLlamaConfig
    config: DamchaLlamaConfig
    _no_split_modules = ["DamchaLlamaDecoderLayer"]


class DamchaLlamaModel(DamchaLlamaPreTrainedModel, LlamaModel):
    def __init__(self, config: DamchaLlamaConfig):
        # LlamaModel.__init__ would build plain Llama layers only for them to be replaced: build DAMCHA's directly.
        DamchaLlamaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DamchaLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.cross_head_metric = stack_cross_head_metric(config)
        self.gradient_checkpointing = False
        self.post_init()

    forward = forward_with_cross_head_metric(LlamaModel.forward)


class DamchaLlamaForCausalLM(DamchaLlamaPreTrainedModel, LlamaForCausalLM, GenerationMixin):
    def __init__(self, config: DamchaLlamaConfig):
        DamchaLlamaPreTrainedModel.__init__(self, config)
        self.model = DamchaLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class DamchaLlamaForSequenceClassification(DamchaLlamaPreTrainedModel, LlamaForSequenceClassification):
    def __init__(self, config: DamchaLlamaConfig):
        # The generic head builds its base model with `AutoModel.from_config`, which would need the Auto registration
        # (absent under remote code): build DAMCHA's directly.
        DamchaLlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = DamchaLlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


DAMCHA_FAMILY = DamchaFamily(
    model_type="llama",
    display_name="Llama",
    config_class=DamchaLlamaConfig,
    heads=(
        DamchaHead("AutoModel", DamchaLlamaModel, LlamaModel),
        DamchaHead("AutoModelForCausalLM", DamchaLlamaForCausalLM, LlamaForCausalLM, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaLlamaForSequenceClassification,
            LlamaForSequenceClassification,
            "text-classification",
        ),
    ),
    causal=True,
    vision=False,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    presets={"tinyllama": (DamchaLlamaForCausalLM, DamchaLlamaConfig.tinyllama_1_1b)},
)

__all__ = [
    "DAMCHA_FAMILY",
    "DamchaLlamaPreTrainedModel",
    "DamchaLlamaModel",
    "DamchaLlamaForCausalLM",
    "DamchaLlamaForSequenceClassification",
]
