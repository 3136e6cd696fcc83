"""Collaborative multi-head attention (`cross_head_variant="colmha"`), a cross-head baseline: its declaration and its
config field.

The heads' shared query and key and their mixing vectors (`CollaborativeMixing`, exact MHA at init) are `colmha.py`;
so is the re-parametrisation of a trained model that a compressed key dimension needs. Torch-free at import (see
`cross_head_variant.py`). Part of the remote-code payload.
"""

from .config_rules import ConfigField, positive_int_rule
from .cross_head_variant import LAYER_MODULE, CrossHeadVariant


class CollaborativeAttention(CrossHeadVariant):
    name = "colmha"
    display_name = "ColMHA"
    summary = "heads share one query/key projection, mixed per head"
    description = (
        "collaborative multi-head attention (ColMHA: the heads share one query and one key projection and differ by "
        "a learned mixing vector)"
    )
    config_doc = (
        '`"colmha"` (Cordonnier et al. 2020: the heads share one query and one key projection and differ by a '
        "learned mixing vector each)"
    )
    reference = (
        "Cordonnier, Loukas and Jaggi, Multi-Head Attention: Collaborate Instead of Concatenate, arXiv:2006.16362, 2020"
    )
    parameter_kind = "collaborative mixing"
    grouped_query = False
    backend_reason = (
        "scores each head against a shared key wider than its value, which only eager attention and SDPA take"
    )
    multi_head_only = "shares one query and one key of all heads' width among the heads"
    module_place = LAYER_MODULE
    unservable_reason = "attends with one shared query and key wider than the value heads vLLM's cache holds"
    fields = {
        "colmha_key_dim": ConfigField(
            int | None,
            None,
            positive_int_rule(
                "the shared query/key width of ColMHA",
                "leave it None for all heads' width",
                none_means="all heads' width",
            ),
            """        The shared query/key width `D~` of `"colmha"`: None (the default) keeps all heads' width
        `num_attention_heads * head_dim`, where the layer starts as exact multi-head attention; a smaller width
        compresses the shared query and key, fitted to a converted model's trained weights by a CP decomposition
        (the paper's re-parametrisation; not exact). Used by `"colmha"` only.""",
            help="ColMHA's shared query/key width (default: all heads' width, exact MHA at the start)",
        )
    }

    def backends(self, config) -> tuple[str, ...]:
        return ("eager", "sdpa")  # the shared query and key are wider than the value heads

    def config_refusal(self, config) -> str | None:
        key_dim = getattr(config, "colmha_key_dim", None)
        heads = config.num_attention_heads
        width = heads * (getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1))
        if key_dim is not None and key_dim > width:
            return (
                f"{type(config).__name__}: `colmha_key_dim` ({key_dim}) is wider than all heads' query width "
                f"({width}); use at most {width}, or None for exactly that width."
            )
        return None

    def module_class(self) -> type:
        from .colmha import CollaborativeMixing

        return CollaborativeMixing

    def init_weights(self, module, std: float) -> None:
        from .colmha import init_colmha

        init_colmha(module, std)

    def after_conversion(self, model, source, caller: str = "convert_to_damcha") -> None:
        from .colmha import CollaborativeMixing, reparametrize

        for layer in model.modules():
            if isinstance(getattr(layer, "cross_head_mixing", None), CollaborativeMixing):
                layer.colmha_reparametrization_error = reparametrize(layer)


VARIANT = CollaborativeAttention()
