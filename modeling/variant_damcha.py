"""DAMCHA (`cross_head_variant="damcha"`): its declaration, its config fields, and its attention hook.

The math (the metric generator `C = I + G(z)` and the key mixing `K~_i = sum_j C_ij K_j`, and the `"scores"` reading)
is `metric.py`; this file says which of it a layer runs. Torch-free at import (see `cross_head_variant.py`).
Part of the remote-code payload.
"""

from .config_rules import ConfigField, choice_rule, positive_int_rule
from .cross_head_variant import ALL_BACKENDS, CrossHeadVariant
from .metric_choices import METRIC_CONTEXTS, METRIC_FORMS, METRIC_INPUT_NORMS, METRIC_MASKS, METRIC_SHARINGS


class Damcha(CrossHeadVariant):
    name = "damcha"
    display_name = "DAMCHA"
    summary = "the data-adaptive cross-head metric (the metric_* fields)"
    description = "DAMCHA: data-adaptive cross-head metric attention"
    config_doc = '`"damcha"` (data-adaptive cross-head metric, the `metric_*` fields)'
    reference = "Data-Adaptive Mahalanobis Metric Learning for Cross-Head Attention in Transformers, NeurIPS 2026"
    parameter_kind = "metric-generator"
    fields = {
        "metric_hidden_size": ConfigField(
            int,
            64,
            positive_int_rule("the metric generator's hidden width", "64 is a good default"),
            "        Hidden width `r` of the metric generator MLP (`d -> r -> H*H`, GELU). Its output layer starts at "
            "zero, so\n        a fresh or converted model computes exactly multi-head attention.",
            help="hidden width r of the metric generator",
        ),
        "metric_context": ConfigField(
            str,
            "token",
            choice_rule(METRIC_CONTEXTS),
            """        What the cross-head matrix `C` depends on: `"token"` (the key token's hidden state; causal-safe),
        `"sequence"` (the mean hidden state of the sequence; bidirectional models only) or `"query"` (the query
        token's hidden state; exact, `H` times the cost of `QK^T`).""",
            help="what the cross-head matrix C depends on",
            documented_default=False,
        ),
        "metric_mask": ConfigField(
            str,
            "full",
            choice_rule(METRIC_MASKS),
            """        The paper's ablation, applicable at inference to a trained model: `"full"`, `"diagonal"` (no cross-head
        terms, `C_ij = 0` for `i != j`) or `"offdiagonal"` (`C_ii = 0`: head `i` scores only against the other
        heads' keys).""",
            help="the paper's ablation: full, diagonal, offdiagonal",
        ),
        "metric_sharing": ConfigField(
            str,
            "stack",
            choice_rule(METRIC_SHARINGS),
            """        `"stack"`: one generator shared by every layer (each layer feeds it its own input, so each layer still
        gets its own metric). `"layer"`: one generator per layer, for ablation.""",
            help="one generator per stack or per layer",
        ),
        "metric_input_norm": ConfigField(
            str,
            "none",
            choice_rule(METRIC_INPUT_NORMS),
            """        What the metric generator reads: `"none"`, the layer's own normalised attention input (as the attention
        does), or `"layernorm"`, that input through a LayerNorm of the generator's own (gain 1 and bias 0 at the
        start), so that the generator's input scale is its own to learn rather than set by the attention's norm.""",
            help="the metric generator's input: none (the attention's normalised input) or layernorm (its own)",
        ),
        "metric_form": ConfigField(
            str,
            "keys",
            choice_rule(METRIC_FORMS),
            """        Which reading of the paper's metric (derived in `metric.py`): `"keys"`, head `i` scores against the keys of
        every head mixed by `C` (rank `d_h` per head; every attention backend and the plain KV cache), or `"scores"`,
        head `i` scores with `sum_j C_ij Q_j K_j^T` (rank up to `H * d_h`; mixes the score maps, so eager attention
        only).""",
            help="keys (mixed keys, every backend) or scores (sum_j C_ij Q_j K_j^T, eager attention only); see "
            "modeling/metric.py",
        ),
    }

    # --- the config -------------------------------------------------------------------------------------------------

    @staticmethod
    def _backends(metric_context: str, metric_form: str) -> tuple[str, ...]:
        if metric_form == "scores":  # mixes the score maps, which only eager attention materialises
            return ("eager",)
        if metric_context == "query":  # the expanded query is wider than the value: only eager and SDPA take it
            return ("eager", "sdpa")
        return ALL_BACKENDS

    def backends(self, config) -> tuple[str, ...]:
        # An encoder-decoder's encoder may have a context of its own (BART's `encoder_context`).
        contexts = {config.metric_context, getattr(config, "encoder_context", config.metric_context)}
        allowed = [self._backends(context, config.metric_form) for context in contexts]
        return min(allowed, key=len)

    def backend_refusal(self, config, requested: str) -> str:
        if config.metric_form == "scores":
            return (
                "`metric_form='scores'` mixes the attention score maps across heads, which only eager attention "
                f"materialises, so it cannot run with `attn_implementation={requested!r}`. Load or build the model with "
                "`attn_implementation='eager'` (or leave it unset), or use DAMCHA's `metric_form='keys'` or "
                "`cross_head_variant='none'`, which run on every backend."
            )
        return query_context_refusal(requested)

    def head_layout_refusal(self, config, heads: int, key_value_heads: int) -> str | None:
        if config.metric_form == "keys" and key_value_heads == 1 and heads > 1:
            return (
                f"{type(config).__name__}: `num_key_value_heads=1` (multi-query attention) leaves DAMCHA no key/value "
                "heads to mix across (`C` would be 1 x 1, a per-token rescaling of the one key, not a cross-head "
                "metric). Use a checkpoint with `num_key_value_heads` >= 2, `metric_form='scores'` (which mixes the "
                "query heads' score maps), or `cross_head_variant='none'` for the plain model."
            )
        return None

    # --- the model's modules ----------------------------------------------------------------------------------------

    def stack_module(self, config, **layout):
        from .metric import CrossHeadMetric

        return CrossHeadMetric.from_config(config, **layout)

    def init_weights(self, module, std: float) -> None:
        from .metric import init_metric_generator

        init_metric_generator(module)

    # --- attention --------------------------------------------------------------------------------------------------

    # "token" and "sequence" mix the keys as they project them (`metric.cross_head_query_key`), in one step; the other
    # settings project the key in the hook, so that the config's fields are read once per call.
    projects_key = True

    def bind(self) -> "Damcha":
        from .metric import (
            MetricScoreMixing,
            backend_copies_its_inputs,
            cross_head_query_key,
            expanded_query,
            project_heads,
        )

        self.metric_score_mixing = MetricScoreMixing
        self.backend_copies_its_inputs = backend_copies_its_inputs
        self.cross_head_query_key = cross_head_query_key
        self.expanded_query = expanded_query
        self.project_heads = project_heads
        return self

    def attention_inputs(self, module, query, key, value, *, hidden_states, key_states, metric, **options):
        config = module.config
        metric_context = options.get("metric_context") or config.metric_context
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
        # Read per call, since they may change on a built model (`model.config.metric_mask = "diagonal"`, the
        # paper's ablation at inference); everything else the layer needs was bound when it was built.
        metric_form, metric_mask = config.metric_form, config.metric_mask
        metric_layer = metric_layer_index(module)
        token_mask = options.get("token_mask")
        if metric_form == "scores":
            if key is None:
                key = self.project_heads(options.get("key_projection"), key_states, query.shape[-1])
            mixing = self.metric_score_mixing(
                metric,
                layer_idx=metric_layer,
                metric_context=metric_context,
                metric_mask=metric_mask,
                num_key_value_heads=(key if key is not None else value).shape[1],
                token_mask=token_mask,
            )
            return query, key, mixing
        attn_implementation, dropout = options.get("attn_implementation"), options.get("dropout", 0.0)
        allowed = self._backends(metric_context, "keys")
        if allowed != ALL_BACKENDS and attn_implementation not in (None, *allowed):
            raise ValueError(query_context_refusal(attn_implementation))
        if key_states is None:  # cached source keys are mixed already; "query" still expands the new queries
            if metric_context == "query":
                query = self.expanded_query(query, metric(hidden_states, metric_layer, metric_mask))
            return query, key, None
        query, key = self.cross_head_query_key(
            query,
            key,
            hidden_states,
            metric,
            layer_idx=metric_layer,
            metric_context=metric_context,
            metric_mask=metric_mask,
            token_mask=token_mask,
            compact_saved_key=self.backend_copies_its_inputs(attn_implementation, dropout, query),
            key_projection=options.get("key_projection"),
            key_states=key_states,
        )
        return query, key, None


def query_context_refusal(requested: str) -> str:
    return (
        f"`metric_context='query'` needs `attn_implementation` 'eager' or 'sdpa' (its query and key heads are wider "
        f"than its value heads); got {requested!r}. Use `metric_context='token'` for {requested}, or load the model "
        "with `attn_implementation='sdpa'`."
    )


def metric_layer_index(module) -> int:
    """The layer index a layer calls its stack's `CrossHeadMetric` with: `metric_layer_index`, set when the layer was
    converted (its own index, or past the decoder's self-attention layers for an encoder-decoder's cross-attention);
    its `layer_idx` for a layer built otherwise."""
    index = module.__dict__.get("metric_layer_index")
    return index if index is not None else module.layer_idx or 0


VARIANT = Damcha()
