"""The DAMCHA metric: the math every model in this folder shares.

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

Two readings of the paper (``metric_form``). The paper itself is not available to us; its summary says that MHA's
per-head metrics are "block-diagonal, input-independent, low-rank", that DAMCHA learns "the full cross-head metric
matrix M(X)" with a shared MLP generator, and that each head scores with "the row-sum of its block row,
X m_i(X) X^T".

* ``"keys"`` (the default, everything above): the blocks of the row are the cross-head query-key products
  ``A_ij = W_q^i W_k^j^T`` weighted by ``C_ij``, so ``m_i = W_q^i (sum_j C_ij W_k^j)^T``. It takes "block row" and
  "row-sum" literally on the ``H x H`` block matrix ``[A_ij]``, whose diagonal is MHA. Each head's metric keeps rank
  at most ``d_h`` (it factors through ``W_q^i``), the property the summary criticises, but attention stays ordinary
  attention on mixed keys: every fused kernel applies and the KV cache is MHA's.
* ``"scores"``: head ``i`` scores with a data-adaptive combination of every head's own metric,
  ``m_i = sum_j C_ij W_q^j W_k^j^T``, so ``S_i = sum_j C_ij Q_j K_j^T / sqrt(d_h)`` (query head ``j`` against its own
  key head, its group's under GQA, where ``C`` is ``H x H`` over the query heads). It takes "full metric" and
  "low-rank" literally: ``m_i`` has rank up to ``H * d_h = d``, a full-rank metric when ``C`` has no zero row. It mixes
  the ``n x n`` score maps across heads, as talking-heads and DCMHA do, so it runs in eager attention
  (``MetricScoreMixing``); its ``"token"`` context weights key ``s`` by ``C(x_s)``, which rides in the KV cache beside
  the keys, and ``"query"`` weights query ``t`` by ``C(x_t)``. At ``G = 0``, ``C = I`` and it is MHA too.

Every context hands ordinary ``(query, key, value)`` tensors to the attention functions of transformers, so eager,
SDPA and the other backends apply unchanged; ``dispatch.cross_head_attention_inputs`` is the entry point the models call, and
``autograd.py`` holds the optional memory-saving functions used here.

This file imports torch and its sibling files `autograd.py` and `metric_choices.py` (never the variant declaration): it
is copied next to the weights of a saved checkpoint (remote code).
"""

import torch
from torch import nn

from .attention_heads import CrossHeadModule, project_heads
from .autograd import RecomputedGeneratorMLP, SequenceMixedKeyProjection, TokenMixedKeyProjection
from .metric_choices import METRIC_CONTEXTS, METRIC_MASKS, QUERY_CONTEXT_BACKENDS
from .score_mixing import ScoreMixing


class MetricOutputLayer(nn.Linear):
    """The generator's last layer. Its own class, because weight init reaches it as a module on its own and must
    zero it (`init_metric_generator`) so that `C = I` and a fresh or converted DAMCHA model equals MHA."""


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


class MetricInputNorm(nn.LayerNorm):
    """The generator's own LayerNorm (`metric_input_norm="layernorm"`): a class of its own so that the models' weight
    init, which does not know it, cannot leave it anywhere but gain 1 and bias 0."""


