"""Defaults a newcomer relies on: runs never share or clobber a folder, a quick run stays quick (one evaluation, the
text it needs), help shows every default, `info` names the saved class and never waits for the network."""

import json
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import load_recipe, tiny_damcha_gpt2_config, write_fashion_mnist, write_gcide
from tiny_checkpoints import DECODER_TYPES, write_stock_decoder

import damcha_hf
from damcha_hf.cli import main as cli_main
from damcha_hf.modeling.variants import CROSS_HEAD_VARIANTS

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
TINY_GPT2_ARGS = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--batch-size", "4",
                  "--metric-hidden-size", "8", "--logging-steps", "1", "--num-threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    path = tmp_path_factory.mktemp("defaults-corpus") / "corpus.txt"
    path.write_text("".join(" ".join(rng.choice(words, 10)) + "\n" for _ in range(300)))
    return str(path)


def documented_commands(script: str) -> list[list[str]]:
    """The arguments of every `python recipes/<script>` command in the recipes page of the documentation."""
    commands = []
    for line in (REPO / "docs" / "recipes.md").read_text().splitlines():
        if line.startswith(f"python recipes/{script}"):
            words = shlex.split(line.split("#")[0])
            commands.append(words[2:])
    return commands


def test_documented_train_gpt2_commands_get_distinct_output_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("DAMCHA_GCIDE_PATH", write_gcide(tmp_path / "gcide.dict.dz"))  # `--data gcide` is checked
    monkeypatch.chdir(tmp_path)
    commands = documented_commands("train_gpt2.py")
    assert len(commands) >= 2
    # The pretrained checkpoints and the corpus the commands name, as a user's folder holds them (a relative path that
    # exists is a local folder, a Hub id's shape included).
    for arguments in commands:
        if "--model-name-or-path" in arguments:
            model = arguments[arguments.index("--model-name-or-path") + 1]
            model_type = next(name for name in DECODER_TYPES if name.replace("2", "-2") in model.lower()
                              or name in model.lower())  # fmt: skip
            write_stock_decoder(tmp_path / model, model_type)
    Path("corpus.txt").write_text("a few words of text\n" * 200)
    recipe = load_recipe("train_gpt2")
    folders = [Path(recipe.parse_args(arguments).output_dir).resolve() for arguments in commands]
    assert len(set(folders)) == len(folders), folders
    assert all(tmp_path / "runs" in folder.parents for folder in folders)


