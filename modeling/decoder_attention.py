"""The self-attention of the rotary decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2) with a cross-head variant.

Their stock attention layers all run the same steps: project the queries `(batch, H, seq, d_h)` and the keys and
values `(batch, H_kv, seq, d_h)`, rotate the queries and keys (RoPE), update the cache, and call the configured
attention function with the layer's `scaling` and a few keyword arguments of the family's own. A DAMCHA layer keeps
each step and hands the rotated projections to `dispatch.cross_head_attention_inputs`, which applies the layer's
cross-head variant (DAMCHA mixes the keys across the key/value heads after RoPE, with which the mixing commutes; see
`metric.py`) and updates the cache; the `forward` then looks up and calls the same attention function as the stock
layer, in the shape serving engines recognise. What differs between the families is declared on the family's class:

- `rotary_embedding` and `stock_eager_attention`: the stock model file's `apply_rotary_pos_emb` (Phi-3's rotates part
  of each head) and `eager_attention_forward` (Gemma 2's soft-caps the logits);
- `project_query_key_value`: separate `q_proj`, `k_proj`, `v_proj` by default (with their biases, Qwen2's); Qwen3
  normalises each query and key head before RoPE, Phi-3 splits one fused `qkv_proj`;
- `stock_attention_options`: the keyword arguments the stock layer adds to the attention-function call, exactly as
  it computes them: the sliding window (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2's local layers) and the logit
  soft-cap (Gemma 2). The window acts on key positions and the mixing on heads at one position, so a mixed key lies
  exactly where its unmixed key did: the window applies unchanged, in every backend and with the cache.

Part of the remote-code payload: imports only torch, transformers and its sibling files.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_heads import project_heads
from .damcha_pretrained import DamchaAttentionMixin
from .dispatch import cross_head_attention_inputs, cross_head_attention_output


class DamchaDecoderAttentionMixin(DamchaAttentionMixin):
    """Mixed in before a stock rotary-decoder attention class (`class DamchaMistralAttention(
    DamchaDecoderAttentionMixin, MistralAttention)`), which then declares `rotary_embedding`,
    `stock_eager_attention` and, where its family needs them, `project_query_key_value` and `stock_attention_options`.
    DAMCHA's metric, the one module a layer stack shares, comes in as `cross_head_metric`; a variant with a per-layer
    module (talking-heads, DCMHA, ColMHA, MoA) gives the layer its `cross_head_mixing`.
    """

    rotary_embedding: staticmethod  # the stock `apply_rotary_pos_emb(query, key, cos, sin)`
    stock_eager_attention: staticmethod  # the stock `eager_attention_forward`

    def project_query_key_value(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The query, key and value heads of `hidden_states`, before RoPE."""
        return tuple(
            project_heads(projection, hidden_states, self.head_dim)
            for projection in (self.q_proj, self.k_proj, self.v_proj)
        )

    def stock_attention_options(self) -> dict:
        """The keyword arguments the stock layer passes to its attention function besides dropout and scaling."""
        return {}

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cross_head_metric: nn.Module | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The cache is `cache` from transformers 5.24 on and `past_key_values` before (the decoder layer passes it by
        # name); `output_attentions` is answered by transformers' output recording, which reads the returned weights.
        kwargs.pop("output_attentions", None)
        query, key, value = self.project_query_key_value(hidden_states)
        cos, sin = position_embeddings
        query, key = self.rotary_embedding(query, key, cos, sin)
        dropout = self.attention_dropout if self.training else 0.0
        options = self.stock_attention_options()
        query, key, value, eager_attention = cross_head_attention_inputs(
            self,
            hidden_states,
            query,
            key,
            value,
            metric=cross_head_metric,
            default_attention=self.stock_eager_attention,
            dropout=dropout,
            cache=cache,
            past_key_values=past_key_values,
            **options,
            **kwargs,
        )
        # The lookup and its one call stay in this `forward`, as in the stock layer: see `cross_head_attention_inputs`.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **options, **kwargs
        )
        attn_output = cross_head_attention_output(self, attn_output, hidden_states)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output), attn_weights
