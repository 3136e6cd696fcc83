"""DAMCHA Llama: Llama whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes; embeddings, RMSNorms, MLPs, rotary embeddings, heads, weight names and the cache are
Llama's, so every Llama checkpoint (grouped-query ones included) loads with all weights kept and (the metric generator
starting at zero) identical outputs. The keys are mixed after the rotary embedding, which is what the cache stores;
mixing across heads commutes with the rotation (see `metric.py`), and with grouped-query attention the mix runs
over the key/value heads, so the cache keeps its GQA size.

Every class inherits its stock class's `__init__` and `forward` (see `damcha_pretrained.py`); only the attention's
`forward` is DAMCHA's. It relies on Llama's attention internals (`q_proj/k_proj/v_proj/o_proj`, the cache argument,
`past_key_values` before transformers 5.24 and `cache` after, `ALL_ATTENTION_FUNCTIONS`, output recording).
"""

from transformers import GenerationMixin
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    LlamaPreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_damcha_llama import DamchaLlamaConfig
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric
from .decoder_attention import DamchaDecoderAttentionMixin


class DamchaLlamaAttention(DamchaDecoderAttentionMixin, LlamaAttention):
    """Llama self-attention with DAMCHA's cross-head metric (`decoder_attention.py`)."""

    rotary_embedding = staticmethod(apply_rotary_pos_emb)
    stock_eager_attention = staticmethod(eager_attention_forward)


class DamchaLlamaPreTrainedModel(DamchaPreTrainedMixin, LlamaPreTrainedModel):
    config_class = DamchaLlamaConfig
    config: DamchaLlamaConfig
    damcha_attention_class = DamchaLlamaAttention


class DamchaLlamaModel(DamchaLlamaPreTrainedModel, LlamaModel):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(LlamaModel.forward)


class DamchaLlamaForCausalLM(DamchaLlamaPreTrainedModel, LlamaForCausalLM, GenerationMixin):
    pass


class DamchaLlamaForSequenceClassification(DamchaLlamaPreTrainedModel, LlamaForSequenceClassification):
    pass


class DamchaLlamaForQuestionAnswering(DamchaLlamaPreTrainedModel, LlamaForQuestionAnswering):
    pass


class DamchaLlamaForTokenClassification(DamchaLlamaPreTrainedModel, LlamaForTokenClassification):
    pass


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
        DamchaHead(
            "AutoModelForQuestionAnswering",
            DamchaLlamaForQuestionAnswering,
            LlamaForQuestionAnswering,
            "question-answering",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaLlamaForTokenClassification,
            LlamaForTokenClassification,
            "token-classification",
        ),
    ),
    vision=False,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaLlamaPreTrainedModel)
