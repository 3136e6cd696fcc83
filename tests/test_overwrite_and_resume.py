"""--overwrite-output-dir replaces the earlier run entirely, and --resume continues only the run its folder holds: run
A with checkpoints, replaced by run B, then resumed, must continue B (or refuse, if B saved nothing), never A; so too
after A was killed mid-run or the replacement itself was cut short. Files the program did not write are refused, and a
checkpoint past --max-steps is never trained past."""

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE_ARGS, dead_pid, load_recipe, one_error_line, snapshot
from safetensors.torch import load_file

from damcha_hf.safe_files import RUN_LOCK_FILE, RUN_RECORD_FILE, SAVE_RECORD_FILE, output_folders

# --------------------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    return path


def arguments(corpus: Path, run: Path) -> list[str]:
    return ["--data", str(corpus), *TINY_RECIPE_ARGS, "--output-dir", str(run)]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, corpus) -> Path:
    """Run A of train_gpt2 (seed 1): checkpoints at steps 3 and 6, the final model and its results."""
    run = tmp_path_factory.mktemp("a") / "run"
    load_recipe("train_gpt2").main([*arguments(corpus, run), "--max-steps", "6", "--save-steps", "3", "--seed", "1"])
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(RUN_LOCK_FILE))
    return copy


def run_id(run: Path) -> str:
    return json.loads((run / RUN_RECORD_FILE).read_text())["run_id"]


def stamp(checkpoint: Path) -> str | None:
    return json.loads((checkpoint / SAVE_RECORD_FILE).read_text()).get("run_id")


def trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def logged_losses(checkpoint: Path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer_state(checkpoint)["log_history"] if "loss" in entry}


def entries(run: Path) -> list[str]:
    return sorted(path.name for path in run.iterdir() if path.name != RUN_LOCK_FILE)


def assert_same_weights(folder: Path, other: Path) -> None:
    mine, theirs = load_file(folder / "model.safetensors"), load_file(other / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def start_only(recipe, argv: list[str]):
    """What a run does before it reads any data: parse (locking the folder), then start (`run_folder.start_run`)."""
    run_folder = importlib.import_module("run_folder")  # the recipes' module, on sys.path once a recipe is loaded
    return run_folder.holding_run_folder(lambda argv: run_folder.start_run(recipe.parse_args(argv), None))(argv)


def killed_mid_run(run: Path) -> None:
    """Leave `run` (A's finished folder) as a kill -9 during A's save of checkpoint-9 would: no final model nor
    results yet, checkpoint-9 named in the run record but half written (a truncated weight file, and no save record,
    though the trainer state that transformers' `get_last_checkpoint` looks for is there), the lock file and a
    half-written temporary file of the dead process."""
    shutil.rmtree(run / "final")
    (run / "eval_results.json").unlink()
    partial = run / "checkpoint-9"
    partial.mkdir()
    for name in ("config.json", "optimizer.pt", "trainer_state.json"):
        shutil.copy(run / "checkpoint-6" / name, partial / name)
    weights = (run / "checkpoint-6" / "model.safetensors").read_bytes()
    (partial / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    record = json.loads((run / RUN_RECORD_FILE).read_text())
    record["entries"].append("checkpoint-9")  # named before the save begins
    (run / RUN_RECORD_FILE).write_text(json.dumps(record))
    pid = dead_pid()
    (run / RUN_LOCK_FILE).write_text(f"{pid}\n")
    (run / f".{RUN_RECORD_FILE}.tmp-{pid}-0123abcd").write_text('{"written_by": "damc')


# ---------------------------------------------------------------------------- A, then B over it, then --resume


def test_overwrite_replaces_the_earlier_run_and_resume_continues_the_new_one(run_a, corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    run_a_id, losses_a = run_id(run), logged_losses(run / "checkpoint-6")
    assert stamp(run / "checkpoint-3") == stamp(run / "checkpoint-6") == run_a_id

    recipe.main([*arguments(corpus, run), "--max-steps", "2", "--overwrite-output-dir", "--seed", "2"])
    assert "removed the earlier run" in capsys.readouterr().out
    assert entries(run) == [RUN_RECORD_FILE, "checkpoint-2", "eval_results.json", "final"]
    run_b_id = run_id(run)
    assert run_b_id != run_a_id and stamp(run / "checkpoint-2") == run_b_id
    losses_b = logged_losses(run / "checkpoint-2")
    assert losses_b[1] != losses_a[1]  # another seed, another model: the two runs can be told apart

    result = recipe.main([*arguments(corpus, run), "--max-steps", "4", "--resume", "--seed", "2"])
    assert result["resumed_from"] == str(run / "checkpoint-2") and result["global_step"] == 4
    resumed = run / "checkpoint-4"
    assert trainer_state(resumed)["global_step"] == 4 and stamp(resumed) == run_id(run) == run_b_id
    continued = logged_losses(resumed)
    assert [continued[step] for step in (1, 2)] == [losses_b[1], losses_b[2]]  # B's history, not A's
    assert_same_weights(run / "final", resumed)
    assert entries(run) == [RUN_RECORD_FILE, "checkpoint-2", "checkpoint-4", "eval_results.json", "final"]


def test_resume_after_an_overwrite_that_saved_nothing_never_takes_the_earlier_run(run_a, corpus, tmp_path):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    start_only(recipe, [*arguments(corpus, run), "--overwrite-output-dir", "--seed", "2"])  # B, killed at once
    assert entries(run) == []
    with pytest.raises(FileNotFoundError, match="no complete checkpoint-N folder"):
        recipe.main([*arguments(corpus, run), "--max-steps", "4", "--resume"])
    assert entries(run) == []


def test_a_run_killed_mid_save_resumes_at_its_last_complete_checkpoint(run_a, corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    killed_mid_run(run)
    run_a_id = run_id(run)
    capsys.readouterr()
    result = recipe.main([*arguments(corpus, run), "--max-steps", "7", "--resume", "--seed", "1"])
    captured = capsys.readouterr()
    assert "skipped checkpoint-9 (its save was cut short)" in captured.err
    assert "removed checkpoint-9, left unfinished by an interrupted save" in captured.out
    assert result["resumed_from"] == str(run / "checkpoint-6") and result["global_step"] == 7
    assert trainer_state(run / "checkpoint-7")["global_step"] == 7 and stamp(run / "checkpoint-7") == run_a_id
    assert entries(run) == [RUN_RECORD_FILE, "checkpoint-6", "checkpoint-7", "eval_results.json", "final"]


def test_a_run_killed_mid_save_is_replaced_entirely_by_overwrite(run_a, corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    killed_mid_run(run)
    run_a_id = run_id(run)
    recipe.main([*arguments(corpus, run), "--max-steps", "2", "--overwrite-output-dir", "--seed", "2"])
    said = capsys.readouterr()
    assert "an earlier save was interrupted" in said.err  # the dead process's temporary file
    assert "(checkpoint-3, checkpoint-6, checkpoint-9)" in said.out
    assert entries(run) == [RUN_RECORD_FILE, "checkpoint-2", "eval_results.json", "final"]
    assert run_id(run) != run_a_id

    result = recipe.main([*arguments(corpus, run), "--max-steps", "4", "--resume", "--seed", "2"])
    assert result["resumed_from"] == str(run / "checkpoint-2") and result["global_step"] == 4
    assert stamp(run / "checkpoint-4") == run_id(run) != run_a_id


@pytest.mark.slow  # about 20 s: a run started in its own process and killed
def test_a_run_killed_by_sigkill_is_replaced_and_never_resumed(corpus, tmp_path):
    import os
    import signal
    import time

    recipe = load_recipe("train_gpt2")
    run = tmp_path / "run"
    command = [sys.executable, str(Path(recipe.__file__)), *arguments(corpus, run), "--max-steps", "100000",
               "--save-steps", "1", "--seed", "1"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "USE_HUB_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    killed = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoint-5").exists() and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert killed.returncode == -signal.SIGKILL
    run_a_id = run_id(run)
    assert any(stamp(path) == run_a_id for path in run.glob("checkpoint-*") if (path / SAVE_RECORD_FILE).exists())

    recipe.main([*arguments(corpus, run), "--max-steps", "2", "--overwrite-output-dir", "--seed", "2"])
    assert entries(run) == [RUN_RECORD_FILE, "checkpoint-2", "eval_results.json", "final"]
    result = recipe.main([*arguments(corpus, run), "--max-steps", "3", "--resume", "--seed", "2"])
    assert result["resumed_from"] == str(run / "checkpoint-2") and result["global_step"] == 3
    assert stamp(run / "checkpoint-3") == run_id(run) != run_a_id


@pytest.mark.parametrize("cut", ["while moving entries aside", "while deleting"])
def test_an_overwrite_cut_short_never_brings_the_earlier_run_back(run_a, corpus, tmp_path, monkeypatch, cut):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    run_a_id = run_id(run)
    replace, moved = output_folders.os.replace, []

    def replace_then_die(source, destination):
        if cut == "while moving entries aside" and len(moved) == 2:
            raise KeyboardInterrupt  # a kill: nothing after this point runs
        replace(source, destination)
        moved.append(Path(source).name)

    def die(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(output_folders.os, "replace", replace_then_die)
    monkeypatch.setattr(output_folders.shutil, "rmtree", die)
    with pytest.raises(KeyboardInterrupt):
        start_only(recipe, [*arguments(corpus, run), "--overwrite-output-dir", "--seed", "2"])
    monkeypatch.undo()
    if cut == "while moving entries aside":  # the rest of A is whole, its record last to go
        assert moved == ["checkpoint-3", "checkpoint-6"] and run_id(run) == run_a_id
        assert {"eval_results.json", "final", RUN_RECORD_FILE} <= set(entries(run))
    else:
        assert not [name for name in entries(run) if not name.startswith(".")]

    # The next start deletes what was moved aside (never restoring it); --resume then finds no checkpoint of A.
    with pytest.raises(FileNotFoundError, match="no complete checkpoint-N folder"):
        recipe.main([*arguments(corpus, run), "--max-steps", "4", "--resume"])
    assert not any(".del-" in name for name in entries(run))
    assert not any(name.startswith("checkpoint-") for name in entries(run))
    start_only(recipe, [*arguments(corpus, run), "--overwrite-output-dir"])
    assert entries(run) == []


# ------------------------------------------------------------------------------------------------- foreign files


def refusal(recipe, argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        start_only(recipe, argv)
    assert exit_info.value.code == 2
    return one_error_line(capsys.readouterr().err)


def test_overwrite_refuses_files_the_program_did_not_write_and_removes_nothing(run_a, corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    argv = [*arguments(corpus, run), "--overwrite-output-dir"]
    (run / "checkpoint-3" / "notes.txt").write_text("mine")
    before = snapshot(run)
    line = refusal(recipe, argv, capsys)
    assert "checkpoint-3/ holds files its save did not write (notes.txt)" in line and "move it out" in line
    assert snapshot(run) == before

    (run / "checkpoint-3" / "notes.txt").unlink()
    (run / RUN_RECORD_FILE).unlink()  # a checkpoint saved by an older damcha-hf, which kept no records
    (run / "checkpoint-6" / SAVE_RECORD_FILE).unlink()
    before = snapshot(run)
    line = refusal(recipe, argv, capsys)
    assert f"checkpoint-6/ has no record of what wrote it (no {SAVE_RECORD_FILE}" in line
    assert snapshot(run) == before

    shutil.rmtree(run / "checkpoint-6")
    (run / "thesis.tex").write_text("mine")  # beside the run: refused as before, by name
    line = refusal(recipe, argv, capsys)
    assert "holds files this recipe did not write (thesis.tex)" in line
    assert (run / "thesis.tex").read_text() == "mine" and (run / "checkpoint-3").is_dir()


# --------------------------------------------------------------------------------------------- which run resumes


def test_resume_refuses_or_skips_checkpoints_of_another_run(run_a, corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    argv = arguments(corpus, run)
    other = tmp_path / "other"
    recipe.main([*arguments(corpus, other), "--max-steps", "9", "--save-steps", "9", "--seed", "3"])
    shutil.copytree(other / "checkpoint-9", run / "checkpoint-9")  # another run's checkpoint, newer than A's

    with pytest.raises(ValueError, match=r"checkpoint-9: not a checkpoint of the run in --output-dir .*another run"):
        recipe.main([*argv, "--resume", str(run / "checkpoint-9"), "--max-steps", "9"])
    capsys.readouterr()
    result = recipe.main([*argv, "--resume", "--max-steps", "7", "--save-total-limit", "1"])
    assert f"skipped checkpoint-9 (of another run ({run_id(other)}))" in capsys.readouterr().err
    assert result["resumed_from"] == str(run / "checkpoint-6") and result["global_step"] == 7
    # --save-total-limit deletes the run's own older checkpoints only.
    assert [name for name in entries(run) if name.startswith("checkpoint-")] == ["checkpoint-7", "checkpoint-9"]
    assert snapshot(run / "checkpoint-9") == snapshot(other / "checkpoint-9")

    line = refusal(recipe, [*argv, "--resume", "--overwrite-output-dir"], capsys)
    assert "which --overwrite-output-dir removes" in line


def test_a_checkpoint_from_elsewhere_continues_only_into_its_own_run_or_with_overwrite(run_a, corpus, tmp_path,
                                                                                       capsys):  # fmt: skip
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    recipe.main([*arguments(corpus, elsewhere), "--max-steps", "2", "--seed", "2"])
    line = refusal(recipe, [*arguments(corpus, run), "--resume", str(elsewhere / "checkpoint-2")], capsys)
    assert f"holds another run (run {run_id(run)})" in line and "--overwrite-output-dir" in line
    result = recipe.main([*arguments(corpus, run), "--resume", str(elsewhere / "checkpoint-2"), "--max-steps", "3",
                          "--overwrite-output-dir"])  # fmt: skip
    assert result["resumed_from"] == str(elsewhere / "checkpoint-2") and result["global_step"] == 3
    assert entries(run) == [RUN_RECORD_FILE, "checkpoint-3", "eval_results.json", "final"]
    assert run_id(run) == stamp(run / "checkpoint-3") == run_id(elsewhere)  # the run it continues


# ------------------------------------------------------------------------------------------------ past --max-steps


def test_resume_never_trains_past_max_steps(run_a, corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2")
    run = copy_of(run_a, tmp_path)
    before = snapshot(run)
    with pytest.raises(ValueError) as error:
        recipe.main([*arguments(corpus, run), "--max-steps", "4", "--resume"])
    message = str(error.value)
    assert f"--resume {run / 'checkpoint-6'}: the checkpoint is at step 6, past --max-steps 4" in message
    assert "--max-steps 6" in message and "\n" not in message
    assert snapshot(run) == before

    # At --max-steps: evaluated and saved as it is, said in one line; no step is taken.
    (run / "final" / "model.safetensors").unlink()
    capsys.readouterr()
    result = recipe.main([*arguments(corpus, run), "--max-steps", "6", "--resume"])
    assert "nothing is left to train" in capsys.readouterr().out
    assert result["global_step"] == 6 and result["train_loss"] is None
    assert not (run / "checkpoint-7").exists()
    assert_same_weights(run / "final", run / "checkpoint-6")


# ------------------------------------------------------------------------------------------ the Accelerate recipe


def test_the_accelerate_recipe_overwrites_and_resumes_the_same_way(corpus, tmp_path, capsys):
    recipe = load_recipe("train_gpt2_accelerate")
    run = tmp_path / "run"
    argv = [*arguments(corpus, run), "--save-steps", "2"]
    recipe.main([*argv, "--max-steps", "4", "--seed", "1"])
    run_a_id = run_id(run)
    assert stamp(run / "checkpoint-2") == stamp(run / "checkpoint-4") == run_a_id

    recipe.main([*argv, "--max-steps", "2", "--overwrite-output-dir", "--seed", "2"])
    names = entries(run)
    assert [name for name in names if name.startswith("checkpoint-")] == ["checkpoint-2"]
    run_b_id = run_id(run)
    assert run_b_id != run_a_id and stamp(run / "checkpoint-2") == run_b_id
    b_state = json.loads((run / "checkpoint-2" / "loop_state.json").read_text())

    result = recipe.main([*argv, "--max-steps", "3", "--resume", "--seed", "2"])
    assert result["resumed_from"] == str(run / "checkpoint-2") and result["global_step"] == 3
    state = json.loads((run / "checkpoint-3" / "loop_state.json").read_text())
    assert state["step"] == 3 and state["log_history"][: len(b_state["log_history"])] == b_state["log_history"]
    assert stamp(run / "checkpoint-3") == run_b_id

    with pytest.raises(ValueError, match=r"checkpoint-3: the checkpoint is at step 3, past --max-steps 2"):
        recipe.main([*argv, "--max-steps", "2", "--resume"])


# ------------------------------------------------------------------------------------- every other Trainer recipe


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory, corpus) -> dict[str, list[str]]:
    """Each Trainer recipe's data and smallest model flags: images, code/docstring pairs, a tiny GPT-2 to adapt."""
    import numpy as np
    from PIL import Image
    from transformers import GPT2Config, GPT2LMHeadModel

    from damcha_hf.data import byte_level_tokenizer

    root = tmp_path_factory.mktemp("recipe-data")
    rng = np.random.default_rng(0)
    for label, level in (("dark", 40), ("bright", 210)):
        (root / "images" / label).mkdir(parents=True)
        for i in range(12):
            pixels = np.clip(rng.normal(level, 20, (8, 8)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / "images" / label / f"{i}.png")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"source": f"def f{i}(x, y={i})", "target": f"Return x plus {i} times y.",
                                         "document": f"module{i % 10}.py"}) + "\n" for i in range(40)))  # fmt: skip
    torch.manual_seed(0)
    base = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=256,
                               eos_token_id=256, pad_token_id=256)).save_pretrained(base)  # fmt: skip
    byte_level_tokenizer().save_pretrained(base)
    vit = ["--data", str(root / "images"), "--image-size", "8", "--patch-size", "2", "--hidden-size", "16",
           "--num-layers", "1", "--num-heads", "2", "--metric-hidden-size", "4", "--no-augment"]  # fmt: skip
    shared = ["--batch-size", "4", "--max-eval-samples", "4", "--logging-steps", "1", "--num-threads", "1"]
    return {
        "train_vit": [*vit, *shared],
        "train_diffusion": [*vit, *shared, "--num-samples", "4", "--sample-steps", "2", "--num-train-timesteps", "20"],
        "train_bart": ["--data", str(pairs), "--d-model", "32", "--layers", "1", "--heads", "2", "--ffn-dim", "64",
                       "--bpe-vocab-size", "300", "--max-source-length", "32", "--max-target-length", "12", *shared],
        "finetune_lora": ["--base", str(base), "--data", str(corpus), "--block-size", "32", "--lora-rank", "4", *shared],
    }  # fmt: skip


@pytest.mark.parametrize("name", [
    pytest.param("train_vit", marks=pytest.mark.slow),  # about 8 s each, and the same shared code as the others
    "train_diffusion",
    pytest.param("train_bart", marks=pytest.mark.slow),
    "finetune_lora",
])  # fmt: skip
def test_every_trainer_recipe_overwrites_and_resumes_through_the_shared_run(name, recipe_data, tmp_path):
    recipe = load_recipe(name)
    run = tmp_path / "run"
    argv = [*recipe_data[name], "--output-dir", str(run), "--save-steps", "1"]
    recipe.main([*argv, "--max-steps", "2", "--seed", "1"])
    run_a_id = run_id(run)
    assert stamp(run / "checkpoint-1") == stamp(run / "checkpoint-2") == run_a_id
    a_results = {path.name for path in run.iterdir()} - {RUN_RECORD_FILE, "checkpoint-1", "checkpoint-2"}

    recipe.main([*argv, "--max-steps", "1", "--overwrite-output-dir", "--seed", "2"])
    assert not (run / "checkpoint-2").exists()  # A's last checkpoint, which --resume would have taken
    assert {path.name for path in run.iterdir()} == {RUN_RECORD_FILE, "checkpoint-1"} | a_results
    run_b_id = run_id(run)
    assert run_b_id != run_a_id and stamp(run / "checkpoint-1") == run_b_id
    if name == "finetune_lora":  # the adapter is the run's too
        assert stamp(run / "adapter") == run_b_id

    result = recipe.main([*argv, "--max-steps", "2", "--resume"])
    assert result["resumed_from"] == str(run / "checkpoint-1") and result["global_step"] == 2
    assert trainer_state(run / "checkpoint-2")["global_step"] == 2 and stamp(run / "checkpoint-2") == run_b_id
