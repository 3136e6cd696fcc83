"""Every family's attention keeps the shape serving engines recognise, and what they cannot run is refused.

vLLM's Transformers backend serves a remote-code model by swapping in its own attention function: it reads the source
of each attention module's `forward` for a lookup of `ALL_ATTENTION_FUNCTIONS` (`.get_interface(...)` or `[...]`)
assigned to a name, and exactly one call of that name with `scaling=` read off the module (`self.<attr>`), and keys
its paged cache by the module's `layer_idx`. A layer that dispatches elsewhere (a helper function) is refused when the
model loads. These tests read every family's `forward` the same way, so that a refactor cannot break serving
silently; check that the reading accepts the stock transformers layers (which vLLM serves) and rejects the shapes it
must; run the models with a swapped-in attention function; and check the one-line refusals of the settings vLLM
cannot run (docs/serving.md). Serving itself is tests/test_vllm.py (marker `vllm`).
"""

import ast
import inspect
import re
import sys
import textwrap
import types

import pytest
import torch
import transformers
from conftest import randomize_cross_head, tiny_bart_config, tiny_gpt2_config, tiny_llama_config, tiny_vit_config
from tiny_decoders import tiny_stock_config
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import damcha_hf
from damcha_hf.families import FAMILIES, family_for_model_type
from damcha_hf.modeling.damcha_pretrained import stock_class_of
from damcha_hf.modeling.dispatch import serving_refusal


def stock_config(model_type: str) -> transformers.PretrainedConfig:
    """The family's tiny stock config; decoders with grouped-query attention (4 query heads, 2 key/value heads)."""
    if model_type == "gpt2":
        return tiny_gpt2_config()
    if model_type == "llama":
        return tiny_llama_config()
    if model_type == "vit":
        return tiny_vit_config()
    if model_type == "bart":
        return tiny_bart_config()
    return tiny_stock_config(model_type)


DECODERS = [family.model_type for family in FAMILIES if family.causal and not family.encoder_decoder]


# --- reading a forward as vLLM reads it ------------------------------------------------------------------------------


def is_interface_lookup(node) -> bool:
    """`ALL_ATTENTION_FUNCTIONS.get_interface(...)` (any method of it, called) or `ALL_ATTENTION_FUNCTIONS[...]`."""
    if isinstance(node, ast.Call):
        node = node.func
    return (
        isinstance(node, (ast.Attribute, ast.Subscript))
        and isinstance(node.value, ast.Name)
        and node.value.id == "ALL_ATTENTION_FUNCTIONS"
    )


def attention_function_call(forward) -> ast.Call | None:
    """The one call of a name assigned from an `ALL_ATTENTION_FUNCTIONS` lookup in `forward`'s source, or None where
    there is no such call or more than one."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and is_interface_lookup(node.value):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and is_interface_lookup(node.value) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ]
    return calls[0] if len(calls) == 1 else None


def scaling_attribute(call: ast.Call) -> str | None:
    """The attribute name `x` of the call's `scaling=self.x`, or None where the scaling is anything else."""
    values = [keyword.value for keyword in call.keywords if keyword.arg == "scaling"]
    if len(values) != 1:
        return None
    value = values[0]
    is_self_attribute = isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
    return value.attr if is_self_attribute and value.value.id == "self" else None


def lookup_in_a_helper(module, query, key, value, attention_mask):
    # The shape the attention had before: the layer calls a helper that does the lookup, so its own forward has none.
    return helper(module, query, key, value, attention_mask)


def helper(module, query, key, value, attention_mask):
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, None)
    return attention_interface(module, query, key, value, attention_mask, scaling=module.scaling)


def two_calls(self, query, key, value, attention_mask):
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    first = attention_interface(self, query, key, value, attention_mask, scaling=self.scaling)
    return attention_interface(self, first[0], key, value, attention_mask, scaling=self.scaling)


def subscript_lookup(self, query, key, value, attention_mask):
    attention_interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return attention_interface(self, query, key, value, attention_mask, scaling=self.scaling)


def test_the_reading_accepts_the_stock_layers_vllm_serves_and_rejects_other_shapes():
    stock_layers = [
        transformers.models.llama.modeling_llama.LlamaAttention,
        transformers.models.gpt2.modeling_gpt2.GPT2Attention,
        transformers.models.gemma2.modeling_gemma2.Gemma2Attention,
        transformers.models.phi3.modeling_phi3.Phi3Attention,
    ]
    for layer in stock_layers:
        call = attention_function_call(layer.forward)
        assert call is not None and scaling_attribute(call) == "scaling", layer.__name__
    assert attention_function_call(lookup_in_a_helper) is None
    assert attention_function_call(two_calls) is None
    assert scaling_attribute(attention_function_call(subscript_lookup)) == "scaling"


