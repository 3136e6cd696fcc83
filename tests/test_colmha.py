"""Collaborative multi-head attention (`cross_head_variant="colmha"`, modeling/colmha.py).

Oracles: a naive per-head, per-position-pair attention written from the paper's formula, a tensor of known CP rank, a
layer of known collaborative structure, and the re-parametrisation's error recomputed from the converted weights.
Everything in float64, so that tolerances are float64 rounding. The family contract (exact conversion at full width,
caches, causality, save and load in every family) is tests/test_families.py's, which reads the variant registry.
"""

import math

import pytest
import torch
from conftest import (
    TINY_GPT2,
    float64_variant_lm,
    randomize_cross_head,
    tiny_gpt2_config,
    tiny_llama_config,
    tiny_token_ids,
)
from transformers import GPT2LMHeadModel

import damcha_hf
from damcha_hf.modeling.colmha import cp_decomposition, head_indicators, query_key_weights
from damcha_hf.modeling.config_rules import DamchaConfigError

HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
EXACT = {"rtol": 1e-10, "atol": 1e-10}


def colmha_lm(**overrides) -> damcha_hf.DamchaGPT2LMHeadModel:
    return float64_variant_lm("colmha", **overrides)


def naive_colmha(attention, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's causal attention layer as ColMHA, one head and one (query, key) pair at a time:
    `S_i[t, s] = sum_k (Q A)[t, k] m_i[k] (K B)[s, k] / sqrt(d_h)`, softmax over `s <= t`, times head `i`'s values."""
    batch, seq, _ = x.shape
    mixing = attention.cross_head_mixing
    query, key, value = (x @ attention.c_attn.weight + attention.c_attn.bias).split(HIDDEN, dim=-1)
    compress_query = mixing.query_compression if mixing.query_compression is not None else torch.eye(HIDDEN).double()
    compress_key = mixing.key_compression if mixing.key_compression is not None else torch.eye(HIDDEN).double()
    shared_query, shared_key = query @ compress_query, key @ compress_key
    out = torch.zeros(batch, seq, HEADS, HEAD_DIM, dtype=x.dtype)
    for b in range(batch):
        for i in range(HEADS):
            for t in range(seq):
                scores = torch.tensor(
                    [
                        sum(
                            shared_query[b, t, k] * mixing.mixing[i, k] * shared_key[b, s, k]
                            for k in range(len(mixing.mixing[i]))
                        )
                        / math.sqrt(HEAD_DIM)
                        for s in range(t + 1)
                    ],
                    dtype=x.dtype,
                )
                weights = torch.softmax(scores, dim=0)
                for s in range(t + 1):
                    out[b, t, i] += weights[s] * value[b, s, i * HEAD_DIM : (i + 1) * HEAD_DIM]
    return out.reshape(batch, seq, HIDDEN) @ attention.c_proj.weight + attention.c_proj.bias


@pytest.mark.parametrize("key_dim", [None, 12])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_layer_matches_the_naive_per_head_formula(key_dim, attn):
    model = colmha_lm(colmha_key_dim=key_dim, initializer_range=0.3)  # scores large enough for the mixing to show
    model.set_attn_implementation(attn)
    randomize_cross_head(model, scale=0.5)
    attention = model.transformer.h[1].attn
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = torch.full((6, 6), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attention(x, attention_mask=mask)
        expected = naive_colmha(attention, x)
        # the mixing matters: the same layer at the head indicators differs
        attention.cross_head_mixing.mixing.copy_(head_indicators(HEADS, attention.cross_head_mixing.key_dim))
        assert (naive_colmha(attention, x) - expected).abs().max() > 1e-2
    torch.testing.assert_close(out, expected, **EXACT)


def test_cp_decomposition_recovers_a_tensor_of_known_rank():
    generator = torch.Generator().manual_seed(0)
    weights, left, right = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in
                            ((4, 5), (12, 5), (12, 5)))  # fmt: skip
    tensor = torch.einsum("ir,jr,kr->ijk", weights, left, right)
    m, a, b, error = cp_decomposition(tensor, 5)
    assert error < 1e-8
    torch.testing.assert_close(torch.einsum("ir,jr,kr->ijk", m, a, b), tensor, rtol=1e-7, atol=1e-7)


def score_forms_error(stock_layer, converted_layer) -> float:
    """The relative Frobenius error of the heads' score bilinear forms, recomputed from the converted parameters:
    sum_i ||Wq (A diag(m_i) B^T - E_i) Wk^T|| against sum_i ||Wq E_i Wk^T||, over the (d + 1)-row projections."""
    query_weight, key_weight = query_key_weights(stock_layer)
    mixing = converted_layer.cross_head_mixing
    indicators = head_indicators(HEADS, HIDDEN).double()
    errors, norms = 0.0, 0.0
    for i in range(HEADS):
        target = query_weight @ torch.diag(indicators[i]) @ key_weight.T
        got = query_weight @ mixing.query_compression @ torch.diag(mixing.mixing[i]) @ mixing.key_compression.T
        errors += float(((got @ key_weight.T) - target).norm() ** 2)
        norms += float(target.norm() ** 2)
    return math.sqrt(errors / norms)


def test_the_reparametrisation_reports_the_error_it_introduces():
    torch.manual_seed(0)
    stock = GPT2LMHeadModel(tiny_gpt2_config()).double().eval()
    errors = []
    for key_dim in (24, 12):
        model = damcha_hf.convert_to_damcha(stock, cross_head_variant="colmha", colmha_key_dim=key_dim)
        for stock_block, block in zip(stock.transformer.h, model.transformer.h, strict=True):
            reported = block.attn.colmha_reparametrization_error
            assert reported == pytest.approx(score_forms_error(stock_block.attn, block.attn), rel=1e-6)
            errors.append(reported)
    assert all(0.01 < error < 1 for error in errors)


def test_a_trained_layer_of_collaborative_structure_converts_exactly_at_its_rank():
    """A GPT-2 whose heads' query/key forms share one rank-8 structure (W_q^i = U diag(M_i), W_k^i = V, biases
    included) is re-parametrised at `colmha_key_dim=8` with no error: the converted model equals the stock one."""
    torch.manual_seed(0)
    stock = GPT2LMHeadModel(tiny_gpt2_config()).double().eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in stock.transformer.h:
            shared_query, shared_key = (torch.randn(HIDDEN + 1, 8, generator=generator, dtype=torch.float64)
                                        for _ in range(2))  # fmt: skip
            scales = torch.randn(HEADS, 8, generator=generator, dtype=torch.float64)
            query = torch.cat([shared_query * scales[i] for i in range(HEADS)], dim=1)  # (d + 1, H * 8)
            key = shared_key.repeat(1, HEADS)
            block.attn.c_attn.weight[:, : 2 * HIDDEN] = torch.cat([query[:-1], key[:-1]], dim=1)
            block.attn.c_attn.bias[: 2 * HIDDEN] = torch.cat([query[-1], key[-1]])
    model = damcha_hf.convert_to_damcha(stock, cross_head_variant="colmha", colmha_key_dim=8)
    assert all(block.attn.colmha_reparametrization_error < 1e-8 for block in model.transformer.h)
    with torch.no_grad():
        torch.testing.assert_close(model(tiny_token_ids()).logits, stock(tiny_token_ids()).logits, rtol=1e-7, atol=1e-7)


def test_generation_of_a_compressed_model_with_a_cache_equals_without():
    """The cache keeps plain keys and the compression is applied as they are read (tests/test_families.py checks the
    full-width start in every family)."""
    model = colmha_lm(colmha_key_dim=12)
    randomize_cross_head(model, scale=0.5)
    prompt = tiny_token_ids(seq=5)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        cached = model.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=True, **settings)
        uncached = model.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=False, **settings)
        full = model(cached).logits[:, 4:-1].argmax(-1)
    assert torch.equal(cached, uncached)
    assert torch.equal(full, cached[:, 5:])


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(
        DamchaConfigError, match="`colmha_key_dim` \\(64\\) is wider than all heads' query width \\(32\\)"
    ):
        damcha_hf.DamchaGPT2Config(**TINY_GPT2, cross_head_variant="colmha", colmha_key_dim=64)
    with pytest.raises(ValueError, match="num_key_value_heads` \\(2\\) is not `num_attention_heads` \\(8\\)"):
        damcha_hf.DamchaLlamaConfig(**tiny_llama_config(num_key_value_heads=2).to_dict(), cross_head_variant="colmha")
    with pytest.raises(ValueError, match="only eager attention and SDPA"):
        config = damcha_hf.DamchaGPT2Config(**TINY_GPT2, cross_head_variant="colmha")
        damcha_hf.DamchaGPT2LMHeadModel._from_config(config, attn_implementation="flex_attention")


def test_a_fresh_compressed_model_gives_each_shared_coordinate_to_one_head_even_when_the_heads_do_not_divide_it():
    model = colmha_lm(colmha_key_dim=10)
    mixing = model.transformer.h[0].attn.cross_head_mixing
    assert mixing.mixing.shape == (HEADS, 10)
    assert torch.equal(mixing.mixing.sum(0), torch.ones(10, dtype=torch.float64))  # each coordinate: one head
    assert sorted(mixing.mixing.sum(1).tolist()) == [2.0, 2.0, 3.0, 3.0]  # the blocks differ by at most one
    with torch.no_grad():
        assert model(tiny_token_ids()).logits.isfinite().all()
