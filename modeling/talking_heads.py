"""Talking-heads attention, the static cross-head baseline (`cross_head_variant="talking_heads"`).

Formulation (Shazeer, Lan, Cheng, Ding and Hou, "Talking-Heads Attention", arXiv:2003.02436, 2020, Section 4 and its
pseudo-code): the attention logits of the `H` heads are mixed by a learned `H x H` matrix right before the softmax,
and the attention weights by a second one right after it:

    J_i = sum_j P_logits[i, j] * (Q_j K_j^T / sqrt(d_h))     (+ mask)
    W   = softmax(J)                                           (per head, over the keys)
    W'_i = sum_j P_weights[i, j] * W_j
    O_i = W'_i V_i

The paper allows different numbers of query/key heads, logit heads and value heads; here all three are `H`, so the
model keeps every weight of a multi-head checkpoint. Both matrices start at the identity, so a fresh or converted
layer computes exactly multi-head attention. The matrices are input-independent (that is what separates this
baseline from DAMCHA and DCMHA). Row `i` is the output head, as for DAMCHA's `C_ij`.

Because it mixes the `n x n` score maps, talking-heads attention cannot run on fused kernels (SDPA, flash, flex):
`dispatch.cross_head_attention_inputs` hands the layer `score_mixing_attention` to run it with in eager mode.

Written for this project from the paper; this file imports only torch and transformers
(remote-code payload).
"""

import torch
from torch import nn
from transformers import initialization as init

from .score_mixing import ScoreMixing


class TalkingHeadsMixing(ScoreMixing, nn.Module):
    """The two `H x H` head-mixing matrices of one talking-heads attention layer (identity at init)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.logits_projection = nn.Parameter(torch.eye(num_heads))
        self.weights_projection = nn.Parameter(torch.eye(num_heads))

    @classmethod
    def from_config(cls, config) -> "TalkingHeadsMixing":
        return cls(config.num_attention_heads)

    def dynamic_weights(self, hidden_states: torch.Tensor, key_states: torch.Tensor | None) -> tuple[None, None]:
        """Talking-heads is static: no query-side or key-side weights come from the tokens."""
        return None, None

    def mix_logits(self, scores: torch.Tensor, query_weights=None, key_weights=None) -> torch.Tensor:
        """`scores`: `(batch, H, queries, keys)` -> the same, mixed across heads by `logits_projection`."""
        return torch.einsum("ij,bjts->bits", self.logits_projection.to(scores.dtype), scores)

    def mix_probabilities(self, probabilities: torch.Tensor, query_weights=None, key_weights=None) -> torch.Tensor:
        """`probabilities`: `(batch, H, queries, keys)` after the softmax -> mixed by `weights_projection`."""
        return torch.einsum("ij,bjts->bits", self.weights_projection.to(probabilities.dtype), probabilities)


def init_talking_heads(module: nn.Module) -> None:
    """Weight init for `TalkingHeadsMixing`: both projections at the identity, so the layer starts as MHA."""
    if isinstance(module, TalkingHeadsMixing):
        # transformers' guarded init functions: they skip parameters already loaded from a checkpoint.
        init.eye_(module.logits_projection)
        init.eye_(module.weights_projection)


__all__ = ["TalkingHeadsMixing", "init_talking_heads"]
