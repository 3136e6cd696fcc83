"""The attention of the variants that mix the `n x n` score maps across heads (talking-heads, DCMHA, DAMCHA's
`metric_form="scores"`): no fused kernel exposes the maps, so they run in eager attention with materialised maps
(`score_mixing_attention`); their variants declare eager as their only backend (`cross_head_variant.py`).

This file imports only torch and its siblings: it is part of the remote-code payload.
"""

import functools
from collections.abc import Callable

import torch
from torch import nn

from .attention_heads import CrossHeadModule


def score_mixing_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    mixing: nn.Module,
    query_weights=None,
    key_weights: torch.Tensor | None = None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention whose score maps are mixed across heads before and after the softmax (talking-heads, DCMHA).

    A logit soft-cap (Gemma 2's `softcap * tanh(logit / softcap)`) bounds each head's logits as they enter the
    softmax, as the stock eager attention bounds its heads': after the mixing, before the mask.
    The logits are mixed first and masked after, so that the mask's large negative values never enter a mix; each
    entry `(t, s)` is mixed only with entry `(t, s)` of the other heads, so a masked (future) key reaches nothing but
    masked entries. After the softmax the masked entries are zero in every head and mixing keeps them zero.
    `attention_mask` is the eager additive float mask or a boolean mask (True = attend), or None.
    Returns `(attn_output (batch, seq, heads, head_dim), attn_weights (batch, heads, seq, keys))`.
    """
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves a group of query heads
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    scores = mixing.mix_logits(scores, query_weights, key_weights)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    # At least float32 (half-precision logits are upcast, as stock eager attention does), and float64 kept: a float64
    # mask's minimum, cast to float32, is -inf, and a row with every key masked (a left pad) would be NaN.
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    probabilities = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype).to(value.dtype)
    probabilities = mixing.mix_probabilities(probabilities, query_weights, key_weights)
    probabilities = nn.functional.dropout(probabilities, p=dropout, training=module.training)
    attn_output = torch.matmul(probabilities, value).transpose(1, 2)
    return attn_output, probabilities


def score_mixing_attention_inputs(
    module, hidden_states, query, key, value, *, mixing, cache=None, key_states, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable]:
    """`(query, key, value, attention_function)` for eager attention whose score maps `mixing` mixes across heads,
    after the cache update: `attention_function` is `score_mixing_attention` bound to `mixing` and its weights, in the
    signature of transformers' attention functions, for the layer to call.

    `mixing` gives per-token weights (`dynamic_weights`, of the queries `hidden_states` and of the keys' tokens
    `key_states`) and mixes the maps before and after the softmax (`mix_logits`, `mix_probabilities`). Its key-side
    weights are concatenated to the keys (last dim) before the cache update and split off after it, so the cache
    stores them per position with the keys and any cache class carries them. `key_states=None`: `key` and `value`
    come from the cache as it stored them (a cross-attention layer's source), weights included.
    """
    query_weights, key_weights = mixing.dynamic_weights(hidden_states, key_states)
    if key_weights is not None:
        key = torch.cat([key, key_weights.to(key.dtype)], dim=-1)
    if cache is not None:
        cache_kwargs = {name: option for name, option in kwargs.items() if name != "softcap"}
        key, value = cache.update(key, value, module.layer_idx, kwargs=cache_kwargs)
    head_dim = value.shape[-1]
    if key.shape[-1] > head_dim:  # the key-side weights ride behind each key
        key, key_weights = key.split([head_dim, key.shape[-1] - head_dim], dim=-1)
    return (
        query,
        key,
        value,
        functools.partial(
            score_mixing_attention_function, mixing=mixing, query_weights=query_weights, key_weights=key_weights
        ),
    )


def score_mixing_attention_function(
    module, query, key, value, attention_mask, *, scaling, dropout=0.0, softcap=None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_mixing_attention` as the layer calls an attention function. The function's other keyword arguments (a
    sliding window, which the mask already applies in eager attention) act through the mask; the soft-cap acts on the
    logits. `kwargs` carries the bound `mixing`, `query_weights` and `key_weights`."""
    mixing, query_weights, key_weights = kwargs["mixing"], kwargs["query_weights"], kwargs["key_weights"]
    return score_mixing_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        mixing=mixing,
        query_weights=query_weights,
        key_weights=key_weights,
        scaling=scaling,
        dropout=dropout,
        softcap=softcap,
    )


class ScoreMixing(CrossHeadModule):
    """Mixed into each module that mixes score maps (`TalkingHeadsMixing`, `DynamicHeadComposition`, DAMCHA's
    `MetricScoreMixing`): as a layer's module it names itself the layer's score mixing (`attention_inputs`); the
    attention core then hands it the layer's projections and it returns what the layer's one attention call runs
    (`score_mixing_attention_inputs`), so that only a checkpoint whose variant mixes score maps carries this file."""

    def attention_inputs(self, layer, query, key, value, *, hidden_states, key_states, **options):
        return query, key, self

    def score_mixing_inputs(self, module, hidden_states, query, key, value, *, cache=None, key_states, **kwargs):
        return score_mixing_attention_inputs(
            module, hidden_states, query, key, value, mixing=self, cache=cache, key_states=key_states, **kwargs
        )
