"""DCMHA, dynamically composable multi-head attention, the dynamic cross-head baseline (`cross_head_variant="dcmha"`).

Formulation (Xiao, Meng, Li and Yuan, "Improving Transformers with Dynamically Composable Multi-Head Attention",
ICML 2024, arXiv:2405.08553, Section 3 and Figure 2; the public reference code consulted for the details is
github.com/Caiyun-AI/DCFormer, `pytorch/dcpythia/modeling_dcpythia.py`: `DynamicWeightProjection`,
`_cross_head_proj`). Written for this project; nothing is copied.

The attention scores (before the softmax) and the attention weights (after it) of the `H` heads pass through a
*Compose* function. For query `t`, key `s` and the head vector `a = A[:, t, s]` of either map:

    Compose(a)_m = sum_n W^b[m, n] a_n                                   static base (identity at init)
                 + sum_r (sum_n a_n Rq[r, n](x_t)) Wq[r, m](x_t)          query-wise low-rank (rank R)
                 + sum_r (sum_n a_n Rk[r, n](x_s)) Wk[r, m](x_s)          key-wise low-rank
                 + a_m * gq_m(x_t) + a_m * gk_m(x_s)                      query-wise and key-wise gates (diagonal)

that is, `a' = M(t, s) a` with `M(t, s) = W^b + Wq^T Rq + diag(gq) + Wk^T Rk + diag(gk)`. The dynamic weights come
from the attention input `x` (the normalised hidden state) of the query position `t` or of the key position `s`:

    h      = GELU(x W_hidden)        (d -> C, C = 4 H, as in the reference code), one branch per
                                      (pre/post softmax) x (query/key side): four in all
    R, W   = h W_read, h W_write     (C -> R x H each); R is RMS-normalised over the heads (no scale)
    g      = tanh(x W_gate)          (d -> H)

The paper's DCFormer uses `R = 2`; `dcmha_rank` sets it. The reference code fixes `W^b` at the identity by default;
the paper learns it; here it is learned, starting at the identity.

**Starting as MHA.** `W^b = I`, `W_write = 0` and `W_gate = 0` make `M(t, s) = I`, so a fresh or converted layer computes
exactly multi-head attention. `W_hidden` and `W_read` start random (`initializer_range`), so the gradients that reach
`W_write` are not zero (all-zero factors would never move).

**Causality.** The key-wise terms of entry `(t, s)` use only `x_s`; the query-wise terms only `x_t`. Each entry is
composed from the same entry of the other heads, so future keys reach only masked entries: the scores are composed
first and then masked, and after the softmax the masked entries are zero in every head, so composing keeps them zero.

**KV cache.** The key-wise weights of a position (`Rk`, `Wk`, `gk` for both maps: `2 (2R + 1)` numbers per head) are
computed once, when the position is new, and stored per head alongside its key: `key_weights` has the key's layout
`(batch, H, seq, 2 (2R + 1))` and `dispatch.cross_head_attention_inputs` concatenates it to the key along the last
dimension before the cache update and splits it off after, so every cache class (dynamic, static, beam reordering,
cropping) carries it without changes.

This file imports only torch and transformers (remote-code payload).
"""

import torch
from torch import nn
from transformers import initialization as init

from .score_mixing import ScoreMixing

# The four dynamic branches, in the order their weights are laid out in the parameters.
BRANCHES = ("pre_query", "pre_key", "post_query", "post_key")
PRE_SOFTMAX, POST_SOFTMAX = 0, 1
RMS_NORM_EPS = 1e-6