class MetricGenerator(nn.Module):
    """`G`: one small MLP `d -> r -> H*H_kv` (GELU), whose output layer starts at zero, reading its input `z` through
    a LayerNorm of its own when `input_norm="layernorm"`.

    `num_heads` is the number of rows of `C` (the heads that receive a mix), `num_key_value_heads` its columns (the
    key heads mixed); both are `H` in multi-head attention.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        metric_hidden_size: int,
        num_key_value_heads: int | None = None,
        input_norm: str = "none",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads or num_heads
        if input_norm == "layernorm":
            self.input_norm = MetricInputNorm(hidden_size)
        elif input_norm != "none":
            raise ValueError(f"unknown `metric_input_norm` {input_norm!r}; choose one of 'none', 'layernorm'.")
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
        input_norm = modules.get("input_norm")
        if input_norm is not None:
            z = input_norm(z)
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
            offsets = RecomputedGeneratorMLP.apply(flat_z, fc_in_weight, fc_in_bias, fc_out_weight, fc_out_bias)
        else:
            # `linear` on 2-D input is one `addmm`, with the weight's transpose taken in C++ rather than as a
            # separate dispatch from Python.
            hidden = exact_gelu(nn.functional.linear(flat_z, fc_in_weight, fc_in_bias))
            offsets = nn.functional.linear(hidden, fc_out_weight, fc_out_bias)
        return offsets.view(shape)


class CrossHeadMetric(CrossHeadModule, nn.Module):
    """The cross-head matrix `C(z) = I + G(z)` of a layer, masked for the paper's ablations, and what a DAMCHA layer
    does with it at each call (`attention_inputs`).

    Holds one generator per stack (`metric_sharing="stack"`) or one per layer (`"layer"`). It is a single module so
    that PEFT's `modules_to_save=["cross_head_metric"]` trains every generator of a model in full. The attention
    core calls it as `metric(z, layer_idx, metric_mask)` for every layer (an encoder-decoder's cross-attention layer
    `i` as layer `L + i` of its decoder), so a forward hook on it sees each layer's `C`.
    """

    # "token" and "sequence" mix the keys as they project them (`cross_head_query_key`), in one step; the other
    # settings project the key in `attention_inputs`, so that the config's fields are read once per call.
    projects_key = True

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        metric_hidden_size: int,
        num_generators: int = 1,
        num_key_value_heads: int | None = None,
        layer_generators: tuple[int, ...] | None = None,
        input_norm: str = "none",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads or num_heads
        # Which generator each calling layer uses, where that is not simply its index (one generator per layer) or 0
        # (one per stack): an encoder-decoder's decoder calls it from its self-attention layers `0..L-1` and its
        # cross-attention layers `L..2L-1`, which may have generators of their own.
        self.layer_generators = layer_generators
        self.generators = nn.ModuleList(
            MetricGenerator(hidden_size, num_heads, metric_hidden_size, self.num_key_value_heads, input_norm)
            for _ in range(num_generators)
        )
        self._identities: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def from_config(
        cls, config, heads: int | None = None, layer_generators: tuple[int, ...] | None = None
    ) -> "CrossHeadMetric":
        """`C` is `H x H` for multi-head attention; with grouped-query attention it is `H_kv x H_kv`, or `H x H_kv`
        for `metric_context="query"` (see "Grouped-query attention" in this file's docstring). The `"scores"` form
        mixes the score maps of the `H` query heads: `H x H`.

        A family whose stack differs from its config's defaults says so: `heads`, the stack's head count (BART's
        decoder, whose config's `num_attention_heads` is the encoder's), and `layer_generators`, the generator each of
        the stack's attention layers uses (BART's decoder: its self- and its cross-attention layers)."""
        num_generators = config.num_hidden_layers if config.metric_sharing == "layer" else 1
        if layer_generators is not None:
            num_generators = len(set(layer_generators))
        heads, input_norm = heads or config.num_attention_heads, config.metric_input_norm
        if config.metric_form == "scores":
            return cls(
                config.hidden_size, heads, config.metric_hidden_size, num_generators, heads, input_norm=input_norm,
                layer_generators=layer_generators,
            )  # fmt: skip
        num_key_value_heads = getattr(config, "num_key_value_heads", None) or heads
        rows = heads if config.metric_context == "query" else num_key_value_heads
        return cls(
            config.hidden_size,
            rows,
            config.metric_hidden_size,
            num_generators,
            num_key_value_heads,
            input_norm=input_norm,
            layer_generators=layer_generators,
        )

    def forward(self, z: torch.Tensor, layer_idx: int = 0, metric_mask: str = "full") -> torch.Tensor:
        """`z`: (..., d) -> `C`: (..., H, H_kv)."""
        # The ModuleList's own dict: `self.generators[i]` and `len()` cost microseconds of Python per layer and step.
        generators = self._modules["generators"]._modules
        if self.layer_generators is not None:
            generator = generators[str(self.layer_generators[layer_idx])]
        else:
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

    def attention_inputs(self, layer, query, key, value, *, hidden_states, key_states, **options):
        """DAMCHA's `(query, key, score_mixing)` for `layer` (see `CrossHeadModule.attention_inputs`): the mixed key
        (`"token"`, `"sequence"`), the expanded query (`"query"`), or the `"scores"` form's score mixing."""
        config = layer.config
        metric_context = options.get("metric_context") or config.metric_context
        if metric_context == "sequence" and getattr(layer, "is_causal", False):
            # The config refuses this, but a field set on a built model (`model.config.metric_context = ...`) is
            # checked only here, where it would otherwise let every token see the ones after it.
            raise ValueError(
                f"{type(layer).__name__} is causal, but `config.metric_context` is 'sequence', which averages over "
                "the whole sequence and would let each token see later ones; set `config.metric_context = 'token'` "
                "(or 'query') on this model."
            )
        # Read per call, since they may change on a built model (`model.config.metric_mask = "diagonal"`, the
        # paper's ablation at inference); everything else the layer needs was fixed when it was built.
        metric_form, metric_mask = config.metric_form, config.metric_mask
        layer_index = metric_layer_index(layer)
        token_mask = options.get("token_mask")
        if metric_form == "scores":
            if key is None:
                key = project_heads(options.get("key_projection"), key_states, query.shape[-1])
            mixing = MetricScoreMixing(
                self,
                layer_idx=layer_index,
                metric_context=metric_context,
                metric_mask=metric_mask,
                num_key_value_heads=(key if key is not None else value).shape[1],
                token_mask=token_mask,
            )
            return query, key, mixing
        if metric_context == "query":
            options["variant"].check_backend_of_built_model(config, QUERY_CONTEXT_BACKENDS)
        if key_states is None:  # cached source keys are mixed already; "query" still expands the new queries
            if metric_context == "query":
                query = expanded_query(query, self(hidden_states, layer_index, metric_mask))
            return query, key, None
        query, key = cross_head_query_key(
            query,
            key,
            hidden_states,
            self,
            layer_idx=layer_index,
            metric_context=metric_context,
            metric_mask=metric_mask,
            token_mask=token_mask,
            compact_saved_key=backend_copies_its_inputs(config, options.get("dropout", 0.0), query),
            key_projection=options.get("key_projection"),
            key_states=key_states,
        )
        return query, key, None

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


