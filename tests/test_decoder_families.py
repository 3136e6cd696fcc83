"""What each rotary decoder family (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2) adds to Llama, kept under DAMCHA.

Each detail is checked, in every family that has it, against a naive reference written out by hand in float64
(`attention_oracle.py`: the family's projections, RoPE, the mixed keys, the scale, the soft-cap and the windows), and
against the stock transformers class: the sliding window (no weight outside it, mixed keys included, with the cache
too), Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm before RoPE, Phi-3's fused `qkv_proj` split and partial
rotation, Gemma 2's soft-capped logits, `query_pre_attn_scalar` scale and alternating local and global layers, and
grouped-query attention everywhere. What every family must do (conversion, cache, save/load, remote code) is in
test_families.py.
"""

import json
import sys

import huggingface_hub
import pytest
import torch
from attention_oracle import oracle_attention_heads, rotate
from conftest import (
    CACHE_ARGUMENT,
    IGNORED_LAYER_ARGUMENTS,
    FakeHub,
    load_recipe,
    randomize_cross_head,
    tiny_token_ids,
    unread_keyword_arguments,
)
from tiny_decoders import STOCK_CONFIGS, WINDOW, tiny_stock_config
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

import damcha_hf
from damcha_hf.families import family_for_model_type

FAMILIES = list(STOCK_CONFIGS)
CONTEXTS = ["token", "query"]


def backends(name):
    return ["eager"] if name == "gemma2" else ["eager", "sdpa"]  # stock Gemma 2 refuses SDPA (it cannot soft-cap)


