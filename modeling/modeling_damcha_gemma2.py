"""DAMCHA Gemma 2: Gemma 2 whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes (`decoder_attention.py`): it passes the attention function each layer's sliding
window (local layers) and the logit soft-cap exactly as stock Gemma 2 does, and the core scales with the layer's
`scaling` (`query_pre_attn_scalar ** -0.5`), so DAMCHA's scores of the mixed keys are scaled and capped as stock
Gemma 2's are; the score-mixing variants cap their mixed logits the same way. Stock Gemma 2 runs eager, flash or flex
attention, not SDPA (which cannot soft-cap), and so does this model. Every Gemma 2 checkpoint loads with all weights
kept and identical outputs.
"""

from transformers import GenerationMixin
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2Attention,
    Gemma2ForCausalLM,
    Gemma2ForSequenceClassification,
    Gemma2ForTokenClassification,
    Gemma2Model,
    Gemma2PreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_damcha_gemma2 import DamchaGemma2Config
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric
from .decoder_attention import DamchaDecoderAttentionMixin


class DamchaGemma2Attention(DamchaDecoderAttentionMixin, Gemma2Attention):
    rotary_embedding = staticmethod(apply_rotary_pos_emb)
    stock_eager_attention = staticmethod(eager_attention_forward)

    def stock_attention_options(self) -> dict:
        return {"sliding_window": self.sliding_window, "softcap": self.attn_logit_softcapping}


class DamchaGemma2PreTrainedModel(DamchaPreTrainedMixin, Gemma2PreTrainedModel):
    config_class = DamchaGemma2Config
    config: DamchaGemma2Config
    damcha_attention_class = DamchaGemma2Attention
    # SDPA cannot soft-cap the logits: stock Gemma 2 says so from transformers 5.22 on, and before it ran SDPA without
    # the cap (other outputs than eager's). Refused here on every release.
    _supports_sdpa = False


class DamchaGemma2Model(DamchaGemma2PreTrainedModel, Gemma2Model):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(Gemma2Model.forward)


class DamchaGemma2ForCausalLM(DamchaGemma2PreTrainedModel, Gemma2ForCausalLM, GenerationMixin):
    pass


class DamchaGemma2ForSequenceClassification(DamchaGemma2PreTrainedModel, Gemma2ForSequenceClassification):
    pass


class DamchaGemma2ForTokenClassification(DamchaGemma2PreTrainedModel, Gemma2ForTokenClassification):
    pass


DAMCHA_FAMILY = DamchaFamily(
    model_type="gemma2",
    display_name="Gemma 2",
    config_class=DamchaGemma2Config,
    heads=(
        DamchaHead("AutoModel", DamchaGemma2Model, Gemma2Model),
        DamchaHead("AutoModelForCausalLM", DamchaGemma2ForCausalLM, Gemma2ForCausalLM, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaGemma2ForSequenceClassification,
            Gemma2ForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaGemma2ForTokenClassification,
            Gemma2ForTokenClassification,
            "token-classification",
        ),
    ),
    vision=False,
    lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaGemma2PreTrainedModel)
