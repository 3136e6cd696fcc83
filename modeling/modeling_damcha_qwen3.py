"""DAMCHA Qwen3: Qwen3 whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes (`decoder_attention.py`): it normalises each query and key head with the stock
`q_norm` / `k_norm` before RoPE, as stock Qwen3 does, so the metric mixes normalised, rotated keys; and it passes each
layer's sliding window to the attention function exactly as stock. Every Qwen3 checkpoint loads with all weights kept
and identical outputs.
"""

from transformers import GenerationMixin
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
    Qwen3Model,
    Qwen3PreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_damcha_qwen3 import DamchaQwen3Config
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric
from .decoder_attention import DamchaDecoderAttentionMixin


class DamchaQwen3Attention(DamchaDecoderAttentionMixin, Qwen3Attention):
    rotary_embedding = staticmethod(apply_rotary_pos_emb)
    stock_eager_attention = staticmethod(eager_attention_forward)

    def project_query_key_value(self, hidden_states):
        query, key, value = super().project_query_key_value(hidden_states)
        # Each head's vector on its own (RMSNorm over its last dimension), before RoPE: that the heads are already
        # transposed to (batch, heads, seq, head_dim) does not change what is normalised.
        return self.q_norm(query), self.k_norm(key), value

    def stock_attention_options(self) -> dict:
        return {"sliding_window": self.sliding_window}


class DamchaQwen3PreTrainedModel(DamchaPreTrainedMixin, Qwen3PreTrainedModel):
    config_class = DamchaQwen3Config
    config: DamchaQwen3Config
    damcha_attention_class = DamchaQwen3Attention


class DamchaQwen3Model(DamchaQwen3PreTrainedModel, Qwen3Model):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(Qwen3Model.forward)


class DamchaQwen3ForCausalLM(DamchaQwen3PreTrainedModel, Qwen3ForCausalLM, GenerationMixin):
    pass


class DamchaQwen3ForSequenceClassification(DamchaQwen3PreTrainedModel, Qwen3ForSequenceClassification):
    pass


class DamchaQwen3ForTokenClassification(DamchaQwen3PreTrainedModel, Qwen3ForTokenClassification):
    pass


class DamchaQwen3ForQuestionAnswering(DamchaQwen3PreTrainedModel, Qwen3ForQuestionAnswering):
    pass


DAMCHA_FAMILY = DamchaFamily(
    model_type="qwen3",
    display_name="Qwen3",
    config_class=DamchaQwen3Config,
    heads=(
        DamchaHead("AutoModel", DamchaQwen3Model, Qwen3Model),
        DamchaHead("AutoModelForCausalLM", DamchaQwen3ForCausalLM, Qwen3ForCausalLM, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaQwen3ForSequenceClassification,
            Qwen3ForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaQwen3ForTokenClassification,
            Qwen3ForTokenClassification,
            "token-classification",
        ),
        DamchaHead(
            "AutoModelForQuestionAnswering",
            DamchaQwen3ForQuestionAnswering,
            Qwen3ForQuestionAnswering,
            "question-answering",
        ),
    ),
    vision=False,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaQwen3PreTrainedModel)