def stock_lm(name, **overrides):
    """A random stock language model whose biases and norm weights are random too: the stock init sets them to
    zero or one, which would hide a bias or a norm left out."""
    family = family_for_model_type(name)
    model = family.task_head.stock_class(tiny_stock_config(name, **overrides)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith("bias") or "norm" in key:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def trained_lm(name, context="token", attn="eager", dtype=torch.float32, **overrides):
    """A DAMCHA language model converted from a random stock one, with a random ("trained") generator."""
    model = damcha_hf.convert_to_damcha(stock_lm(name, **overrides), metric_context=context).to(dtype)
    model.set_attn_implementation(attn)
    randomize_cross_head(model)
    return model


# --- each family's attention, written out by hand -----------------------------------------------------------------


def window_of(config, layer: int):
    """The sliding window of a layer, from the config as each family defines it: Mistral and Phi-3 slide every layer;
    Qwen2, Qwen3 and Gemma 2 the layers `layer_types` marks "sliding_attention"."""
    if config.model_type.removeprefix("damcha_") in ("mistral", "phi3"):
        return config.sliding_window
    return config.sliding_window if config.layer_types[layer] == "sliding_attention" else None


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads  # Qwen2 has none


def rms_norm(x, weight, eps):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def linear(x, layer):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def heads_by_hand(name, attention, x):
    """The query, key and value heads `(batch, seq, heads, d_h)` of a layer input, before RoPE, as each family
    computes them."""
    config = attention.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    if name == "phi3":  # one fused projection: the query rows, then the key rows, then the value rows
        weight = attention.qkv_proj.weight
        query_rows, key_rows = heads * head_dim, kv_heads * head_dim
        q, k, v = (x @ weight[rows].T for rows in (slice(0, query_rows), slice(query_rows, query_rows + key_rows),
                                                  slice(query_rows + key_rows, None)))  # fmt: skip
    else:  # with their biases where the family has them (Qwen2)
        q, k, v = (linear(x, layer) for layer in (attention.q_proj, attention.k_proj, attention.v_proj))
    q = q.reshape(*x.shape[:2], heads, head_dim)
    k, v = (t.reshape(*x.shape[:2], kv_heads, head_dim) for t in (k, v))
    if name == "qwen3":  # each head normalised on its own, before RoPE
        q = rms_norm(q, attention.q_norm.weight, config.rms_norm_eps)
        k = rms_norm(k, attention.k_norm.weight, config.rms_norm_eps)
    return q, k, v


def attention_by_hand(name, attention, metric, x, context, layer, mask="full"):
    config = attention.config
    q, k, v = heads_by_hand(name, attention, x)
    rope = config.rope_parameters
    rotary_dim = int(head_dim_of(config) * rope.get("partial_rotary_factor", 1.0))
    q, k = (torch.stack([rotate(t[:, s], s, rope["rope_theta"], rotary_dim) for s in range(x.shape[1])], dim=1)
            for t in (q, k))  # fmt: skip
    scale = getattr(config, "query_pre_attn_scalar", None) or head_dim_of(config)
    out = oracle_attention_heads(
        q, k, v, x, metric, context,
        scaling=scale**-0.5,
        mask=mask,
        window=window_of(config, layer),
        softcap=getattr(config, "attn_logit_softcapping", None),
        layer=layer,
    )  # fmt: skip
    return linear(out.reshape(*x.shape[:2], -1), attention.o_proj)


def record_attention_layers(model):
    """Forward hooks that keep each attention layer's input hidden states and its output."""
    records, handles = [], []
    for layer in model.model.layers:

        def hook(module, args, kwargs, output):
            records.append((kwargs.get("hidden_states", args[0] if args else None), output[0]))

        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    return records, handles


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("name, attn", [(name, attn) for name in FAMILIES for attn in backends(name)])
def test_every_attention_layer_equals_the_naive_reference(name, attn, context):
    """In float64 and with a random generator: each layer's output, given its input in the full model, equals the
    family's attention written out by hand (its projections, RoPE, the mixed keys, scale, soft-cap and window)."""
    model = trained_lm(name, context, attn, dtype=torch.float64)
    records, handles = record_attention_layers(model)
    with torch.no_grad():
        model(tiny_token_ids(seq=9))
    for handle in handles:
        handle.remove()
    assert len(records) == model.config.num_hidden_layers
    metric = model.model.cross_head_metric
    for layer, (x, output) in enumerate(records):
        attention = model.model.layers[layer].self_attn
        with torch.no_grad():
            expected = attention_by_hand(name, attention, metric, x, context, layer)
        # The stock rotary embedding computes its cos/sin tables in float32 whatever the model's dtype, so the layer
        # carries float32's relative rounding (eps ~1.2e-7) through RoPE; everything else here is float64.
        tolerance = 16 * torch.finfo(torch.float32).eps * expected.abs().max().item()
        torch.testing.assert_close(output, expected, rtol=0, atol=tolerance)


def refuse_deferred_model_imports(monkeypatch):
    """Make a relative import from inside the model files (`from .metric import ...` in a function) raise."""
    import builtins

    stock_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        if level > 0 and importer.startswith("damcha_hf.modeling"):
            raise AssertionError(f"{importer} imported .{name} during a forward")
        return stock_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", guarded_import)


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_a_built_model_binds_its_variant_and_follows_a_metric_mask_set_on_its_config(name, monkeypatch):
    """A forward consults no variant registry and imports nothing (the variant was bound when the layers were built),
    yet `model.config.metric_mask = ...` on the built model (the paper's ablation at inference) changes every layer to
    exactly the masked attention written out by hand, in float64."""
    from damcha_hf.modeling import damcha_pretrained, dispatch, variants

    model = trained_lm(name, "token", "sdpa", dtype=torch.float64)

    def registry_lookup(config):
        raise AssertionError("the variant registry was consulted during a forward")

    for module in (variants, dispatch, damcha_pretrained):
        monkeypatch.setattr(module, "variant_of", registry_lookup)
    refuse_deferred_model_imports(monkeypatch)
    metric = model.model.cross_head_metric
    logits = {}
    for mask in ("diagonal", "offdiagonal", "full"):
        model.config.metric_mask = mask
        records, handles = record_attention_layers(model)
        with torch.no_grad():
            logits[mask] = model(tiny_token_ids(seq=9)).logits
        for handle in handles:
            handle.remove()
        for layer, (x, output) in enumerate(records):
            attention = model.model.layers[layer].self_attn
            with torch.no_grad():
                expected = attention_by_hand(name, attention, metric, x, "token", layer, mask=mask)
            tolerance = 16 * torch.finfo(torch.float32).eps * expected.abs().max().item()  # RoPE's float32 tables
            torch.testing.assert_close(output, expected, rtol=0, atol=tolerance)
    assert (logits["full"] - logits["diagonal"]).abs().max() > 1e-3
    assert (logits["diagonal"] - logits["offdiagonal"]).abs().max() > 1e-3


# --- the attention function gets what stock gives it ----------------------------------------------------------------


@pytest.fixture
def recording_attention(monkeypatch):
    """An attention backend, "recording", that keeps the keyword arguments of each call and runs the family's eager
    attention (the one every family has; SDPA refuses Gemma 2's soft-cap)."""
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, {k: v for k, v in kwargs.items() if isinstance(v, (int, float, type(None)))}))
        eager_attention = sys.modules[type(module).__module__].eager_attention_forward
        return eager_attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "recording", recording)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "recording", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_the_attention_function_gets_the_stock_window_softcap_and_scale(name, recording_attention):
    """Eager and SDPA attention take the window from the mask; flash attention takes it (and Gemma 2's soft-cap) as
    keyword arguments, which must reach the attention function exactly as the stock layer passes them."""
    stock = stock_lm(name)
    damcha = damcha_hf.convert_to_damcha(stock)
    ids = tiny_token_ids(seq=9)
    for model in (stock, damcha):
        model.config._attn_implementation = "recording"
        with torch.no_grad():
            model(ids)
    stock_calls, damcha_calls = recording_attention[:2], recording_attention[2:]
    assert len(stock_calls) == len(damcha_calls) == 2
    assert damcha_calls == stock_calls
    windows = [call["sliding_window"] for _, call in stock_calls]
    assert windows == [window_of(stock.config, layer) for layer in range(2)] and WINDOW in windows
    if name == "gemma2":
        assert all(call["softcap"] == 1.0 and call["scaling"] == 24**-0.5 for _, call in damcha_calls)


