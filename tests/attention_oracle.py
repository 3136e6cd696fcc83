"""The tests' one set of naive references for cross-head attention: the cross-head matrix `C` of DAMCHA from its
generator's weights, the per-head attention of the rotary decoders built on it, whole GPT-2 and Llama attention
layers, DAMCHA's scores form, and the score-mixing variants (talking heads, DCMHA).

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


def oracle_gpt2_attention_layer(attention, cross_head_metric, x, context, mask):
    """One GPT-2 attention layer written out by hand: every head pair, weighted by C computed from the weights."""
    batch, seq, hidden = x.shape
    heads = attention.num_heads
    head_dim = hidden // heads
    qkv = x @ attention.c_attn.weight + attention.c_attn.bias
    q, k, v = (t.reshape(batch, seq, heads, head_dim) for t in qkv.split(hidden, dim=-1))
    cross_head = oracle_cross_head(cross_head_metric, x, heads, heads, mask)
    out = torch.zeros(batch, seq, heads, head_dim, dtype=x.dtype)
    for b in range(batch):
        for i in range(heads):
            scores = torch.full((seq, seq), float("-inf"), dtype=x.dtype)
            for t in range(seq):
                for s in range(t + 1):  # causal
                    weights_at = t if context == "query" else s
                    scores[t, s] = sum(
                        cross_head[b, weights_at, i, j] * (q[b, t, i] @ k[b, s, j]) for j in range(heads)
                    )
            out[b, :, i] = torch.softmax(scores / math.sqrt(head_dim), dim=-1) @ v[b, :, i]
    return out.reshape(batch, seq, hidden) @ attention.c_proj.weight + attention.c_proj.bias


def oracle_llama_attention_layer(attention, metric, x, positions, context, mask, base):
    """One Llama attention layer by hand: RoPE'd heads, every (query head, key head) pair weighted by C, causal."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = attention.config.num_attention_heads, attention.config.num_key_value_heads, 8
    q = (x @ attention.q_proj.weight.T).reshape(batch, seq, heads, head_dim)
    k = (x @ attention.k_proj.weight.T).reshape(batch, seq, kv_heads, head_dim)
    v = (x @ attention.v_proj.weight.T).reshape(batch, seq, kv_heads, head_dim)
    q = torch.stack([rotate(q[:, t], positions[t], base) for t in range(seq)], dim=1)
    k = torch.stack([rotate(k[:, t], positions[t], base) for t in range(seq)], dim=1)
    out = oracle_attention_heads(q, k, v, x, metric, context, scaling=head_dim**-0.5, mask=mask)
    return out.reshape(batch, seq, heads * head_dim) @ attention.o_proj.weight.T


