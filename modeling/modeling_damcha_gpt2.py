"""DAMCHA GPT-2: GPT-2 whose self-attention scores with the data-adaptive cross-head metric of `metric.py`.

Only the self-attention changes; embeddings, MLPs, heads, weight names and the cache are GPT-2's, so every GPT-2
checkpoint loads with all weights kept and (the metric generator starting at zero) identical outputs. Cross-attention
layers (`add_cross_attention=True`) stay plain multi-head attention.

Every class inherits its stock class's `__init__` and `forward` (see `damcha_pretrained.py`); only the attention's
`forward` is DAMCHA's. It relies on GPT-2's attention internals (the cache argument, `past_key_values` before
transformers 5.24 and `cache` after, `ALL_ATTENTION_FUNCTIONS`, output recording); `tests/test_contract.py` checks them.
"""

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import (
    GPT2Attention,
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    GPT2PreTrainedModel,
    eager_attention_forward,
)

from .configuration_damcha_gpt2 import DamchaGPT2Config
from .damcha_family import DamchaFamily, DamchaHead
from .damcha_pretrained import DamchaAttentionMixin, DamchaPreTrainedMixin, forward_with_cross_head_metric
from .dispatch import cross_head_attention_inputs, cross_head_attention_output


def upcast_and_reordered_attention(module, query, key, value, attention_mask, **kwargs):
    """GPT-2's eager `reorder_and_upcast_attn` path, in the signature of the attention functions."""
    return module._upcast_and_reordered_attn(query, key, value, attention_mask)


class DamchaGPT2Attention(DamchaAttentionMixin, GPT2Attention):
    """GPT-2 self-attention with DAMCHA's cross-head metric; the metric comes in as `cross_head_metric`.

    A variant with a per-layer module (talking-heads, DCMHA) gives the layer its `cross_head_mixing`.
    Cross-attention layers (`add_cross_attention=True`) stay stock multi-head attention.
    """

    @classmethod
    def converts(cls, module) -> bool:
        return not module.is_cross_attention

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        cross_head_metric: nn.Module | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Every argument of `GPT2Attention.forward` is named here, so that none lands unread in `**kwargs`: the cache
        # is `cache` from transformers 5.24 on and `past_key_values` before (`GPT2Block` passes it by name).
        # `output_attentions` is answered by transformers' output recording, which reads the returned weights.
        if encoder_hidden_states is not None:
            raise ValueError(
                f"{type(self).__name__} is self-attention only; cross-attention (`add_cross_attention=True`) runs in "
                "the block's `crossattention`, a stock `GPT2Attention`."
            )
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        head_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (t.view(head_shape).transpose(1, 2) for t in (query, key, value))
        dropout = self.attn_dropout.p if self.training else 0.0
        query, key, value, eager_attention = cross_head_attention_inputs(
            self,
            hidden_states,
            query,
            key,
            value,
            metric=cross_head_metric,
            default_attention=upcast_and_reordered_attention
            if self.reorder_and_upcast_attn
            else eager_attention_forward,
            dropout=dropout,
            cache=cache,
            past_key_values=past_key_values,
            **kwargs,
        )
        # The lookup and its one call stay in this `forward`, as in the stock layer: see `cross_head_attention_inputs`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        attn_output = cross_head_attention_output(self, attn_output, hidden_states)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        attn_output = self.resid_dropout(self.c_proj(attn_output))
        return attn_output, attn_weights