@pytest.mark.parametrize("name", FAMILIES)
def test_attention_receives_no_argument_it_does_not_name(name, monkeypatch):
    family = family_for_model_type(name)
    unread = unread_keyword_arguments(monkeypatch, family.task_head.model_class.damcha_attention_class)
    model = trained_lm(name, attn=backends(name)[-1])
    prompt = tiny_token_ids(seq=6)
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, pad_token_id=0,
                   output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)  # fmt: skip
    model.train()
    model(prompt, labels=prompt).loss.backward()
    assert unread <= IGNORED_LAYER_ARGUMENTS, unread - IGNORED_LAYER_ARGUMENTS


# --- sliding windows ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_keys_outside_the_window_get_no_weight(name, context):
    """The mixed keys stay at their positions, so a sliding layer gives no weight to keys `window` or more positions
    back; a global layer does (so the check sees the difference)."""
    model = trained_lm(name, context)
    with torch.no_grad():
        attentions = model(tiny_token_ids(seq=9), output_attentions=True).attentions
    seq = attentions[0].shape[-1]
    distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    for layer, attention in enumerate(attentions):
        assert torch.all(attention[..., distance < 0] == 0)
        if window_of(model.config, layer):
            assert torch.all(attention[..., distance >= WINDOW] == 0)
        else:
            assert attention[..., distance >= WINDOW].sum() > 1e-2


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_window_holds_with_the_cache(name, cache_implementation):
    """Decoding past the window with a cache gives each step the logits of one full forward pass, and those differ
    from the same model without a window: the cache keeps the window, mixed keys included."""
    model = trained_lm(name, attn=backends(name)[-1])
    prompt = tiny_token_ids(seq=3)
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                                   pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                   cache_implementation=cache_implementation)  # fmt: skip
        steps = torch.stack(generated.logits, 1)
        full = model(generated.sequences[:, :-1]).logits[:, prompt.shape[1] - 1 :]
        torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
        unwindowed = trained_lm(name, attn=backends(name)[-1], sliding_window=64)  # beyond every position
        unwindowed.load_state_dict(model.state_dict())
        assert (unwindowed(generated.sequences[:, :-1]).logits[:, -1] - full[:, -1]).abs().max() > 1e-3


# --- grouped-query attention ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_the_cache_keeps_the_grouped_query_size_and_the_metric_mixes_key_value_heads(name):
    model = trained_lm(name)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert model.model.cross_head_metric.generators[0].fc_out.out_features == 2 * 2  # C is H_kv x H_kv
    with torch.no_grad():
        cache = getattr(model(tiny_token_ids(seq=9), use_cache=True), CACHE_ARGUMENT)
    keys = cache.layers[0].keys
    assert keys.shape[:2] == (2, 2) and keys.shape[-1] == head_dim_of(config)


# --- presets at the published sizes ---------------------------------------------------------------------------------

