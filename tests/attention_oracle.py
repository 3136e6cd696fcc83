"""Naive references for the rotary decoders' DAMCHA attention, shared by test_llama.py and test_decoder_families.py.

Everything is written out by hand, one query head and one (query, key) position pair at a time: RoPE from its
formula, the cross-head matrix `C` from the generator's weights, the mixed keys `K~ = sum_j C_ij K_j`, the scale,
the logit soft-cap, the causal and sliding-window masks, the softmax and the grouped-query value heads. Run it in
float64 on a float64 model, so that a comparison's tolerance is float64 rounding.
"""

import torch


def rotate(x, position, base, rotary_dim=None):
    """RoPE written out: rotate each pair (x[k], x[k + r/2]) of the first `rotary_dim` (r, default all) components by
    the angle position * base^(-2k/r); the other components pass unrotated (Phi-3's partial rotation)."""
    rotary_dim = rotary_dim or x.shape[-1]
    half = rotary_dim // 2
    angle = position * base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    first, second, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos, rest], dim=-1)


def oracle_cross_head(metric, z, rows, columns, mask="full", layer=0):
    """C(z) from the generator's weights; the identity of grouped-query attention maps query head i to group i // g."""
    generator = metric.generators[layer if len(metric.generators) > 1 else 0]
    hidden = torch.nn.functional.gelu(z @ generator.fc_in.weight.T + generator.fc_in.bias)
    offsets = (hidden @ generator.fc_out.weight.T + generator.fc_out.bias).reshape(rows, columns)
    identity = torch.zeros(rows, columns, dtype=offsets.dtype)
    for i in range(rows):
        identity[i, i // (rows // columns)] = 1.0
    return {"full": identity + offsets, "diagonal": identity * (1 + offsets), "offdiagonal": offsets * (1 - identity)}[
        mask
    ]


def oracle_attention_heads(
    q, k, v, x, metric, context, *, scaling, mask="full", window=None, softcap=None, layer=0
) -> torch.Tensor:
    """The attention output `(batch, seq, H, d_h)` of rotated heads `q` `(batch, seq, H, d_h)`, `k` and `v`
    `(batch, seq, H_kv, d_h)` at positions 0..seq-1, the metric computed from `x` (the layer's input).

    Key s is seen by query t when s <= t and, with a sliding `window`, t - s < window. "token": head i scores against
    its group's mixed key, sum_j C_gj(x_s) k_j[s] with g = i // (H / H_kv); "query": against every key head,
    sum_j C_ij(x_t) q_i[t] . k_j[s]. The logits are scaled, then soft-capped (softcap * tanh(logit / softcap)).
    """
    batch, seq, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    out = torch.zeros(*q.shape, dtype=q.dtype)
    for b in range(batch):
        if context == "query":  # C is H x H_kv, from the query token
            weights = [oracle_cross_head(metric, x[b, t], heads, kv_heads, mask, layer) for t in range(seq)]
        else:  # C is H_kv x H_kv, from the key token
            weights = [oracle_cross_head(metric, x[b, s], kv_heads, kv_heads, mask, layer) for s in range(seq)]
        for i in range(heads):
            scores = torch.full((seq, seq), float("-inf"), dtype=q.dtype)
            for t in range(seq):
                for s in range(t + 1):
                    if window is not None and t - s >= window:
                        continue
                    row = weights[t][i] if context == "query" else weights[s][i // group]
                    mixed_key = sum(row[j] * k[b, s, j] for j in range(kv_heads))
                    logit = (q[b, t, i] @ mixed_key) * scaling
                    scores[t, s] = logit if softcap is None else softcap * torch.tanh(logit / softcap)
            out[b, :, i] = torch.softmax(scores, dim=-1) @ v[b, :, i // group]
    return out