class DamchaGPT2PreTrainedModel(DamchaPreTrainedMixin, GPT2PreTrainedModel):
    config_class = DamchaGPT2Config
    config: DamchaGPT2Config
    damcha_attention_class = DamchaGPT2Attention
    # The stock patterns ("attn.bias": old checkpoints' causal-mask buffers), anchored to a whole module name: vLLM's
    # Transformers backend drops every checkpoint weight these patterns find anywhere in its name, and the stock ones
    # also find each layer's `c_attn.bias`, which then never loads.
    _keys_to_ignore_on_load_unexpected = [r"(^|\.)attn\.bias$", r"(^|\.)crossattention\.bias$"]

    def post_init(self):
        super().post_init()
        # `post_init` unites a model's patterns with its children's, and a head's base model was built (and
        # post-initialised) as the stock class: every DAMCHA GPT-2 module keeps the anchored patterns alone.
        for module in self.modules():
            if isinstance(module, DamchaGPT2PreTrainedModel):
                module._keys_to_ignore_on_load_unexpected = set(
                    DamchaGPT2PreTrainedModel._keys_to_ignore_on_load_unexpected
                )

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        # GPT-2's positions are a learned table of `n_positions` rows: generating past it would end in an IndexError
        # deep inside the embedding (transformers only warns), so refuse it here, naming the limit.
        positions, max_length = self.config.n_positions, generation_config.max_length
        if max_length > positions:
            fits = positions - input_ids_length
            fix = (
                f"ask for at most max_new_tokens={fits}" if fits > 0 else f"shorten the prompt below {positions} tokens"
            )
            raise ValueError(
                f"generate() would reach {max_length} tokens (a prompt of {input_ids_length} and up to "
                f"{max_length - input_ids_length} new), but this model has {positions} positions "
                f"(`config.n_positions`); {fix}."
            )


class DamchaGPT2Model(DamchaGPT2PreTrainedModel, GPT2Model):
    damcha_layer_stack = True
    forward = forward_with_cross_head_metric(GPT2Model.forward)


class DamchaGPT2LMHeadModel(DamchaGPT2PreTrainedModel, GPT2LMHeadModel, GenerationMixin):
    pass


class DamchaGPT2ForSequenceClassification(DamchaGPT2PreTrainedModel, GPT2ForSequenceClassification):
    pass


class DamchaGPT2ForTokenClassification(DamchaGPT2PreTrainedModel, GPT2ForTokenClassification):
    pass


class DamchaGPT2ForQuestionAnswering(DamchaGPT2PreTrainedModel, GPT2ForQuestionAnswering):
    pass


class DamchaGPT2DoubleHeadsModel(DamchaGPT2PreTrainedModel, GPT2DoubleHeadsModel, GenerationMixin):
    """GPT-2 with a language-modelling and a multiple-choice head. Like the stock `GPT2DoubleHeadsModel`, no Auto
    class maps to it: load it with `DamchaGPT2DoubleHeadsModel.from_pretrained` (its checkpoints also load as
    `AutoModelForCausalLM`, which drops the multiple-choice head)."""


DAMCHA_FAMILY = DamchaFamily(
    model_type="gpt2",
    display_name="GPT-2",
    config_class=DamchaGPT2Config,
    heads=(
        DamchaHead("AutoModel", DamchaGPT2Model, GPT2Model),
        DamchaHead("AutoModelForCausalLM", DamchaGPT2LMHeadModel, GPT2LMHeadModel, "text-generation"),
        DamchaHead(
            "AutoModelForSequenceClassification",
            DamchaGPT2ForSequenceClassification,
            GPT2ForSequenceClassification,
            "text-classification",
        ),
        DamchaHead(
            "AutoModelForTokenClassification",
            DamchaGPT2ForTokenClassification,
            GPT2ForTokenClassification,
            "token-classification",
        ),
        DamchaHead(
            "AutoModelForQuestionAnswering",
            DamchaGPT2ForQuestionAnswering,
            GPT2ForQuestionAnswering,
            "question-answering",
        ),
        DamchaHead(None, DamchaGPT2DoubleHeadsModel, GPT2DoubleHeadsModel, "text-generation"),
    ),
    vision=False,
    lora_target_modules=("c_attn", "c_proj", "c_fc"),
    lora_fan_in_fan_out=True,  # GPT-2's projections are Conv1D (weight stored transposed)
)

__all__ = DAMCHA_FAMILY.exports(DamchaGPT2PreTrainedModel)
