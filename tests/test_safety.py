"""Nothing lost, nothing leaked: output folders, pushes that stay inside their folder, validated config overrides,
cards without local paths, honest resumes, one-line errors and an instant `--help`."""

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import (
    RECIPE_NAMES,
    TINY_RECIPE_ARGS,
    USER_BYTES,
    load_recipe,
    one_error_line,
    randomize_cross_head,
    snapshot,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_damcha_vit_config,
    tiny_gpt2_config,
    tiny_lm,
)
from huggingface_hub import HfApi
from transformers import AutoConfig, AutoModelForCausalLM, GPT2LMHeadModel

import damcha_hf
from damcha_hf import hub
from damcha_hf.cli import main as cli_main
from damcha_hf.metrics import load_metric
from damcha_hf.safe_files import UnsafeOutputError

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
# ------------------------------------------------------------------------------------------ output folders (item 1)


def test_save_hub_checkpoint_never_replaces_a_folder_holding_user_files(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_bytes(USER_BYTES)
    (folder / "config.json").write_text(json.dumps({"model_type": "damcha_gpt2"}))  # looks like a checkpoint...
    before = snapshot(folder)
    with pytest.raises(UnsafeOutputError, match=r"notes\.txt.*new or empty folder"):
        hub.save_hub_checkpoint(tiny_lm(), folder, overwrite=True, metric_heatmap=False)
    assert snapshot(folder) == before  # ...but holds a file a save does not write: untouched, byte for byte
    assert sorted(path.name for path in tmp_path.iterdir()) == ["work"]  # no staging folder left behind


def test_save_hub_checkpoint_replaces_only_an_earlier_checkpoint_of_this_plugin(tmp_path):
    folder = tmp_path / "hub"
    hub.save_hub_checkpoint(tiny_lm(), folder, metric_heatmap=False)
    hub.save_hub_checkpoint(tiny_lm(n_layer=1), folder, overwrite=True, metric_heatmap=False)
    assert json.loads((folder / "config.json").read_text())["n_layer"] == 1

    plain = tmp_path / "plain-gpt2"  # a checkpoint, but not of this plugin: not replaced
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(plain)
    before = snapshot(plain)
    with pytest.raises(UnsafeOutputError, match="not a damcha-hf checkpoint"):
        hub.save_hub_checkpoint(tiny_lm(), plain, overwrite=True, metric_heatmap=False)
    assert snapshot(plain) == before


def test_save_hub_checkpoint_refuses_the_current_folder_its_parents_and_home(tmp_path, monkeypatch):
    inner = tmp_path / "home" / "project"
    inner.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(inner)
    for target in (inner, inner.parent, Path(".")):
        with pytest.raises(UnsafeOutputError, match="current folder, one of its parents or the home folder"):
            hub.save_hub_checkpoint(tiny_lm(), target, overwrite=True, metric_heatmap=False)
    assert sorted(path.name for path in inner.parent.iterdir()) == ["project"]


def test_save_hub_checkpoint_into_a_file_says_it_is_a_file(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(USER_BYTES)
    for overwrite in (False, True):
        with pytest.raises(UnsafeOutputError, match="is a file, not a folder") as error:
            hub.save_hub_checkpoint(tiny_lm(), target, overwrite=overwrite, metric_heatmap=False)
        assert "overwrite=True" not in str(error.value)
    assert target.read_bytes() == USER_BYTES


def test_written_files_and_folders_follow_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        folder = hub.save_hub_checkpoint(tiny_lm(), tmp_path / "hub", log_history=[{"loss": 1.0, "step": 1}])
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~0o022
    for name in ("README.md", "config.json", "metric_heatmap.png", "loss_curve.png", "model.safetensors"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o666 & ~0o022, name


def test_demo_refuses_a_folder_with_user_files_and_a_file_before_any_training(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "data.csv").write_bytes(USER_BYTES)
    a_file = tmp_path / "results.txt"
    a_file.write_bytes(USER_BYTES)
    for output, expected in ((folder, r"data\.csv"), (a_file, "is a file"), (Path.cwd(), "current folder")):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["demo", "--output-dir", str(output)])
        assert exit_info.value.code == 2
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith("damcha-hf demo: error: argument --output-dir:") and str(output) in line
        assert __import__("re").search(expected, line)
    assert (folder / "data.csv").read_bytes() == USER_BYTES and a_file.read_bytes() == USER_BYTES
    assert sorted(path.name for path in folder.iterdir()) == ["data.csv"]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipes_refuse_an_output_dir_with_user_files_while_parsing(name, tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "final").mkdir()
    (output / "final" / "draft.md").write_bytes(USER_BYTES)  # `final` would be replaced: it is not a checkpoint
    extra = ["--base", str(tmp_path)] if name == "finetune_lora" else []
    with pytest.raises(SystemExit) as exit_info:
        load_recipe(name).parse_args(["--output-dir", str(output), *extra])
    assert exit_info.value.code == 2
    assert "draft.md" in one_error_line(capsys.readouterr().err)
    (output / "final" / "draft.md").unlink()
    (output / "final").rmdir()
    (output / "paper.tex").write_bytes(USER_BYTES)
    with pytest.raises(SystemExit):
        load_recipe(name).parse_args(["--output-dir", str(output), *extra])
    assert "paper.tex" in capsys.readouterr().err
    assert (output / "paper.tex").read_bytes() == USER_BYTES


# --------------------------------------------------------------------------------------------------- push (item 2)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return hub.save_hub_checkpoint(tiny_lm(), tmp_path / "ckpt", metric_heatmap=False)


def set_auto_map_entry(folder: Path, key: str, reference: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"][key] = reference
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("reference", ["/SECRET/settings.Anything", "../settings.Anything", "sub/settings.Anything"])
def test_upload_plan_refuses_auto_map_references_leaving_the_folder(checkpoint, tmp_path, reference):
    secret = tmp_path / "settings.py"
    secret.write_text("TOKEN = 'hf_do_not_upload'\n")
    for key in ("AutoModelForTokenClassification", "AutoModel"):  # outside the family, and one of its own
        before = (checkpoint / "config.json").read_text()
        set_auto_map_entry(checkpoint, key, reference.replace("/SECRET", str(tmp_path)))
        with pytest.raises(hub.HubPushError, match=r"auto_map\[.*plain module name"):
            hub.upload_plan(checkpoint)
        (checkpoint / "config.json").write_text(before)
    assert "settings.py" not in hub.upload_plan(checkpoint)


def test_foreign_auto_map_entries_are_dropped_on_save(checkpoint, tmp_path):
    set_auto_map_entry(checkpoint, "AutoModelForMaskedLM", "../evil.Anything")  # no GPT-2 head
    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # a "downloaded" checkpoint carrying the entry
    for saved in (tmp_path / "plain-save", tmp_path / "hub-save"):
        if saved.name == "plain-save":
            model.save_pretrained(saved)
        else:
            hub.save_hub_checkpoint(model, saved, metric_heatmap=False)
        auto_map = json.loads((saved / "config.json").read_text())["auto_map"]
        assert "AutoModelForMaskedLM" not in auto_map
        assert all("." in value and "/" not in value for value in auto_map.values())
        plan = hub.upload_plan(saved)
        assert all(path.resolve().parent == saved.resolve() for path in plan.values())


def test_upload_plan_follows_only_image_links_to_files_of_the_folder(checkpoint, tmp_path):
    (tmp_path / "outside.png").write_bytes(b"\x89PNG outside")
    (checkpoint / "figure.png").write_bytes(b"\x89PNG inside")
    (checkpoint / "notes.txt").write_text("private")
    card = (checkpoint / "README.md").read_text()
    card += "\n![a](figure.png) ![b](../outside.png) ![c](" + str(tmp_path / "outside.png") + ") [n](notes.txt)\n"
    (checkpoint / "README.md").write_text(card)
    plan = hub.upload_plan(checkpoint)
    assert "figure.png" in plan and "notes.txt" not in plan
    assert all(path.resolve().parent == checkpoint.resolve() for path in plan.values())


def test_upload_plan_refuses_a_symlink_leaving_the_folder_and_names_it(checkpoint, tmp_path):
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    (checkpoint / "tokenizer.json").symlink_to(secret)
    with pytest.raises(hub.HubPushError, match=r"tokenizer\.json.*symbolic link.*outside the checkpoint folder"):
        hub.upload_plan(checkpoint)


@pytest.mark.parametrize(
    ("import_line", "refused"),
    [
        ("from .sub.settings import TOKEN", r"imports `\.sub\.settings`"),  # a module in a subfolder
        ("from .x/../../settings import TOKEN", r"imports `\.x/\.\./\.\./settings`"),  # a path the regex parser reads
        ("from .leak import TOKEN", r"leak\.py in .* symbolic link .* outside the checkpoint folder"),
        ("from ..settings import TOKEN", None),  # the parent package: no file of the folder, not uploaded
    ],
)
def test_code_files_come_only_from_the_folder(checkpoint, tmp_path, import_line, refused):
    # The code files are those the auto_map modules import (transformers' relative-import parser): each must be a
    # regular file inside the folder, checked before it is read, whatever the import line names.
    secret = tmp_path / "settings.py"
    secret.write_text("TOKEN = 'hf_do_not_upload'\n")
    (checkpoint / "leak.py").symlink_to(secret)
    modeling = checkpoint / "modeling_damcha_gpt2.py"
    modeling.write_text(modeling.read_text() + f"\n{import_line}\n")
    if refused is None:
        plan = hub.upload_plan(checkpoint)
        assert "modeling_damcha_gpt2.py" in plan and "settings.py" not in plan and "leak.py" not in plan
        assert all(path.resolve().parent == checkpoint.resolve() for path in plan.values())
    else:
        with pytest.raises(hub.HubPushError, match=refused):
            hub.upload_plan(checkpoint)


def test_push_network_failure_is_one_line_without_the_token(checkpoint, monkeypatch, capsys):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    token = "hf_SECRETsecretSECRET1234"

    def unreachable(self, *args, **kwargs):
        raise ConnectionError(f"Max retries exceeded (Caused by NameResolutionError)\nheaders: Bearer {token}")

    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    with pytest.raises(hub.HubPushError, match="ConnectionError"):
        hub.push_checkpoint(checkpoint, "someone/tiny", token=token)
    assert cli_main(["push", str(checkpoint), "someone/tiny", "--token", token]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert line.startswith("damcha-hf push: error: pushing to someone/tiny failed")
    assert token not in captured.err + captured.out


# ----------------------------------------------------------------------------------------- validation (item 3)


def causal_probe(model) -> bool:
    """True when changing the last token leaves the earlier positions' logits unchanged."""
    ids = torch.randint(1, 90, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 90
    with torch.no_grad():
        return torch.allclose(model(ids).logits[0, :-1], model(changed).logits[0, :-1], atol=1e-6)


def test_a_causal_model_refuses_sequence_context_on_every_path(tmp_path):
    folder = tmp_path / "ckpt"
    model = tiny_lm()
    model.save_pretrained(folder)
    assert causal_probe(AutoModelForCausalLM.from_pretrained(folder))
    attempts = {
        "constructor": lambda: tiny_damcha_gpt2_config(metric_context="sequence"),
        "from_pretrained override": lambda: damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(
            folder, metric_context="sequence"
        ),
        "Auto from_pretrained override": lambda: AutoModelForCausalLM.from_pretrained(folder, metric_context="sequence"),
        "AutoConfig override": lambda: AutoConfig.from_pretrained(folder, metric_context="sequence"),
        "from_dict": lambda: damcha_hf.DamchaGPT2Config.from_dict({**model.config.to_dict(), "metric_context": "sequence"}),
        "from_dict kwargs": lambda: damcha_hf.DamchaGPT2Config.from_dict(model.config.to_dict(), metric_context="sequence"),
        "convert_to_damcha": lambda: damcha_hf.convert_to_damcha(GPT2LMHeadModel(tiny_gpt2_config()), metric_context="sequence"),
    }  # fmt: skip
    for name, attempt in attempts.items():
        with pytest.raises(Exception, match="metric_context='sequence'.*future tokens") as error:
            attempt()
        assert isinstance(error.value, ValueError) or isinstance(error.value.__cause__, ValueError), name

    config = tiny_damcha_gpt2_config()
    config.metric_context = "sequence"  # set after creation: checked when a model is built from it
    for model_class in (damcha_hf.DamchaGPT2LMHeadModel, damcha_hf.DamchaGPT2Model,
                        damcha_hf.DamchaGPT2ForSequenceClassification):  # fmt: skip
        with pytest.raises(Exception, match="future tokens"):
            model_class(config)
    with pytest.raises(Exception, match="future tokens"):
        AutoModelForCausalLM.from_pretrained(folder, config=config)


def test_a_causal_llama_refuses_sequence_context_on_override_and_after_creation(tmp_path):
    model = damcha_hf.DamchaLlamaForCausalLM(tiny_damcha_llama_config()).eval()
    model.save_pretrained(tmp_path / "llama")
    assert causal_probe(AutoModelForCausalLM.from_pretrained(tmp_path / "llama"))
    with pytest.raises(Exception, match="future tokens"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "llama", metric_context="sequence")
    config = tiny_damcha_llama_config()
    config.metric_context = "sequence"
    with pytest.raises(Exception, match="future tokens"):
        damcha_hf.DamchaLlamaForCausalLM(config)


@pytest.mark.parametrize(
    "field, value",
    [("metric_context", "bogus"), ("dcmha_rank", 0), ("metric_hidden_size", -3), ("metric_mask", "upper")],
)
def test_bad_overrides_fail_at_load_naming_the_field(tmp_path, field, value):
    folder = tmp_path / "ckpt"
    tiny_lm().save_pretrained(folder)
    with pytest.raises(Exception, match=f"`{field}`") as error:
        AutoModelForCausalLM.from_pretrained(folder, **{field: value})
    assert "negative dimension" not in str(error.value)
    vit_config = tiny_damcha_vit_config()
    with pytest.raises(ValueError, match=f"`{field}`"):  # refused as it is set, before any model is built
        setattr(vit_config, field, value)


# ---------------------------------------------------------------------------- card paths and resume (items 4, 5)


@pytest.fixture(scope="module")
def private_corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("private_corpus_location_q7z")
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs", "far", "away"]
    path = folder / "corpus.txt"
    path.write_text("".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + "\n" for i in range(300)))
    return path


def test_recipe_card_and_files_carry_no_local_data_path_and_resume_checks_settings(tmp_path, private_corpus):
    recipe = load_recipe("train_gpt2")
    output = tmp_path / "run"
    common = ["--data", str(private_corpus), *TINY_RECIPE_ARGS, "--output-dir", str(output)]
    recipe.main([*common, "--metric-context", "query", "--metric-hidden-size", "8", "--max-steps", "2",
                 "--save-steps", "1", "--eval-steps", "2"])  # fmt: skip
    marker = private_corpus.parent.name.encode()
    for path in output.rglob("*"):
        if path.is_file():
            assert marker not in path.read_bytes(), path
    card = (output / "final" / "README.md").read_text()
    assert "- corpus.txt" in card  # the dataset is named by its base name

    # Resuming with other model settings is refused before training, naming every differing flag.
    with pytest.raises(ValueError) as error:
        recipe.main([*common, "--resume", "--metric-context", "token", "--metric-sharing", "layer",
                     "--metric-hidden-size", "16", "--max-steps", "3"])  # fmt: skip
    message = str(error.value)
    for flag in ("--metric-context token", "--metric-sharing layer", "--metric-hidden-size 16"):
        assert flag in message
    assert "--n-layer" not in message
    assert not (output / "checkpoint-3").exists()

    # Flags left out take the checkpoint's values: the run continues as `query` with r = 8.
    result = recipe.main([*common, "--resume", "--max-steps", "3", "--save-steps", "1"])
    assert result["global_step"] == 3
    config = json.loads((output / "final" / "config.json").read_text())
    assert (config["metric_context"], config["metric_hidden_size"]) == ("query", 8)


def test_lora_resume_refuses_other_adapter_or_metric_settings(tmp_path, private_corpus):
    from transformers import GPT2Config

    from damcha_hf.data import byte_level_tokenizer

    base = tmp_path / "base"
    config = GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=256,
                        eos_token_id=256, pad_token_id=256)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(base)
    byte_level_tokenizer().save_pretrained(base)
    recipe = load_recipe("finetune_lora")
    output = tmp_path / "lora"
    common = ["--base", str(base), "--data", str(private_corpus), "--output-dir", str(output), "--block-size", "32",
              "--batch-size", "8", "--max-eval-samples", "8", "--num-threads", "1", "--save-steps", "1"]  # fmt: skip
    recipe.main([*common, "--max-steps", "1", "--lora-rank", "4", "--metric-hidden-size", "8"])
    assert (output / "checkpoint-1").is_dir()
    with pytest.raises(ValueError) as error:
        recipe.main([*common, "--max-steps", "2", "--resume", "--lora-rank", "8", "--metric-hidden-size", "16"])
    assert "--lora-rank 8 (the checkpoint has 4)" in str(error.value)
    assert "--metric-hidden-size 16 (the checkpoint has 8)" in str(error.value)
    assert not (output / "checkpoint-2").exists()
    assert recipe.main([*common, "--max-steps", "2", "--resume"])["global_step"] == 2  # settings from the run


# ------------------------------------------------------------------------------------------ one-line errors (item 6)


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    plain = tmp_path / "plain-gpt2"
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(plain)
    damcha_checkpoint = tmp_path / "damcha"
    tiny_lm().save_pretrained(damcha_checkpoint)
    capsys.readouterr()  # the saves' progress bars
    cases = [
        (["info", str(tmp_path / "missing")], "neither a preset"),
        (["info", str(plain)], "not a DAMCHA one"),
        (["inspect", str(damcha_checkpoint), "--output", str(tmp_path)], "is a folder"),
        (["demo", "--batch-size", "0"], "--batch-size: must be a positive integer"),
        (["demo", "--n-head", "5", "--output-dir", str(tmp_path / "new")], "--n-head 5 must divide --n-embd 128"),
        (["demo", "--data", str(tmp_path / "nothing*.txt"), "--output-dir", str(tmp_path / "new")], "--data"),
        (["demo", "--learning-rate", "nan"], "finite"),
        (["push", str(tmp_path / "missing"), "someone/x", "--token", "hf_x"], "error"),
    ]
    for argv, expected in cases:
        try:
            code = cli_main(argv)
        except SystemExit as exit_info:
            code = exit_info.code
        assert code == 2, argv
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"damcha-hf {argv[0]}: error:") and expected in line, (argv, line)
    with pytest.raises(ValueError, match="not a DAMCHA one"):  # --debug: the exception itself, with its traceback
        cli_main(["--debug", "info", str(plain)])


def test_console_script_and_recipe_errors_are_one_line_with_exit_code_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("DAMCHA_HF_DEBUG", None)
    runs = [
        [str(Path(sys.executable).parent / "damcha-hf"), "info", str(tmp_path / "nonexistent")],
        [sys.executable, str(RECIPES / "train_gpt2.py"), "--n-head", "5", "--output-dir", str(tmp_path / "o")],
        [sys.executable, str(RECIPES / "train_gpt2.py"), "--data", str(tmp_path / "no-such.txt")],
        # Fails after the imports, in the recipe's main: still one line.
        [sys.executable, str(RECIPES / "train_gpt2.py"), "--output-dir", str(tmp_path / "o"), "--resume"],
    ]
    for command in runs:
        completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert completed.returncode == 2, completed.stderr
        line = one_error_line(completed.stderr)
        assert " error: " in line, line
    debug = subprocess.run(runs[-1], capture_output=True, text=True, env={**env, "DAMCHA_HF_DEBUG": "1"}, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


# ---------------------------------------------------------------------------------------------- smaller (item 7)


@pytest.mark.parametrize(
    "name, config_name, predictions, references, expected",
    [
        ("perplexity", "nll", [float("nan")], [3], "finite, non-negative"),
        ("perplexity", "nll", [-5.0], [3], "finite, non-negative"),
        ("perplexity", "nll", [1.0], [-3], "non-negative whole counts"),
        ("perplexity", "nll", [], [], "no inputs"),
        ("bits_per_byte", "nll", [float("inf")], [3], "finite, non-negative"),
        ("perplexity", None, [[[0.0, float("nan")], [0.0, 1.0]]], [[0, 1]], "NaN or infinite"),
        ("bits_per_byte", None, [[[0.0, 1.0], [0.0, 1.0]]], [[0, 1, 1]], "logits cover 1 positions but labels 2"),
        ("accuracy", None, [], [], "no predictions"),
    ],
)
def test_metric_modules_reject_bad_inputs_clearly(name, config_name, predictions, references, expected):
    with pytest.raises(ValueError, match=expected):
        load_metric(name, config_name).compute(predictions=predictions, references=references)


def test_perplexity_overflow_is_infinite_not_an_error():
    result = load_metric("perplexity", "nll").compute(predictions=[1e6], references=[1])
    assert result["perplexity"] == math.inf and result["mean_nll"] == 1e6
    assert load_metric("perplexity", "nll").compute(predictions=[2.0], references=[2])["perplexity"] == math.e


def test_a_damcha_checkpoint_missing_its_generator_is_refused_not_loaded_as_mha(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    tiny_lm().save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    kept = {key: value for key, value in weights.items() if "cross_head_metric" not in key}
    assert len(kept) < len(weights)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    for loader in (damcha_hf.DamchaGPT2LMHeadModel, AutoModelForCausalLM):
        with pytest.raises(ValueError, match="lacks metric-generator weights.*plain multi-head attention"):
            loader.from_pretrained(folder)
    # A stock GPT-2 checkpoint has no generator by design: it converts, the generator starting at zero.
    stock = tmp_path / "stock"
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(stock)
    model, info = damcha_hf.DamchaGPT2LMHeadModel.from_pretrained(stock, output_loading_info=True)
    assert any("cross_head_metric" in key for key in info["missing_keys"])
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if "cross_head_metric" in n and "fc_out" in n)


def test_heatmap_of_a_vit_with_a_non_square_image(tmp_path):
    model = damcha_hf.DamchaViTModel(tiny_damcha_vit_config(image_size=(28, 16))).eval()
    randomize_cross_head(model)
    result = damcha_hf.write_metric_map(model, tmp_path / "map.png")
    assert result.panels == 2 and (tmp_path / "map.png").read_bytes().startswith(b"\x89PNG")
