"""The DAMCHA math core, shared by every model in this folder.

DAMCHA ("Data-Adaptive Mahalanobis Metric Learning for Cross-Head Attention", NeurIPS 2026) scores head ``i`` with
the row-sum of its block row of a data-adaptive cross-head metric:

    S_i = X m_i(X) X^T / sqrt(d_h),   m_i(X) = sum_j C_ij(X) A_ij,   A_ij = W_q^i W_k^j^T

which equals ``Q_i (sum_j C_ij K_j)^T / sqrt(d_h)``. ``C = I + G(z)`` comes from a small MLP (the *metric
generator*) whose last layer starts at zero, so a fresh DAMCHA layer computes exactly multi-head attention.

Where ``C`` may depend on the tokens is ``metric_context``:

* ``"token"``: ``C`` from the key token's own normalised hidden state, applied as key-side mixing
  ``K~_i[s] = sum_j C_ij(x_s) K_j[s]``. Causal-safe; the KV cache stores ``K~``.
* ``"sequence"``: one ``C`` per sequence from the mean hidden state (the literal ``M(X)``). Bidirectional only.
* ``"query"``: ``C`` from the query token, ``S_i[t, s] = sum_j C_ij(x_t) Q_i[t] . K_j[s]``, computed exactly in
  expanded-query form: query ``[C_i1 q_i, ..., C_iH q_i]`` (width ``H * d_h``) against the full-width key shared
  by every head. It costs ``H`` times the ``QK^T`` of multi-head attention. The key itself is not mixed, so the KV
  cache stores the plain per-head keys in the usual ``(batch, heads, seq, head_dim)`` layout (every cache class,
  static included, fits it) and the full-width key is formed after the cache update (``full_width_key``).

Grouped-query attention (Llama-style decoders: ``H`` query heads share ``H_kv`` key/value heads, ``H_kv`` dividing
``H``). What users choose GQA for is a KV cache ``H / H_kv`` times smaller and the fused kernels that read it, so DAMCHA
mixes among the *key/value* heads: ``C`` is ``H_kv x H_kv`` and ``K~_j = sum_l C_jl K_l`` has the GQA shape, which the
cache stores and every backend's grouped-query path reads as usual; query head ``i`` scores against ``K~`` of its
group, ``i // (H / H_kv)``. For ``"query"``, ``C`` is ``H x H_kv`` (row ``i`` weights the ``H_kv`` key heads for query
head ``i``; the expanded query is ``H_kv * d_h`` wide). The starting point (``G = 0``) is plain GQA: ``C`` is the head
-> group assignment matrix (``head_group_identity``), against which ``metric_mask`` takes its diagonal. Mixing over
all ``H`` query heads instead (keys expanded first) would make the cache ``H / H_kv`` times larger and is not offered.
With a single key/value head (multi-query attention) there is nothing to mix across: such configs are refused.
Rotary position embeddings rotate every head of a position by the same angle, a linear map ``R_s`` applied to each
head's ``d_h`` slice, so ``sum_l C_jl (R_s K_l) = R_s sum_l C_jl K_l``: mixing commutes with RoPE. The models mix the
rotated keys, which is what the cache holds.

Every context hands ordinary ``(query, key, value)`` tensors to the attention functions of transformers, so eager,
SDPA and the other backends apply unchanged.

The paper's baselines run through the same entry point, ``cross_head_attention``, chosen by ``cross_head_variant``:
``"damcha"`` (the above), ``"talking_heads"`` (static ``H x H`` mixing of the logits and of the weights,
``talking_heads.py``), ``"dcmha"`` (dynamic per-query and per-key composition of both maps, ``dcmha.py``) and
``"none"`` (plain multi-head attention). Talking-heads and DCMHA mix the ``n x n`` score maps across heads, which no
fused kernel exposes: they run ``score_mixing_attention`` (eager, materialised maps), and a model refuses any other
``attn_implementation`` for them (``eager_attn_implementation_for``).

This file imports only torch and transformers: it is copied next to the weights of a saved checkpoint (remote code).
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .damcha_config import METRIC_CONTEXTS, METRIC_MASKS
from .dcmha import DynamicHeadComposition, init_dcmha
from .talking_heads import TalkingHeadsMixing, init_talking_heads

# Variants that mix the n x n score maps across heads, so that only eager attention can run them.
SCORE_MIXING_VARIANTS = {"talking_heads": TalkingHeadsMixing, "dcmha": DynamicHeadComposition}


class MetricOutputLayer(nn.Linear):
    """The generator's last layer. Its own class, because weight init reaches it as a module on its own and must
    zero it (`init_metric_generator`) so that `C = I` and a fresh or converted DAMCHA model equals MHA."""


class _RecomputedGeneratorMLP(torch.autograd.Function):
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


class _SequenceMixedKeyProjection(torch.autograd.Function):
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


class _TokenMixedKeyProjection(torch.autograd.Function):
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


# Below this many values, PyTorch's own CPU GELU kernel beats oneDNN's (measured on torch 2.13, AVX2: 3 µs against
# 12-20 µs at 64 values; equal near 16,000; oneDNN ahead from about 32,000 on).
_ONEDNN_GELU_MIN_NUMEL = 8192


def exact_gelu(x: torch.Tensor) -> torch.Tensor:
    """`gelu(x)` (exact, erf form), computed by PyTorch's own kernel for the few values of a decoding step on a CPU.

    For a contiguous float CPU tensor PyTorch calls oneDNN, whose fixed cost (12-20 µs, and a slower next operator) is
    more than the rest of the generator's arithmetic for one token: batch-1 decoding pays it in every layer and step.
    A broadcast view is not contiguous, which routes the call to PyTorch's vectorised kernel (same formula; the two
    differ by float rounding, about 1e-7); it computes the values twice, which at this size costs nothing.
    """
    if x.device.type == "cpu" and x.numel() < _ONEDNN_GELU_MIN_NUMEL:
        return nn.functional.gelu(x.expand(2, *x.shape))[0]
    return nn.functional.gelu(x)


class MetricGenerator(nn.Module):
    """`G`: one small MLP `d -> r -> H*H_kv` (GELU), whose output layer starts at zero.

    `num_heads` is the number of rows of `C` (the heads that receive a mix), `num_key_value_heads` its columns (the
    key heads mixed); both are `H` in multi-head attention.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, metric_hidden_size: int, num_key_value_heads: int | None = None
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads or num_heads
        self.fc_in = nn.Linear(hidden_size, metric_hidden_size)
        self.act = nn.GELU()
        self.fc_out = MetricOutputLayer(metric_hidden_size, num_heads * self.num_key_value_heads)
        nn.init.zeros_(self.fc_out.weight)
        nn.init.zeros_(self.fc_out.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """`z`: (..., d) -> `G(z)`: (..., H, H_kv)."""
        return self.offsets(z)

    def offsets(self, z: torch.Tensor, flat_identity: torch.Tensor | None = None) -> torch.Tensor:
        """`G(z)`, or `I + G(z)` given the flattened identity, as (..., H, H_kv).

        With plain linears and exact GELU this is two 2-D `linear` (one `addmm` each) on the flattened tokens, with
        the identity added to the output bias: batch-1 decoding on a CPU pays per operator and per Python attribute
        lookup, and `nn.Linear` on a 3-D input adds reshapes. Anything else (e.g. a PEFT adapter on one of the linears) runs through the
        modules. When gradients are taken the hidden layer is recomputed in backward rather than saved (not under
        autocast, whose casts the explicit backward would not replay).
        """
        modules = self._modules  # direct lookups: each `nn.Module.__getattr__` costs about a microsecond
        fc_in, act, fc_out = modules["fc_in"], modules["act"], modules["fc_out"]
        shape = (*z.shape[:-1], self.num_heads, self.num_key_value_heads)
        plain = type(fc_in) is nn.Linear and type(fc_out) is MetricOutputLayer and type(act) is nn.GELU
        if plain:
            fc_in_weight, fc_in_bias = fc_in._parameters["weight"], fc_in._parameters["bias"]
            fc_out_weight, fc_out_bias = fc_out._parameters["weight"], fc_out._parameters["bias"]
        if not (plain and act.approximate == "none" and fc_in_bias is not None and fc_out_bias is not None):
            offsets = fc_out(act(fc_in(z)))
            return (offsets if flat_identity is None else offsets + flat_identity).view(shape)
        if flat_identity is not None:
            fc_out_bias = fc_out_bias + flat_identity
        flat_z = z.reshape(-1, z.shape[-1])
        if torch.is_grad_enabled() and not torch.is_autocast_enabled(z.device.type):
            offsets = _RecomputedGeneratorMLP.apply(flat_z, fc_in_weight, fc_in_bias, fc_out_weight, fc_out_bias)
        else:
            # `linear` on 2-D input is one `addmm`, with the weight's transpose taken in C++ rather than as a
            # separate dispatch from Python.
            hidden = exact_gelu(nn.functional.linear(flat_z, fc_in_weight, fc_in_bias))
            offsets = nn.functional.linear(hidden, fc_out_weight, fc_out_bias)
        return offsets.view(shape)


class CrossHeadMetric(nn.Module):
    """The cross-head matrix `C(z) = I + G(z)` of a layer, masked for the paper's ablations.

    Holds one generator per stack (`metric_sharing="stack"`) or one per layer (`"layer"`). It is a single module so
    that PEFT's `modules_to_save=["cross_head_metric"]` trains every generator of a model in full. The attention
    core calls it as `metric(z, layer_idx, metric_mask)` for every layer, so a forward hook on it sees each layer's
    `C`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        metric_hidden_size: int,
        num_generators: int = 1,
        num_key_value_heads: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads or num_heads
        self.generators = nn.ModuleList(
            MetricGenerator(hidden_size, num_heads, metric_hidden_size, self.num_key_value_heads)
            for _ in range(num_generators)
        )
        self._identities: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def from_config(cls, config) -> "CrossHeadMetric":
        """`C` is `H x H` for multi-head attention; with grouped-query attention it is `H_kv x H_kv`, or `H x H_kv`
        for `metric_context="query"` (see "Grouped-query attention" in this file's docstring)."""
        num_generators = config.num_hidden_layers if config.metric_sharing == "layer" else 1
        num_key_value_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        rows = config.num_attention_heads if config.metric_context == "query" else num_key_value_heads
        return cls(config.hidden_size, rows, config.metric_hidden_size, num_generators, num_key_value_heads)

    def forward(self, z: torch.Tensor, layer_idx: int = 0, metric_mask: str = "full") -> torch.Tensor:
        """`z`: (..., d) -> `C`: (..., H, H_kv)."""
        # The ModuleList's own dict: `self.generators[i]` and `len()` cost microseconds of Python per layer and step.
        generators = self._modules["generators"]._modules
        generator = generators[str(layer_idx)] if len(generators) > 1 else generators["0"]
        flat_identity = self.flat_identity(z)
        if metric_mask == "full":
            return generator.offsets(z, flat_identity)
        identity = flat_identity.view(self.num_heads, self.num_key_value_heads)
        if metric_mask == "diagonal":
            return generator.offsets(z, flat_identity) * identity
        if metric_mask == "offdiagonal":
            return generator.offsets(z) * (1 - identity)
        raise ValueError(f"unknown `metric_mask` {metric_mask!r}; choose one of {', '.join(map(repr, METRIC_MASKS))}.")

    def flat_identity(self, like: torch.Tensor) -> torch.Tensor:
        """`head_group_identity` (the identity when `H == H_kv`) flattened, on `like`'s device and dtype, made once per
        device and dtype.

        Cached rather than a buffer: it is no weight, and a non-persistent buffer would have to be rebuilt after
        transformers creates the model on the meta device to load a checkpoint.
        """
        key = (like.device, like.dtype)
        identity = self._identities.get(key)
        if identity is None:
            identity = head_group_identity(self.num_heads, self.num_key_value_heads)
            identity = identity.to(device=like.device, dtype=like.dtype).flatten()
            self._identities[key] = identity
        return identity


def head_group_identity(num_heads: int, num_key_value_heads: int) -> torch.Tensor:
    """The `C` of plain (grouped-query) attention, `(H, H_kv)`: query head `i` reads key head `i // (H / H_kv)`.

    The identity matrix when `H == H_kv`; the `"diagonal"` and `"offdiagonal"` masks are taken against it.
    """
    group_size = num_heads // num_key_value_heads
    return (torch.arange(num_heads)[:, None] // group_size == torch.arange(num_key_value_heads)).float()


def init_metric_generator(module: nn.Module) -> None:
    """Called from a model's `_init_weights` after the default init: zero the generator's output layer."""
    if isinstance(module, MetricOutputLayer):
        nn.init.zeros_(module.weight)
        nn.init.zeros_(module.bias)


def cross_head_variant_of(config) -> str:
    """The config's `cross_head_variant` (every DAMCHA config declares it)."""
    return config.cross_head_variant


def build_cross_head_mixing(config) -> nn.Module | None:
    """The per-layer module of a score-mixing variant (`TalkingHeadsMixing`, `DynamicHeadComposition`), else None.

    A model's attention layer stores it as `cross_head_mixing`, where `cross_head_attention` finds it.
    """
    mixing_class = SCORE_MIXING_VARIANTS.get(cross_head_variant_of(config))
    return None if mixing_class is None else mixing_class.from_config(config)


def init_cross_head_weights(module: nn.Module, std: float) -> None:
    """Called from a model's `_init_weights` after the default init: every cross-head module starts as exact MHA
    (zero DAMCHA generator output, identity talking-heads matrices, identity DCMHA composition)."""
    init_metric_generator(module)
    init_talking_heads(module)
    init_dcmha(module, std)


def _backend_copies_its_inputs(attn_implementation: str | None, dropout: float, query: torch.Tensor) -> bool:
    """Whether the attention function saves copies of q, k, v for backward rather than the tensors themselves.

    Eager attention and SDPA's math fallback (which a CPU takes when attention dropout is on) do: they then keep no
    view into a fused `c_attn` projection alive, and a key mixing that saved its input as such a view would keep the
    whole `(b, s, 3d)` projection alive for backward on its own (3 keys' worth per layer). The fused kernels save the
    q, k, v views themselves, so the projection is kept anyway and a view costs nothing.
    """
    if not (torch.is_grad_enabled() and query.requires_grad):
        return False
    if attn_implementation == "eager":
        return True
    return attn_implementation == "sdpa" and dropout > 0 and query.device.type == "cpu"


def mix_keys_per_token(cross_head: torch.Tensor, key: torch.Tensor, compact_saved_key: bool = False) -> torch.Tensor:
    """`K~_i[s] = sum_j C_ij[s] K_j[s]` for `C` (b, s, H, H) and `key` (b, H, s, d_h): one `bmm` over the tokens.

    The projections hand the key over as a transposed view of `(b, s, H, d_h)`, so transposing it back and merging
    `(b, s)` are views, not copies; the result is again a `(b, H, s, d_h)` view, laid out as the plain key was.
    `compact_saved_key`: save a compact copy of the key for backward rather than a view into its projection (see
    `_backend_copies_its_inputs`).
    """
    batch, heads, seq, head_dim = key.shape
    token_major = key.transpose(1, 2).reshape(batch * seq, heads, head_dim)
    if compact_saved_key:
        # A no-op for a key that is already compact; otherwise a key-sized copy instead of a view into the projection.
        # (A stride test, not a storage-size test: torch.compile traces strides, not storages.)
        token_major = token_major.contiguous()
    mixed = torch.bmm(cross_head.reshape(batch * seq, heads, heads), token_major)
    return mixed.view(batch, seq, heads, head_dim).transpose(1, 2)


def project_heads(projection: nn.Module, hidden_states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`projection(hidden_states)` `(b, s, H * d_h)` as the `(b, H, s, d_h)` view the attention functions take."""
    return projection(hidden_states).view(*hidden_states.shape[:-1], -1, head_dim).transpose(1, 2)


def projected_mixed_key(
    cross_head: torch.Tensor, key_projection: nn.Module, hidden_states: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """The mixed key `(b, H, s, d_h)` from a layer's separate key projection (ViT's `k_proj`), for `C` of one sequence
    `(b, H, H)` (`"sequence"`) or of each token `(b, s, H, H)` (`"token"`).

    A plain `nn.Linear` under autograd goes through `_SequenceMixedKeyProjection` / `_TokenMixedKeyProjection`, which
    keep one key-sized tensor per layer less for backward; anything else (a PEFT adapter on the projection, autocast,
    inference) projects and mixes as usual.
    """
    per_token = cross_head.dim() == 4
    if (
        type(key_projection) is nn.Linear
        and torch.is_grad_enabled()
        and not torch.is_autocast_enabled(hidden_states.device.type)
        and (hidden_states.requires_grad or cross_head.requires_grad or key_projection.weight.requires_grad)
    ):
        fused = _TokenMixedKeyProjection if per_token else _SequenceMixedKeyProjection
        return fused.apply(hidden_states, key_projection.weight, key_projection.bias, cross_head)
    key = project_heads(key_projection, hidden_states, head_dim)
    return mix_keys_per_token(cross_head, key) if per_token else mix_keys_per_sequence(cross_head, key)


def mix_keys_per_sequence(cross_head: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """`K~_i = sum_j C_ij K_j` for one `C` (b, H, H) per sequence and `key` (b, H, s, d_h): one `bmm` per batch.

    The key is flattened to `(b, H, s * d_h)`, a copy of the transposed view the projections give, and the copy is
    what autograd keeps for backward, not the projection. Broadcasting `C` over the tokens instead would avoid the
    copy but keep an expanded `(b * s, H, H)` copy of `C` for backward, more bytes at ViT widths.
    """
    return (cross_head @ key.flatten(2)).view_as(key)


def cross_head_query_key(
    query: torch.Tensor,
    key: torch.Tensor | None,
    hidden_states: torch.Tensor,
    metric: CrossHeadMetric,
    *,
    layer_idx: int,
    metric_context: str,
    metric_mask: str = "full",
    token_mask: torch.Tensor | None = None,
    compact_saved_key: bool = False,
    key_projection: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn multi-head `(query, key)` into DAMCHA's, for any attention function.

    Args:
        query, key: `(batch, heads, seq, head_dim)` and `(batch, kv_heads, seq, head_dim)` projections of the new
            tokens (after any rotary embedding); `kv_heads` divides `heads` (grouped-query attention) or equals it.
        hidden_states: `(batch, seq, hidden)`, the normalised attention input `X` of the same tokens.
        metric: the model's `CrossHeadMetric`.
        token_mask: `(batch, seq)`, True for real tokens and False for padding, or None (no padding). Only
            `"sequence"` uses it: its `C` comes from the mean over the real tokens.
        compact_saved_key: `"token"` keeps a compact copy of the key for backward instead of a view into its
            projection: for attention functions that copy their inputs (`_backend_copies_its_inputs`). (`"sequence"`
            always keeps a compact copy.)
        key_projection: a layer with its own key projection (ViT) may pass it, with `key=None`, instead of the key:
            `"sequence"` and `"token"` then project and mix in one step that keeps less for backward
            (`projected_mixed_key`).

    Returns:
        `(query, key)`, each to be handed on as it is (the key to the KV cache). For `"token"` and `"sequence"` the
        query is unchanged and the key is the mixed `K~` (same shape). For `"query"` the query is
        `(batch, heads, seq, kv_heads * head_dim)` and the key is the plain per-head key, unchanged: after the cache
        update, `full_width_key` turns it into the key every head's expanded query scores against.
    """
    if metric_context == "token":
        cross_head = metric(hidden_states, layer_idx, metric_mask)  # (b, s, H, H)
        if key is None:
            return query, projected_mixed_key(cross_head, key_projection, hidden_states, query.shape[-1])
        return query, mix_keys_per_token(cross_head, key, compact_saved_key)
    if metric_context == "sequence":
        cross_head = metric(masked_mean(hidden_states, token_mask), layer_idx, metric_mask)  # (b, H, H)
        if key is None:
            return query, projected_mixed_key(cross_head, key_projection, hidden_states, query.shape[-1])
        return query, mix_keys_per_sequence(cross_head, key)
    if key is None:
        key = project_heads(key_projection, hidden_states, query.shape[-1])
    if metric_context == "query":
        cross_head = metric(hidden_states, layer_idx, metric_mask)  # (b, t, H, H_kv)
        # expanded[b, i, t, j, :] = C_ij(x_t) * q_i[t]
        expanded = cross_head.permute(0, 2, 1, 3).unsqueeze(-1) * query.unsqueeze(-2)
        return expanded.flatten(-2), key
    raise ValueError(
        f"unknown `metric_context` {metric_context!r}; choose one of {', '.join(map(repr, METRIC_CONTEXTS))}."
    )


def masked_mean(hidden_states: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of `hidden_states` `(batch, seq, hidden)` over the tokens where `token_mask` `(batch, seq)` is True
    (every token when it is None), so that padding does not change a `"sequence"` metric."""
    if token_mask is None:
        return hidden_states.mean(dim=1)
    weights = token_mask.to(hidden_states.dtype).unsqueeze(-1)
    # A row without real tokens (every query of it is masked anyway) gets the zero vector rather than NaN.
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


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


def self_attention_cache(cache):
    """The cache the self-attention layers update: an `EncoderDecoderCache` (a decoder with cross-attention, e.g.
    GPT-2 with `add_cross_attention=True`) holds it as `.self_attention_cache`, as stock GPT-2 reads it."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def check_attention_backend(metric_context: str, attn_implementation: str | None) -> None:
    """The expanded-query form gives the query a wider head than the value, which only eager and SDPA accept."""
    if metric_context == "query" and attn_implementation not in (None, "eager", "sdpa"):
        raise ValueError(
            f"`metric_context='query'` needs `attn_implementation` 'eager' or 'sdpa' (its query and key heads are "
            f"wider than its value heads); got {attn_implementation!r}. Use `metric_context='token'` for "
            f"{attn_implementation}, or load the model with `attn_implementation='sdpa'`."
        )


def eager_attn_implementation_for(config, requested: str | None) -> str | None:
    """The attention backend a model must use for `config`'s variant, or None where the usual resolution applies.

    Talking-heads and DCMHA need the materialised score maps: they get `"eager"` when no backend was requested, and a
    `ValueError` naming `attn_implementation` and the fix when another one was. Models call this from
    `_check_and_adjust_attn_implementation`, so that construction, `from_pretrained` and `set_attn_implementation`
    all resolve the same way.
    """
    variant = cross_head_variant_of(config)
    if variant not in SCORE_MIXING_VARIANTS:
        return None
    if requested not in (None, "eager"):
        raise ValueError(
            f"`cross_head_variant={variant!r}` mixes the attention score maps across heads, which only eager attention "
            f"materialises, so it cannot run with `attn_implementation={requested!r}`. Load or build the model with "
            f"`attn_implementation='eager'` (or leave it unset), or use `cross_head_variant='damcha'` or `'none'`, "
            "which run on every backend."
        )
    return "eager"


def score_mixing_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    mixing: nn.Module,
    query_weights=None,
    key_weights: torch.Tensor | None = None,
    scaling: float,
    dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention whose score maps are mixed across heads before and after the softmax (talking-heads, DCMHA).

    The logits are mixed first and masked after, so that the mask's large negative values never enter a mix; each
    entry `(t, s)` is mixed only with entry `(t, s)` of the other heads, so a masked (future) key reaches nothing but
    masked entries. After the softmax the masked entries are zero in every head and mixing keeps them zero.
    `attention_mask` is the eager additive float mask or a boolean mask (True = attend), or None.
    Returns `(attn_output (batch, seq, heads, head_dim), attn_weights (batch, heads, seq, keys))`.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    scores = mixing.mix_logits(scores, query_weights, key_weights)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probabilities = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    probabilities = mixing.mix_probabilities(probabilities, query_weights, key_weights)
    probabilities = nn.functional.dropout(probabilities, p=dropout, training=module.training)
    attn_output = torch.matmul(probabilities, value).transpose(1, 2)
    return attn_output, probabilities


def cross_head_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    metric: CrossHeadMetric | None = None,
    default_attention: Callable,
    dropout: float,
    cache=None,
    past_key_values=None,
    token_mask: torch.Tensor | None = None,
    key_projection: nn.Module | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-head attention for any model, dispatched on `config.cross_head_variant`; updates the KV cache.

    `module` is the model's attention layer (it provides `config`, `layer_idx`, `scaling` and the head count, and for
    `"talking_heads"` / `"dcmha"` its `cross_head_mixing` module from `build_cross_head_mixing`);
    `query`, `key`, `value` are its `(batch, heads, seq, head_dim)` projections of `hidden_states`;
    `metric` is the model's `CrossHeadMetric` (`"damcha"` only);
    `default_attention` is the model's eager attention function, used when `config._attn_implementation` is eager.
    `cache` (transformers >= 5.24) or `past_key_values` (5.23 and earlier) is the KV cache, a plain or an
    `EncoderDecoderCache` (whose self-attention part is updated); `token_mask` `(batch, seq)` marks the real tokens
    for `"sequence"` (see `cross_head_query_key`). A layer with its own key projection may pass `key=None` and
    `key_projection` (its `k_proj`), so that `"sequence"` and `"token"` can project and mix the key in one step.
    Returns `(attn_output (batch, seq, heads, head_dim), attn_weights or None)` as the attention functions do.

    `"damcha"` mixes `(query, key)` and runs the configured attention function; `"none"` runs it on the plain
    projections; `"talking_heads"` and `"dcmha"` run `score_mixing_attention`. DCMHA's key-side weights are
    concatenated to the keys (last dim) before the cache update and split off after it, so the cache stores them per
    position with the keys and any cache class carries them.
    """
    config = module.config
    # Each config field is read once: a transformers config attribute costs microseconds per read (its
    # `__getattribute__` hooks), which batch-1 decoding pays per layer and step.
    variant = cross_head_variant_of(config)
    attn_implementation = config._attn_implementation
    metric_context = config.metric_context if variant == "damcha" else None
    # transformers renamed the cache argument in 5.24; whichever name the caller used, it is the same cache.
    cache = self_attention_cache(cache if cache is not None else past_key_values)
    if key is None and metric_context not in ("sequence", "token"):
        key = project_heads(key_projection, hidden_states, query.shape[-1])
    if variant in SCORE_MIXING_VARIANTS:
        return _score_mixing_cross_head_attention(
            module, hidden_states, query, key, value, attention_mask, dropout=dropout, cache=cache, **kwargs
        )
    if variant == "damcha":
        if metric is None:
            raise ValueError(
                f"{type(module).__name__}: `cross_head_variant='damcha'` needs the model's `cross_head_metric`; call "
                "the layer through its model, which passes it."
            )
        check_attention_backend(metric_context, attn_implementation)
        query, key = cross_head_query_key(
            query,
            key,
            hidden_states,
            metric,
            layer_idx=module.layer_idx or 0,
            metric_context=metric_context,
            metric_mask=config.metric_mask,
            token_mask=token_mask,
            compact_saved_key=_backend_copies_its_inputs(attn_implementation, dropout, query),
            key_projection=key_projection,
        )
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    key = full_width_key(query, key)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn_implementation, default_attention)
    return attention_interface(
        module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, **kwargs
    )


def _score_mixing_cross_head_attention(
    module, hidden_states, query, key, value, attention_mask, *, dropout, cache=None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    config = module.config
    variant = cross_head_variant_of(config)
    if config._attn_implementation not in (None, "eager"):
        eager_attn_implementation_for(config, config._attn_implementation)  # raises the error that names the fix
    mixing = getattr(module, "cross_head_mixing", None)
    # A wrapper (PEFT's modules_to_save) stands in for the module and forwards its methods to the trained copy, so the
    # check looks through it instead of insisting on the class.
    if not isinstance(getattr(mixing, "original_module", mixing), SCORE_MIXING_VARIANTS[variant]):
        raise ValueError(
            f"{type(module).__name__} has no `cross_head_mixing` module for `cross_head_variant={variant!r}`; build "
            "it in the layer's __init__ with `build_cross_head_mixing(config)`."
        )
    query_weights, key_weights = mixing.dynamic_weights(hidden_states)
    head_dim = key.shape[-1]
    if key_weights is not None:
        key = torch.cat([key, key_weights.to(key.dtype)], dim=-1)
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    if key_weights is not None:
        key, key_weights = key.split([head_dim, key.shape[-1] - head_dim], dim=-1)
    return score_mixing_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        mixing=mixing,
        query_weights=query_weights,
        key_weights=key_weights,
        scaling=module.scaling,
        dropout=dropout,
    )
