"""Talking-heads attention (`cross_head_variant="talking_heads"`), the static cross-head baseline: its declaration.

The mixing itself (`TalkingHeadsMixing`: two learned `H x H` matrices, identity at init) is `talking_heads.py`; it runs
in eager attention through `score_mixing.py`. Part of the remote-code payload.
"""

from .cross_head_variant import ScoreMixingVariant


class TalkingHeads(ScoreMixingVariant):
    name = "talking_heads"
    display_name = "talking_heads"  # the row name the quality reports use
    summary = "static H x H mixing of the score maps"
    description = "talking-heads attention (static H x H mixing of the attention logits and weights)"
    config_doc = (
        '`"talking_heads"` (Shazeer et al. 2020: learned `H x H` mixing of the logits before the softmax and of the '
        "weights after it)"
    )
    reference = "Shazeer, Lan, Cheng, Ding and Hou, Talking-Heads Attention, arXiv:2003.02436, 2020"

    def module_class(self) -> type:
        from .talking_heads import TalkingHeadsMixing

        return TalkingHeadsMixing

    def init_weights(self, module, std: float) -> None:
        from .talking_heads import init_talking_heads

        init_talking_heads(module)


VARIANT = TalkingHeads()
