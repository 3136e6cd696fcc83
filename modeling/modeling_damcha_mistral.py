"""DAMCHA Mistral: Mistral whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes (`decoder_attention.py`), and it passes the attention function the sliding window
exactly as stock Mistral does; every Mistral checkpoint loads with all weights kept and identical outputs.
"""

from transformers import GenerationMixin
from transformers.models.mistral.modeling_mistral import (
    MistralAttention,
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
    MistralPreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_damcha_mistral import DamchaMistralConfig
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric
from .decoder_attention import DamchaDecoderAttentionMixin


class DamchaMistralAttention(DamchaDecoderAttentionMixin, MistralAttention):
    rotary_embedding = staticmethod(apply_rotary_pos_emb)
    stock_eager_attention = staticmethod(eager_attention_forward)

    def stock_attention_options(self) -> dict:
        return {"sliding_window": getattr(self.config, "sliding_window", None)}


class DamchaMistralPreTrainedModel(DamchaPreTrainedMixin, MistralPreTrainedModel):
    config_class = DamchaMistralConfig
    config: DamchaMistralConfig
    damcha_attention_class = DamchaMistralAttention


class DamchaMistralModel(DamchaMistralPreTrainedModel, MistralModel):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(MistralModel.forward)


class DamchaMistralForCausalLM(DamchaMistralPreTrainedModel, MistralForCausalLM, GenerationMixin):
    pass


class DamchaMistralForSequenceClassification(DamchaMistralPreTrainedModel, MistralForSequenceClassification):
    pass


class DamchaMistralForTokenClassification(DamchaMistralPreTrainedModel, MistralForTokenClassification):
    pass


class DamchaMistralForQuestionAnswering(DamchaMistralPreTrainedModel, MistralForQuestionAnswering):
    pass


DAMCHA_FAMILY = DamchaFamily(
    model_type="mistral",
    display_name="Mistral",
    config_class=DamchaMistralConfig,
    heads=(
        DamchaHead("AutoModel", DamchaMistralModel, MistralModel),
        DamchaHead("AutoModelForCausalLM", DamchaMistralForCausalLM, MistralForCausalLM, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaMistralForSequenceClassification,
            MistralForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaMistralForTokenClassification,
            MistralForTokenClassification,
            "token-classification",
        ),
        DamchaHead(
            "AutoModelForQuestionAnswering",
            DamchaMistralForQuestionAnswering,
            MistralForQuestionAnswering,
            "question-answering",
        ),
    ),
    vision=False,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaMistralPreTrainedModel)