class DynamicHeadComposition(ScoreMixing, nn.Module):
    """The Compose function of one DCMHA layer: its static base, the dynamic-weight projections, and the composition."""

    def __init__(self, hidden_size: int, num_heads: int, rank: int, dynamic_hidden_size: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.rank = rank
        self.dynamic_hidden_size = dynamic_hidden_size or 4 * num_heads
        branches, width = len(BRANCHES), self.dynamic_hidden_size
        # Raw parameters, not nn.Linear, so that the host model's Linear init never overrides the MHA-exact start.
        self.base_projection = nn.Parameter(torch.eye(num_heads).repeat(2, 1, 1))  # (pre/post, H_out, H_in)
        self.hidden_projection = nn.Parameter(torch.zeros(hidden_size, branches, width))
        self.read_projection = nn.Parameter(torch.zeros(branches, width, rank, num_heads))
        self.write_projection = nn.Parameter(torch.zeros(branches, width, rank, num_heads))
        self.gate_projection = nn.Parameter(torch.zeros(hidden_size, branches, num_heads))

    @classmethod
    def from_config(cls, config) -> "DynamicHeadComposition":
        return cls(config.hidden_size, config.num_attention_heads, config.dcmha_rank)

    def dynamic_weights(
        self, hidden_states: torch.Tensor, key_states: torch.Tensor | None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The query-side weights of the tokens `hidden_states` and the key-side weights of `key_states` (the same
        tensor in self-attention; the encoder output in cross-attention; None when the keys come from the cache with
        their weights), each `(batch, seq, hidden)`.

        Returns:
            `query_weights`: `(read, write, gate)` of shapes `(batch, seq, 2, R, H)`, `(batch, seq, 2, R, H)`,
            `(batch, seq, 2, H)`, indexed `[PRE_SOFTMAX]` / `[POST_SOFTMAX]` on dim 2.
            `key_weights`: `(batch, H, seq, 2 (2R + 1))`, laid out like the keys so that it can ride in the KV cache.
        """
        query_weights, key_weights = self.branch_weights(hidden_states)
        if key_states is not hidden_states:  # cross-attention: the key side comes from other tokens, or the cache
            key_weights = None if key_states is None else self.branch_weights(key_states)[1]
        return query_weights, key_weights

    def branch_weights(self, hidden_states: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Both sides' weights of the same tokens (see `dynamic_weights`)."""
        dtype = hidden_states.dtype
        hidden = nn.functional.gelu(torch.einsum("btd,dgc->btgc", hidden_states, self.hidden_projection.to(dtype)))
        read = torch.einsum("btgc,gcrh->btgrh", hidden, self.read_projection.to(dtype))
        read = read * torch.rsqrt(read.pow(2).mean(dim=-1, keepdim=True) + RMS_NORM_EPS)
        write = torch.einsum("btgc,gcrh->btgrh", hidden, self.write_projection.to(dtype))
        gate = torch.tanh(torch.einsum("btd,dgh->btgh", hidden_states, self.gate_projection.to(dtype)))
        query_weights = (read[:, :, 0::2], write[:, :, 0::2], gate[:, :, 0::2])
        # Per key position and head: [read (R), write (R), gate (1)] for the pre-softmax map, then for the post one.
        key_weights = torch.cat(
            [
                read[:, :, 1::2].transpose(-1, -2),  # (b, s, 2, H, R)
                write[:, :, 1::2].transpose(-1, -2),
                gate[:, :, 1::2].unsqueeze(-1),  # (b, s, 2, H, 1)
            ],
            dim=-1,
        )  # (b, s, 2, H, 2R + 1)
        key_weights = key_weights.permute(0, 3, 1, 2, 4).flatten(-2)  # (b, H, s, 2 (2R + 1))
        return query_weights, key_weights

    def compose(
        self, scores: torch.Tensor, stage: int, query_weights: tuple[torch.Tensor, ...], key_weights: torch.Tensor
    ) -> torch.Tensor:
        """Compose `(batch, H, queries, keys)` score maps across heads, for `stage` `PRE_SOFTMAX` or `POST_SOFTMAX`.

        `query_weights` are those of the query tokens; `key_weights` those of every key (cached ones included).
        """
        query_read, query_write, query_gate = (weights[:, :, stage] for weights in query_weights)
        key_weights = key_weights.unflatten(-1, (2, 2 * self.rank + 1))[..., stage, :].to(scores.dtype)
        key_read, key_write = key_weights[..., : self.rank], key_weights[..., self.rank : 2 * self.rank]
        key_gate = key_weights[..., 2 * self.rank]  # (b, H, s)

        composed = torch.einsum("mn,bnts->bmts", self.base_projection[stage].to(scores.dtype), scores)
        # Low-rank terms: project the H heads onto R per-position directions, then write them back to the H heads.
        query_hidden = torch.einsum("bnts,btrn->brts", scores, query_read)
        composed = composed + torch.einsum("brts,btrm->bmts", query_hidden, query_write)
        key_hidden = torch.einsum("bnts,bnsr->brts", scores, key_read)
        composed = composed + torch.einsum("brts,bmsr->bmts", key_hidden, key_write)
        # Diagonal terms: per-head gates of the query and of the key.
        composed = composed + scores * query_gate.transpose(1, 2).unsqueeze(-1)
        composed = composed + scores * key_gate.unsqueeze(-2)
        return composed

    def mix_logits(self, scores, query_weights, key_weights) -> torch.Tensor:
        return self.compose(scores, PRE_SOFTMAX, query_weights, key_weights)

    def mix_probabilities(self, probabilities, query_weights, key_weights) -> torch.Tensor:
        return self.compose(probabilities, POST_SOFTMAX, query_weights, key_weights)


def init_dcmha(module: nn.Module, std: float) -> None:
    """Weight init for `DynamicHeadComposition`: identity base, zero write and gate projections (so the layer is MHA),
    random hidden and read projections (so that training moves the write projections)."""
    if isinstance(module, DynamicHeadComposition):
        # transformers' guarded init functions: they skip parameters already loaded from a checkpoint.
        identity = torch.eye(module.num_heads, device=module.base_projection.device)
        init.copy_(module.base_projection, identity.repeat(2, 1, 1))
        init.normal_(module.hidden_projection, mean=0.0, std=std)
        init.normal_(module.read_projection, mean=0.0, std=std)
        init.zeros_(module.write_projection)
        init.zeros_(module.gate_projection)


__all__ = ["DynamicHeadComposition", "init_dcmha"]