# The size each model card publishes, to the digits it gives: (total, precision), (non-embedding, precision) or None.
PUBLISHED_SIZES = {
    "mistral-7b": ((7.24e9, 1e7), None),  # Mistral-7B-v0.1: 7.24B
    "qwen2.5-0.5b": ((0.49e9, 1e7), (0.36e9, 1e7)),  # Qwen2.5-0.5B: 0.49B, non-embedding 0.36B
    "qwen3-0.6b": ((0.6e9, 1e8), (0.44e9, 1e7)),  # Qwen3-0.6B: 0.6B, non-embedding 0.44B
    "phi3-mini-4k": ((3.82e9, 1e7), None),  # Phi-3-mini-4k: 3.82B
    "gemma2-2b": ((2.61e9, 1e7), None),  # Gemma-2-2B: 2.61B
}


@pytest.mark.parametrize("preset", PUBLISHED_SIZES)
def test_info_presets_have_the_published_stock_size_and_count_the_generator(preset, capsys):
    from damcha_hf.cli import main
    from damcha_hf.families import presets

    assert main(["info", preset]) == 0
    printed = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
    model_class, make_config = presets()[preset]
    config = make_config()
    stock_class = next(head.stock_class for family in damcha_hf.families.FAMILIES for head in family.heads
                       if head.model_class is model_class)  # fmt: skip
    stock_config = stock_class.config_class(**{key: value for key, value in config.to_dict().items()
                                               if key not in ("model_type", "transformers_version")})  # fmt: skip
    with torch.device("meta"):
        stock = stock_class(stock_config)
    stock_count = stock.num_parameters()
    kv_heads, width = config.num_key_value_heads, config.hidden_size
    generator = (width * 64 + 64) + (64 * kv_heads**2 + kv_heads**2)  # d -> r -> H_kv * H_kv
    assert printed["stock parameters"].strip() == f"{stock_count:,}"
    assert printed["parameters"].strip() == f"{stock_count + generator:,}"
    assert printed["cross-head params"].strip().startswith(f"{generator:,} (")
    (total, precision), non_embedding = PUBLISHED_SIZES[preset]
    assert round(stock_count / precision) == round(total / precision)
    if non_embedding is not None:
        embedding = stock.get_input_embeddings().weight.numel()
        assert round((stock_count - embedding) / non_embedding[1]) == round(non_embedding[0] / non_embedding[1])


# --- the LoRA recipe ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_targets_are_the_projections_of_every_layer(name):
    family = family_for_model_type(name)
    model = trained_lm(name)
    linear_names = {key.rsplit(".", 1)[-1] for key, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear) and ".layers." in key}  # fmt: skip
    assert linear_names == set(family.lora_target_modules)  # every projection of the layers, attention and MLP
    if name == "phi3":
        assert set(family.lora_target_modules) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


# A full recipe run for the family whose LoRA targets differ from Llama's (fused projections), the others under -m slow.
@pytest.mark.parametrize("name", [name if name == "phi3" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in FAMILIES])  # fmt: skip
def test_lora_recipe_upgrades_a_stock_checkpoint_folder_and_merges_exactly(name, tmp_path, corpus):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from damcha_hf.data import byte_level_tokenizer

    family = family_for_model_type(name)
    folder = tmp_path / "base"
    stock = stock_lm(name, vocab_size=257, bos_token_id=256, eos_token_id=256, pad_token_id=256)
    stock.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    recipe = load_recipe("finetune_lora")
    result = recipe.main([
        "--base", str(folder), "--data", corpus, "--output-dir", str(tmp_path / "run"), "--max-steps", "2",
        "--batch-size", "4", "--block-size", "16", "--eval-steps", "2", "--max-eval-samples", "8",
        "--learning-rate", "1e-2", "--lora-rank", "2", "--metric-hidden-size", "8", "--num-threads", "1", "--merge",
    ])  # fmt: skip
    trainable = result["trainable_parameters"]
    assert trainable and all("lora_" in key or "cross_head_metric" in key for key in trainable)
    adapted = {key.split("lora_")[0].rstrip(".").rsplit(".", 1)[-1] for key in trainable if "lora_" in key}
    assert adapted == set(family.lora_target_modules)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged").eval()
    assert type(merged) is family.task_head.model_class
    merged_weights = merged.state_dict()
    for key, weight in stock.state_dict().items():  # only the LoRA targets moved, by the merge
        targeted = any(f".{target}." in key for target in family.lora_target_modules) and key.endswith("weight")
        assert (not torch.equal(weight, merged_weights[key])) == targeted, key
    peft_model = recipe.load_adapter(str(folder), str(tmp_path / "run" / "adapter"), metric_hidden_size=8).eval()
    ids = torch.tensor([list(b"the quick brown fox")])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_recipe_takes_eager_attention_for_gemma2_and_refuses_sdpa(tmp_path, capsys):
    folder = tmp_path / "gemma2"
    tiny_stock_config("gemma2").save_pretrained(folder)
    recipe = load_recipe("finetune_lora")
    assert recipe.parse_args(["--base", str(folder), "--output-dir", str(tmp_path / "a")]).attn == "eager"
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args(["--base", str(folder), "--attn", "sdpa", "--output-dir", str(tmp_path / "b")])
    assert exit_info.value.code == 2 and "--attn sdpa: Gemma 2 models run eager" in capsys.readouterr().err


