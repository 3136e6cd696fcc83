"""Each recipe end to end on tiny generated data: the loss goes down, resume continues at the saved step,
two Accelerate processes stay identical, LoRA trains only LoRA + generator and merges exactly."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TINY_GPT2_ARGS,
    assert_loss_goes_down,
    load_recipe,
    losses,
    needs_auto_image_processor,
    trainer_state,
)
from PIL import Image
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
)

import damcha_hf
from damcha_hf.data import byte_level_tokenizer
from damcha_hf.hub import upload_plan

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.mark.parametrize(
    "name", ["train_gpt2", "train_gpt2_accelerate", "train_vit", "finetune_lora", "train_diffusion"]
)
def test_help_lists_every_metric_option(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_recipe(name).parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--metric-context", "--metric-mask", "--metric-sharing", "--metric-hidden-size",
                   "--cross-head-variant", "--attn", "--max-steps", "--max-train-samples", "--resume"):  # fmt: skip
        assert option in text, option


def test_train_gpt2_learns_saves_and_resumes_at_the_saved_step(tmp_path, corpus):
    recipe = load_recipe("train_gpt2")
    common_args = ["--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "6", "--save-steps", "3", "--eval-steps", "3"]
    full = recipe.main([*common_args, "--output-dir", str(tmp_path / "full")])
    assert full["global_step"] == 6
    uninterrupted = losses(trainer_state(tmp_path / "full" / "checkpoint-6")["log_history"])
    assert_loss_goes_down(uninterrupted)
    assert full["eval_bits_per_byte"] < 8.0

    final = tmp_path / "full" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert isinstance(model, damcha_hf.DamchaGPT2LMHeadModel)
    assert AutoTokenizer.from_pretrained(final)("fox")["input_ids"] == list(b"fox")
    # Every checkpoint's tokenizer knows the model's 32 positions; the figures say which validation gave them.
    for folder in (final, tmp_path / "full" / "checkpoint-3"):
        assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == 32
    assert model.config.n_positions == 32
    card = (final / "README.md").read_text()
    validation = f"16 blocks of 32 tokens drawn at random (seed 0) from {full['eval_documents']} held-out sections"
    assert f"Validation figures: {validation} of the text" in card and 3 <= full["eval_documents"] <= 16

    # Resume from step 3 in a fresh folder: the run continues at step 4 and repeats the uninterrupted losses.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = recipe.main([*common_args, "--output-dir", str(resumed_dir), "--resume"])
    assert resumed["resumed_from"] == str(resumed_dir / "checkpoint-3")
    state = trainer_state(resumed_dir / "checkpoint-6")
    assert state["global_step"] == 6
    after_resume = losses(state["log_history"])
    for step in (4, 5, 6):
        assert after_resume[step] == pytest.approx(uninterrupted[step], rel=1e-5)


def test_train_gpt2_bpe_and_metric_options_reach_the_model(tmp_path, corpus, capsys):
    result = load_recipe("train_gpt2").main([
        "--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "2", "--output-dir", str(tmp_path),
        "--tokenizer", "bpe", "--bpe-vocab-size", "300", "--metric-context", "query", "--metric-mask", "diagonal",
        "--metric-sharing", "layer", "--cross-head-variant", "damcha", "--attn", "eager", "--n-layer", "2",
    ])  # fmt: skip
    assert result["global_step"] == 2
    assert "training a byte-level BPE tokenizer (300 tokens)" in capsys.readouterr().out  # said, not a silent wait
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert len(tokenizer) == model.config.vocab_size <= 300
    assert len(tokenizer("the quick brown fox")["input_ids"]) < len("the quick brown fox")  # BPE merges
    config = model.config
    assert (config.metric_context, config.metric_mask, config.metric_sharing, config.metric_hidden_size) == (
        "query",
        "diagonal",
        "layer",
        8,
    )
    assert config.n_layer == 2 and len(model.transformer.cross_head_metric.generators) == 2  # one per layer


@pytest.mark.parametrize(("model_type", "stock_class"), [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_train_gpt2_recipe_saves_a_stock_baseline(tmp_path, corpus, model_type, stock_class):
    """The MHA baseline a user trains beside DAMCHA: a stock model needs no remote code, so its final save must not
    demand an auto_map (it used to fail after training), and it loads with transformers' own class."""
    extra = ["--n-kv-head", "2"] if model_type == "llama" else []
    index = TINY_GPT2_ARGS.index("--metric-hidden-size")  # a stock model has no generator: the flag is refused
    stock_args = TINY_GPT2_ARGS[:index] + TINY_GPT2_ARGS[index + 2 :]
    result = load_recipe("train_gpt2").main([
        "--data", corpus, *stock_args, "--max-steps", "2", "--output-dir", str(tmp_path),
        "--model-type", model_type, *extra,
    ])  # fmt: skip
    assert result["global_step"] == 2
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["model_type"] == model_type and "auto_map" not in config
    assert not list((tmp_path / "final").glob("*.py"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(model).__name__ == stock_class and type(model).__module__.startswith("transformers.")
    assert set(upload_plan(tmp_path / "final")) >= {"config.json", "model.safetensors", "README.md"}


@pytest.mark.parametrize("model_type", ["damcha_llama"])
def test_train_gpt2_recipe_trains_a_grouped_query_llama(tmp_path, corpus, model_type):
    result = load_recipe("train_gpt2").main([
        "--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "6", "--output-dir", str(tmp_path),
        "--model-type", model_type, "--n-kv-head", "2", "--metric-context", "query",
    ])  # fmt: skip
    assert result["global_step"] == 6
    assert_loss_goes_down(losses(trainer_state(tmp_path / "checkpoint-6")["log_history"]))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(model) is damcha_hf.DamchaLlamaForCausalLM
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (4, 2, 32)
    assert config.intermediate_size == 96  # 8/3 of the width, rounded up to a multiple of 32
    assert config.metric_context == "query"
    assert model.model.cross_head_metric.generators[0].fc_out.out_features == 4 * 2  # C is H x H_kv


def test_train_gpt2_recipe_refuses_key_value_heads_that_do_not_divide_the_heads(tmp_path, corpus, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_recipe("train_gpt2").main([
            "--data", corpus, *TINY_GPT2_ARGS, "--output-dir", str(tmp_path), "--model-type", "damcha_llama",
            "--n-kv-head", "3",
        ])  # fmt: skip
    assert exit_info.value.code == 2 and "--n-kv-head" in capsys.readouterr().err


def _accelerate(args, *, launcher=None, timeout=300):
    command = [*(launcher or [sys.executable]), str(RECIPES / "train_gpt2_accelerate.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


@pytest.mark.slow  # about 30 s: two Accelerate runs and a resume
def test_accelerate_recipe_resumes_at_the_saved_step(tmp_path, corpus):
    common_args = ["--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "6", "--save-steps", "3", "--eval-steps", "3"]
    _accelerate([*common_args, "--output-dir", str(tmp_path / "full")])
    uninterrupted = losses(
        json.loads((tmp_path / "full" / "checkpoint-6" / "loop_state.json").read_text())["log_history"]
    )
    assert_loss_goes_down(uninterrupted)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed_dir / "checkpoint-3")
    completed = _accelerate([*common_args, "--output-dir", str(resumed_dir), "--resume"])
    assert "at step 3" in completed.stdout
    state = json.loads((resumed_dir / "checkpoint-6" / "loop_state.json").read_text())
    assert state["step"] == 6
    for step in (4, 5, 6):
        assert losses(state["log_history"])[step] == pytest.approx(uninterrupted[step], rel=1e-5)
    assert (resumed_dir / "parameter_sha256_rank0.txt").read_text() == (
        tmp_path / "full" / "parameter_sha256_rank0.txt"
    ).read_text()


@pytest.mark.slow  # about 30 s: two launches of the Accelerate loop
def test_accelerate_recipe_trains_and_resumes_a_grouped_query_llama(tmp_path, corpus):
    model_flags = ["--model-type", "damcha_llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "4",
                   "--n-kv-head", "2", "--block-size", "32", "--metric-hidden-size", "8"]  # fmt: skip
    run_flags = ["--data", corpus, "--batch-size", "8", "--learning-rate", "3e-3", "--logging-steps", "1",
                 "--max-eval-samples", "16", "--num-threads", "1", "--max-steps", "6", "--save-steps", "3",
                 "--eval-steps", "3"]  # fmt: skip
    _accelerate([*run_flags, *model_flags, "--output-dir", str(tmp_path / "full")])
    uninterrupted = losses(
        json.loads((tmp_path / "full" / "checkpoint-6" / "loop_state.json").read_text())["log_history"]
    )
    assert_loss_goes_down(uninterrupted)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    assert type(model) is damcha_hf.DamchaLlamaForCausalLM
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    checksum = (tmp_path / "full" / "parameter_sha256_rank0.txt").read_text()
    assert load_recipe("train_gpt2_accelerate").parameter_sha256(model) + "\n" == checksum

    # Resumed with the model flags left out: the checkpoint's architecture and sizes are used.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed_dir / "checkpoint-3")
    with pytest.raises(ValueError, match="checkpoint is a damcha_llama model, not --model-type gpt2"):
        load_recipe("train_gpt2_accelerate").main([*run_flags, "--model-type", "gpt2", "--output-dir",
                                                   str(resumed_dir), "--resume"])  # fmt: skip
    completed = _accelerate([*run_flags, "--output-dir", str(resumed_dir), "--resume"])
    assert "at step 3" in completed.stdout
    state = json.loads((resumed_dir / "checkpoint-6" / "loop_state.json").read_text())
    for step in (4, 5, 6):
        assert losses(state["log_history"])[step] == pytest.approx(uninterrupted[step], rel=1e-5)
    assert (resumed_dir / "parameter_sha256_rank0.txt").read_text() == checksum


@pytest.mark.slow  # about 25 s: two CPU processes
def test_accelerate_two_cpu_processes_keep_identical_parameters(tmp_path, corpus):
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch",
                  "--config_file", str(RECIPES / "accelerate_configs" / "cpu_ddp_2proc.yaml"),
                  "--main_process_port", str(29500 + os.getpid() % 1000)]  # fmt: skip
    args = ["--data", corpus, *TINY_GPT2_ARGS, "--batch-size", "4", "--max-steps", "6", "--eval-steps", "6",
            "--output-dir", str(tmp_path)]  # fmt: skip
    _accelerate(args, launcher=accelerate)
    checksums = [(tmp_path / f"parameter_sha256_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert checksums[0] == checksums[1]
    results = json.loads((tmp_path / "eval_results.json").read_text())
    assert results["num_processes"] == 2 and results["global_step"] == 6
    log = losses(json.loads((tmp_path / "checkpoint-6" / "loop_state.json").read_text())["log_history"])
    assert_loss_goes_down(log)
    # The saved model is the one every process holds.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert load_recipe("train_gpt2_accelerate").parameter_sha256(model) + "\n" == checksums[0]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for label, level in (("dark", 50), ("bright", 200)):
        (root / label).mkdir()
        for i in range(12):
            pixels = np.clip(rng.normal(level, 30, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i}.png")
    return str(root)


def test_train_vit_learns_and_resumes(tmp_path, image_folder):
    recipe = load_recipe("train_vit")
    common_args = ["--data", image_folder, "--image-size", "16", "--patch-size", "4", "--hidden-size", "32",
                   "--num-layers", "2", "--num-heads", "4", "--metric-hidden-size", "8", "--batch-size", "8",
                   "--max-steps", "6", "--save-steps", "3", "--eval-steps", "3", "--logging-steps", "1",
                   "--learning-rate", "3e-3", "--num-threads", "1", "--no-augment"]  # fmt: skip
    full = recipe.main([*common_args, "--output-dir", str(tmp_path / "full")])
    uninterrupted = losses(trainer_state(tmp_path / "full" / "checkpoint-6")["log_history"])
    assert_loss_goes_down(uninterrupted)
    assert 0.0 <= full["eval_accuracy"] <= 1.0
    model = AutoModelForImageClassification.from_pretrained(tmp_path / "full" / "final")
    assert isinstance(model, damcha_hf.DamchaViTForImageClassification)
    assert model.config.id2label == {0: "bright", 1: "dark"}
    card = (tmp_path / "full" / "final" / "README.md").read_text()
    assert re.search(r"averaged over the tokens of the first \d validation images of the training run", card)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = recipe.main([*common_args, "--output-dir", str(resumed_dir), "--resume"])
    assert resumed["global_step"] == 6
    after_resume = losses(trainer_state(resumed_dir / "checkpoint-6")["log_history"])
    for step in (4, 5, 6):
        assert after_resume[step] == pytest.approx(uninterrupted[step], rel=1e-5)


def test_vit_augmentation_crops_and_flips_without_torchvision():
    image_data = load_recipe("train_vit").image_data
    image = torch.arange(2 * 6 * 6, dtype=torch.float32).view(2, 6, 6)
    seen = set()
    for seed in range(40):
        out = image_data.random_crop_and_flip(image, padding=1, generator=torch.Generator().manual_seed(seed))
        assert out.shape == image.shape
        padded = torch.nn.functional.pad(image[None], (1,) * 4, mode="reflect")[0]
        crops = {(top, left): padded[:, top : top + 6, left : left + 6] for top in range(3) for left in range(3)}
        matches = [(top, left, flip) for (top, left), crop in crops.items() for flip in (False, True)
                   if torch.equal(out, crop.flip(-1) if flip else crop)]  # fmt: skip
        assert matches, "output is not a flipped/unflipped crop of the padded image"
        seen.update(matches)
    assert any(flip for *_, flip in seen) and any(not flip for *_, flip in seen)
    assert len({(top, left) for top, left, _ in seen}) > 3


@pytest.fixture(scope="module")
def pretrained_gpt2(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gpt2-base")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=256,
                        eos_token_id=256, pad_token_id=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return str(folder)


def test_lora_trains_only_lora_and_generator_and_merges_exactly(tmp_path, corpus, pretrained_gpt2):
    recipe = load_recipe("finetune_lora")
    result = recipe.main([
        "--base", pretrained_gpt2, "--data", corpus, "--output-dir", str(tmp_path), "--max-steps", "8",
        "--batch-size", "8", "--block-size", "32", "--logging-steps", "1", "--eval-steps", "8",
        "--max-eval-samples", "16", "--learning-rate", "1e-2", "--lora-rank", "4", "--metric-hidden-size", "8",
        "--num-threads", "1", "--merge",
    ])  # fmt: skip
    trainable = result["trainable_parameters"]
    assert trainable and all("lora_" in name or "cross_head_metric" in name for name in trainable)
    assert any("cross_head_metric" in name for name in trainable)
    assert {name.split("lora_")[0].rstrip(".").rsplit(".", 1)[-1] for name in trainable if "lora_" in name} == {
        "c_attn",
        "c_proj",
        "c_fc",
    }
    assert_loss_goes_down(losses(trainer_state(tmp_path / "checkpoint-8")["log_history"]))

    base = GPT2LMHeadModel.from_pretrained(pretrained_gpt2)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged) is damcha_hf.DamchaGPT2LMHeadModel
    base_weights, merged_weights = base.state_dict(), merged.state_dict()
    for name, weight in base_weights.items():
        changed = not torch.equal(weight, merged_weights[name])
        is_target = any(f".{target}." in name for target in ("c_attn", "c_proj", "c_fc")) and name.endswith("weight")
        assert changed == is_target, name  # frozen weights are untouched; LoRA targets moved by the merge
    generator = [w for name, w in merged_weights.items() if "cross_head_metric" in name and "fc_out.weight" in name]
    assert generator and all(w.abs().sum() > 0 for w in generator)  # the generator trained in full, off zero

    peft_model = recipe.load_adapter(pretrained_gpt2, str(tmp_path / "adapter"), metric_hidden_size=8).eval()
    ids = torch.tensor([list(b"the quick brown fox jumps over")])
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids).logits, peft_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_trains_the_baselines_head_mixing_in_full(tmp_path, corpus, pretrained_gpt2):
    recipe = load_recipe("finetune_lora")
    result = recipe.main([
        "--base", pretrained_gpt2, "--data", corpus, "--output-dir", str(tmp_path), "--max-steps", "2",
        "--batch-size", "8", "--block-size", "32", "--eval-steps", "2", "--max-eval-samples", "8",
        "--lora-rank", "2", "--cross-head-variant", "talking_heads", "--attn", "eager", "--num-threads", "1",
        "--learning-rate", "1e-2",
    ])  # fmt: skip
    trainable = result["trainable_parameters"]
    mixing = [name for name in trainable if "cross_head_mixing" in name]
    assert mixing and all("lora_" in name or "cross_head_mixing" in name for name in trainable)
    # The trained copies PEFT keeps are the ones that ran: they moved off their identity start.
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    projections = [tensor for name, tensor in saved.items() if "cross_head_mixing" in name]
    assert projections and any(not torch.equal(tensor, torch.eye(tensor.shape[0])) for tensor in projections)


@pytest.fixture(scope="module")
def pretrained_llama(tmp_path_factory) -> str:
    """A stock grouped-query Llama checkpoint folder (4 query heads, 2 key/value heads) with a byte-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=256,
                         eos_token_id=256, pad_token_id=256)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return str(folder)


def test_lora_upgrades_a_grouped_query_llama_and_merges_exactly(tmp_path, corpus, pretrained_llama):
    from transformers import LlamaForCausalLM

    recipe = load_recipe("finetune_lora")
    result = recipe.main([
        "--base", pretrained_llama, "--data", corpus, "--output-dir", str(tmp_path), "--max-steps", "6",
        "--batch-size", "8", "--block-size", "32", "--logging-steps", "1", "--eval-steps", "6",
        "--max-eval-samples", "16", "--learning-rate", "1e-2", "--lora-rank", "4", "--metric-hidden-size", "8",
        "--num-threads", "1", "--merge",
    ])  # fmt: skip
    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable = result["trainable_parameters"]
    assert trainable and all("lora_" in name or "cross_head_metric" in name for name in trainable)
    assert {name.split("lora_")[0].rstrip(".").rsplit(".", 1)[-1] for name in trainable if "lora_" in name} == targets
    assert_loss_goes_down(losses(trainer_state(tmp_path / "checkpoint-6")["log_history"]))

    base = LlamaForCausalLM.from_pretrained(pretrained_llama)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged) is damcha_hf.DamchaLlamaForCausalLM and merged.config.num_key_value_heads == 2
    merged_weights = merged.state_dict()
    for name, weight in base.state_dict().items():
        changed = not torch.equal(weight, merged_weights[name])
        assert changed == any(f".{target}." in name for target in targets), name
    generator = merged.model.cross_head_metric.generators[0].fc_out.weight
    assert generator.shape[0] == 2 * 2 and generator.abs().sum() > 0  # C is H_kv x H_kv, trained off zero

    peft_model = recipe.load_adapter(pretrained_llama, str(tmp_path / "adapter"), metric_hidden_size=8).eval()
    ids = torch.tensor([list(b"the quick brown fox jumps over")])
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids).logits, peft_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@needs_auto_image_processor
def test_vit_image_processor_warns_of_no_missing_torchvision_and_normalises_as_configured(tmp_path):
    """The recipes' ViT image processor, made and reloaded in a fresh process (transformers warns once per process):
    no "requires torchvision" warning where torchvision is missing, and pixels scaled to (x / 255 - 0.5) / 0.5."""
    script = f"""
import sys
sys.path.insert(0, {str(RECIPES)!r})
import numpy as np
from PIL import Image
from transformers import AutoImageProcessor
import image_data
image_data.image_processor(4, 1).save_pretrained({str(tmp_path)!r})
processor = AutoImageProcessor.from_pretrained({str(tmp_path)!r})
image = Image.fromarray(np.arange(16, dtype=np.uint8).reshape(4, 4) * 16, mode="L")
np.save({str(tmp_path / "pixels.npy")!r}, np.asarray(processor(image, return_tensors="np")["pixel_values"]))
"""
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "torchvision" not in completed.stdout + completed.stderr
    expected = (np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4) * 16 / 255 - 0.5) / 0.5
    np.testing.assert_allclose(np.load(tmp_path / "pixels.npy"), expected, rtol=1e-6, atol=1e-6)


def parse_error(recipe_name: str, argv: list[str], capsys) -> str:
    """The one-line error a recipe's parser gives for `argv` (exit code 2), before any data is read."""
    with pytest.raises(SystemExit) as exit_info:
        load_recipe(recipe_name).parse_args(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_mistakes_that_would_fail_after_loading_data_fail_while_parsing(tmp_path, monkeypatch, capsys):
    """A missing dictionary, a causal --metric-context sequence, a score-mixing variant on SDPA, a tokenizer folder
    that is not one, an image folder without label folders, an abbreviated flag: each one line naming the fix."""
    import damcha_hf.data_sources

    out = ["--output-dir", str(tmp_path / "run")]
    monkeypatch.delenv("DAMCHA_GCIDE_PATH", raising=False)
    monkeypatch.setattr(damcha_hf.data_sources, "GCIDE_PATH", str(tmp_path / "dictd" / "gcide.dict.dz"))
    for name in ("train_gpt2", "train_gpt2_accelerate"):
        message = parse_error(name, ["--data", "gcide", *out], capsys)
        assert f"the GCIDE dictionary is not at {tmp_path}/dictd/gcide.dict.dz;" in message
        assert "apt-get install dict-gcide" in message and "set DAMCHA_GCIDE_PATH to a copy" in message
        message = parse_error(name, ["--metric-context", "sequence", *out], capsys)
        assert "would let a causal language model see future tokens; use --metric-context token" in message
    monkeypatch.setenv("DAMCHA_GCIDE_PATH", str(tmp_path / "elsewhere.dict.dz"))
    message = parse_error("train_gpt2", ["--data", "gcide", *out], capsys)
    assert f"not at {tmp_path}/elsewhere.dict.dz ($DAMCHA_GCIDE_PATH);" in message
    monkeypatch.delenv("DAMCHA_GCIDE_PATH")
    assert main_cli_error(["demo", "--data", "gcide", "--output-dir", str(tmp_path / "demo")], capsys).endswith(
        "apt-get install dict-gcide`) or set DAMCHA_GCIDE_PATH to a copy, or pass --data stdlib or a text file, folder "
        "or glob (see damcha-hf demo --help)"
    )
    message = parse_error("train_gpt2", ["--cross-head-variant", "dcmha", "--attn", "sdpa", *out], capsys)
    assert "use --attn eager (its default) instead of --attn sdpa" in message
    assert load_recipe("train_gpt2").parse_args(["--cross-head-variant", "dcmha", *out]).attn == "eager"
    assert load_recipe("train_gpt2").parse_args(out).attn == "sdpa"
    message = parse_error("train_gpt2", ["--metric-form", "scores", "--attn", "sdpa", *out], capsys)
    assert ("--metric-form scores mixes the attention score maps, which only eager attention "
                            "materialises; use --attn eager (its default) instead of --attn sdpa") in message  # fmt: skip
    scores = load_recipe("train_gpt2").parse_args(["--metric-form", "scores", *out])
    assert (
        scores.attn == "eager"
        and load_recipe("train_gpt2").recipe_options.metric_options(scores)["metric_form"] == "scores"
    )
    message = parse_error("train_gpt2", ["--tokenizer", str(tmp_path / "no-tokenizer"), *out], capsys)
    assert "is not a folder; use 'byte', 'bpe' or a folder a tokenizer was saved to" in message
    loose = tmp_path / "images"
    loose.mkdir()
    for index in range(2):
        Image.new("RGB", (8, 8)).save(loose / f"{index}.png")
    message = parse_error("train_vit", ["--data", str(loose), *out], capsys)
    assert "2 image(s) but no label folders; expected <folder>/<label>/<image>" in message
    message = parse_error("train_gpt2", ["--max-step", "5", *out], capsys)
    assert "unrecognized arguments: --max-step 5" in message


def main_cli_error(argv: list[str], capsys) -> str:
    from damcha_hf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ----------------------------------------------------------------------------------------- attention-variant flags
# Every recipe that takes the variant flags, and what its parser needs besides them to get as far as checking them.
def variant_recipe_arguments(name: str, tmp_path, base: str) -> list[str]:
    from conftest import write_fashion_mnist

    out = ["--output-dir", str(tmp_path / f"run-{name}")]
    if name in ("train_vit", "train_diffusion"):
        pytest.importorskip("diffusers") if name == "train_diffusion" else None
        folder = tmp_path / "fashion-mnist"
        if not folder.exists():
            write_fashion_mnist(folder)
        return ["--fashion-mnist-dir", str(folder), "--hidden-size", "32", "--num-heads", "4", *out]
    if name == "finetune_lora":
        return ["--base", base, *out]
    return ["--n-embd", "32", "--n-head", "4", *out] if name.startswith("train_gpt2") else out


VARIANT_RECIPES = ["train_gpt2", "train_gpt2_accelerate", "train_vit", "train_bart", "train_diffusion", "finetune_lora"]


@pytest.mark.parametrize(
    ("name", "model_type", "flags"),
    [("train_gpt2", "gpt2", ["--cross-head-variant", "moa"]),
     ("train_gpt2", "llama", ["--cross-head-variant", "colmha"]),
     ("train_gpt2", "gpt2", ["--metric-context", "query"]),
     ("train_gpt2_accelerate", "gpt2", ["--moa-top-k", "2"]),
     ("train_gpt2_accelerate", "llama", ["--metric-mask", "diagonal"]),
     ("train_bart", "bart", ["--cross-head-variant", "dcmha"]),
     ("train_bart", "bart", ["--metric-hidden-size", "8"])],
)  # fmt: skip
def test_variant_flags_on_a_plain_model_type_are_refused_while_parsing(name, model_type, flags, tmp_path, capsys):
    """A plain model type is stock multi-head attention: it has no variant fields, so a variant flag would train the
    stock model without a word. Refused in one line naming the flag and the DAMCHA model type that takes it."""
    argv = [*variant_recipe_arguments(name, tmp_path, ""), "--model-type", model_type, *flags]
    message = parse_error(name, argv, capsys)
    assert f"--model-type {model_type} is plain {model_type}" in message
    assert f"{flags[0]} applies to damcha_{model_type}; use --model-type damcha_{model_type}" in message
    # The oracle: the stock config has no such field, and the DAMCHA one takes the setting.
    field = flags[0][2:].replace("-", "_")
    stock = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "bart": "BartConfig"}[model_type]
    assert field not in vars(getattr(__import__("transformers"), stock)())
    assert not (tmp_path / f"run-{name}").exists()


@pytest.mark.parametrize("name", VARIANT_RECIPES)
@pytest.mark.parametrize(
    ("flags", "owner", "chosen"),
    [(["--colmha-key-dim", "8"], "colmha", "damcha (the default)"),
     (["--cross-head-variant", "moa", "--metric-mask", "diagonal"], "damcha", "moa (given)"),
     (["--cross-head-variant", "damcha", "--dcmha-rank", "2"], "dcmha", "damcha (given)"),
     (["--cross-head-variant", "none", "--moa-z-loss-coef", "0.5"], "moa", "none (given)")],
)  # fmt: skip
def test_another_variants_flags_are_refused_in_every_recipe(name, flags, owner, chosen, tmp_path, pretrained_gpt2,
                                                            capsys):  # fmt: skip
    argv = [*variant_recipe_arguments(name, tmp_path, pretrained_gpt2), *flags]
    message = parse_error(name, argv, capsys)
    flag = next(flag for flag in flags if flag.startswith("--") and flag != "--cross-head-variant")
    assert f"{flag} is a setting of --cross-head-variant {owner}, not of {chosen}, which would ignore it" in message
    assert f"add --cross-head-variant {owner}, or leave {flag} out" in message
    # The oracle: the variant that declares the field is the one the message names.
    from damcha_hf.modeling.variants import VARIANTS

    assert flag[2:].replace("-", "_") in VARIANTS[owner].fields


def config_accepts(field: str, value, owner: str) -> bool:
    try:
        damcha_hf.DamchaGPT2Config(n_embd=32, n_head=4, cross_head_variant=owner, **{field: value})
    except ValueError:
        return False
    return True


NUMBER_TEXTS = ["0", "1", "2", "0.5", "0.02", "-1", "1e-3", "nan", "two"]


def numeric_variant_fields():
    from damcha_hf.modeling.damcha_config import VARIANT_FIELDS
    from damcha_hf.modeling.variants import VARIANTS

    owners = {field: name for name, variant in VARIANTS.items() for field in variant.fields}
    return [(field, owners[field]) for field, spec in VARIANT_FIELDS.items() if not spec.rule.choices]


@pytest.mark.parametrize(("field", "owner"), numeric_variant_fields())
def test_each_variant_flag_takes_exactly_what_its_config_field_accepts(field, owner, tmp_path, capsys):
    """A flag is typed from its field's declared type and range: the config class is the oracle. `--moa-z-loss-coef 0`
    and `--moa-balance-loss-coef 0.02` are floats the config takes; `--moa-top-k 0.5` an integer field refuses."""
    import ast
    import typing

    from damcha_hf.modeling.damcha_config import VARIANT_FIELDS

    recipe = load_recipe("train_gpt2")
    flag = "--" + field.replace("_", "-")
    declared = typing.get_args(VARIANT_FIELDS[field].type) or (VARIANT_FIELDS[field].type,)
    for index, text in enumerate(NUMBER_TEXTS):
        try:
            value = ast.literal_eval(text)
        except ValueError:
            value = text
        if float in declared and type(value) is int:  # "0" is the number 0.0 to a float field
            value = float(value)
        argv = ["--n-embd", "32", "--n-head", "4", "--cross-head-variant", owner, flag, text,
                "--output-dir", str(tmp_path / f"run{index}")]  # fmt: skip
        if config_accepts(field, value, owner):
            args = recipe.parse_args(argv)
            assert getattr(args, field) == value and type(getattr(args, field)) is type(value), text
            config = recipe.text_data.language_model_config(args, 257)
            assert getattr(config, field) == value
        else:
            message = parse_error("train_gpt2", argv, capsys)
            assert f"argument {flag}: must be" in message and repr(text) in message, message


def test_moa_loss_coefficients_are_floats_and_reach_the_model(tmp_path):
    recipe = load_recipe("train_gpt2")
    args = recipe.parse_args(["--cross-head-variant", "moa", "--moa-balance-loss-coef", "0.02", "--moa-z-loss-coef",
                              "0", "--output-dir", str(tmp_path / "run")])  # fmt: skip
    config = recipe.text_data.language_model_config(args, 257)
    assert (config.moa_balance_loss_coef, config.moa_z_loss_coef) == (0.02, 0.0)


@pytest.mark.parametrize(
    ("flags", "named", "field", "config"),
    [(["--cross-head-variant", "moa", "--moa-top-k", "5"], "--moa-top-k (5) is more than --n-head (4)", "moa_top_k",
      {"cross_head_variant": "moa", "moa_top_k": 5}),
     (["--cross-head-variant", "colmha", "--colmha-key-dim", "33"], "--colmha-key-dim (33) is wider than",
      "colmha_key_dim", {"cross_head_variant": "colmha", "colmha_key_dim": 33}),
     (["--model-type", "damcha_llama", "--n-kv-head", "2", "--cross-head-variant", "colmha"],
      "--n-kv-head (2) is not --n-head (4)", "num_key_value_heads",
      {"cross_head_variant": "colmha", "num_key_value_heads": 2})],
)  # fmt: skip
@pytest.mark.parametrize("name", ["train_gpt2", "train_gpt2_accelerate"])
def test_flags_that_build_a_config_it_refuses_are_refused_while_parsing_naming_the_flags(
    name, flags, named, field, config, tmp_path, capsys
):
    """Checked right after parsing, before any data is read, by the config's own rules; the message names the flags a
    user typed, not the config fields."""
    message = parse_error(name, ["--n-embd", "32", "--n-head", "4", *flags, "--output-dir", str(tmp_path / "r")],
                          capsys)  # fmt: skip
    assert named in message and f"`{field}`" not in message, message
    # The oracle: the config class the recipe would build refuses the same settings.
    config_class = damcha_hf.DamchaLlamaConfig if "damcha_llama" in flags else damcha_hf.DamchaGPT2Config
    sizes = {"hidden_size": 32, "num_attention_heads": 4} if "damcha_llama" in flags else {"n_embd": 32, "n_head": 4}
    with pytest.raises(ValueError, match=field):
        config_class(**sizes, **config)


@pytest.mark.parametrize(
    ("name", "sizes", "heads_flag"),
    [("train_vit", ["--hidden-size", "32", "--num-heads", "4"], "--num-heads"),
     ("train_diffusion", ["--hidden-size", "32", "--num-heads", "4"], "--num-heads"),
     ("train_bart", ["--d-model", "32", "--heads", "4"], "--heads")],
)  # fmt: skip
def test_every_recipe_checks_the_config_its_variant_flags_build(name, sizes, heads_flag, tmp_path, capsys):
    arguments = [*variant_recipe_arguments(name, tmp_path, ""), *sizes]
    message = parse_error(name, [*arguments, "--cross-head-variant", "moa", "--moa-top-k", "5"], capsys)
    assert f"--moa-top-k (5) is more than {heads_flag} (4); use at most 4" in message, message
    message = parse_error(name, [*arguments, "--cross-head-variant", "colmha", "--colmha-key-dim", "33"], capsys)
    assert "--colmha-key-dim (33) is wider than all heads' query width (32); use at most 32" in message, message


@pytest.fixture(scope="module")
def init_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny GPT-2 checkpoints to start from: DAMCHA (its generator trained away from zero), DAMCHA with
    cross_head_variant none (MHA), and plain GPT-2; and a plain ViT."""
    from conftest import randomize_cross_head
    from transformers import ViTConfig, ViTForImageClassification

    root = tmp_path_factory.mktemp("init-from")
    shape = {"vocab_size": 257, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 4, "bos_token_id": 256,
             "eos_token_id": 256, "pad_token_id": 256}  # fmt: skip
    torch.manual_seed(0)
    damcha = damcha_hf.DamchaGPT2LMHeadModel(damcha_hf.DamchaGPT2Config(**shape, metric_hidden_size=8))
    randomize_cross_head(damcha)
    models = {
        "damcha": damcha,
        "mha": damcha_hf.DamchaGPT2LMHeadModel(damcha_hf.DamchaGPT2Config(**shape, cross_head_variant="none")),
        "plain": GPT2LMHeadModel(GPT2Config(**shape)),
        "plain-vit": ViTForImageClassification(ViTConfig(image_size=28, patch_size=4, num_channels=1, hidden_size=32,
                                                         num_hidden_layers=1, num_attention_heads=4,
                                                         intermediate_size=64, num_labels=10)),
    }  # fmt: skip
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: str(root / name) for name in models}


@pytest.mark.parametrize(("variant", "flags"), [("moa", ["--moa-top-k", "4"]), ("dcmha", []), ("damcha", [])])
def test_init_from_an_mha_checkpoint_applies_the_variant_flags_starting_as_its_function(
    variant, flags, init_checkpoints, tmp_path
):
    """From an MHA checkpoint every variant flag applies (they used to be dropped: the checkpoint's own attention was
    trained), and each variant starts as the checkpoint's exact function."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe("train_gpt2")
    args = recipe.parse_args(["--init-from", init_checkpoints["mha"], "--block-size", "32", "--cross-head-variant",
                              variant, *flags, "--attn", "eager", "--output-dir", str(tmp_path / "run")])  # fmt: skip
    model = recipe.build_model(args, byte_level_tokenizer(model_max_length=32)).eval()
    assert model.config.cross_head_variant == variant
    if flags:
        assert model.config.moa_top_k == 4
    reference = AutoModelForCausalLM.from_pretrained(init_checkpoints["mha"], attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(["--cross-head-variant", "moa"], "--cross-head-variant moa: the --init-from checkpoint's attention is damcha "
      "with cross_head_variant=damcha"),
     (["--metric-context", "query"], "--metric-context query: the --init-from checkpoint's attention is damcha with "
      "metric_context=token"),
     (["--metric-hidden-size", "16"], "--metric-hidden-size 16: the --init-from checkpoint's attention is damcha with "
      "metric_hidden_size=8")],
)  # fmt: skip
@pytest.mark.parametrize("name", ["train_gpt2", "train_vit", "train_diffusion", "finetune_lora"])
def test_init_from_a_trained_variant_refuses_flags_that_would_change_it(name, flags, expected, init_checkpoints,
                                                                        tmp_path, capsys):  # fmt: skip
    """The variant's trained weights would be dropped (another variant) or read under other settings: training would
    not start from the checkpoint's function, which --init-from (and --base) promise."""
    checkpoint_flag = "--base" if name == "finetune_lora" else "--init-from"
    arguments = variant_recipe_arguments(name, tmp_path, init_checkpoints["damcha"])
    if name != "finetune_lora":
        arguments = ["--init-from", init_checkpoints["damcha"], *arguments]
    message = parse_error(name, [*arguments, *flags], capsys)
    expected = expected.replace("--init-from", checkpoint_flag)
    assert expected in message and f"Leave {flags[0]} out (the checkpoint's value is used)" in message
    # The oracle: the checkpoint's saved settings.
    saved = json.loads((Path(init_checkpoints["damcha"]) / "config.json").read_text())
    assert (saved["cross_head_variant"], saved["metric_context"], saved["metric_hidden_size"]) == ("damcha", "token", 8)
    # The checkpoint's own values are no change: taken.
    args = load_recipe("train_gpt2").parse_args(["--init-from", init_checkpoints["damcha"], "--metric-context",
                                                 "token", "--output-dir", str(tmp_path / "same")])  # fmt: skip
    assert args.metric_context == "token"


@pytest.mark.parametrize(("name", "checkpoint"), [("train_gpt2", "plain"), ("train_vit", "plain-vit")])
def test_init_from_a_plain_checkpoint_refuses_variant_flags(name, checkpoint, init_checkpoints, tmp_path, capsys):
    from conftest import write_fashion_mnist

    extra = ["--fashion-mnist-dir", write_fashion_mnist(tmp_path / "fm")] if name == "train_vit" else []
    argv = ["--init-from", init_checkpoints[checkpoint], "--cross-head-variant", "damcha", *extra, "--output-dir",
            str(tmp_path / "run")]  # fmt: skip
    message = parse_error(name, argv, capsys)
    model_type = json.loads((Path(init_checkpoints[checkpoint]) / "config.json").read_text())["model_type"]
    assert f"holds a plain {model_type} model" in message and "would ignore --cross-head-variant" in message
    assert "damcha_hf.convert_to_damcha" in message
