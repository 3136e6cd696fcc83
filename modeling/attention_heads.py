"""The tensor layout every attention layer shares, whatever its variant: heads split out of a projection, the key
an attention function gets, the tokens a mask lets a query attend to.

This file imports only torch: it is part of the shared core a saved checkpoint carries (remote code).
"""

import torch
from torch import nn


def split_heads(states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`(b, s, H * d_h)` as the `(b, H, s, d_h)` view the attention functions take."""
    return states.view(*states.shape[:-1], -1, head_dim).transpose(1, 2)


def project_heads(projection: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`projection(hidden_states)` split into heads (`split_heads`)."""
    return split_heads(projection(hidden_states), head_dim)


def full_width_key(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The key the attention function gets for `query`.

    For `"query"`, the expanded query `(b, H, t, H_kv * d_h)` scores against the keys of every key/value head laid
    side by side: `key` `(b, H_kv, s, d_h)` (as the cache returns it) becomes `(b, 1, s, H_kv * d_h)`, broadcast
    (a view, no copy) to the `H_kv` key heads; the attention functions repeat keys and values alike to the query
    heads for grouped queries. Any other query has the key's own width and gets `key` unchanged.
    """
    if query.shape[-1] == key.shape[-1]:
        return key
    batch, kv_heads, seq, head_dim = key.shape
    shared = key.transpose(1, 2).reshape(batch, 1, seq, kv_heads * head_dim)
    return shared.expand(-1, kv_heads, -1, -1)


def attended_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """`(batch, seq)` bool, True for the tokens `attention_mask` lets any query attend to: the `token_mask` of
    `"sequence"`.

    Takes the forms the models accept: `(batch, seq)` with 1 for real tokens and 0 for padding, or a 4D
    `(batch, 1 or heads, queries, keys)` mask, boolean (True = attend) or additive float (0 = attend).
    """
    if attention_mask.dim() == 2:
        return attention_mask.bool()
    if attention_mask.dim() == 4:
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        return attention_mask.any(dim=1).any(dim=1)
    raise ValueError(
        f"`attention_mask` must be (batch, seq) with 1 for real tokens and 0 for padding (or a 4D attention mask), got "
        f"shape {tuple(attention_mask.shape)}."
    )


__all__ = ["attended_tokens", "full_width_key", "project_heads", "split_heads"]
