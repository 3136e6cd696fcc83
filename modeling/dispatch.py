"""The attention entry point every DAMCHA model calls (`cross_head_attention`): it dispatches on
`config.cross_head_variant`, applies the metric of `metric.py`, updates the KV cache and hands ordinary
`(query, key, value)` to transformers' attention functions (`ALL_ATTENTION_FUNCTIONS`); plus the checks of which
backend a config can run on. The KV-cache adaptor and the transformers-version warning are `transformers_releases.py`'s.

The variants: `"damcha"` (the metric), `"talking_heads"` (static `H x H` mixing of the logits and of the weights,
`talking_heads.py`), `"dcmha"` (dynamic per-query and per-key composition of both maps, `dcmha.py`), both run by
`score_mixing.py` in eager attention, and `"none"` (plain multi-head attention).

This file imports only torch, transformers and its siblings: it is part of the remote-code payload.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .metric import (
    CrossHeadMetric,
    MetricScoreMixing,
    cross_head_query_key,
    expanded_query,
    full_width_key,
    project_heads,
)
from .score_mixing import SCORE_MIXING_VARIANTS, layer_mixing, score_mixing_cross_head_attention
from .transformers_releases import SourceKeyCache, self_attention_cache


def register_output_recording(model: nn.Module) -> None:
    """Register a model whose class changed after `PreTrainedModel.__init__` for transformers' output recording
    (`output_attentions`, `output_hidden_states`), which looks up what to record by the model's class."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


def metric_layer_index(module: nn.Module) -> int:
    """The layer index a layer calls its stack's `CrossHeadMetric` with: `metric_layer_index`, set when the layer was
    converted (its own index, or past the decoder's self-attention layers for an encoder-decoder's cross-attention);
    its `layer_idx` for a layer built otherwise."""
    index = module.__dict__.get("metric_layer_index")
    return index if index is not None else module.layer_idx or 0


def check_attention_backend(metric_context: str, attn_implementation: str | None) -> None:
    """The expanded-query form gives the query a wider head than the value, which only eager and SDPA accept."""
    if metric_context == "query" and attn_implementation not in (None, "eager", "sdpa"):
        raise ValueError(
            f"`metric_context='query'` needs `attn_implementation` 'eager' or 'sdpa' (its query and key heads are "
            f"wider than its value heads); got {attn_implementation!r}. Use `metric_context='token'` for "
            f"{attn_implementation}, or load the model with `attn_implementation='sdpa'`."
        )


def _backend_copies_its_inputs(attn_implementation: str | None, dropout: float, query: torch.Tensor) -> bool:
    """Whether the attention function saves copies of q, k, v for backward rather than the tensors themselves.

    Eager attention and SDPA's math fallback (which a CPU takes when attention dropout is on) do: they then keep no
    view into a fused `c_attn` projection alive, and a key mixing that saved its input as such a view would keep the
    whole `(b, s, 3d)` projection alive for backward on its own (3 keys' worth per layer). The fused kernels save the
    q, k, v views themselves, so the projection is kept anyway and a view costs nothing.
    """
    if not (torch.is_grad_enabled() and query.requires_grad):
        return False
    if attn_implementation == "eager":
        return True
    return attn_implementation == "sdpa" and dropout > 0 and query.device.type == "cpu"


