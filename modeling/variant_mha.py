"""Plain multi-head attention (`cross_head_variant="none"`): the baseline every other variant starts as.

The model keeps its stock attention, on every backend, with no added parameters: the same code path as the other
variants, so that a comparison differs only in attention. Part of the remote-code payload.
"""

from .cross_head_variant import CrossHeadVariant


class MultiHeadAttention(CrossHeadVariant):
    name = "none"
    display_name = "MHA"
    summary = "plain multi-head attention"
    description = "plain multi-head attention"
    config_doc = '`"none"` (plain multi-head attention)'
    reference = "Vaswani et al. 2017"


VARIANT = MultiHeadAttention()
