"""DAMCHA Qwen2: Qwen2 and Qwen2.5, whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes (`decoder_attention.py`): its biased q/k/v projections are the stock layers', and it
passes the attention function each layer's sliding window (None on global layers) exactly as stock Qwen2 does; every
Qwen2 checkpoint loads with all weights kept and identical outputs.
"""

from transformers import GenerationMixin
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
    Qwen2PreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_damcha_qwen2 import DamchaQwen2Config
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric
from .decoder_attention import DamchaDecoderAttentionMixin


class DamchaQwen2Attention(DamchaDecoderAttentionMixin, Qwen2Attention):
    rotary_embedding = staticmethod(apply_rotary_pos_emb)
    stock_eager_attention = staticmethod(eager_attention_forward)

    def stock_attention_options(self) -> dict:
        return {"sliding_window": self.sliding_window}


class DamchaQwen2PreTrainedModel(DamchaPreTrainedMixin, Qwen2PreTrainedModel):
    config_class = DamchaQwen2Config
    config: DamchaQwen2Config
    damcha_attention_class = DamchaQwen2Attention


class DamchaQwen2Model(DamchaQwen2PreTrainedModel, Qwen2Model):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(Qwen2Model.forward)


class DamchaQwen2ForCausalLM(DamchaQwen2PreTrainedModel, Qwen2ForCausalLM, GenerationMixin):
    pass


class DamchaQwen2ForSequenceClassification(DamchaQwen2PreTrainedModel, Qwen2ForSequenceClassification):
    pass


class DamchaQwen2ForTokenClassification(DamchaQwen2PreTrainedModel, Qwen2ForTokenClassification):
    pass


class DamchaQwen2ForQuestionAnswering(DamchaQwen2PreTrainedModel, Qwen2ForQuestionAnswering):
    pass


DAMCHA_FAMILY = DamchaFamily(
    model_type="qwen2",
    display_name="Qwen2",
    config_class=DamchaQwen2Config,
    heads=(
        DamchaHead("AutoModel", DamchaQwen2Model, Qwen2Model),
        DamchaHead("AutoModelForCausalLM", DamchaQwen2ForCausalLM, Qwen2ForCausalLM, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaQwen2ForSequenceClassification,
            Qwen2ForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaQwen2ForTokenClassification,
            Qwen2ForTokenClassification,
            "token-classification",
        ),
        DamchaHead(
            "AutoModelForQuestionAnswering",
            DamchaQwen2ForQuestionAnswering,
            Qwen2ForQuestionAnswering,
            "question-answering",
        ),
    ),
    vision=False,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaQwen2PreTrainedModel)
