"""The DAMCHA math core against a naive oracle that materialises every head pair Q_i K_j^T."""

import math

import pytest
import torch
from attention_oracle import oracle_cross_head
from torch.nn import functional as F

from damcha_hf.modeling.attention_heads import full_width_key
from damcha_hf.modeling.metric import CrossHeadMetric, cross_head_query_key, exact_gelu

BATCH, SEQ, HIDDEN, HEADS = 2, 5, 24, 3
HEAD_DIM = HIDDEN // HEADS


def random_metric(seed: int = 0) -> CrossHeadMetric:
    metric = CrossHeadMetric(HIDDEN, HEADS, metric_hidden_size=8, num_generators=2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in metric.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return metric


def oracle_scores(query, key, x, metric, layer_idx, context, mask):
    """S[b, i, t, s] = sum_j C_ij(z) <q_i[t], k_j[s]>, with z chosen by the context, one head pair at a time."""
    scores = [[[[0.0] * SEQ for _ in range(SEQ)] for _ in range(HEADS)] for _ in range(BATCH)]
    for b in range(BATCH):
        for t in range(SEQ):
            for s in range(SEQ):
                z = {"token": x[b, s], "query": x[b, t], "sequence": x[b].mean(0)}[context]
                cross_head = oracle_cross_head(metric, z, HEADS, HEADS, mask, layer_idx)
                for i in range(HEADS):
                    for j in range(HEADS):
                        scores[b][i][t][s] = scores[b][i][t][s] + cross_head[i, j] * (query[b, i, t] @ key[b, j, s])
    return torch.stack([torch.stack([torch.stack([torch.stack(row) for row in head]) for head in b]) for b in scores])


@pytest.mark.parametrize("context", ["token", "sequence", "query"])
@pytest.mark.parametrize("mask", ["full", "diagonal", "offdiagonal"])
def test_query_key_scores_match_head_pair_oracle(context, mask):
    metric = random_metric()
    query, key = torch.randn(2, BATCH, HEADS, SEQ, HEAD_DIM)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    layer_idx = 1
    mixed_query, mixed_key = cross_head_query_key(
        query, key, x, metric, layer_idx=layer_idx, metric_context=context, metric_mask=mask
    )
    scores = mixed_query @ full_width_key(mixed_query, mixed_key).transpose(-1, -2)
    expected = oracle_scores(query, key, x, metric, layer_idx, context, mask)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
    # Sanity: the random metric really is far from the identity, so the test could tell DAMCHA from MHA.
    assert not torch.allclose(expected, query @ key.transpose(-1, -2), atol=1e-2)


def test_zero_generator_is_identity_and_mha_scores():
    # float64: mixing by the identity sums in another order than `query @ key^T`, a rounding far below 1e-6 here
    metric = CrossHeadMetric(HIDDEN, HEADS, metric_hidden_size=8).double()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(metric(x), torch.eye(HEADS, dtype=torch.float64).expand(BATCH, SEQ, HEADS, HEADS))
    query, key = torch.randn(2, BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float64)
    for context in ("token", "sequence", "query"):
        mixed_query, mixed_key = cross_head_query_key(query, key, x, metric, layer_idx=0, metric_context=context)
        scores = mixed_query @ full_width_key(mixed_query, mixed_key).transpose(-1, -2)
        torch.testing.assert_close(scores, query @ key.transpose(-1, -2), rtol=0, atol=1e-6)


def test_per_layer_generators_differ_and_stack_generator_is_shared():
    layered = random_metric()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    assert not torch.allclose(layered(x, 0), layered(x, 1))
    stack = CrossHeadMetric(HIDDEN, HEADS, metric_hidden_size=8, num_generators=1)
    torch.nn.init.normal_(stack.generators[0].fc_out.weight)
    torch.testing.assert_close(stack(x, 0), stack(x, 5))


def test_unknown_context_and_mask_name_the_field():
    metric = random_metric()
    query, key = torch.randn(2, BATCH, HEADS, SEQ, HEAD_DIM)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with pytest.raises(ValueError, match="metric_context"):
        cross_head_query_key(query, key, x, metric, layer_idx=0, metric_context="keys")
    with pytest.raises(ValueError, match="metric_mask"):
        metric(x, 0, "upper")


def test_scaled_softmax_attention_over_mixed_keys_is_ordinary_attention():
    """Key-side mixing hands the backend an ordinary (Q, K~, V): SDPA on it equals softmax(S / sqrt(d_h)) V."""
    metric = random_metric()
    query, key, value = torch.randn(3, BATCH, HEADS, SEQ, HEAD_DIM)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    for context in ("token", "query"):
        mixed_query, mixed_key = cross_head_query_key(query, key, x, metric, layer_idx=0, metric_context=context)
        mixed_key = full_width_key(mixed_query, mixed_key)
        out = F.scaled_dot_product_attention(mixed_query, mixed_key, value, scale=1 / math.sqrt(HEAD_DIM))
        weights = torch.softmax(oracle_scores(query, key, x, metric, 0, context, "full") / math.sqrt(HEAD_DIM), -1)
        torch.testing.assert_close(out, weights @ value, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("context", ["token", "sequence", "query"])
@pytest.mark.parametrize("mask", ["full", "diagonal", "offdiagonal"])
def test_gradients_match_head_pair_oracle(context, mask):
    """The generator's recomputed backward and the key mixing give autograd's gradients of the written-out scores."""
    metric = random_metric(seed=1)
    query, key = torch.randn(2, BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float64)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    metric = metric.double()
    upstream = torch.randn(BATCH, HEADS, SEQ, SEQ, dtype=torch.float64)

    def gradients(score_function):
        inputs = [t.clone().requires_grad_() for t in (query, key, x)]
        metric.zero_grad(set_to_none=True)
        (score_function(*inputs) * upstream).sum().backward()
        return [t.grad for t in inputs] + [p.grad.clone() for p in metric.parameters() if p.grad is not None]

    def core_scores(q, k, z):
        mixed_query, mixed_key = cross_head_query_key(q, k, z, metric, layer_idx=1, metric_context=context,
                                                      metric_mask=mask)  # fmt: skip
        return mixed_query @ full_width_key(mixed_query, mixed_key).transpose(-1, -2)

    def oracle(q, k, z):
        return oracle_scores(q, k, z, metric, 1, context, mask)

    core, expected = gradients(core_scores), gradients(oracle)
    assert len(core) == len(expected) == 3 + 4  # query, key, x; fc_in and fc_out weight and bias of generator 1
    for mine, reference in zip(core, expected):
        torch.testing.assert_close(mine, reference, rtol=1e-9, atol=1e-9)


def test_generator_saves_no_hidden_layer_for_backward():
    """Only the generator's input is kept for backward (plus the weights): its hidden layer is recomputed."""
    metric = random_metric()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        cross_head = metric(x, 0)
    parameters = {p.data_ptr() for p in metric.parameters()}
    activations = [t for t in saved if t.data_ptr() not in parameters]
    assert [tuple(t.shape) for t in activations] == [(BATCH * SEQ, HIDDEN)]
    assert activations[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    cross_head.sum().backward()
    assert x.grad is not None and metric.generators[0].fc_in.weight.grad is not None


@pytest.mark.parametrize("context", ["token"])
def test_compact_saved_key_keeps_the_fused_projection_free_and_the_gradients(context):
    """With `compact_saved_key` the mixing saves a key-sized copy, not a view that keeps a fused q/k/v projection
    alive (3 keys' worth); the result and the gradients are those of the plain path."""
    metric = random_metric()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    fused = torch.randn(BATCH, SEQ, 3 * HIDDEN, requires_grad=True)  # like GPT-2's c_attn output
    results = []
    for compact in (False, True):
        query, key, _ = (t.view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2) for t in fused.split(HIDDEN, dim=-1))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            _, mixed = cross_head_query_key(
                query, key, x, metric, layer_idx=0, metric_context=context, compact_saved_key=compact
            )
        keeps_projection = any(t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for t in saved)
        assert keeps_projection != compact
        fused.grad = None
        (mixed * torch.arange(mixed.numel()).view_as(mixed).sin()).sum().backward()
        results.append((mixed.detach(), fused.grad.clone()))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_generator_with_replaced_modules_runs_them():
    """A generator whose layers are not the plain ones (a PEFT adapter, another activation) runs its modules, not the
    fused fast path that reads the plain weights."""
    metric = random_metric()
    generator = metric.generators[0]
    generator.act = torch.nn.GELU(approximate="tanh")
    x = torch.randn(BATCH, SEQ, HIDDEN)
    hidden = F.gelu(x @ generator.fc_in.weight.T + generator.fc_in.bias, approximate="tanh")
    offsets = (hidden @ generator.fc_out.weight.T + generator.fc_out.bias).reshape(BATCH, SEQ, HEADS, HEADS)
    torch.testing.assert_close(metric(x, 0), torch.eye(HEADS) + offsets)
    assert not torch.allclose(metric(x, 0), oracle_cross_head(metric, x, HEADS, HEADS), atol=1e-4)  # exact GELU differs


@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 8), (1, 1), (300, 64)])
def test_exact_gelu_is_pytorchs_own_kernel_for_small_inputs_and_gelu_for_all(shape):
    """`exact_gelu` is the erf GELU at every size; below its threshold it is PyTorch's own kernel to the bit (the oracle:
    `F.gelu` with oneDNN switched off), which is what keeps oneDNN's fixed cost out of each decoding step; above it,
    `F.gelu` as dispatched by default."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    erf_form = 0.5 * x.double() * (1 + torch.erf(x.double() / math.sqrt(2)))
    # float32 rounding of 1 + erf(x / sqrt 2) reaches about 1e-6 (the tolerance once flaked at 1e-6 on an unseeded
    # draw); the tanh approximation, the thing to tell apart, is up to 5e-4 away.
    torch.testing.assert_close(exact_gelu(x).double(), erf_form, rtol=1e-5, atol=1e-5)
    tanh_form = F.gelu(x, approximate="tanh").double()
    if x.numel() > 8:
        assert not torch.allclose(tanh_form, erf_form, rtol=1e-5, atol=1e-5)
    assert exact_gelu(x).shape == x.shape and exact_gelu(x).is_contiguous()
    if x.numel() < 8192:
        with torch.backends.mkldnn.flags(enabled=False):
            native = F.gelu(x)
        assert torch.equal(exact_gelu(x), native)
    else:  # large inputs keep the default dispatch (oneDNN, faster there)
        assert torch.equal(exact_gelu(x), F.gelu(x))


def test_inference_path_equals_the_autograd_path_and_the_oracle():
    """The generator's no-grad path (what decoding runs: two `linear` and `exact_gelu`) and its autograd path
    (`RecomputedGeneratorMLP`) give the oracle's C, for one token as in a decoding step and for a prompt, with the
    per-layer generators picked by index (in float64, where the paths' rounding is far below the tolerance)."""
    metric = random_metric().double()
    for x in (torch.randn(1, 1, HIDDEN, dtype=torch.float64), torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)):
        for layer_idx in (0, 1):
            for mask in ("full", "diagonal", "offdiagonal"):
                expected = oracle_cross_head(metric, x, HEADS, HEADS, mask, layer_idx)
                with torch.no_grad():
                    inference = metric(x, layer_idx, mask)
                trained = metric(x.clone().requires_grad_(), layer_idx, mask)
                assert trained.requires_grad
                torch.testing.assert_close(inference, expected, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(trained.detach(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_gradients_flow_through_the_plain_path():
    metric = random_metric()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cross_head = metric(x, 0)
    assert cross_head.dtype == torch.bfloat16
    cross_head.float().sum().backward()
    # bf16 keeps 8 significant bits: the generator's inputs, hidden activations and output each round to within 2^-8
    # of their size (eps / 2), against an oracle in float32; a few such roundings add up, not 8 eps of them.
    tolerance = 8 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(
        cross_head.float(), oracle_cross_head(metric, x.detach(), HEADS, HEADS), rtol=tolerance, atol=tolerance
    )
    assert x.grad is not None and metric.generators[0].fc_in.weight.grad is not None


class _NotPlainLinear(torch.nn.Linear):
    """A key projection the core cannot read as plain weights (as a PEFT adapter is): it takes the unfused path."""


@pytest.mark.parametrize("context", ["sequence", "token"])
@pytest.mark.parametrize("bias", [True, False])
def test_key_projection_matches_head_pair_oracle(bias, context):
    """`"sequence"` / `"token"` handed the key projection instead of the key (ViT) project and mix in one autograd step;
    the scores and every gradient (input, projection weight and bias, generator) are the written-out scores'."""
    metric = random_metric(seed=2).double()
    projection = torch.nn.Linear(HIDDEN, HIDDEN, bias=bias).double()
    query = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float64)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    upstream = torch.randn(BATCH, HEADS, SEQ, SEQ, dtype=torch.float64)
    parameters = [*projection.parameters(), *metric.generators[0].parameters()]

    def gradients(score_function):
        inputs = [t.clone().requires_grad_() for t in (query, x)]
        for parameter in parameters:
            parameter.grad = None
        scores = score_function(*inputs)
        (scores * upstream).sum().backward()
        return [scores.detach()] + [t.grad for t in inputs] + [p.grad.clone() for p in parameters]

    def core_scores(q, z):
        _, mixed_key = cross_head_query_key(
            q, None, z, metric, layer_idx=0, metric_context=context, key_projection=projection
        )
        return q @ mixed_key.transpose(-1, -2)

    def oracle(q, z):
        key = projection(z).view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)
        return oracle_scores(q, key, z, metric, 0, context, "full")

    for mine, reference in zip(gradients(core_scores), gradients(oracle), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("context", ["sequence", "token"])
def test_key_projection_keeps_no_key_for_backward(context):
    """Projecting and mixing in one step keeps, besides the weights, only the layer input (which the query and value
    projections keep anyway) and tensors of `C`'s size; the unfused path keeps the projected key as well. Padding
    (`token_mask`) reaches the fused path's `C` as it does the plain one's (`"sequence"`), with equal results and
    gradients."""
    metric = random_metric(seed=3)
    token_mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    token_mask[0, -2:] = False
    query = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM)
    runs = []
    for projection_class in (torch.nn.Linear, _NotPlainLinear):
        torch.manual_seed(0)
        projection = projection_class(HIDDEN, HIDDEN)
        x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            _, mixed = cross_head_query_key(
                query, None, x, metric, layer_idx=0, metric_context=context, token_mask=token_mask,
                key_projection=projection,
            )  # fmt: skip
        weights = {p.untyped_storage().data_ptr() for p in [*projection.parameters(), *metric.parameters()]}
        activations = [t for t in saved if t.untyped_storage().data_ptr() not in weights]
        key_sized = [t for t in activations if t.numel() >= BATCH * SEQ * HIDDEN]
        key_sized_storages = {t.untyped_storage().data_ptr() for t in key_sized}
        (mixed * torch.arange(mixed.numel()).view_as(mixed).cos()).sum().backward()
        runs.append((key_sized_storages, x, mixed.detach(), x.grad, projection.weight.grad, projection.bias.grad))
    (fused_storages, fused_x, *fused), (plain_storages, plain_x, *plain) = runs
    assert fused_storages == {fused_x.untyped_storage().data_ptr()}
    assert len(plain_storages - {plain_x.untyped_storage().data_ptr()}) >= 1
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