@pytest.mark.parametrize("model_type", [family.model_type for family in FAMILIES])
def test_every_family_attention_forward_has_the_shape_vllm_reads(model_type):
    family = family_for_model_type(model_type)
    attention_class = family.heads[0].model_class.damcha_attention_class
    call = attention_function_call(attention_class.forward)
    assert call is not None, f"{attention_class.__name__}.forward has no single ALL_ATTENTION_FUNCTIONS call"
    attribute = scaling_attribute(call)
    assert attribute is not None, f"{attention_class.__name__}.forward's call has no `scaling=self.<attr>`"
    # vLLM serves a model only if its class declares it dispatches through the interface (BART's stock class does not).
    if model_type in DECODERS:
        assert family.task_head.model_class._supports_attention_backend

    # On a built model the attribute is the stock layer's softmax scale, and every layer has its own `layer_idx`.
    torch.manual_seed(0)
    stock = family.task_head.stock_class(stock_config(model_type)).eval()
    stock_layers = [module for module in stock.modules() if type(module) is stock_class_of(attention_class)]
    model = damcha_hf.convert_to_damcha(stock)
    layers = [module for module in model.modules() if isinstance(module, attention_class)]
    assert layers and len(layers) == len(stock_layers)
    for layer, stock_scaling in zip(layers, [layer.scaling for layer in stock_layers]):
        scale = getattr(layer, attribute)
        assert isinstance(scale, float) and scale == stock_scaling
    if family.causal and not family.encoder_decoder:
        assert [layer.layer_idx for layer in layers] == list(range(len(layers)))


@pytest.mark.parametrize("model_type", DECODERS)
def test_no_weight_of_the_model_matches_its_patterns_of_keys_to_ignore(model_type):
    """vLLM's Transformers backend drops every checkpoint weight that a pattern of `_keys_to_ignore_on_load_unexpected`
    finds anywhere in its name (transformers only silences such unexpected keys): no real weight may match one.
    Stock GPT-2's "attn.bias" finds each `c_attn.bias`, so that vLLM would refuse the checkpoint as incomplete."""
    family = family_for_model_type(model_type)
    model = damcha_hf.convert_to_damcha(family.task_head.stock_class(stock_config(model_type)))
    patterns = model._keys_to_ignore_on_load_unexpected or []
    for key in model.state_dict():
        for prefixed in (key, f"{model.base_model_prefix}.{key}"):
            assert not any(re.search(pattern, prefixed) for pattern in patterns), (key, patterns)
    if model_type == "gpt2":  # the old checkpoints' causal-mask buffers are still ignored
        assert any(re.search(pattern, "transformer.h.0.attn.bias") for pattern in patterns)


# --- a swapped-in attention function serves every layer --------------------------------------------------------------

PROBE = "serving_probe"


@pytest.fixture
def probe_calls():
    """An attention function registered as `serving_probe`, as an engine registers its own: it records what each layer
    hands it and computes plain attention from exactly that (repeated key/value heads, `scaling`, the causal mask),
    knowing nothing of DAMCHA."""
    calls = []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((module, scaling))
        groups = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        scores = query @ key.transpose(-1, -2) * scaling
        if kwargs.get("softcap") is not None:
            scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
        queries, keys = scores.shape[-2:]
        allowed = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
        if kwargs.get("sliding_window") is not None:
            allowed &= ~torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries - kwargs["sliding_window"])
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return (scores.softmax(-1) @ value).transpose(1, 2), None

    ALL_ATTENTION_FUNCTIONS.register(PROBE, probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE, sdpa_mask)
    try:
        yield calls
    finally:
        del ALL_ATTENTION_FUNCTIONS._global_mapping[PROBE]
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[PROBE]