def test_a_stock_gemma2_on_sdpa_converts_to_eager_and_equals_the_stock_model_in_eager():
    """Stock Gemma 2 ran SDPA by default before transformers 5.22 (dropping the soft-cap), which DAMCHA Gemma 2
    refuses: its conversion takes eager attention, and equals the stock model in eager, which soft-caps."""
    stock = stock_lm("gemma2").double()
    ids = tiny_token_ids(seq=9)
    with torch.no_grad():
        expected = stock(ids).logits
        stock.config._attn_implementation = "sdpa"  # as the stock default set it before 5.22
        damcha = damcha_hf.convert_to_damcha(stock)
        got = damcha(ids).logits
    assert damcha.config._attn_implementation == "eager"
    assert stock.config.attn_logit_softcapping is not None
    torch.testing.assert_close(got, expected, rtol=100 * torch.finfo(torch.float32).eps, atol=1e-10)


# --- the Hub card, push and inspect -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_hub_checkpoint_card_push_and_inspect(name, tmp_path, monkeypatch, capsys):
    from damcha_hf.cli import main
    from damcha_hf.data import byte_level_tokenizer
    from damcha_hf.hub import push_checkpoint, save_hub_checkpoint

    family = family_for_model_type(name)
    model = trained_lm(name, attn=backends(name)[-1], vocab_size=257, bos_token_id=256, eos_token_id=256,
                       pad_token_id=256)  # fmt: skip
    folder = save_hub_checkpoint(model, tmp_path / name, tokenizer_or_processor=byte_level_tokenizer(),
                                 heatmap_inputs=tiny_token_ids(batch=1, seq=8))  # fmt: skip
    card = (folder / "README.md").read_text()
    task_class = family.task_head.model_class.__name__
    assert "pipeline_tag: text-generation" in card and f"- {name}" in card
    assert f"A {family.display_name} model ({task_class})" in card
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": f"configuration_damcha_{name}.{family.config_class.__name__}",
        **{head.auto_class: f"modeling_damcha_{name}.{head.model_class.__name__}" for head in family.heads},
    }

    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    fake_hub = FakeHub(tmp_path / "hub").install(monkeypatch)
    push_checkpoint(folder, f"someone/damcha-{name}", token="hf_fake")
    (pushed,) = [call[2]["files"] for call in fake_hub.calls if call[0] == "create_commit"]
    code = {f"configuration_damcha_{name}.py", f"modeling_damcha_{name}.py", "decoder_attention.py", "metric.py"}
    assert code <= set(pushed) and {"model.safetensors", "README.md", "metric_heatmap.png"} <= set(pushed)

    heatmap = tmp_path / "c.png"
    assert main(["inspect", str(folder), "--output", str(heatmap)]) == 0
    assert heatmap.is_file() and f"wrote {heatmap} ({model.config.num_hidden_layers} panels)" in capsys.readouterr().out


@pytest.mark.slow  # flex attention without torch.compile takes seconds per call on a CPU
@pytest.mark.parametrize("name", FAMILIES)
def test_flex_attention_equals_eager(name):
    """Flex attention reads the soft-cap from the attention function's arguments (and the window from its block
    mask), so it sees what the DAMCHA layer passes, unlike eager and SDPA's masks alone."""
    model = trained_lm(name, attn="eager")
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        eager = model(tiny_token_ids(seq=9), attention_mask=mask).logits
        model.set_attn_implementation("flex_attention")
        flex = model(tiny_token_ids(seq=9), attention_mask=mask).logits
    torch.testing.assert_close(flex[mask.bool()], eager[mask.bool()], rtol=1e-4, atol=1e-5)