def metric_layer_index(layer: nn.Module) -> int:
    """The layer index a layer calls its stack's `CrossHeadMetric` with: `metric_layer_index`, set when the layer was
    converted (its own index, or past the decoder's self-attention layers for an encoder-decoder's cross-attention);
    its `layer_idx` for a layer built otherwise."""
    index = layer.__dict__.get("metric_layer_index")
    return index if index is not None else layer.layer_idx or 0


def head_group_identity(num_heads: int, num_key_value_heads: int) -> torch.Tensor:
    """The `C` of plain (grouped-query) attention, `(H, H_kv)`: query head `i` reads key head `i // (H / H_kv)`.

    The identity matrix when `H == H_kv`; the `"diagonal"` and `"offdiagonal"` masks are taken against it.
    """
    group_size = num_heads // num_key_value_heads
    return (torch.arange(num_heads)[:, None] // group_size == torch.arange(num_key_value_heads)).float()


def init_metric_generator(module: nn.Module) -> None:
    """Called from a model's `_init_weights` after the default init: zero the generator's output layer, and start its
    own input norm as the identity map of a LayerNorm."""
    if isinstance(module, MetricInputNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    if isinstance(module, MetricOutputLayer):
        nn.init.zeros_(module.weight)
        nn.init.zeros_(module.bias)


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
    key_states: torch.Tensor | None = None,
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
            projection: for attention functions that copy their inputs (`backend_copies_its_inputs`). (`"sequence"`
            always keeps a compact copy.)
        key_projection: a layer with its own key projection (ViT) may pass it, with `key=None`, instead of the key:
            `"sequence"` and `"token"` then project and mix in one step that keeps less for backward
            (`projected_mixed_key`).
        key_states: `(batch, keys, hidden)`, the tokens the keys come from where they are not the queries'
            (cross-attention: the encoder output); `"token"` and `"sequence"` take `C` from them.

    Returns:
        `(query, key)`, each to be handed on as it is (the key to the KV cache). For `"token"` and `"sequence"` the
        query is unchanged and the key is the mixed `K~` (same shape). For `"query"` the query is
        `(batch, heads, seq, kv_heads * head_dim)` and the key is the plain per-head key, unchanged: after the cache
        update, `full_width_key` turns it into the key every head's expanded query scores against.
    """
    key_states = hidden_states if key_states is None else key_states
    if metric_context == "token":
        cross_head = metric(key_states, layer_idx, metric_mask)  # (b, s, H, H)
        if key is None:
            return query, projected_mixed_key(cross_head, key_projection, key_states, query.shape[-1])
        return query, mix_keys_per_token(cross_head, key, compact_saved_key)
    if metric_context == "sequence":
        cross_head = metric(masked_mean(key_states, token_mask), layer_idx, metric_mask)  # (b, H, H)
        if key is None:
            return query, projected_mixed_key(cross_head, key_projection, key_states, query.shape[-1])
        return query, mix_keys_per_sequence(cross_head, key)
    if key is None:
        key = project_heads(key_projection, key_states, query.shape[-1])
    if metric_context == "query":
        return expanded_query(query, metric(hidden_states, layer_idx, metric_mask)), key
    raise ValueError(
        f"unknown `metric_context` {metric_context!r}; choose one of {', '.join(map(repr, METRIC_CONTEXTS))}."
    )


def backend_copies_its_inputs(config, dropout: float, query) -> bool:
    """Whether the attention function of `config` (its `_attn_implementation`, read only under autograd) saves copies
    of q, k, v for backward rather than the tensors themselves.

    Eager attention and SDPA's math fallback (which a CPU takes when attention dropout is on) do: they then keep no
    view into a fused `c_attn` projection alive, and a key mixing that saved its input as such a view would keep the
    whole `(b, s, 3d)` projection alive for backward on its own (3 keys' worth per layer). The fused kernels save the
    q, k, v views themselves, so the projection is kept anyway and a view costs nothing.
    """
    if not (torch.is_grad_enabled() and query.requires_grad):
        return False
    attn_implementation = config._attn_implementation
    if attn_implementation == "eager":
        return True
    return attn_implementation == "sdpa" and dropout > 0 and query.device.type == "cpu"


def expanded_query(query: torch.Tensor, cross_head: torch.Tensor) -> torch.Tensor:
    """`"query"`'s expanded query `(b, H, t, H_kv * d_h)` from `query` `(b, H, t, d_h)` and `C` of the query tokens
    `(b, t, H, H_kv)`: `expanded[b, i, t, j, :] = C_ij(x_t) * q_i[t]`."""
    expanded = cross_head.permute(0, 2, 1, 3).unsqueeze(-1) * query.unsqueeze(-2)
    return expanded.flatten(-2)


def masked_mean(hidden_states: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of `hidden_states` `(batch, seq, hidden)` over the tokens where `token_mask` `(batch, seq)` is True
    (every token when it is None), so that padding does not change a `"sequence"` metric."""
    if token_mask is None:
        return hidden_states.mean(dim=1)
    weights = token_mask.to(hidden_states.dtype).unsqueeze(-1)
    # A row without real tokens (every query of it is masked anyway) gets the zero vector rather than NaN.
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def mix_keys_per_token(cross_head: torch.Tensor, key: torch.Tensor, compact_saved_key: bool = False) -> torch.Tensor:
    """`K~_i[s] = sum_j C_ij[s] K_j[s]` for `C` (b, s, H, H) and `key` (b, H, s, d_h): one `bmm` over the tokens.

    The projections hand the key over as a transposed view of `(b, s, H, d_h)`, so transposing it back and merging
    `(b, s)` are views, not copies; the result is again a `(b, H, s, d_h)` view, laid out as the plain key was.
    `compact_saved_key`: save a compact copy of the key for backward rather than a view into its projection (see
    `backend_copies_its_inputs`).
    """
    batch, heads, seq, head_dim = key.shape
    token_major = key.transpose(1, 2).reshape(batch * seq, heads, head_dim)
    if compact_saved_key:
        # A no-op for a key that is already compact; otherwise a key-sized copy instead of a view into the projection.
        # (A stride test, not a storage-size test: torch.compile traces strides, not storages.)
        token_major = token_major.contiguous()
    mixed = torch.bmm(cross_head.reshape(batch * seq, heads, heads), token_major)
    return mixed.view(batch, seq, heads, head_dim).transpose(1, 2)


def mix_keys_per_sequence(cross_head: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """`K~_i = sum_j C_ij K_j` for one `C` (b, H, H) per sequence and `key` (b, H, s, d_h): one `bmm` per batch.

    The key is flattened to `(b, H, s * d_h)`, a copy of the transposed view the projections give, and the copy is
    what autograd keeps for backward, not the projection. Broadcasting `C` over the tokens instead would avoid the
    copy but keep an expanded `(b * s, H, H)` copy of `C` for backward, more bytes at ViT widths.
    """
    return (cross_head @ key.flatten(2)).view_as(key)


def projected_mixed_key(
    cross_head: torch.Tensor, key_projection: nn.Module, hidden_states: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """The mixed key `(b, H, s, d_h)` from a layer's separate key projection (ViT's `k_proj`), for `C` of one sequence
    `(b, H, H)` (`"sequence"`) or of each token `(b, s, H, H)` (`"token"`).

    A plain `nn.Linear` under autograd goes through `SequenceMixedKeyProjection` / `TokenMixedKeyProjection`, which
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
        fused = TokenMixedKeyProjection if per_token else SequenceMixedKeyProjection
        return fused.apply(hidden_states, key_projection.weight, key_projection.bias, cross_head)
    key = project_heads(key_projection, hidden_states, head_dim)
    return mix_keys_per_token(cross_head, key) if per_token else mix_keys_per_sequence(cross_head, key)


class MetricScoreMixing(ScoreMixing):
    """The `"scores"` form of the metric as a score-mixing step for `score_mixing.score_mixing_attention`:
    head `i`'s logits are `sum_j C_ij(z) (Q_j K_j^T / sqrt(d_h))`, the probabilities are left as they are.

    `dynamic_weights` gives `C` of the query tokens (`"query"`), of each sequence (`"sequence"`), or of the key tokens
    (`"token"`), the last laid out like the keys `(batch, H_kv, seq, H * H / H_kv)` so that it rides in the KV cache.
    """

    def __init__(
        self,
        metric: CrossHeadMetric,
        *,
        layer_idx: int,
        metric_context: str,
        metric_mask: str,
        num_key_value_heads: int,
        token_mask: torch.Tensor | None = None,
    ):
        self.metric, self.layer_idx, self.metric_mask = metric, layer_idx, metric_mask
        self.metric_context, self.num_key_value_heads, self.token_mask = metric_context, num_key_value_heads, token_mask

    def dynamic_weights(
        self, hidden_states: torch.Tensor, key_states: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`C` of the queries `hidden_states` or of the keys' tokens `key_states` (None: the keys come from the
        cache with their weights, and only query-side weights are made)."""
        if self.metric_context == "query":
            return self.metric(hidden_states, self.layer_idx, self.metric_mask), None  # (b, t, H, H)
        if key_states is None and self.metric_context in ("token", "sequence"):
            if self.metric_context == "sequence":
                raise ValueError("`metric_context='sequence'` needs the tokens the keys come from, not cached keys.")
            return None, None
        if self.metric_context == "sequence":
            z = masked_mean(key_states, self.token_mask)
            return self.metric(z, self.layer_idx, self.metric_mask), None  # (b, H, H)
        if self.metric_context == "token":
            cross_head = self.metric(key_states, self.layer_idx, self.metric_mask)  # (b, s, H, H)
            batch, seq = cross_head.shape[:2]
            per_key_head = cross_head.reshape(batch, seq, self.num_key_value_heads, -1)
            return None, per_key_head.transpose(1, 2)
        raise ValueError(
            f"unknown `metric_context` {self.metric_context!r}; choose one of {', '.join(map(repr, METRIC_CONTEXTS))}."
        )

    def mix_logits(self, scores: torch.Tensor, query_weights, key_weights) -> torch.Tensor:
        """`scores` `(batch, H, queries, keys)` -> `S_i = sum_j C_ij P_j` with `C` of the context."""
        if key_weights is not None:  # "token": C of each key, as the cache returned it (b, H_kv, s, H * H / H_kv)
            batch, _, keys, _ = key_weights.shape
            heads = scores.shape[1]
            cross_head = key_weights.transpose(1, 2).reshape(batch, keys, heads, heads).to(scores.dtype)
            return torch.einsum("bsij,bjts->bits", cross_head, scores)
        cross_head = query_weights.to(scores.dtype)
        if cross_head.dim() == 3:  # "sequence"
            return torch.einsum("bij,bjts->bits", cross_head, scores)
        return torch.einsum("btij,bjts->bits", cross_head, scores)  # "query"

    def mix_probabilities(self, probabilities: torch.Tensor, query_weights, key_weights) -> torch.Tensor:
        return probabilities
