"""Mixture of attention heads (`cross_head_variant="moa"`, modeling/moa.py).

Oracles: a naive per-token router (softmax, a sort for the top k, the gates `E p`) and a naive per-head,
per-position-pair attention written from the paper's formula; the stock transformers layer for the heads of a
multi-query Llama (the paper's shared key/value); the Switch Transformer's load-balancing loss and the router z-loss
recomputed per token; transformers' own causal-LM loss for what the model adds. Everything in float64. The family
contract (exact conversion with every head kept, caches, causality, save and load in every family) is
tests/test_families.py's, which reads the variant registry.
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
from transformers import GPT2LMHeadModel, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.loss.loss_utils import ForCausalLMLoss

import damcha_hf
from damcha_hf.modeling.config_rules import DamchaConfigError
from damcha_hf.modeling.cross_head_variant import InexactStartWarning
from damcha_hf.modeling.moa import HeadRouter

HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
EXACT = {"rtol": 1e-10, "atol": 1e-10}


def moa_lm(**overrides) -> damcha_hf.DamchaGPT2LMHeadModel:
    return float64_variant_lm("moa", **overrides)


def naive_router(router, x: torch.Tensor):
    """Per token: the router's probabilities `p` `(b, t, E)`, the kept heads (a full sort, the `k` largest) and the
    gates `E p_i` on them, 0 elsewhere."""
    batch, seq, _ = x.shape
    probabilities = torch.zeros(batch, seq, router.num_heads, dtype=x.dtype)
    gates = torch.zeros_like(probabilities)
    kept = []
    for b in range(batch):
        for t in range(seq):
            logits = torch.tensor(
                [float(x[b, t] @ router.weight.detach()[i]) for i in range(router.num_heads)], dtype=x.dtype
            )
            p = torch.exp(logits - logits.max())
            p = p / p.sum()
            order = sorted(range(router.num_heads), key=lambda i: -float(p[i]))[: router.top_k]
            kept.append(order)
            probabilities[b, t] = p
            for i in order:
                gates[b, t, i] = router.num_heads * p[i]
    return probabilities, gates, kept


def naive_moa(attention, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's causal attention layer as MoA, one head and one (query, key) pair at a time: head `i`'s output at `t`,
    times its gate, through head `i`'s rows of the output projection."""
    batch, seq, _ = x.shape
    query, key, value = (x @ attention.c_attn.weight + attention.c_attn.bias).split(HIDDEN, dim=-1)
    _, gates, _ = naive_router(attention.cross_head_mixing, x)
    out = attention.c_proj.bias.expand(batch, seq, HIDDEN).clone()
    for b in range(batch):
        for t in range(seq):
            for i in range(HEADS):
                head = slice(i * HEAD_DIM, (i + 1) * HEAD_DIM)
                scores = torch.tensor(
                    [float(query[b, t, head] @ key[b, s, head]) / math.sqrt(HEAD_DIM) for s in range(t + 1)],
                    dtype=x.dtype,
                )
                weights = torch.softmax(scores, dim=0)
                head_output = sum(weights[s] * value[b, s, head] for s in range(t + 1))
                out[b, t] += gates[b, t, i] * (head_output @ attention.c_proj.weight[head])
    return out


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_layer_matches_the_naive_per_head_formula(top_k, attn):
    model = moa_lm(moa_top_k=top_k)
    model.set_attn_implementation(attn)
    randomize_cross_head(model, scale=0.5)
    attention = model.transformer.h[1].attn
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = torch.full((6, 6), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attention(x, attention_mask=mask)
        expected = naive_moa(attention, x)
        _, _, kept = naive_router(attention.cross_head_mixing, x)
    torch.testing.assert_close(out, expected, **EXACT)
    assert len({tuple(sorted(heads)) for heads in kept}) > 1 or top_k == HEADS  # tokens chose different heads


def test_the_paper_layout_one_shared_key_value_head_gates_the_stock_heads():
    """A Llama with `num_key_value_heads=1` is the paper's MoA: the experts share one key and value. The stock layer,
    with its output projection set to the identity, gives every head's output; MoA is their gated sum through the
    trained output projection."""
    stock = LlamaForCausalLM(tiny_llama_config(num_key_value_heads=1)).double().eval()
    with pytest.warns(InexactStartWarning, match="keeps 3 of its 8 heads"):
        model = damcha_hf.convert_to_damcha(stock, cross_head_variant="moa", moa_top_k=3).eval()
    randomize_cross_head(model, scale=0.5)
    layer, stock_layer = model.model.layers[0].self_attn, stock.model.layers[0].self_attn
    width = stock_layer.o_proj.weight.shape[1]
    x = torch.randn(2, 7, stock.config.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    positions = torch.arange(7)[None].expand(2, -1)
    embeddings = stock.model.rotary_emb(x, positions)
    mask = torch.full((7, 7), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        trained_output_projection = stock_layer.o_proj.weight.clone()
        stock_layer.o_proj.weight.copy_(torch.eye(width, dtype=torch.float64))
        heads_output, _ = stock_layer(x, position_embeddings=embeddings, attention_mask=mask)
        stock_layer.o_proj.weight.copy_(trained_output_projection)
        _, gates, _ = naive_router(layer.cross_head_mixing, x)
        head_dim = width // stock.config.num_attention_heads
        expected = (heads_output.view(2, 7, -1, head_dim) * gates[..., None]).flatten(-2) @ trained_output_projection.T
        got, _ = layer(x, position_embeddings=embeddings, attention_mask=mask)
    torch.testing.assert_close(got, expected, **EXACT)


def test_every_head_kept_starts_as_multi_head_attention_and_half_of_them_does_not():
    stock = GPT2LMHeadModel(tiny_gpt2_config()).double().eval()
    ids = tiny_token_ids()
    with torch.no_grad():
        expected = stock(ids).logits
        all_heads = damcha_hf.convert_to_damcha(stock, cross_head_variant="moa", moa_top_k=HEADS)
        torch.testing.assert_close(all_heads(ids).logits, expected, **EXACT)
        with pytest.warns(UserWarning, match="moa_top_k=4` to start as exactly the source"):
            half = damcha_hf.convert_to_damcha(stock, cross_head_variant="moa")
        assert half.config.moa_top_k is None and half.transformer.h[0].attn.cross_head_mixing.top_k == HEADS // 2
        assert (half(ids).logits - expected).abs().max() > 1e-3


def naive_router_loss(router, x: torch.Tensor, balance_coef: float, z_coef: float) -> torch.Tensor:
    """`balance_coef E sum_i f_i P_i + z_coef mean_t logsumexp(logits_t)^2`, per token, from the definitions."""
    probabilities, _, kept = naive_router(router, x)
    tokens_count = len(kept)
    shares = [sum(heads.count(i) for heads in kept) / (tokens_count * router.top_k) for i in range(router.num_heads)]
    mean_p = probabilities.reshape(-1, router.num_heads).mean(0)
    balance = router.num_heads * sum(shares[i] * float(mean_p[i]) for i in range(router.num_heads))
    logits = x.reshape(-1, x.shape[-1]) @ router.weight.detach().T
    z = sum(float(torch.log(torch.exp(row).sum())) ** 2 for row in logits) / tokens_count
    return torch.tensor(balance_coef * balance + z_coef * z, dtype=x.dtype)


def test_the_output_reports_the_router_loss_and_adds_it_to_the_loss():
    model = moa_lm(moa_balance_loss_coef=0.3, moa_z_loss_coef=0.02)
    randomize_cross_head(model, scale=0.5)
    ids = tiny_token_ids()
    inputs = {}
    hooks = [
        block.attn.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: inputs.__setitem__(index, kwargs.get("hidden_states", args[0])),
            with_kwargs=True,
        )
        for index, block in enumerate(model.transformer.h)
    ]
    with torch.no_grad():
        output = model(ids, labels=ids)
    for hook in hooks:
        hook.remove()
    expected_aux = torch.stack(
        [naive_router_loss(block.attn.cross_head_mixing, inputs[i], 0.3, 0.02) for i, block in
         enumerate(model.transformer.h)]
    ).mean()  # fmt: skip
    torch.testing.assert_close(output.aux_loss, expected_aux, **EXACT)
    # transformers takes the cross-entropy in float32 (the tolerance is float32's); the router loss is added to it.
    cross_entropy = ForCausalLMLoss(output.logits, ids, vocab_size=model.config.vocab_size)
    torch.testing.assert_close(output.loss, cross_entropy + expected_aux.float())
    # The tuple layout (`return_dict=False`) carries the same loss first; the base model reports without a loss.
    with torch.no_grad():
        as_tuple = model(ids, labels=ids, return_dict=False)
        base = model.transformer(ids)
    torch.testing.assert_close(as_tuple[0], output.loss, **EXACT)
    torch.testing.assert_close(base.aux_loss, expected_aux, **EXACT)


def test_a_balanced_router_has_balance_loss_one_and_the_loss_trains_the_router():
    """At the zero start every head has probability 1/E, so `E sum_i f_i P_i = 1` whatever the selection, and the
    z-loss is `log(E)^2`; the auxiliary loss alone gives the router a gradient."""
    model = moa_lm(moa_balance_loss_coef=1.0, moa_z_loss_coef=1.0).train()
    output = model(tiny_token_ids())
    torch.testing.assert_close(output.aux_loss, torch.tensor(1 + math.log(HEADS) ** 2, dtype=torch.float64), **EXACT)
    output.aux_loss.backward()
    assert all(block.attn.cross_head_mixing.weight.grad.abs().max() > 0 for block in model.transformer.h)


def test_the_trainer_loss_includes_the_auxiliary_loss(tmp_path):
    model = moa_lm(moa_balance_loss_coef=0.5).train()
    randomize_cross_head(model, scale=0.5)
    ids = tiny_token_ids(batch=4)
    arguments = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4)
    trainer = Trainer(model=model, args=arguments)
    inputs = {"input_ids": ids, "labels": ids}
    loss = trainer.compute_loss(model, inputs)
    with torch.no_grad():
        output = model(**inputs)
    cross_entropy = ForCausalLMLoss(output.logits, ids, vocab_size=model.config.vocab_size)
    assert output.aux_loss > 0.5  # the balance loss is at least 1, weighted 0.5
    torch.testing.assert_close(loss.detach(), cross_entropy + output.aux_loss.float())


def test_a_router_a_forward_did_not_run_is_not_counted():
    """A module a wrapper replaced (PEFT's modules_to_save keeps the original beside the trained copy) keeps what its
    last forward recorded; the model counts only the routers of the forward that just ran."""
    model = moa_lm()
    ids = tiny_token_ids()
    with torch.no_grad():
        reference = model(ids).aux_loss
        stale = model.transformer.h[0].attn.cross_head_mixing
        model.transformer.h[0].attn.cross_head_mixing = type(stale)(HIDDEN, HEADS, 2, 0.01, 0.001).double()
        model.transformer.h[0].attn.stale_router = stale  # still a submodule, no longer called
        stale.router_loss = torch.tensor(1e3, dtype=torch.float64)
        torch.testing.assert_close(model(ids).aux_loss, reference, **EXACT)


@pytest.mark.parametrize(
    "field, value, words",
    [("moa_top_k", 5, "at most 4"), ("moa_top_k", 0, "positive integer"), ("moa_balance_loss_coef", -0.1, "above zero"),
     ("moa_z_loss_coef", float("nan"), "above zero")],
)  # fmt: skip
def test_a_config_refuses_a_bad_value_in_one_line_naming_the_field(field, value, words):
    with pytest.raises(DamchaConfigError, match=field) as refusal:
        damcha_hf.DamchaGPT2Config(**{**TINY_GPT2, "cross_head_variant": "moa", field: value})
    assert words in str(refusal.value) and "\n" not in str(refusal.value)


@torch.no_grad()
def test_compiled_static_cache_generation_is_one_graph_with_the_eager_tokens():
    """`generate` with a static cache compiles the decoding step with `fullgraph=True` (backend "eager": dynamo traces
    as for inductor, and a graph break fails); the router's gating and loss recording trace with it."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = moa_lm()
    randomize_cross_head(model, scale=0.5)
    model.generation_config.eos_token_id = None
    ids = tiny_token_ids(batch=1, seq=5)
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = model.generate(ids, **options)
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told otherwise
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **options)
    assert counters["stats"]["unique_graphs"] >= 1 and counters["stats"]["calls_captured"] > 0
    assert not counters["graph_break"]
    assert torch.equal(compiled, expected)


def test_an_encoder_decoder_generates_with_beams_and_reports_the_loss_of_both_stacks():
    """`generate` repeats every tensor of the encoder's output per beam: the encoder leaves the loss to the model, which
    reports the mean over the routers of both stacks."""
    from conftest import tiny_bart_config
    from transformers import BartForConditionalGeneration

    stock = BartForConditionalGeneration(tiny_bart_config()).eval()
    model = damcha_hf.convert_to_damcha(stock, cross_head_variant="moa", moa_top_k=HEADS).double()
    randomize_cross_head(model, scale=0.5)
    ids = tiny_token_ids(seq=7)
    with torch.no_grad():
        beams = model.generate(ids, num_beams=2, num_return_sequences=2, max_new_tokens=4, min_new_tokens=4)
        assert beams.shape[0] == 4
        output = model(ids, decoder_input_ids=ids)
        encoder_output = model.model.encoder(ids)
    assert "aux_loss" not in encoder_output
    routers = [module for module in model.modules() if isinstance(module, HeadRouter)]
    assert any(isinstance(module, HeadRouter) for module in model.model.encoder.modules())
    torch.testing.assert_close(output.aux_loss, torch.stack([router.router_loss for router in routers]).mean(), **EXACT)