def cross_head_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    metric: CrossHeadMetric | None = None,
    default_attention: Callable,
    dropout: float,
    cache=None,
    past_key_values=None,
    token_mask: torch.Tensor | None = None,
    key_projection: nn.Module | None = None,
    source_states: torch.Tensor | None = None,
    metric_context: str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-head attention for any model, dispatched on `config.cross_head_variant`; updates the KV cache.

    `module` is the model's attention layer (it provides `config`, `layer_idx`, `scaling` and the head count, and for
    `"talking_heads"` / `"dcmha"` its `cross_head_mixing` module from `build_cross_head_mixing`);
    `query`, `key`, `value` are its `(batch, heads, seq, head_dim)` projections of `hidden_states`;
    `metric` is the model's `CrossHeadMetric` (`"damcha"` only);
    `default_attention` is the model's eager attention function, used when `config._attn_implementation` is eager.
    `cache` (transformers >= 5.24) or `past_key_values` (5.23 and earlier) is the KV cache, a plain or an
    `EncoderDecoderCache` (whose self-attention part is updated); `token_mask` `(batch, seq)` marks the real tokens
    for `"sequence"` (see `cross_head_query_key`). A layer with its own key projection may pass `key=None` and
    `key_projection` (its `k_proj`), so that `"sequence"` and `"token"` can project and mix the key in one step.
    `metric_context` overrides `config.metric_context` for this layer (an encoder-decoder's encoder has its own).

    Cross-attention (an encoder-decoder's decoder): `source_states` are the encoder outputs the keys and values come
    from, and `key`, `value` their projections; the source's keys are mixed once and kept, mixed, in the
    `EncoderDecoderCache`'s cross-attention part, so later steps pass `key=value=None`
    (`cross_attention_source_cached`) and only the query side is computed.
    Returns `(attn_output (batch, seq, heads, head_dim), attn_weights or None)` as the attention functions do.

    `"damcha"` mixes `(query, key)` and runs the configured attention function (`metric_form="keys"`), or mixes the
    score maps in eager attention (`"scores"`); `"none"` runs the attention function on the plain projections;
    `"talking_heads"` and `"dcmha"` run `score_mixing_attention`.
    """
    config = module.config
    # Each config field is read once: a transformers config attribute costs microseconds per read (its
    # `__getattribute__` hooks), which batch-1 decoding pays per layer and step.
    variant = config.cross_head_variant
    attn_implementation = config._attn_implementation
    if variant != "damcha":
        metric_context = None
    elif metric_context is None:
        metric_context = config.metric_context
    scores_form = variant == "damcha" and config.metric_form == "scores"
    # transformers renamed the cache argument in 5.24; whichever name the caller used, it is the same cache.
    cache = cache if cache is not None else past_key_values
    if source_states is None:
        cache, key_states = self_attention_cache(cache), hidden_states
    else:
        cache, key_states = SourceKeyCache.of(cache, module.layer_idx), source_states
        if cache is not None and cache.filled:  # the source's keys, values (and key-side weights) as stored
            (key, value), cache, key_states = cache.stored(), None, None
    if key is None and key_states is not None and (scores_form or metric_context not in ("sequence", "token")):
        key = project_heads(key_projection, key_states, query.shape[-1])
    mixing = layer_mixing(module) if variant in SCORE_MIXING_VARIANTS else None
    if variant == "damcha":
        if metric is None:
            raise ValueError(
                f"{type(module).__name__}: `cross_head_variant='damcha'` needs the model's `cross_head_metric`; call "
                "the layer through its model, which passes it."
            )
        if metric_context == "sequence" and getattr(module, "is_causal", False):
            # The config refuses this, but a field set on a built model (`model.config.metric_context = ...`) is
            # checked only here, where it would otherwise let every token see the ones after it.
            raise ValueError(
                f"{type(module).__name__} is causal, but `config.metric_context` is 'sequence', which averages over "
                "the whole sequence and would let each token see later ones; set `config.metric_context = 'token'` "
                "(or 'query') on this model."
            )
        metric_layer = metric_layer_index(module)
        if scores_form:
            mixing = MetricScoreMixing(
                metric,
                layer_idx=metric_layer,
                metric_context=metric_context,
                metric_mask=config.metric_mask,
                num_key_value_heads=(key if key is not None else value).shape[1],
                token_mask=token_mask,
            )
        else:
            check_attention_backend(metric_context, attn_implementation)
            if key_states is None:  # cached source keys are mixed already; "query" still expands the new queries
                if metric_context == "query":
                    query = expanded_query(query, metric(hidden_states, metric_layer, config.metric_mask))
            else:
                query, key = cross_head_query_key(
                    query,
                    key,
                    hidden_states,
                    metric,
                    layer_idx=metric_layer,
                    metric_context=metric_context,
                    metric_mask=config.metric_mask,
                    token_mask=token_mask,
                    compact_saved_key=_backend_copies_its_inputs(attn_implementation, dropout, query),
                    key_projection=key_projection,
                    key_states=key_states,
                )
    if mixing is not None:
        return score_mixing_cross_head_attention(
            module, hidden_states, query, key, value, attention_mask, mixing=mixing, dropout=dropout, cache=cache,
            key_states=key_states, **kwargs,
        )  # fmt: skip
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    key = full_width_key(query, key)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, default_attention)
    return attention_interface(
        module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, **kwargs
    )
