"""The tensor layout every attention layer shares, whatever its variant: heads split out of a projection, the key
an attention function gets, the tokens a mask lets a query attend to; and what a variant's own module does at each
attention call (`CrossHeadModule`).

This file imports only torch: it is part of the shared core a saved checkpoint carries (remote code).
"""

from typing import ClassVar

import torch
from torch import nn


def split_heads(states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`(b, s, H * d_h)` as the `(b, H, s, d_h)` view the attention functions take."""
    return states.view(*states.shape[:-1], -1, head_dim).transpose(1, 2)


def project_heads(projection: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`projection(hidden_states)` split into heads (`split_heads`)."""
    return split_heads(projection(hidden_states), head_dim)


def full_width_key(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The key the attention function gets for `query`.

    For `"query"`, the expanded query `(b, H, t, H_kv * d_h)` scores against the keys of every key/value head laid
    side by side: `key` `(b, H_kv, s, d_h)` (as the cache returns it) becomes `(b, 1, s, H_kv * d_h)`, broadcast
    (a view, no copy) to the `H_kv` key heads; the attention functions repeat keys and values alike to the query
    heads for grouped queries. Any other query has the key's own width and gets `key` unchanged.
    """
    if query.shape[-1] == key.shape[-1]:
        return key
    batch, kv_heads, seq, head_dim = key.shape
    shared = key.transpose(1, 2).reshape(batch, 1, seq, kv_heads * head_dim)
    return shared.expand(-1, kv_heads, -1, -1)


def attended_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """`(batch, seq)` bool, True for the tokens `attention_mask` lets any query attend to: the `token_mask` of
    `"sequence"`.

    Takes the forms the models accept: `(batch, seq)` with 1 for real tokens and 0 for padding, or a 4D
    `(batch, 1 or heads, queries, keys)` mask, boolean (True = attend) or additive float (0 = attend).
    """
    if attention_mask.dim() == 2:
        return attention_mask.bool()
    if attention_mask.dim() == 4:
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        return attention_mask.any(dim=1).any(dim=1)
    raise ValueError(
        f"`attention_mask` must be (batch, seq) with 1 for real tokens and 0 for padding (or a 4D attention mask), got "
        f"shape {tuple(attention_mask.shape)}."
    )


class CrossHeadModule:
    """Mixed into a variant's module (DAMCHA's `CrossHeadMetric`, the score mixings, ColMHA's `CollaborativeMixing`,
    MoA's `HeadRouter`): what it does at each attention call and in the model around it. The defaults are plain
    multi-head attention; `PLAIN_ATTENTION` is their instance for a variant without a module.

    The attention core (`dispatch.cross_head_attention_inputs`) calls the module where its variant's declaration says
    it lives (`CrossHeadVariant.module_place`): the stack's module, shared by its layers and handed to each layer's
    call, or the layer's own. A PEFT wrapper (`modules_to_save`) that stands in for the module forwards these methods to
    the copy it trains.
    """

    # Whether `attention_inputs` computes the key from `key_projection` itself when a layer passes no key (otherwise
    # the attention core projects it first).
    projects_key: ClassVar[bool] = False

    def attention_inputs(self, layer, query, key, value, *, hidden_states, key_states, **options):
        """`(query, key, score_mixing)` for the attention layer `layer`.

        `query`, `key` `(batch, heads, seq, head_dim)` are the layer's projections (`key` is None where it comes from
        the cache already mixed); `hidden_states` the queries' tokens; `key_states` the keys' tokens (None: from the
        cache). `score_mixing`, if not None, mixes the `n x n` score maps in eager attention (`score_mixing.py`);
        otherwise `(query, key, value)` go to the configured attention function as they are. `options`:
        `metric_context`, `token_mask`, `key_projection`, `dropout`, and `variant`, the layer's declaration (for a
        refusal's text). A module that depends on the attention backend reads `layer.config._attn_implementation`
        itself, where it needs it.
        """
        return query, key, None

    def attended_key(self, layer, key):
        """The key the attention function gets, from `key` `(batch, heads, seq, head_dim)` as the KV cache returns it
        (the cache stores what `attention_inputs` gave). The attention core then lays the key heads side by side for a
        query wider than the key (`full_width_key`)."""
        return key

    def attended_output(self, layer, output, hidden_states):
        """The attention output `(batch, seq, heads, head_dim)` the layer projects, from `output` as the attention
        function returns it, for the query tokens `hidden_states` (MoA gates each token's heads here). Called on a
        layer's own module (`cross_head_mixing`), the one place a per-layer output hook can live."""
        return output

    @classmethod
    def prepare_model(cls, model) -> None:
        """Called on each model a built model holds (a head, and the base model inside it) once its layers are built:
        a module that records a loss registers there what reports it (MoA's forward hooks)."""

    @classmethod
    def checkpointing_function(cls, checkpoint, layer):
        """The gradient-checkpointing function `layer` uses, from `checkpoint`, the one transformers gives it: a module
        that records a loss makes the checkpointed function return it (MoA)."""
        return checkpoint


PLAIN_ATTENTION = CrossHeadModule()


__all__ = ["PLAIN_ATTENTION", "CrossHeadModule", "attended_tokens", "full_width_key", "project_heads", "split_heads"]
