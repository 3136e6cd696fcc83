"""The attention entry point every DAMCHA model calls (`cross_head_attention`): it normalises the KV cache, lets the
config's attention variant (`variants.py`) prepare the query and key or name a score mixing, updates the cache and hands
ordinary `(query, key, value)` to transformers' attention functions (`ALL_ATTENTION_FUNCTIONS`), or runs the score
mixing in eager attention (`score_mixing.py`); plus which backend a config can run on (`attn_implementation_for`). The
KV-cache adaptor and the transformers-version warning are `transformers_releases.py`'s.

This file imports only torch, transformers and its siblings: it is part of the remote-code payload.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cross_head_variant import ALL_BACKENDS
from .metric import full_width_key, project_heads
from .score_mixing import score_mixing_cross_head_attention
from .transformers_releases import SourceKeyCache, self_attention_cache
from .variants import variant_of


def register_output_recording(model: nn.Module) -> None:
    """Register a model whose class changed after `PreTrainedModel.__init__` for transformers' output recording
    (`output_attentions`, `output_hidden_states`), which looks up what to record by the model's class."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


def attn_implementation_for(config, requested) -> str | None:
    """The attention backend a model must use for `config`'s variant, or None where the usual resolution applies.

    A variant that runs only in eager attention (one that mixes the score maps) gets `"eager"` when no backend was
    requested; a backend the variant cannot run on gets a `ValueError` naming `attn_implementation` and the fix. Models
    call this from `_check_and_adjust_attn_implementation`, so that construction, `from_pretrained` and
    `set_attn_implementation` all resolve the same way.
    """
    variant = variant_of(config)
    backends = variant.backends(config)
    if requested is None or isinstance(requested, dict):  # a dict sets sub-configs' backends: theirs to check
        return "eager" if backends == ("eager",) and requested is None else None
    if backends != ALL_BACKENDS and requested not in backends:
        raise ValueError(variant.backend_refusal(config, requested))
    return None


def cross_head_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    metric: nn.Module | None = None,
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

    `module` is the model's attention layer (it provides `config`, `layer_idx`, `scaling` and the head count, and the
    per-layer module of a variant that has one, `cross_head_mixing`);
    `query`, `key`, `value` are its `(batch, heads, seq, head_dim)` projections of `hidden_states`;
    `metric` is the layer stack's module (DAMCHA's `CrossHeadMetric`), None for a variant without one;
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

    The variant's `attention_inputs` hook decides: DAMCHA mixes `(query, key)` for the configured attention function
    (`metric_form="keys"`) or names a score mixing (`"scores"`); talking-heads and DCMHA name their layer's mixing,
    run by `score_mixing_attention`; plain attention passes the projections through. Its `attended_output` hook then
    sees the heads' outputs (MoA gates them per token).
    """
    config = module.config
    # Each config field is read once: a transformers config attribute costs microseconds per read (its
    # `__getattribute__` hooks), which batch-1 decoding pays per layer and step.
    variant = variant_of(config)
    attn_implementation = config._attn_implementation
    # transformers renamed the cache argument in 5.24; whichever name the caller used, it is the same cache.
    cache = cache if cache is not None else past_key_values
    if source_states is None:
        cache, key_states = self_attention_cache(cache), hidden_states
    else:
        cache, key_states = SourceKeyCache.of(cache, module.layer_idx), source_states
        if cache is not None and cache.filled:  # the source's keys, values (and key-side weights) as stored
            (key, value), cache, key_states = cache.stored(), None, None
    if key is None and key_states is not None and not variant.projects_key(config, metric_context):
        key = project_heads(key_projection, key_states, query.shape[-1])
    query, key, mixing = variant.attention_inputs(
        module, query, key, value, hidden_states=hidden_states, key_states=key_states, metric=metric,
        metric_context=metric_context, token_mask=token_mask, key_projection=key_projection, dropout=dropout,
        attn_implementation=attn_implementation,
    )  # fmt: skip
    if mixing is not None:
        output, weights = score_mixing_cross_head_attention(
            module, hidden_states, query, key, value, attention_mask, mixing=mixing, dropout=dropout, cache=cache,
            key_states=key_states, **kwargs,
        )  # fmt: skip
    else:
        if cache is not None:
            key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
        key = full_width_key(query, variant.attended_key(module, key))
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, default_attention)
        output, weights = attention_interface(
            module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, **kwargs
        )
    return variant.attended_output(module, output, hidden_states), weights