def oracle_scores_form_attention(query, key, value, hidden_states, metric, context, mask, causal, token_mask=None):
    """Every head pair in a loop: S_i[t, s] = sum_j C_ij(z) q_j[t] . k_g(j)[s] / sqrt(d_h), masked, softmax, P_i v_i."""
    batch, heads, kv_heads = query.shape[0], query.shape[1], key.shape[1]
    group = heads // kv_heads
    if context == "sequence":
        weights = torch.ones(hidden_states.shape[:2]) if token_mask is None else token_mask.float()
        mean = (hidden_states * weights[..., None]).sum(1) / weights.sum(1, keepdim=True)
        cross_head = oracle_cross_head(metric, mean, heads, heads, mask)[:, None, None]  # (b, 1, 1, H, H)
    else:
        per_token = oracle_cross_head(metric, hidden_states, heads, heads, mask)  # (b, n, H, H)
        cross_head = per_token[:, :, None] if context == "query" else per_token[:, None, :]  # (b, t|1, s|1, H, H)
    seq = query.shape[2]
    outputs = torch.zeros(batch, heads, seq, value.shape[-1])
    for i in range(heads):
        scores = torch.zeros(batch, seq, seq)
        for j in range(heads):
            pair = query[:, j] @ key[:, j // group].transpose(-1, -2) / math.sqrt(query.shape[-1])
            scores = scores + cross_head[..., i, j] * pair
        if causal:
            scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
        if token_mask is not None:
            scores = scores.masked_fill(~token_mask[:, None, :], float("-inf"))
        outputs[:, i] = scores.softmax(-1) @ value[:, i // group]
    return outputs


# --- the score-mixing variants ---------------------------------------------------------------------------------------


def score_mixing_head_matrices(attention, x, variant):
    """`M[stage][b, t, s]`: the H x H matrix that maps the head vector of entry (t, s) of the logits (stage 0) or of
    the weights (stage 1), written from the papers' formulas with the layer's raw parameters."""
    batch, seq, _ = x.shape
    heads = attention.config.num_attention_heads
    mixing = attention.cross_head_mixing
    if variant == "talking_heads":
        return [p.expand(batch, seq, seq, heads, heads) for p in (mixing.logits_projection, mixing.weights_projection)]
    rank = mixing.rank

    def branch(c):  # c: 0 pre-query, 1 pre-key, 2 post-query, 3 post-key
        hidden = torch.nn.functional.gelu(x @ mixing.hidden_projection[:, c, :])  # (b, n, C)
        read = (hidden @ mixing.read_projection[c].flatten(1)).unflatten(-1, (rank, heads))
        read = read / torch.sqrt((read**2).mean(-1, keepdim=True) + 1e-6)  # RMS over heads, no scale
        write = (hidden @ mixing.write_projection[c].flatten(1)).unflatten(-1, (rank, heads))
        gate = torch.tanh(x @ mixing.gate_projection[:, c, :])  # (b, n, H)
        return read, write, gate

    matrices = []
    for stage in range(2):
        q_read, q_write, q_gate = branch(2 * stage)
        k_read, k_write, k_gate = branch(2 * stage + 1)
        m = torch.zeros(batch, seq, seq, heads, heads)
        for b in range(batch):
            for t in range(seq):
                for s in range(seq):
                    for i in range(heads):  # output head
                        for j in range(heads):  # input head
                            value = mixing.base_projection[stage, i, j]
                            value = value + sum(q_write[b, t, r, i] * q_read[b, t, r, j] for r in range(rank))
                            value = value + sum(k_write[b, s, r, i] * k_read[b, s, r, j] for r in range(rank))
                            if i == j:
                                value = value + q_gate[b, t, i] + k_gate[b, s, i]
                            m[b, t, s, i, j] = value
        matrices.append(m)
    return matrices


def oracle_score_mixing_layer(attention, x, variant, causal=True):
    """One attention layer (GPT-2's, or ViT's with `causal=False`) written out by hand for a score-mixing variant:
    per entry (t, s), the head vector of the logits is mixed by M_pre(t, s), masked, softmaxed per head, and mixed
    again by M_post(t, s)."""
    batch, seq, hidden = x.shape
    heads = attention.num_heads if causal else attention.config.num_attention_heads
    head_dim = hidden // heads
    if causal:  # GPT-2: one Conv1D (x @ W + b) for q, k, v
        qkv = (x @ attention.c_attn.weight + attention.c_attn.bias).split(hidden, dim=-1)
    else:  # ViT: nn.Linear (x @ W^T + b) each
        qkv = [x @ p.weight.T + p.bias for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
    q, k, v = (t.reshape(batch, seq, heads, head_dim) for t in qkv)
    pre, post = score_mixing_head_matrices(attention, x, variant)
    out = torch.zeros(batch, seq, heads, head_dim)
    for b in range(batch):
        for t in range(seq):
            logits = torch.zeros(heads, seq)
            for s in range(seq):
                raw = torch.stack([q[b, t, j] @ k[b, s, j] / math.sqrt(head_dim) for j in range(heads)])
                logits[:, s] = pre[b, t, s] @ raw
            visible = t + 1 if causal else seq
            logits[:, visible:] = float("-inf")  # causal, applied after the mix
            weights = torch.softmax(logits, dim=-1)
            for s in range(visible):
                mixed = post[b, t, s] @ weights[:, s]
                for i in range(heads):
                    out[b, t, i] += mixed[i] * v[b, s, i]
    out = out.reshape(batch, seq, hidden)
    if causal:
        return out @ attention.c_proj.weight + attention.c_proj.bias
    return out @ attention.o_proj.weight.T + attention.o_proj.bias
