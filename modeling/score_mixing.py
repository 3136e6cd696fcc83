"""The score-mixing baselines' attention: talking-heads and DCMHA mix the `n x n` score maps across heads, which no
fused kernel exposes, so they run in eager attention with materialised maps (`score_mixing_attention`), and a model
refuses any other `attn_implementation` for them (`eager_attn_implementation_for`).

This file imports only torch and its siblings: it is part of the remote-code payload.
"""

import torch
from torch import nn

from .damcha_config import SCORE_MIXING_VARIANT_NAMES
from .dcmha import DynamicHeadComposition
from .talking_heads import TalkingHeadsMixing

# Variants that mix the n x n score maps across heads, so that only eager attention can run them.
SCORE_MIXING_VARIANTS = dict(zip(SCORE_MIXING_VARIANT_NAMES, (TalkingHeadsMixing, DynamicHeadComposition), strict=True))


def build_cross_head_mixing(config) -> nn.Module | None:
    """The per-layer module of a score-mixing variant (`TalkingHeadsMixing`, `DynamicHeadComposition`), else None.

    A model's attention layer stores it as `cross_head_mixing`, where `cross_head_attention` finds it.
    """
    mixing_class = SCORE_MIXING_VARIANTS.get(config.cross_head_variant)
    return None if mixing_class is None else mixing_class.from_config(config)


def mixes_score_maps(config) -> bool:
    """Talking-heads, DCMHA and DAMCHA's `metric_form="scores"` mix the `n x n` score maps across heads."""
    variant = config.cross_head_variant
    return variant in SCORE_MIXING_VARIANTS or (variant == "damcha" and config.metric_form == "scores")


def eager_attn_implementation_for(config, requested: str | None) -> str | None:
    """The attention backend a model must use for `config`'s variant, or None where the usual resolution applies.

    Score-mixing attention needs the materialised score maps: it gets `"eager"` when no backend was requested, and a
    `ValueError` naming `attn_implementation` and the fix when another one was. Models call this from
    `_check_and_adjust_attn_implementation`, so that construction, `from_pretrained` and `set_attn_implementation`
    all resolve the same way.
    """
    if not mixes_score_maps(config):
        return None
    if requested not in (None, "eager"):
        chosen = (
            "`metric_form='scores'`"
            if config.cross_head_variant == "damcha"
            else f"`cross_head_variant={config.cross_head_variant!r}`"
        )
        raise ValueError(
            f"{chosen} mixes the attention score maps across heads, which only eager attention materialises, so it "
            f"cannot run with `attn_implementation={requested!r}`. Load or build the model with "
            "`attn_implementation='eager'` (or leave it unset), or use DAMCHA's `metric_form='keys'` or "
            "`cross_head_variant='none'`, which run on every backend."
        )
    return "eager"


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


def layer_mixing(module: nn.Module) -> nn.Module:
    """The layer's talking-heads or DCMHA module, checked against its config's variant."""
    variant = module.config.cross_head_variant
    mixing = getattr(module, "cross_head_mixing", None)
    # A wrapper (PEFT's modules_to_save) stands in for the module and forwards its methods to the trained copy, so the
    # check looks through it instead of insisting on the class.
    if not isinstance(getattr(mixing, "original_module", mixing), SCORE_MIXING_VARIANTS[variant]):
        raise ValueError(
            f"{type(module).__name__} has no `cross_head_mixing` module for `cross_head_variant={variant!r}`; build "
            "it with `build_cross_head_mixing(config)`."
        )
    return mixing


def score_mixing_cross_head_attention(
    module, hidden_states, query, key, value, attention_mask, *, mixing, dropout, cache=None, key_states, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention whose score maps `mixing` mixes across heads, with the cache update.

    `mixing` gives per-token weights (`dynamic_weights`, of the queries `hidden_states` and of the keys' tokens
    `key_states`) and mixes the maps before and after the softmax (`mix_logits`, `mix_probabilities`). Its key-side
    weights are concatenated to the keys (last dim) before the cache update and split off after it, so the cache
    stores them per position with the keys and any cache class carries them. `key_states=None`: `key` and `value`
    come from the cache as it stored them (a cross-attention layer's source), weights included.
    """
    config = module.config
    if config._attn_implementation not in (None, "eager"):
        eager_attn_implementation_for(config, config._attn_implementation)  # raises the error that names the fix
    # The attention function's other keyword arguments (a sliding window, which the mask already applies in eager
    # attention) act through the mask; the soft-cap acts on the logits.
    softcap = kwargs.pop("softcap", None)
    query_weights, key_weights = mixing.dynamic_weights(hidden_states, key_states)
    if key_weights is not None:
        key = torch.cat([key, key_weights.to(key.dtype)], dim=-1)
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    head_dim = value.shape[-1]
    if key.shape[-1] > head_dim:  # the key-side weights ride behind each key
        key, key_weights = key.split([head_dim, key.shape[-1] - head_dim], dim=-1)
    return score_mixing_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        mixing=mixing,
        query_weights=query_weights,
        key_weights=key_weights,
        scaling=module.scaling,
        dropout=dropout,
        softcap=softcap,
    )
