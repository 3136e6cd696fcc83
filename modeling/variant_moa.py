"""Mixture of attention heads (`cross_head_variant="moa"`), a cross-head baseline: its declaration and its config
fields.

The router (`HeadRouter`, zero at the start), its gating of the heads' outputs and its losses are `moa.py`.
Torch-free at import (see `cross_head_variant.py`). Part of the remote-code payload.
"""

import warnings

from .config_rules import ConfigField, non_negative_float_rule, positive_int_rule
from .cross_head_variant import LAYER_MODULE, CrossHeadVariant, InexactStartWarning


class MixtureOfAttentionHeads(CrossHeadVariant):
    name = "moa"
    display_name = "MoA"
    summary = "a router picks the top-k heads of each token"
    description = "MoA (mixture of attention heads: a router picks the top-k heads of each token and gates them)"
    config_doc = (
        '`"moa"` (Zhang et al. 2022: a router picks the top `moa_top_k` heads of each token and gates their outputs; '
        "the load-balancing loss is reported as `aux_loss` and added to `loss`)"
    )
    reference = (
        "Zhang, Shen, Huang, Zhou, Rong and Xiong, Mixture of Attention Heads: Selecting Attention Heads Per Token, "
        "EMNLP 2022"
    )
    parameter_kind = "head-router"
    reports_auxiliary_loss = True
    module_place = LAYER_MODULE
    unservable_reason = "gates each head's output per token, and vLLM's attention returns the heads already joined"
    fields = {
        "moa_top_k": ConfigField(
            int | None,
            None,
            positive_int_rule(
                "the heads MoA's router keeps per token",
                "use at most `num_attention_heads`",
                none_means="half the heads",
            ),
            """        How many heads (MoA's experts) each token keeps, `k`: None (the default) keeps half the heads, rounded
        up; `num_attention_heads` keeps every head, where the layer starts as exact multi-head attention (the
        router only re-weights the heads per token). Used by `"moa"` only.""",
            help="heads each token keeps in MoA (default: half the heads; all heads start as exact MHA)",
        ),
        "moa_balance_loss_coef": ConfigField(
            float,
            0.01,
            non_negative_float_rule("the weight of MoA's load-balancing loss", "0.01 is the Switch Transformer's"),
            """        Weight of MoA's load-balancing loss (the Switch Transformer's `E sum_i f_i P_i`, 1 when the heads are
        used evenly) in the `aux_loss` the model adds to `loss`. Used by `"moa"` only.""",
            help="weight of MoA's load-balancing loss in aux_loss",
        ),
        "moa_z_loss_coef": ConfigField(
            float,
            0.001,
            non_negative_float_rule("the weight of MoA's router z-loss", "0.001 is ST-MoE's"),
            """        Weight of MoA's router z-loss (the mean squared log-partition of the router's logits) in `aux_loss`.
        Used by `"moa"` only.""",
            help="weight of MoA's router z-loss in aux_loss",
        ),
    }

    def config_refusal(self, config) -> str | None:
        top_k, heads = getattr(config, "moa_top_k", None), config.num_attention_heads
        if top_k is not None and top_k > heads:
            return (
                f"{type(config).__name__}: `moa_top_k` ({top_k}) is more than `num_attention_heads` ({heads}); use at "
                f"most {heads} (all heads: exact multi-head attention at the start), or None for half of them."
            )
        return None

    def exact_start_fields(self, config) -> dict:
        return {"moa_top_k": config.num_attention_heads}  # every head kept: a zero router weights them all 1

    def after_conversion(self, model, source, caller: str = "convert_to_damcha") -> None:
        from .moa import selected_heads

        config = model.config
        if selected_heads(config) < config.num_attention_heads:
            warnings.warn(
                f"{caller}: with `moa_top_k={config.moa_top_k}` each token keeps {selected_heads(config)} of "
                f"its {config.num_attention_heads} heads, so the converted model no longer computes what the source "
                f"did (MoA's design: no sparse start is exact); pass `moa_top_k={config.num_attention_heads}` to start "
                "as exactly the source.",
                InexactStartWarning,
                stacklevel=3,
            )

    def module_class(self) -> type:
        from .moa import HeadRouter

        return HeadRouter

    def init_weights(self, module, std: float) -> None:
        from .moa import init_moa

        init_moa(module, std)


VARIANT = MixtureOfAttentionHeads()
