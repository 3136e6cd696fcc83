"""The tests' one set of naive references for cross-head attention: the cross-head matrix `C` of DAMCHA from its
generator's weights, and the per-head attention of the rotary decoders built on it.

Everything is written out by hand: the generator's MLP and its GELU from their formulas, the grouped-query identity as
a loop, and the attention one query head and one (query, key) position pair at a time: RoPE, the mixed keys
`K~ = sum_j C_ij K_j`, the scale, the logit soft-cap, the causal and sliding-window masks, the softmax and the
grouped-query value heads. Run it in float64 on a float64 model, so that a comparison's tolerance is float64 rounding.
"""

import math

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


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU: x * Phi(x)."""
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def oracle_cross_head(metric, z, rows: int, columns: int, mask: str = "full", layer: int = 0) -> torch.Tensor:
    """DAMCHA's cross-head matrix `C(z) = I + fc_out(gelu(fc_in(z)))` `(..., rows, columns)` for inputs `z` `(..., d)`
    (`z` first through the generator's own LayerNorm when it has one),
        from the weights of the generator of `layer` (the one generator of a stack that shares it), masked as
        `metric_mask` says: "full", "diagonal" (C_ij = 0 for i != j) or "offdiagonal" (C_ii = 0).

        `rows` x `columns` is H x H for multi-head attention; under grouped-query attention (H query heads sharing H_kv
        key/value heads) it is H_kv x H_kv, or H x H_kv where each query head has a row, and the identity then maps query
        head i to its group i // (H / H_kv).
    """
    generators = metric.generators
    generator = generators[layer] if len(generators) > 1 else generators[0]
    norm = getattr(generator, "input_norm", None)  # `metric_input_norm="layernorm"`: the generator's own LayerNorm
    if norm is not None:
        centred = z - z.mean(-1, keepdim=True)
        z = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias
    hidden = gelu(z @ generator.fc_in.weight.T + generator.fc_in.bias)
    offsets = (hidden @ generator.fc_out.weight.T + generator.fc_out.bias).reshape(*z.shape[:-1], rows, columns)
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
