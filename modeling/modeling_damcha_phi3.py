"""DAMCHA Phi-3: Phi-3 whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes (`decoder_attention.py`): it splits the fused `qkv_proj` output into the query, key
and value heads exactly as stock Phi-3 does (the query rows first, then the key rows, then the value rows), rotates
with Phi-3's (partial) RoPE, and passes the sliding window to the attention function as stock. Every Phi-3 checkpoint
loads with all weights kept and identical outputs.
"""

from transformers import GenerationMixin
from transformers.models.phi3.modeling_phi3 import (
    Phi3Attention,
    Phi3ForCausalLM,
    Phi3ForSequenceClassification,
    Phi3ForTokenClassification,
    Phi3Model,
    Phi3PreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .attention_heads import split_heads
from .configuration_damcha_phi3 import DamchaPhi3Config
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaPreTrainedMixin, forward_with_cross_head_metric
from .decoder_attention import DamchaDecoderAttentionMixin


class DamchaPhi3Attention(DamchaDecoderAttentionMixin, Phi3Attention):
    rotary_embedding = staticmethod(apply_rotary_pos_emb)
    stock_eager_attention = staticmethod(eager_attention_forward)

    def project_query_key_value(self, hidden_states):
        query_width = self.config.num_attention_heads * self.head_dim
        key_width = self.num_key_value_heads * self.head_dim
        qkv = self.qkv_proj(hidden_states)
        query, key, value = (
            qkv[..., :query_width],
            qkv[..., query_width : query_width + key_width],
            qkv[..., query_width + key_width :],
        )
        return tuple(split_heads(states, self.head_dim) for states in (query, key, value))

    def stock_attention_options(self) -> dict:
        return {"sliding_window": getattr(self.config, "sliding_window", None)}


class DamchaPhi3PreTrainedModel(DamchaPreTrainedMixin, Phi3PreTrainedModel):
    config_class = DamchaPhi3Config
    config: DamchaPhi3Config
    damcha_attention_class = DamchaPhi3Attention


class DamchaPhi3Model(DamchaPhi3PreTrainedModel, Phi3Model):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(Phi3Model.forward)


class DamchaPhi3ForCausalLM(DamchaPhi3PreTrainedModel, Phi3ForCausalLM, GenerationMixin):
    pass


class DamchaPhi3ForSequenceClassification(DamchaPhi3PreTrainedModel, Phi3ForSequenceClassification):
    pass


class DamchaPhi3ForTokenClassification(DamchaPhi3PreTrainedModel, Phi3ForTokenClassification):
    pass


DAMCHA_FAMILY = DamchaFamily(
    model_type="phi3",
    display_name="Phi-3",
    config_class=DamchaPhi3Config,
    heads=(
        DamchaHead("AutoModel", DamchaPhi3Model, Phi3Model),
        DamchaHead("AutoModelForCausalLM", DamchaPhi3ForCausalLM, Phi3ForCausalLM, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaPhi3ForSequenceClassification,
            Phi3ForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaPhi3ForTokenClassification,
            Phi3ForTokenClassification,
            "token-classification",
        ),
    ),
    vision=False,
    # Phi-3 fuses the query, key and value projections (`qkv_proj`) and the MLP's gate and up projections.
    lora_target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
)

__all__ = DAMCHA_FAMILY.exports(DamchaPhi3PreTrainedModel)
