"""DAMCHA (`cross_head_variant="damcha"`): its declaration and its config fields.

The math (the metric generator `C = I + G(z)` and the key mixing `K~_i = sum_j C_ij K_j`, and the `"scores"` reading)
and what a layer runs of it at each call are `metric.py`'s `CrossHeadMetric`, the module one layer stack shares.
Torch-free at import (see `cross_head_variant.py`). Part of the remote-code payload.
"""

from .config_rules import ConfigField, choice_rule, positive_int_rule
from .cross_head_variant import ALL_BACKENDS, STACK_MODULE, CrossHeadVariant
from .metric_choices import (
    METRIC_CONTEXTS,
    METRIC_FORMS,
    METRIC_INPUT_NORMS,
    METRIC_MASKS,
    METRIC_SHARINGS,
    QUERY_CONTEXT_BACKENDS,
)


class Damcha(CrossHeadVariant):
    name = "damcha"
    display_name = "DAMCHA"
    summary = "the data-adaptive cross-head metric (the metric_* fields)"
    description = "DAMCHA: data-adaptive cross-head metric attention"
    config_doc = '`"damcha"` (data-adaptive cross-head metric, the `metric_*` fields)'
    reference = "Data-Adaptive Mahalanobis Metric Learning for Cross-Head Attention in Transformers, NeurIPS 2026"
    parameter_kind = "metric-generator"
    module_place = STACK_MODULE
    # The metric mixes every key/value head of a layer, and one generator serves every layer of the stack.
    serves_split_heads = False
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
            return QUERY_CONTEXT_BACKENDS
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

    def serving_refusal(self, config) -> str | None:
        if config.metric_form != "keys":
            return (
                f"vLLM cannot serve `metric_form={config.metric_form!r}`: it mixes the attention score maps, which "
                "vLLM's paged kernels never form"
            )
        contexts = {config.metric_context, getattr(config, "encoder_context", config.metric_context)}
        for context, reason in (
            ("query", "its query heads are wider than the key and value heads vLLM's cache and kernels hold"),
            ("sequence", "it averages over the sequence, and vLLM's sequence joins the tokens of many requests"),
        ):
            if context in contexts:
                return f"vLLM cannot serve `metric_context={context!r}`: {reason}"
        return None

    # --- the model's modules ----------------------------------------------------------------------------------------

    def module_class(self) -> type:
        from .metric import CrossHeadMetric

        return CrossHeadMetric

    def init_weights(self, module, std: float) -> None:
        from .metric import init_metric_generator

        init_metric_generator(module)


def query_context_refusal(requested: str) -> str:
    return (
        f"`metric_context='query'` needs `attn_implementation` 'eager' or 'sdpa' (its query and key heads are wider "
        f"than its value heads); got {requested!r}. Use `metric_context='token'` for {requested}, or load the model "
        "with `attn_implementation='sdpa'`."
    )


VARIANT = Damcha()
