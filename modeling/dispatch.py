"""The attention core every DAMCHA layer calls (`cross_head_attention_inputs`): it normalises the KV cache, lets the
config's attention variant (`variants.py`) prepare the query and key or name a score mixing, updates the cache and
returns ordinary `(query, key, value)` with the eager attention function for them; the layer's own `forward` looks up
transformers' attention function (`ALL_ATTENTION_FUNCTIONS`) and calls it, as a stock layer does, so that anything
that swaps in its own attention function (a serving engine's paged attention) sees the usual shape. A score mixing
runs in eager attention (`score_mixing.py`). Plus which backend a config can run on (`attn_implementation_for`) and
what a serving engine cannot run (`serving_refusal`). The KV-cache adaptor and the transformers-version warning are
`transformers_releases.py`'s.

This file imports only torch, transformers and its siblings: it is part of the remote-code payload.
"""

import sys
from collections.abc import Callable

import torch
from torch import nn

from .attention_heads import PLAIN_ATTENTION, CrossHeadModule, full_width_key, project_heads
from .cross_head_variant import ALL_BACKENDS, BOUND_VARIANT, LAYER_MODULE, STACK_MODULE, CrossHeadVariant
from .transformers_releases import SourceKeyCache, self_attention_cache
from .variants import variant_of

# The attention implementations vLLM's Transformers backend registers and sets on a model's config before building it.
SERVING_ATTN_IMPLEMENTATIONS = ("vllm", "vllm_mla")
SERVED_SETTING = "`cross_head_variant='damcha'` with `metric_form='keys'` and `metric_context='token'` (the defaults)"


def serving_refusal(config, parallel_sizes: tuple[int, int] | None = None) -> str | None:
    """Why vLLM cannot serve `config` (one line naming the setting and what to use), or None where it can.

    vLLM's Transformers backend calls a layer's attention function with one flattened sequence holding the tokens of
    every scheduled request, keeps the keys it returns in its paged cache, and computes attention in its own kernels.
    Key-side mixing with a key-token context (`"token"`) fits that exactly: each cached key is mixed from its own
    token's heads, whatever else is scheduled beside it. What does not fit is refused, never run: a mixing of the
    score maps (no paged kernel exposes them), a query wider than the cached heads (`"query"`, ColMHA), a metric that
    averages over a sequence (vLLM's sequence is a batch of requests), a gate on each head's output (MoA; vLLM's
    attention returns the heads already joined), and heads split across devices (tensor parallelism; the metric mixes
    heads that would live on other devices) or layers split from the stack's one generator (pipeline parallelism).
    `parallel_sizes` are vLLM's (tensor, pipeline) parallel sizes, read from vLLM when not given.
    """
    name = type(config).__name__
    use = f"serve {SERVED_SETTING}, or run this model with transformers"
    if getattr(config, "is_encoder_decoder", False):
        return (
            f"{name}: vLLM's Transformers backend serves decoder-only models, not encoder-decoders; run this "
            "model with transformers' `generate`."
        )
    variant = variant_of(config)
    refusal = variant.serving_refusal(config)
    if refusal is not None:
        return f"{name}: {refusal}; {use}."
    if variant.serves_split_heads:
        return None
    tensor_parallel, pipeline_parallel = parallel_sizes or _vllm_parallel_sizes()
    if tensor_parallel > 1:
        return (
            f"{name}: vLLM's tensor parallelism ({tensor_parallel}) would split the key/value heads the metric mixes "
            "across devices; serve with `--tensor-parallel-size 1` (more replicas: `--data-parallel-size`)."
        )
    if pipeline_parallel > 1:
        return (
            f"{name}: vLLM's pipeline parallelism ({pipeline_parallel}) would keep the stack's one metric generator on "
            "one stage while every stage's layers need it; serve with `--pipeline-parallel-size 1` (more replicas: "
            "`--data-parallel-size`)."
        )
    return None


def _vllm_parallel_sizes() -> tuple[int, int]:
    """vLLM's tensor and pipeline parallel sizes in the process building the model, read from the `vllm.distributed`
    module the engine has loaded (this file imports nothing beyond torch and transformers); (1, 1) where it has not,
    or where its groups are not set up (a model built outside an engine)."""
    distributed = sys.modules.get("vllm.distributed")
    try:
        return distributed.get_tensor_model_parallel_world_size(), distributed.get_pp_group().world_size
    except (AssertionError, RuntimeError, AttributeError):
        return 1, 1


def attn_implementation_for(config, requested) -> str | None:
    """The attention backend a model must use for `config`'s variant, or None where the usual resolution applies.

    A variant that runs only in eager attention (one that mixes the score maps) gets `"eager"` when no backend was
    requested; a backend the variant cannot run on gets a `ValueError` naming `attn_implementation` and the fix, and
    vLLM's (set when vLLM builds the model) a `ValueError` for a setting vLLM cannot serve (`serving_refusal`). Models
    call this from `_check_and_adjust_attn_implementation`, so that construction, `from_pretrained` and
    `set_attn_implementation` all resolve the same way.
    """
    if requested in SERVING_ATTN_IMPLEMENTATIONS and (refusal := serving_refusal(config)) is not None:
        raise ValueError(refusal)
    variant = variant_of(config)
    backends = variant.backends(config)
    if requested is None or isinstance(requested, dict):  # a dict sets sub-configs' backends: theirs to check
        return "eager" if backends == ("eager",) and requested is None else None
    if backends != ALL_BACKENDS and requested not in backends:
        raise ValueError(variant.backend_refusal(config, requested))
    return None