@pytest.mark.parametrize("model_type", DECODERS)
def test_a_swapped_in_attention_function_gets_the_mixed_keys_of_every_layer(model_type, probe_calls):
    """Each layer calls the registered function once per forward with its own scaling, and what it hands over is
    everything the attention needs: the logits from the probe's plain attention equal the model's own eager ones,
    with a non-zero metric (so unmixed keys would differ), and differ from the stock model's."""
    family = family_for_model_type(model_type)
    torch.manual_seed(0)
    stock = family.task_head.stock_class(stock_config(model_type)).eval().to(torch.float64)
    model = damcha_hf.convert_to_damcha(stock).eval()
    randomize_cross_head(model)
    model = model.to(torch.float64)
    model.set_attn_implementation("eager")
    tokens = torch.randint(3, stock.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
        model.set_attn_implementation(PROBE)
        served = model(tokens).logits
        stock_logits = stock(tokens).logits
    layers = [module for module in model.modules() if isinstance(module, family.heads[0].model_class.damcha_attention_class)]  # fmt: skip
    assert [module for module, _ in probe_calls] == layers
    assert all(scaling == module.scaling for module, scaling in probe_calls)
    # The stock eager functions of the rotary decoders take the softmax in float32: float32's tolerance.
    torch.testing.assert_close(served, expected, rtol=1.3e-6, atol=1e-5)
    assert (served - stock_logits).abs().max() > 1e-3


# --- refusals --------------------------------------------------------------------------------------------------------


def llama(**fields) -> damcha_hf.DamchaLlamaConfig:
    return damcha_hf.DamchaLlamaConfig(**{**tiny_llama_config().to_dict(), **fields})


def multi_head_llama(**fields) -> damcha_hf.DamchaLlamaConfig:
    """Talking-heads and DCMHA mix the score maps of all query heads: multi-head attention only."""
    return llama(num_key_value_heads=tiny_llama_config().num_attention_heads, **fields)


REFUSED = {
    "query context": (lambda: llama(metric_context="query"), "metric_context='query'"),
    "scores form": (lambda: llama(metric_form="scores"), "metric_form='scores'"),
    "talking-heads": (
        lambda: multi_head_llama(cross_head_variant="talking_heads"),
        "cross_head_variant='talking_heads'",
    ),
    "DCMHA": (lambda: multi_head_llama(cross_head_variant="dcmha"), "cross_head_variant='dcmha'"),
    "MoA": (lambda: llama(cross_head_variant="moa"), "cross_head_variant='moa'"),
    "ColMHA": (lambda: multi_head_llama(cross_head_variant="colmha"), "cross_head_variant='colmha'"),
    "GPT-2 query context": (
        lambda: damcha_hf.DamchaGPT2Config(**tiny_gpt2_config().to_dict(), metric_context="query"),
        "metric_context='query'",
    ),
    "ViT sequence context": (
        lambda: damcha_hf.DamchaViTConfig(**tiny_vit_config().to_dict(), metric_context="sequence"),
        "metric_context='sequence'",
    ),
    "BART": (lambda: damcha_hf.DamchaBartConfig(**tiny_bart_config().to_dict()), "encoder-decoder"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_setting_vllm_cannot_serve_is_refused_in_one_line_naming_it_and_the_fix(case):
    make_config, setting = REFUSED[case]
    config = make_config()
    family = family_for_model_type(config.model_type.removeprefix("damcha_"))
    # vLLM sets its attention implementation on the config and builds the model from it.
    config._attn_implementation = "vllm"
    with pytest.raises(ValueError) as refusal:
        family.task_head.model_class(config)
    message = str(refusal.value)
    assert "\n" not in message and setting in message and "vLLM" in message
    if setting != "encoder-decoder":
        assert "metric_context='token'" in message  # what to use instead


@pytest.mark.parametrize(
    ("sizes", "setting"), [((2, 1), "tensor parallelism (2)"), ((1, 2), "pipeline parallelism (2)")]
)
def test_splitting_the_mixed_heads_or_the_stack_across_devices_is_refused(sizes, setting, monkeypatch):
    config = llama()
    assert serving_refusal(config, parallel_sizes=(1, 1)) is None
    message = serving_refusal(config, parallel_sizes=sizes)
    assert setting in message and "\n" not in message and "size 1" in message
    # Inside an engine the sizes come from vLLM's parallel groups, read when the model is built.
    fake_distributed = types.SimpleNamespace(
        get_tensor_model_parallel_world_size=lambda: sizes[0],
        get_pp_group=lambda: types.SimpleNamespace(world_size=sizes[1]),
    )
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", fake_distributed)
    config._attn_implementation = "vllm"
    with pytest.raises(ValueError, match=setting.replace("(", r"\(").replace(")", r"\)")):
        damcha_hf.DamchaLlamaForCausalLM(config)
    # Plain multi-head attention ("none") mixes nothing, so vLLM may shard it as the stock model.
    assert serving_refusal(llama(cross_head_variant="none"), parallel_sizes=sizes) is None


@pytest.mark.parametrize("fields", [{}, {"cross_head_variant": "none"}, {"metric_mask": "offdiagonal"}])
def test_the_served_settings_build_with_the_engines_attention_implementation(fields, probe_calls, monkeypatch):
    """The default DAMCHA decoder (and plain attention, and the ablation masks) builds when an engine asks for its own
    attention implementation, and runs through it."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "vllm", ALL_ATTENTION_FUNCTIONS[PROBE])
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "vllm", sdpa_mask)
    config = llama(**fields)
    assert serving_refusal(config, parallel_sizes=(1, 1)) is None
    config._attn_implementation = "vllm"
    model = damcha_hf.DamchaLlamaForCausalLM(config).eval()
    assert model.config._attn_implementation == "vllm"
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))
    assert len(probe_calls) == config.num_hidden_layers
