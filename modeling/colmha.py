"""Collaborative multi-head attention (ColMHA), a cross-head baseline (`cross_head_variant="colmha"`).

Formulation (Cordonnier, Loukas and Jaggi, "Multi-Head Attention: Collaborate Instead of Concatenate", 2020,
arXiv:2006.16362, Section 3): the heads share one query and one key projection of width `D~` and differ by a learned
mixing vector `m_i` (`D~` numbers) each:

    S_i = (X W~_q) diag(m_i) (X W~_k)^T / sqrt(d_h)          (+ mask)    head_i = softmax(S_i) X W_v^i

Here the shared projections are the layer's own query and key projections, all heads side by side (`D = H * d_h`
wide, biases included), optionally compressed to `D~ = colmha_key_dim` by two learned `D x D~` maps:
`Q~ = Q A`, `K~ = K B` (without `colmha_key_dim`, `A = B = I` and `D~ = D`). Every weight of a multi-head checkpoint
is kept, and with `D~ = D` the mixing vectors start as the head indicators (`m_i[k] = 1` for the `d_h` coordinates of
head `i`), so a fresh or converted layer computes exactly multi-head attention: the paper's "concatenate" start.

**Re-parametrising a trained model** (the paper's Section 4): with `D~ < D`, `convert_to_damcha` fits `A`, `B` and the
`m_i` to the trained layer by a rank-`D~` CP decomposition (alternating least squares) of the `H` bilinear forms
`W_q^i W_k^i^T` (biases appended as a row), in the coordinates where their Frobenius error is the error of the
scores per unit input. That approximation is the error the compression introduces; `reparametrize` returns it per
layer. Rotary decoders rotate the heads before the mixing, which the decomposition of the weights does not see: their
scores change more than the figure says (at `D~ = D` every family is exact).

**Cost**: each head scores against the shared key at width `D~`: `H * D~ / (H * d_h)` times the `QK^T` work of
multi-head attention (`H` times at `D~ = D`), as DAMCHA's `"query"` context. The query and key are wider than the
value, which eager attention and SDPA take, not the flash or flex kernels. The KV cache keeps the plain keys; the
compression is applied to them as read. Grouped-query attention is refused: the query and key widths differ.

Written for this project from the paper; this file imports only torch and transformers (remote-code payload).
"""

import torch
from torch import nn
from transformers import initialization as init

from .attention_heads import CrossHeadModule

CP_ITERATIONS = 500
CP_TOLERANCE = 1e-10
PINV_RTOL = 1e-10


def concatenated_head_width(config) -> int:
    """`D = H * d_h`: the width of all query heads side by side (`head_dim` where the family declares one)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


class CollaborativeMixing(CrossHeadModule, nn.Module):
    """The mixing vectors `m_i` of one ColMHA layer (`mixing`, `H x D~`) and, with a compressed key dimension, the
    maps `A`, `B` (`D x D~`) of the shared query and key; at each call, the mixed query (`attention_inputs`) and the
    shared key (`attended_key`)."""

    def __init__(self, num_heads: int, width: int, key_dim: int | None = None):
        super().__init__()
        self.num_heads, self.width = num_heads, width
        self.key_dim = key_dim or width
        # Raw parameters, not nn.Linear, so that the host model's Linear init never overrides the MHA-exact start.
        self.mixing = nn.Parameter(head_indicators(num_heads, self.key_dim))
        if key_dim is not None and key_dim != width:
            self.query_compression = nn.Parameter(torch.eye(width, key_dim))
            self.key_compression = nn.Parameter(torch.eye(width, key_dim))
        else:
            self.query_compression = self.key_compression = None

    @classmethod
    def from_config(cls, config) -> "CollaborativeMixing":
        return cls(config.num_attention_heads, concatenated_head_width(config), config.colmha_key_dim)

    def attention_inputs(self, layer, query, key, value, *, hidden_states, key_states, **options):
        variant = options["variant"]  # the shared query and key are wider than the value heads
        variant.check_backend_of_built_model(layer.config, variant.backends(layer.config))
        return self.mixed_query(query), key, None

    def attended_key(self, layer, key):
        return self.shared_key(key)

    def mixed_query(self, query: torch.Tensor) -> torch.Tensor:
        """`query` `(b, H, t, d_h)` -> each head's mixed shared query `(b, H, t, D~)`: `(Q A) * m_i`."""
        shared = query.transpose(1, 2).flatten(-2)  # (b, t, D): the heads side by side
        if self.query_compression is not None:
            shared = shared @ self.query_compression.to(query.dtype)
        return shared.unsqueeze(1) * self.mixing.to(query.dtype)[None, :, None, :]

    def shared_key(self, key: torch.Tensor) -> torch.Tensor:
        """`key` `(b, H, s, d_h)` as the cache holds it -> the compressed shared key `K B` `(b, H, s, D~)` (one key,
        broadcast to the heads: a view). Uncompressed, `key` is returned as it is: the attention core lays the heads
        side by side for a query wider than the key (`attention_heads.full_width_key`)."""
        if self.key_compression is None:
            return key
        shared = key.transpose(1, 2).flatten(-2) @ self.key_compression.to(key.dtype)
        return shared.unsqueeze(1).expand(-1, key.shape[1], -1, -1)