def test_an_earlier_run_is_not_replaced_without_overwrite_output_dir(tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = tmp_path / "run"
    (run / "checkpoint-5").mkdir(parents=True)
    (run / "eval_results.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        recipe.parse_args(["--output-dir", str(run)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--overwrite-output-dir" in error and "--resume" in error and len(error.strip().splitlines()) == 1
    assert recipe.parse_args(["--output-dir", str(run), "--overwrite-output-dir"]).output_dir == str(run)
    assert recipe.parse_args(["--output-dir", str(run), "--resume"]).resume == "latest"
    assert (run / "eval_results.json").read_text() == "{}"


def test_a_quick_run_evaluates_and_saves_once_at_the_end_and_reads_only_what_it_needs(tmp_path, corpus, capsys):
    recipe = load_recipe("train_gpt2")
    output = tmp_path / "quick"
    recipe.main(["--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "5", "--output-dir", str(output)])
    assert sorted(path.name for path in output.iterdir() if path.name.startswith("checkpoint-")) == ["checkpoint-5"]
    log = json.loads((output / "checkpoint-5" / "trainer_state.json").read_text())["log_history"]
    assert [entry for entry in log if "eval_loss" in entry] == []  # no evaluation during 5 steps
    assert json.loads((output / "eval_results.json").read_text())["eval_loss"] > 0  # one, after training
    printed = capsys.readouterr().out
    assert "reading about" in printed and "--max-data-bytes" in printed

    # The data read is sized by the run: 5 steps of 4 blocks of 32 bytes need far less than 2,000 steps.
    text_data = recipe.text_data
    quick = text_data.data_bytes_needed(recipe.parse_args(["--max-steps", "5", "--output-dir", str(tmp_path / "a")]))
    long = text_data.data_bytes_needed(recipe.parse_args(["--max-steps", "20000", "--output-dir", str(tmp_path / "b")]))
    assert quick < long / 10


@pytest.mark.parametrize("name", ["train_gpt2", "train_gpt2_accelerate", "train_vit", "finetune_lora"])
def test_help_shows_the_real_defaults(name, capsys, tmp_path, monkeypatch):
    recipe = load_recipe(name)
    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapping, which breaks words at hyphens
    with pytest.raises(SystemExit):
        recipe.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.01)" in text  # --weight-decay, whose help says nothing else
    assert "--seed SEED (default: 0)" in text  # a default of 0 is a default too
    assert f"--cross-head-variant {{{','.join(CROSS_HEAD_VARIANTS)}}}" in text
    eval_default = 2000 if name == "train_vit" else 256
    assert re.search(rf"--max-eval-samples MAX_EVAL_SAMPLES [^-]*\(default: {eval_default}\)", text), text
    assert "(default: None)" not in text
    # The example run folder in --output-dir's help is the one this recipe's defaults give.
    example = re.search(r"--output-dir OUTPUT_DIR .*? e\.g\. ([^\s):]+)", text)[1]
    monkeypatch.chdir(tmp_path)
    arguments = ["--fashion-mnist-dir", str(tmp_path)] if name == "train_vit" else []  # (none needed to parse)
    if name == "finetune_lora":  # the help's example: --base path/to/gpt2 --data corpus.txt
        assert "--base path/to/gpt2 --data corpus.txt" in text
        (tmp_path / "path" / "to" / "gpt2").mkdir(parents=True)
        (tmp_path / "path" / "to" / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        (tmp_path / "corpus.txt").write_text("text")
        arguments = ["--base", "path/to/gpt2", "--data", "corpus.txt"]
    assert recipe.parse_args(arguments).output_dir == example


def test_cli_help_shows_the_real_defaults(capsys):
    for command, shown in (("push", "(default: Upload DAMCHA checkpoint)"), ("demo", "--seed SEED (default: 0)")):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert shown in text, command


def test_accelerate_docstring_keeps_each_example_on_its_line():
    """A backslash at the end of an example line continues the shell command; in a plain docstring Python would join
    the two lines (`single_process.yaml         recipes/...`)."""
    recipe = load_recipe("train_gpt2_accelerate")
    assert "single_process.yaml \\\n        recipes/train_gpt2_accelerate.py" in recipe.__doc__


def test_info_names_the_saved_class_and_never_waits_for_the_network(tmp_path, capsys):
    folder = tmp_path / "lm"
    damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config()).save_pretrained(folder)
    assert cli_main(["info", str(folder)]) == 0
    assert "DamchaGPT2LMHeadModel" in capsys.readouterr().out

    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["info", "gpt2"])
    assert exit_info.value.code == 2 and time.perf_counter() - started < 30  # no network wait
    error = capsys.readouterr().err
    from damcha_hf.commands.info import PRESET_DESCRIPTIONS, PRESETS
    from damcha_hf.families import FAMILIES, presets

    assert "offline" in error and f"({', '.join(PRESETS)})" in error
    assert PRESETS[0] == "gpt2-small" and {"tinyllama", "vit-small", "bart-base"} <= set(PRESETS)
    # Only the families' presets count as presets (words of their descriptions once did: `info GQA` went to the Hub).

    assert set(PRESETS) == set(presets())
    # The descriptions `--help` reads from the source are those the family declares beside its config.
    for family in FAMILIES:
        declared = sys.modules[family.config_class.__module__].__dict__.get("INFO_PRESETS", {})
        assert declared.keys() == family.presets.keys()
        assert all(PRESET_DESCRIPTIONS[name] == preset["about"] for name, preset in declared.items())
    assert presets()["vit-small"][1]().num_labels == 1000  # the declared overrides reach the config
    for word in ("GQA", "224px"):
        with pytest.raises(SystemExit):
            cli_main(["info", word])


@pytest.mark.slow  # about 15 s: a full Accelerate run
def test_accelerate_recipe_keeps_save_total_limit_checkpoints_quietly(tmp_path, corpus):
    import os
    import subprocess
    import sys

    output = tmp_path / "accelerate"
    command = [sys.executable, str(RECIPES / "train_gpt2_accelerate.py"), "--data", corpus, *TINY_GPT2_ARGS,
               "--max-steps", "4", "--save-steps", "1", "--save-total-limit", "2", "--output-dir", str(output)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert sorted(path.name for path in output.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert "Removed shared tensor" not in completed.stdout + completed.stderr
    # Piped, not a terminal: no training bar in the log (tests/test_progress_output.py checks the logging lines).
    assert not re.search(r"training: +\d+%\|", completed.stderr), completed.stderr[-2000:]


def test_report_to_takes_a_comma_separated_list_and_refuses_unknown_or_missing_trackers(tmp_path, corpus, monkeypatch,
                                                                                         capsys):  # fmt: skip
    from transformers.integrations import integration_utils

    recipe = load_recipe("train_gpt2")
    output = ["--output-dir", str(tmp_path / "run")]
    assert recipe.parse_args([*output, "--report-to", "tensorboard, wandb"]).report_to == ["tensorboard", "wandb"]
    assert recipe.parse_args(output).report_to == []  # none
    with pytest.raises(SystemExit):
        recipe.parse_args([*output, "--report-to", "none,wandb"])
    assert "--report-to" in capsys.readouterr().err

    # Checked before any data is read: an unknown name, and a tracker that is not installed.
    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: [])
    for trackers, expected in (("tensorboard,nonsense", "nonsense: not a tracker transformers knows"),
                               ("tensorboard", "tensorboard: tensorboard not installed here")):  # fmt: skip
        with pytest.raises(ValueError, match=f"--report-to {expected}"):
            recipe.main(["--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "2", *output, "--report-to", trackers])
        assert "reading about" not in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_report_to_reaches_the_trainer_and_the_accelerate_loop(tmp_path, corpus, monkeypatch):
    """A tracker named with --report-to receives the losses: the Trainer's reporting callback, and Accelerate's
    tracker in the Accelerate recipe (which used to accept the flag and log nowhere)."""
    from accelerate import tracking
    from transformers import TrainerCallback
    from transformers.integrations import integration_utils

    trainer_logs, accelerate_trackers = [], []

    class RecordingCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            trainer_logs.append(dict(logs or {}))

    class RecordingTracker(tracking.GeneralTracker):
        name, requires_logging_directory = "recorder", True

        def __init__(self, run_name, logging_dir, **kwargs):
            super().__init__()
            self.run_name, self.logging_dir, self.config, self.logs = run_name, logging_dir, None, []
            accelerate_trackers.append(self)

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = dict(values)

        def log(self, values, step=None, **kwargs):
            self.logs.append((step, dict(values)))

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "recorder", RecordingCallback)
    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: ["recorder"])
    monkeypatch.setitem(tracking.LOGGER_TYPE_TO_CLASS, "recorder", RecordingTracker)
    arguments = ["--data", corpus, *TINY_GPT2_ARGS, "--max-steps", "2", "--report-to", "recorder"]

    load_recipe("train_gpt2").main([*arguments, "--output-dir", str(tmp_path / "trainer")])
    assert [entry["loss"] > 0 for entry in trainer_logs if "loss" in entry] == [True, True]  # --logging-steps 1

    output = tmp_path / "accelerate"
    load_recipe("train_gpt2_accelerate").main([*arguments, "--output-dir", str(output)])
    (tracker,) = accelerate_trackers
    assert tracker.logging_dir == str(output / "runs") and tracker.config["max_steps"] == 2
    assert [step for step, values in tracker.logs if "loss" in values] == [1, 2]
    assert [step for step, values in tracker.logs if "eval_bits_per_byte" in values] == [2]


def test_train_vit_without_fashion_mnist_says_how_to_get_it_while_parsing(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        load_recipe("train_vit").parse_args(["--fashion-mnist-dir", str(tmp_path / "missing"),
                                             "--output-dir", str(tmp_path / "run")])  # fmt: skip
    error = capsys.readouterr().err
    assert refused.value.code == 2
    assert "apt-get install dataset-fashion-mnist" in error and "--fashion-mnist-dir" in error


def test_a_quick_vit_run_reads_only_the_fashion_mnist_images_it_needs(tmp_path, capsys):
    """5 steps of 4 images need a few images, not the whole training set (60,000 images took 10 s to read)."""
    folder = write_fashion_mnist(tmp_path / "fashion-mnist", train=500, test=20)
    vit = ["--fashion-mnist-dir", str(folder), "--hidden-size", "16", "--num-layers", "1", "--num-heads", "2",
           "--patch-size", "7", "--batch-size", "4", "--num-threads", "1", "--max-steps", "5"]  # fmt: skip
    load_recipe("train_vit").main([*vit, "--output-dir", str(tmp_path / "quick")])
    printed = capsys.readouterr().out
    assert "reading at most 40 Fashion-MNIST training images" in printed and "40 training and 20 validation" in printed
    load_recipe("train_vit").main([*vit, "--max-train-samples", "300", "--output-dir", str(tmp_path / "given")])
    assert "300 training and 20 validation" in capsys.readouterr().out
