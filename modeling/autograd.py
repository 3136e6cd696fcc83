"""Optional memory-saving autograd functions for the metric (`metric.py`): each computes what the plain PyTorch
expression would, with the same gradients, but keeps fewer or smaller tensors for backward.

The metric falls back to plain PyTorch wherever these do not apply (autocast, a PEFT adapter on a projection,
inference). This file imports only torch: it is part of the remote-code payload.
"""

import torch
from torch import nn


class RecomputedGeneratorMLP(torch.autograd.Function):
    """`linear(gelu(linear(z, W1, b1)), W2, b2)` (2-D `z`) that saves only `z` for backward, recomputing the hidden
    layer.

    Autograd would keep the hidden layer before and after the GELU (`2 r` floats per token and layer); `z` is the
    layer's normalised input, which the attention projections save anyway. The backward is autograd's own formulas
    (`addmm`, `gelu_backward`), so the gradients are those of the plain path.
    """

    @staticmethod
    def forward(ctx, z, fc_in_weight, fc_in_bias, fc_out_weight, fc_out_bias):
        ctx.save_for_backward(z, fc_in_weight, fc_in_bias, fc_out_weight)
        hidden = nn.functional.gelu(nn.functional.linear(z, fc_in_weight, fc_in_bias))
        return nn.functional.linear(hidden, fc_out_weight, fc_out_bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        z, fc_in_weight, fc_in_bias, fc_out_weight = ctx.saved_tensors
        pre_activation = nn.functional.linear(z, fc_in_weight, fc_in_bias)
        hidden = nn.functional.gelu(pre_activation)
        grad_pre_activation = torch.ops.aten.gelu_backward(grad_output @ fc_out_weight, pre_activation)
        needs = ctx.needs_input_grad
        return (
            grad_pre_activation @ fc_in_weight if needs[0] else None,
            grad_pre_activation.t() @ z if needs[1] else None,
            grad_pre_activation.sum(0) if needs[2] else None,
            grad_output.t() @ hidden if needs[3] else None,
            grad_output.sum(0) if needs[4] else None,
        )


class SequenceMixedKeyProjection(torch.autograd.Function):
    """`K~_b = C_b (x_b W_k^T + b_k)`, a separate key projection and the per-sequence mixing in one, saving for backward
    only `x` (which the query and value projections save anyway), the weights and the small `C` `(b, H, H)`.

    Unfused, autograd keeps both the projected key (the mixing's backward needs it: `dC = dK~ K^T`) and the mixed key
    (the attention backend's input): one key-sized tensor per layer more than multi-head attention, 6% of ViT-S/16's
    activations. Here `dC` and `dW_k` both come from `M_b = dK~_b^T x_b` `(b, H * d_h, d)`, which takes the place of the
    projection's own weight-gradient GEMM (`dW_k[g] = sum_b sum_h C_b[h, g] M_b[h]`,
    `dC_b[h, g] = <M_b[h], W_k[g]> + <sum_s dK~_b[h, s], b_k[g]>`), so the backward runs no more large matmuls than
    `nn.Linear`'s; the rest is `H x H` mixing.
    """

    @staticmethod
    def forward(ctx, hidden_states, weight, bias, cross_head):
        ctx.save_for_backward(hidden_states, weight, bias, cross_head)
        batch, seq, _ = hidden_states.shape
        heads = cross_head.shape[-1]
        key = nn.functional.linear(hidden_states, weight, bias).view(batch, seq, heads, -1)
        head_major = key.transpose(1, 2).reshape(batch, heads, -1)  # (b, H, s * d_h)
        return (cross_head @ head_major).view(batch, heads, seq, -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_mixed):
        hidden_states, weight, bias, cross_head = ctx.saved_tensors
        batch, heads, seq, head_dim = grad_mixed.shape
        needs = ctx.needs_input_grad
        grad_hidden = grad_weight = grad_bias = grad_cross_head = None
        # dK_b[g] = sum_h C_b[h, g] dK~_b[h], token-major for the projection's backward.
        grad_key = (cross_head.transpose(1, 2) @ grad_mixed.reshape(batch, heads, -1)).view(grad_mixed.shape)
        grad_key = grad_key.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        if needs[0]:
            grad_hidden = grad_key @ weight
        if needs[2] and bias is not None:
            grad_bias = grad_key.sum((0, 1))
        if needs[1] or needs[3]:
            grad_mixed_tokens = grad_mixed.transpose(1, 2).reshape(batch, seq, heads * head_dim)
            per_head = (grad_mixed_tokens.transpose(1, 2) @ hidden_states).view(batch, heads, -1)  # M_b
            if needs[1]:
                # One GEMM over the (sequence, head) pairs, reading `M` once: mixing each `M_b` and summing after would
                # write and read `b` weight-sized tensors more (at ViT-S/16 widths, more bytes than the key itself).
                mixing = cross_head.permute(2, 0, 1).reshape(heads, batch * heads)  # [g, (b, h)] = C_b[h, g]
                grad_weight = (mixing @ per_head.view(batch * heads, -1)).view_as(weight)
            if needs[3]:
                grad_cross_head = per_head @ weight.view(heads, -1).t()
                if bias is not None:
                    grad_cross_head = grad_cross_head + grad_mixed.sum(2) @ bias.view(heads, head_dim).t()
        return grad_hidden, grad_weight, grad_bias, grad_cross_head


class TokenMixedKeyProjection(torch.autograd.Function):
    """`K~[t] = C[t] (x[t] W_k^T + b_k)`, a separate key projection and the per-token mixing in one, saving for backward
    only `x` (which the query and value projections save anyway), the weights and `C` `(b, s, H, H)`.

    Unlike `"sequence"`'s, `"token"`'s `dC[t] = dK~[t] K[t]^T` needs the projected key of every token, so the backward
    recomputes `K = x W_k^T + b_k`: one `d x d` GEMM per layer more than `nn.Linear`'s backward (about 2.6% of a
    ViT-S/16 training step's FLOPs) for one key-sized tensor per layer less kept (6% of its activations). Only ViT
    hands its key projection over, and its default context is `"sequence"`; `"token"` there is the memory-lean choice.
    """

    @staticmethod
    def forward(ctx, hidden_states, weight, bias, cross_head):
        ctx.save_for_backward(hidden_states, weight, bias, cross_head)
        batch, seq, heads = cross_head.shape[:3]
        key = nn.functional.linear(hidden_states, weight, bias).view(batch * seq, heads, -1)
        mixed = torch.bmm(cross_head.reshape(batch * seq, heads, heads), key)
        return mixed.view(batch, seq, heads, -1).transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_mixed):
        hidden_states, weight, bias, cross_head = ctx.saved_tensors
        batch, heads, seq, head_dim = grad_mixed.shape
        needs = ctx.needs_input_grad
        grad_hidden = grad_weight = grad_bias = grad_cross_head = None
        grad_tokens = grad_mixed.transpose(1, 2).reshape(batch * seq, heads, head_dim)
        if needs[3]:
            key = nn.functional.linear(hidden_states, weight, bias).view(batch * seq, heads, head_dim)
            grad_cross_head = torch.bmm(grad_tokens, key.transpose(1, 2)).view(cross_head.shape)
        # dK[t] = C[t]^T dK~[t]
        grad_key = torch.bmm(cross_head.reshape(batch * seq, heads, heads).transpose(1, 2), grad_tokens)
        grad_key = grad_key.view(batch * seq, heads * head_dim)
        if needs[0]:
            grad_hidden = (grad_key @ weight).view(hidden_states.shape)
        if needs[1]:
            grad_weight = grad_key.t() @ hidden_states.reshape(batch * seq, -1)
        if needs[2] and bias is not None:
            grad_bias = grad_key.sum(0)
        return grad_hidden, grad_weight, grad_bias, grad_cross_head