def head_indicators(num_heads: int, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`(H, width)`: row `i` is 1 on the coordinates of head `i` (its block of `width / H`; blocks differ by at most one
    coordinate where `H` does not divide `width`), 0 elsewhere. In `dtype`, by default torch's default dtype, which
    transformers sets to the dtype a model is built or loaded in (a float64 checkpoint must not be rounded)."""
    owner = torch.arange(width) * num_heads // width
    return (torch.arange(num_heads)[:, None] == owner).to(dtype or torch.get_default_dtype())


def init_colmha(module: nn.Module, std: float) -> None:
    """Weight init for `CollaborativeMixing`: the head indicators and identity maps (exact MHA at `D~ = D`). At a
    compressed `D~` no start is exact; the maps then start as the first `D~` coordinates of the heads side by side,
    each head's indicator over its share of them."""
    if isinstance(module, CollaborativeMixing):
        # transformers' guarded init functions: they skip parameters already loaded from a checkpoint.
        device = module.mixing.device
        init.copy_(module.mixing, head_indicators(module.num_heads, module.key_dim, module.mixing.dtype).to(device))
        if module.query_compression is not None:
            init.copy_(module.query_compression, torch.eye(module.width, module.key_dim, device=device))
            init.copy_(module.key_compression, torch.eye(module.width, module.key_dim, device=device))


# --------------------------------------------------------------------------------------------- re-parametrisation


def query_key_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's query and key projections as `(d + 1, D)` matrices (weight rows, then the bias row), float64,
    whichever way its family names them (GPT-2's fused `c_attn`, Phi-3's `qkv_proj`, `q_proj` / `k_proj`, ViT's
    `query` / `key`)."""

    def augmented(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # weight (d, D)
        bias = torch.zeros(weight.shape[1], dtype=weight.dtype, device=weight.device) if bias is None else bias
        return torch.cat([weight, bias[None]]).double()

    def linear(projection: nn.Module) -> torch.Tensor:
        return augmented(projection.weight.T, projection.bias)

    width = concatenated_head_width(layer.config)
    if hasattr(layer, "c_attn"):  # Conv1D: weight (d, 3d)
        weight, bias = layer.c_attn.weight, layer.c_attn.bias
        return augmented(weight[:, :width], bias[:width]), augmented(
            weight[:, width : 2 * width], bias[width : 2 * width]
        )
    if hasattr(layer, "qkv_proj"):  # nn.Linear: weight (D + 2 D_kv, d)
        weight, bias = layer.qkv_proj.weight.T, layer.qkv_proj.bias
        query_bias, key_bias = (None, None) if bias is None else (bias[:width], bias[width : 2 * width])
        return augmented(weight[:, :width], query_bias), augmented(weight[:, width : 2 * width], key_bias)
    for query_name, key_name in (("q_proj", "k_proj"), ("query", "key")):
        if hasattr(layer, query_name):
            return linear(getattr(layer, query_name)), linear(getattr(layer, key_name))
    raise TypeError(f"{type(layer).__name__}: no query and key projections found to re-parametrise for ColMHA")


def cp_decomposition(tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Rank-`rank` CP decomposition of `tensor` `(H, D, D)` by alternating least squares:
    `tensor[i] ~ A diag(M[i]) B^T`. Returns `(M (H, rank), A (D, rank), B (D, rank), relative Frobenius error)`.

    Started from the leading singular vectors of the two `D`-sized unfoldings, so the result is deterministic."""
    heads, size, _ = tensor.shape
    a = torch.linalg.svd(tensor.permute(1, 0, 2).reshape(size, -1), full_matrices=False)[0][:, :rank]
    b = torch.linalg.svd(tensor.permute(2, 0, 1).reshape(size, -1), full_matrices=False)[0][:, :rank]
    m = torch.einsum("ijk,jr,kr->ir", tensor, a, b) @ torch.linalg.pinv((a.T @ a) * (b.T @ b))
    norm, previous = tensor.norm(), None
    for _ in range(CP_ITERATIONS):
        a = torch.einsum("ijk,kr,ir->jr", tensor, b, m) @ torch.linalg.pinv((m.T @ m) * (b.T @ b))
        b = torch.einsum("ijk,jr,ir->kr", tensor, a, m) @ torch.linalg.pinv((m.T @ m) * (a.T @ a))
        m = torch.einsum("ijk,jr,kr->ir", tensor, a, b) @ torch.linalg.pinv((a.T @ a) * (b.T @ b))
        error = float((torch.einsum("ir,jr,kr->ijk", m, a, b) - tensor).norm() / norm)
        if previous is not None and abs(previous - error) < CP_TOLERANCE:
            break
        previous = error
    return m, a, b, error


@torch.no_grad()
def reparametrize(layer: nn.Module) -> float:
    """Fit the layer's `CollaborativeMixing` (compressed to `D~ < D`) to its trained query and key projections, as the
    paper re-parametrises a trained model; returns the relative error it introduces (0 at `D~ = D`).

    With `Wq`, `Wk` the `(d + 1, D)` projections (bias row last) and `E_i` the indicator of head `i`'s coordinates,
    multi-head attention scores with `Wq E_i Wk^T`, ColMHA with `Wq A diag(m_i) B^T Wk^T`. Writing `Wq = U_q R_q` and
    `Wk = U_k R_k` (QR), the error `sum_i ||Wq (A diag(m_i) B^T - E_i) Wk^T||` is that of the CP decomposition of
    `T_i = R_q E_i R_k^T`: `A = R_q^+ A'`, `B = R_k^+ B'` from its factors `A'`, `B'`, and `m_i` its weights.
    """
    mixing = layer.cross_head_mixing
    if mixing.query_compression is None:
        return 0.0
    query_weight, key_weight = query_key_weights(layer)
    r_query, r_key = torch.linalg.qr(query_weight)[1], torch.linalg.qr(key_weight)[1]
    indicators = head_indicators(mixing.num_heads, mixing.width).to(r_query)
    targets = torch.einsum("ab,ib,cb->iac", r_query, indicators, r_key)  # R_q diag(e_i) R_k^T for each head
    weights, a, b, error = cp_decomposition(targets, mixing.key_dim)
    mixing.mixing.copy_(weights)
    # A projection of lower rank than D (a redundant trained layer) has directions R leaves out: the pseudo-inverse
    # keeps the factors in R's range instead of amplifying rounding along them.
    mixing.query_compression.copy_(torch.linalg.pinv(r_query, rtol=PINV_RTOL) @ a)
    mixing.key_compression.copy_(torch.linalg.pinv(r_key, rtol=PINV_RTOL) @ b)
    return error


__all__ = ["CollaborativeMixing", "cp_decomposition", "init_colmha", "reparametrize"]