def cross_head_attention_inputs(
    module: nn.Module,
    hidden_states: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable]:
    """What a layer's attention function gets, dispatched on `config.cross_head_variant`; updates the KV cache.

    Returns `(query, key, value, eager_attention)`. The layer's `forward` then looks its attention function up itself
    and calls it once, with the layer's scaling:

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        attn_output = cross_head_attention_output(self, attn_output, hidden_states)

    That is the shape of a stock transformers attention layer, and the one that serving engines which swap in their
    own attention function recognise by reading the `forward` (vLLM's Transformers backend, whose paged cache then
    holds the mixed keys); `tests/test_serving_shape.py` checks it in every family.

    `module` is the model's attention layer (it provides `config`, `layer_idx`, `scaling` and the head count, and the
    per-layer module of a variant that has one, `cross_head_mixing`);
    `query`, `key`, `value` are its `(batch, heads, seq, head_dim)` projections of `hidden_states`;
    `metric` is the layer stack's module (DAMCHA's `CrossHeadMetric`), None for a variant without one;
    `default_attention` is the model's eager attention function, returned as `eager_attention` (what the lookup gives
    when `config._attn_implementation` is eager) unless the variant mixes the score maps.
    `cache` (transformers >= 5.24) or `past_key_values` (5.23 and earlier) is the KV cache, a plain or an
    `EncoderDecoderCache` (whose self-attention part is updated); `token_mask` `(batch, seq)` marks the real tokens
    for `"sequence"` (see `cross_head_query_key`). A layer with its own key projection may pass `key=None` and
    `key_projection` (its `k_proj`), so that `"sequence"` and `"token"` can project and mix the key in one step.
    `metric_context` overrides `config.metric_context` for this layer (an encoder-decoder's encoder has its own).
    `kwargs` are the layer's other keyword arguments, which the cache update reads as the stock layers pass them.

    Cross-attention (an encoder-decoder's decoder): `source_states` are the encoder outputs the keys and values come
    from, and `key`, `value` their projections; the source's keys are mixed once and kept, mixed, in the
    `EncoderDecoderCache`'s cross-attention part, so later steps pass `key=value=None`
    (`cross_attention_source_cached`) and only the query side is computed.

    The variant's module decides (`attention_heads.CrossHeadModule.attention_inputs`; the layer's own, or the stack's
    `metric`, as the variant's declaration places it): DAMCHA's `CrossHeadMetric` mixes `(query, key)` for the
    configured attention function (`metric_form="keys"`) or names a score mixing (`"scores"`); talking-heads and DCMHA
    name their layer's mixing. A score mixing runs in eager attention only: its `eager_attention` is
    `score_mixing_attention` bound to the mixing (the variant refuses every other backend), so the layer's one call
    runs it. Plain attention passes the projections through.
    """
    # The variant was bound when the layer was built, and its module reads each config field it needs once: a
    # transformers config attribute costs microseconds per read (its `__getattribute__` hooks), and a registry lookup
    # about as much, which batch-1 decoding pays per layer and step.
    variant = layer_variant(module)
    variant_module = attention_module(module, variant, metric)
    # transformers renamed the cache argument in 5.24; whichever name the caller used, it is the same cache.
    cache = cache if cache is not None else past_key_values
    if source_states is None:
        cache, key_states = self_attention_cache(cache), hidden_states
    else:
        cache, key_states = SourceKeyCache.of(cache, module.layer_idx), source_states
        if cache is not None and cache.filled:  # the source's keys, values (and key-side weights) as stored
            (key, value), cache, key_states = cache.stored(), None, None
    if key is None and key_states is not None and not variant_module.projects_key:
        key = project_heads(key_projection, key_states, query.shape[-1])
    query, key, mixing = variant_module.attention_inputs(
        module, query, key, value, hidden_states=hidden_states, key_states=key_states, metric_context=metric_context,
        token_mask=token_mask, key_projection=key_projection, dropout=dropout, variant=variant,
    )  # fmt: skip
    if mixing is not None:
        # The backend is read here and where a module needs it only: the layer's `forward` reads it for its lookup.
        variant.check_backend_of_built_model(module.config, ("eager",))
        return mixing.score_mixing_inputs(
            module, hidden_states, query, key, value, cache=cache, key_states=key_states, **kwargs
        )
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    key = full_width_key(query, variant_module.attended_key(module, key))
    return query, key, value, default_attention


def cross_head_attention_output(module: nn.Module, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """The heads' outputs the layer projects, from what its attention function returned: the layer's own module
    gates them (MoA, per token); a layer without one returns `output` as it is."""
    layer_module = module._modules.get(LAYER_MODULE)
    return output if layer_module is None else layer_module.attended_output(module, output, hidden_states)


def layer_variant(module: nn.Module) -> CrossHeadVariant:
    """The attention variant's declaration of the layer `module`, kept when the layer was turned into a DAMCHA layer
    (`DamchaAttentionMixin.adopt_stock_layer`); a layer built on its own, by its stock `__init__`, takes it on its first
    call. A layer is built for one variant (its modules are that variant's), so the registry is not consulted again."""
    variant = module.__dict__.get(BOUND_VARIANT)
    if variant is None:
        variant = variant_of(module.config)
        setattr(module, BOUND_VARIANT, variant)
    return variant


def attention_module(layer: nn.Module, variant: CrossHeadVariant, metric: nn.Module | None) -> CrossHeadModule:
    """The variant's module whose methods run at `layer`'s attention call: where `variant` places it, the stack's
    `metric` (handed to the layer's call) or the layer's own `cross_head_mixing`; `PLAIN_ATTENTION` for a variant
    without one. A missing one is refused, never run as plain attention."""
    place = variant.module_place
    if place is None:
        return PLAIN_ATTENTION
    found = metric if place == STACK_MODULE else layer._modules.get(LAYER_MODULE)
    if found is None:
        raise ValueError(variant.missing_module_refusal(layer))
    return found
