"""DCMHA, dynamically composable multi-head attention (`cross_head_variant="dcmha"`), the dynamic cross-head baseline:
its declaration and its config field.

The composition itself (`DynamicHeadComposition`, identity at init) is `dcmha.py`; it runs in eager attention through
`score_mixing.py`. Part of the remote-code payload.
"""

from .config_rules import ConfigField, positive_int_rule
from .cross_head_variant import ScoreMixingVariant


class DynamicallyComposableAttention(ScoreMixingVariant):
    name = "dcmha"
    display_name = "DCMHA"
    summary = "dynamic per-query and per-key composition of the score maps"
    description = "DCMHA (dynamically composable multi-head attention: input-dependent mixing of the score maps)"
    config_doc = (
        '`"dcmha"` (Xiao et al. 2024: dynamic per-query and per-key low-rank plus diagonal composition of both maps)'
    )
    reference = "Xiao, Meng, Li and Yuan, Improving Transformers with Dynamically Composable Multi-Head Attention, 2024"
    fields = {
        "dcmha_rank": ConfigField(
            int,
            2,
            positive_int_rule("the rank of DCMHA's dynamic head projections", "2 is the paper's choice"),
            "        Rank `R` of DCMHA's query-wise and key-wise dynamic projections (the paper uses 2). Used by "
            '`"dcmha"` only.',
            help="rank R of DCMHA's dynamic head projections",
        )
    }

    def module_class(self) -> type:
        from .dcmha import DynamicHeadComposition

        return DynamicHeadComposition

    def init_weights(self, module, std: float) -> None:
        from .dcmha import init_dcmha

        init_dcmha(module, std)


VARIANT = DynamicallyComposableAttention()
