"""Run folders and checkpoints that nothing can wreck: files owned by what a save recorded, saves that survive a
kill, one run per folder, damaged inputs named in one line, resumes that check their state, output paths checked
while parsing."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import (
    RECIPE_NAMES,
    TINY_RECIPE_ARGS,
    USER_BYTES,
    dead_pid,
    load_recipe,
    one_error_line,
    snapshot,
    tiny_lm,
)
from huggingface_hub import HfApi

from damcha_hf import hub
from damcha_hf.cli import main as cli_main
from damcha_hf.hub.push import without_secret
from damcha_hf.safe_files import SAVE_RECORD_FILE, CorruptFileError, UnsafeOutputError, check_checkpoint_folder

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def exit_code_and_line(argv, capsys) -> tuple[int, str]:
    try:
        code = cli_main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, one_error_line(capsys.readouterr().err)


def recipe_refusal(name: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        load_recipe(name).parse_args(argv)
    assert exit_info.value.code == 2
    return one_error_line(capsys.readouterr().err)


def start_run(argv: list[str], name: str = "train_gpt2"):
    """Parse as a run of the recipe does (locking --output-dir and finishing what a killed save left), then end it."""
    recipe = load_recipe(name)
    return recipe.run_folder.holding_run_folder(recipe.parse_args)(argv)


def base_argument(name: str, tmp_path: Path) -> list[str]:
    if name != "finetune_lora":
        return []
    base = tmp_path / "lora-base"
    if not base.exists():
        tiny_lm().save_pretrained(base)
    return ["--base", str(base)]


# --------------------------------------------------------------------------------- ownership by record (item 1)


USER_FILES = ("my_embeddings.safetensors", "my_notes.safetensors.index.json", "vocab.txt",
              "model-00001-of-00009.safetensors")  # fmt: skip


def test_replacing_a_checkpoint_removes_only_the_files_its_save_recorded(tmp_path):
    folder = hub.save_hub_checkpoint(tiny_lm(), tmp_path / "ow", metric_heatmap=False)
    recorded = json.loads((folder / SAVE_RECORD_FILE).read_text())["files"]
    assert sorted(recorded) == sorted(path.name for path in folder.iterdir() if path.name != SAVE_RECORD_FILE)
    for name in USER_FILES:
        (folder / name).write_bytes(USER_BYTES)
    before = snapshot(folder)
    with pytest.raises(UnsafeOutputError) as error:
        hub.save_hub_checkpoint(tiny_lm(n_layer=1), folder, overwrite=True, metric_heatmap=False)
    for name in USER_FILES:
        assert name in str(error.value)
    assert snapshot(folder) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ow"]

    for name in USER_FILES:  # moved away: the earlier save is replaced
        (folder / name).unlink()
    hub.save_hub_checkpoint(tiny_lm(n_layer=1), folder, overwrite=True, metric_heatmap=False)
    assert json.loads((folder / "config.json").read_text())["n_layer"] == 1


def test_a_checkpoint_saved_without_a_record_is_never_replaced(tmp_path):
    folder = tmp_path / "older"
    tiny_lm().save_pretrained(folder)  # what `save_pretrained` or a damcha-hf before the record leaves
    before = snapshot(folder)
    with pytest.raises(UnsafeOutputError, match=re.escape(SAVE_RECORD_FILE) + ".*move it away"):
        hub.save_hub_checkpoint(tiny_lm(), folder, overwrite=True, metric_heatmap=False)
    assert snapshot(folder) == before


def test_demo_refuses_an_earlier_demo_folder_holding_user_files(tmp_path, capsys):
    folder = hub.save_hub_checkpoint(
        tiny_lm(), tmp_path / "ow", metric_heatmap=False, extra_files={"demo_results.json": "{}"}
    )
    for name in ("my_embeddings.safetensors", "my_notes.safetensors.index.json", "vocab.txt"):
        (folder / name).write_bytes(USER_BYTES)
    before = snapshot(folder)
    capsys.readouterr()
    code, line = exit_code_and_line(["demo", "--output-dir", str(folder), "--max-steps", "1"], capsys)
    assert code == 2
    for name in ("my_embeddings.safetensors", "my_notes.safetensors.index.json", "vocab.txt"):
        assert name in line
    assert snapshot(folder) == before


def test_push_uploads_the_weights_by_their_exact_names_only(tmp_path):
    folder = hub.save_hub_checkpoint(tiny_lm(), tmp_path / "ckpt", metric_heatmap=False)
    for name in (".hidden.safetensors", "my_embeddings.safetensors", "model-00001-of-00009.safetensors"):
        shutil.copy(folder / "model.safetensors", folder / name)
    plan = hub.upload_plan(folder)
    assert [name for name in plan if "safetensors" in name] == ["model.safetensors"]
    assert SAVE_RECORD_FILE not in plan

    sharded = tmp_path / "sharded"
    tiny_lm().save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (sharded / "model-00099-of-00099.safetensors").write_bytes(USER_BYTES)  # not in the index: not the model's
    uploaded = [name for name in hub.upload_plan(sharded) if "safetensors" in name]
    assert uploaded == ["model.safetensors.index.json", *shards]


# -------------------------------------------------------------------------------- interrupted saves (item 2)


def leftover(parent: Path, target: str, kind: str, pid: int) -> Path:
    return parent / f".{target}.{kind}-{pid}-0123abcd"


def saved(folder: Path, n_layer: int) -> Path:
    return hub.save_hub_checkpoint(tiny_lm(n_layer=n_layer), folder, metric_heatmap=False)


@pytest.fixture
def old_and_new(tmp_path) -> tuple[Path, Path]:
    """Two complete checkpoints: what `final/` held (1 layer) and what the interrupted save wrote (2 layers)."""
    return saved(tmp_path / "old-checkpoint", 1), saved(tmp_path / "new-checkpoint", 2)


def run_folder_with(tmp_path: Path, old_and_new, state: str) -> Path:
    """A recipe's run folder as a save of `final/` leaves it when killed at `state`."""
    run = tmp_path / "run"
    run.mkdir()
    old, new = old_and_new
    pid = dead_pid()
    (run / "eval_results.json").write_text("{}")
    (run / f".eval_results.json.tmp-{pid}-0123abcd").write_text('{"eval_lo')  # a half-written result
    if state == "while writing the new checkpoint":
        shutil.copytree(old, run / "final")
        partial = leftover(run, "final", "tmp", pid)
        partial.mkdir()
        (partial / "model.safetensors").write_bytes((new / "model.safetensors").read_bytes()[:100])
    elif state == "before the first rename":
        shutil.copytree(old, run / "final")
        shutil.copytree(new, leftover(run, "final", "tmp", pid))
    elif state == "between the two renames":
        shutil.copytree(old, leftover(run, "final", "old", pid))
        shutil.copytree(new, leftover(run, "final", "tmp", pid))
    elif state == "while deleting the old checkpoint":
        shutil.copytree(new, run / "final")
        half_deleted = leftover(run, "final", "old", pid)
        shutil.copytree(old, half_deleted)
        (half_deleted / "model.safetensors").unlink()
    return run


KILL_STATES = ("while writing the new checkpoint", "before the first rename", "between the two renames",
               "while deleting the old checkpoint")  # fmt: skip


@pytest.mark.parametrize("state", KILL_STATES)
@pytest.mark.parametrize("flag", ["--overwrite-output-dir", "--resume"])
def test_a_run_folder_left_by_a_killed_save_works_at_the_next_start(tmp_path, old_and_new, state, flag, capsys):
    run = run_folder_with(tmp_path, old_and_new, state)
    old, new = old_and_new
    capsys.readouterr()
    start_run(["--output-dir", str(run), flag])
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "interrupted" in said[0], said
    assert sorted(path.name for path in run.iterdir()) == ["eval_results.json", "final"]
    # A save cut short leaves what was there before it; one that had finished the swap leaves the new checkpoint.
    expected = new if state == "while deleting the old checkpoint" else old
    assert snapshot(run / "final") == snapshot(expected)


def test_a_demo_folder_left_by_a_killed_save_is_restored_and_a_save_in_progress_left_alone(tmp_path, old_and_new):
    old, new = old_and_new
    dead = dead_pid()
    shutil.copytree(old, leftover(tmp_path, "demo", "old", dead))
    shutil.copytree(new, leftover(tmp_path, "demo", "tmp", dead))
    running = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        in_progress = leftover(tmp_path, "demo", "tmp", running.pid)
        shutil.copytree(new, in_progress)
        check_checkpoint_folder(tmp_path / "demo", argument="--output-dir")
        assert snapshot(tmp_path / "demo") == snapshot(old)
        assert in_progress.is_dir()  # another process's save is not touched
        assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
            ["demo", in_progress.name, "new-checkpoint", "old-checkpoint"]
        )
    finally:
        running.communicate(b"")


KILLED_SAVE = textwrap.dedent(
    """
    import os, shutil, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import tiny_damcha_gpt2_config
    import damcha_hf
    from damcha_hf.hub import save_hub_checkpoint

    point = {point!r}
    replace, rmtree = os.replace, shutil.rmtree

    def killing_replace(source, destination):
        if point == "before the first rename" and ".old-" in str(destination):
            os.kill(os.getpid(), signal.SIGKILL)
        replace(source, destination)
        if point == "between the two renames" and ".old-" in str(destination):
            os.kill(os.getpid(), signal.SIGKILL)

    def killing_rmtree(path, *args, **kwargs):
        if ".old-" in str(path):
            os.remove(os.path.join(path, "config.json"))
            os.kill(os.getpid(), signal.SIGKILL)
        rmtree(path, *args, **kwargs)

    os.replace, shutil.rmtree = killing_replace, killing_rmtree
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(n_layer=2))
    save_hub_checkpoint(model, {final!r}, overwrite=True, metric_heatmap=False)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before the first rename", "between the two renames", "while deleting the old"])
def test_a_save_killed_by_sigkill_is_recovered_by_the_next_run(tmp_path, point, capsys):
    run = tmp_path / "run"
    old = saved(run / "final", 1)
    before = snapshot(old)
    script = KILLED_SAVE.format(tests=str(REPO / "tests"), point=point, final=str(run / "final"))
    env = {**os.environ, "USE_HUB_KERNELS": "0", "HF_HUB_OFFLINE": "1"}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert any(path.name.startswith(".final.") for path in run.iterdir())
    capsys.readouterr()
    start_run(["--output-dir", str(run), "--overwrite-output-dir"])
    assert "interrupted" in one_error_line(capsys.readouterr().err)
    assert sorted(path.name for path in run.iterdir()) == ["final"]
    layers = json.loads((run / "final" / "config.json").read_text())["n_layer"]
    if point == "while deleting the old":
        assert layers == 2  # the new checkpoint was in place
    else:
        assert snapshot(run / "final") == before


# ---------------------------------------------------------------------------------- one run per folder (item 3)


HOLD_FOLDER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {recipes!r})
    import train_gpt2

    def run(argv):
        train_gpt2.parse_args(argv)
        print("holding", flush=True)
        sys.stdin.read()

    train_gpt2.run_folder.holding_run_folder(run)(["--output-dir", {output!r}, "--overwrite-output-dir"])
    """
)


def test_a_second_run_on_a_folder_is_refused_naming_the_first(tmp_path, capsys):
    output = tmp_path / "shared"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_FOLDER.format(recipes=str(RECIPES), output=str(output))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "holding"
        for flag in ("--overwrite-output-dir", "--resume"):
            line = recipe_refusal("train_gpt2", ["--output-dir", str(output), flag, "--seed", "1"], capsys)
            assert f"in use by another run (process {first.pid}" in line
            with pytest.raises(SystemExit) as exit_info:  # as a run: its lock is refused
                start_run(["--output-dir", str(output), flag, "--seed", "1"])
            assert exit_info.value.code == 2
            assert f"in use by another run (process {first.pid}" in one_error_line(capsys.readouterr().err)
    finally:
        first.communicate("")
    assert not output.exists()  # the first run made the folder for its lock only, and removed both
    start_run(["--output-dir", str(output)])  # free again
    assert not output.exists()


def test_a_killed_run_leaves_its_folder_free(tmp_path):
    output = tmp_path / "shared"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_FOLDER.format(recipes=str(RECIPES), output=str(output))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert first.stdout.readline().strip() == "holding"
    first.kill()
    first.wait()
    assert (output / ".damcha-hf-run.lock").is_file()  # left by the kill, but no longer locked by anyone
    start_run(["--output-dir", str(output)])
    assert list(output.iterdir()) == []  # the stale lock file is gone; the folder the killed run made stays, empty


# ------------------------------------------------------------------------------ damaged inputs (items 4 and 8)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture
def damaged(tmp_path) -> dict[str, Path]:
    """A checkpoint with a truncated model.safetensors, and one whose weights do not fit its config."""
    truncated = saved(tmp_path / "truncated", 1)
    truncate(truncated / "model.safetensors")
    mismatched = saved(tmp_path / "mismatched", 1)
    config = json.loads((mismatched / "config.json").read_text())
    config["vocab_size"] += 3
    (mismatched / "config.json").write_text(json.dumps(config))
    garbage = saved(tmp_path / "garbage", 1)
    (garbage / "model.safetensors").write_bytes(os.urandom(4096))
    return {"truncated": truncated, "mismatched": mismatched, "garbage": garbage}


def test_inspect_and_info_name_a_damaged_checkpoint_in_one_line(damaged, tmp_path, capsys):
    capsys.readouterr()
    for kind, expected in (("truncated", "truncated safetensors"), ("garbage", "not a safetensors file")):
        weights = damaged[kind] / "model.safetensors"
        for argv in (
            ["inspect", str(damaged[kind]), "--output", str(tmp_path / "c.png")],
            ["info", str(damaged[kind])],
        ):
            code, line = exit_code_and_line(argv, capsys)
            assert code == 2 and str(weights) in line and expected in line, line
    code, line = exit_code_and_line(
        ["inspect", str(damaged["mismatched"]), "--output", str(tmp_path / "c.png")], capsys
    )
    assert code == 2
    assert "model.safetensors" in line and "transformer.wte.weight has shape [97, 32] in the file, [100, 32]" in line
    assert not (tmp_path / "c.png").exists()


def test_init_from_and_base_name_a_damaged_checkpoint_in_one_line(damaged, tmp_path, capsys):
    for name, flag in (("train_gpt2", "--init-from"), ("finetune_lora", "--base")):
        line = recipe_refusal(name, [flag, str(damaged["truncated"]), "--output-dir", str(tmp_path / name)], capsys)
        assert str(damaged["truncated"] / "model.safetensors") in line and "truncated" in line
    with pytest.raises(CorruptFileError, match="transformer.wte.weight has shape"):
        load_recipe("train_gpt2").build_model(
            load_recipe("train_gpt2").parse_args(
                ["--init-from", str(damaged["mismatched"]), "--output-dir", str(tmp_path / "m")]
            ),
            None,
        )


@pytest.mark.usefixtures("online")
def test_push_names_a_damaged_config_or_weight_file(damaged, tmp_path, capsys):
    broken = saved(tmp_path / "broken-config", 1)
    (broken / "config.json").write_text('{"model_type": "damcha_gpt2", ')
    capsys.readouterr()
    for folder, expected in ((broken, "config.json"), (damaged["truncated"], "model.safetensors")):
        code, line = exit_code_and_line(["push", str(folder), "someone/x", "--token", "hf_x"], capsys)
        assert code == 2 and str(folder / expected) in line, line


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A tiny train_gpt2 run with checkpoints at steps 1 and 2."""
    folder = tmp_path_factory.mktemp("trained")
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    run = folder / "run"
    recipe = load_recipe("train_gpt2")
    args_run = [
        "--data",
        str(corpus),
        *TINY_RECIPE_ARGS,
        "--output-dir",
        str(run),
        "--max-steps",
        "2",
        "--save-steps",
        "1",
    ]
    recipe.main(args_run)
    return run


def copy_of(run: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".damcha-hf-run.lock"))
    corpus = run.parent / "corpus.txt"
    return copy, ["--data", str(corpus), *TINY_RECIPE_ARGS, "--output-dir", str(copy), "--save-steps", "1"]


@pytest.mark.parametrize(
    ("name", "damage", "expected"),
    [
        ("optimizer.pt", "garbage", "not a readable optimizer state file"),
        ("optimizer.pt", "truncate", "not a readable optimizer state file"),
        ("rng_state.pth", "truncate", "not a readable random number generator state file"),
        ("scheduler.pt", "garbage", "not a readable learning-rate schedule file"),
        ("model.safetensors", "truncate", "truncated safetensors"),
        ("trainer_state.json", "garbage", "not the training state"),
    ],
)
def test_resume_names_a_damaged_state_file(trained_run, tmp_path, name, damage, expected):
    run, argv = copy_of(trained_run, tmp_path)
    path = run / "checkpoint-2" / name
    if damage == "truncate":
        truncate(path)
    else:
        path.write_bytes(os.urandom(2048))
    with pytest.raises(ValueError) as error:
        load_recipe("train_gpt2").main([*argv, "--resume", "--max-steps", "3"])
    assert str(path) in str(error.value) and expected in str(error.value)
    assert not (run / "checkpoint-3").exists()


def test_resume_refuses_missing_optimizer_state_unless_told_to_use_the_weights_alone(trained_run, tmp_path, capsys):
    run, argv = copy_of(trained_run, tmp_path)
    for name in ("optimizer.pt", "scheduler.pt"):
        (run / "checkpoint-2" / name).unlink()
    recipe = load_recipe("train_gpt2")
    with pytest.raises(ValueError) as error:
        recipe.main([*argv, "--resume", "--max-steps", "3"])
    message = str(error.value)
    assert "optimizer.pt (optimizer state) is missing" in message and "scheduler.pt" in message
    assert "--resume-weights-only" in message
    assert not (run / "checkpoint-3").exists()
    result = recipe.main([*argv, "--resume", "--resume-weights-only", "--max-steps", "3"])
    assert result["global_step"] == 3 and result["resumed_from"].endswith("checkpoint-2")
    assert "--resume-weights-only: continuing from the weights" in capsys.readouterr().out


def test_resume_refuses_a_tokenizer_other_than_the_checkpoints(trained_run, tmp_path):
    run, argv = copy_of(trained_run, tmp_path)
    with pytest.raises(ValueError, match="trained with the byte-level tokenizer, not --tokenizer bpe"):
        load_recipe("train_gpt2").main([*argv, "--resume", "--tokenizer", "bpe", "--max-steps", "3"])
    assert not (run / "checkpoint-3").exists()


# ------------------------------------------------------------------------------- output paths (item 7)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipes_refuse_output_paths_that_cannot_be_written_or_are_the_current_folder(name, tmp_path, capsys,
                                                                                       monkeypatch):  # fmt: skip
    extra = base_argument(name, tmp_path)
    capsys.readouterr()
    line = recipe_refusal(name, ["--output-dir", "/etc/passwd/x", *extra], capsys)
    assert "/etc/passwd is a file, not a folder" in line
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for output in (".", "..", str(work)):
        line = recipe_refusal(name, ["--output-dir", output, *extra], capsys)
        assert "current folder, one of its parents or the home folder" in line
    assert sorted(work.iterdir()) == []


def test_demo_and_inspect_refuse_output_paths_under_a_file(tmp_path, capsys):
    checkpoint = saved(tmp_path / "ckpt", 1)
    capsys.readouterr()
    for argv in (["demo", "--output-dir", "/etc/passwd/x"],
                 ["inspect", str(checkpoint), "--output", "/etc/passwd/x.png"]):  # fmt: skip
        code, line = exit_code_and_line(argv, capsys)
        assert code == 2 and "/etc/passwd is a file, not a folder" in line, line


# ---------------------------------------------------------------------------------------- smaller (item 8)


def test_any_long_piece_of_the_token_is_masked():
    token = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123"
    message = f"401 for token {token[:-4]}, header {token[6:20]}; user alice; repo someone/model-1234"
    masked = without_secret(message, token)
    assert masked == "401 for token <token>, header <token>; user alice; repo someone/model-1234"
    for start in range(len(token) - 8):
        assert token[start : start + 8] not in masked


@pytest.mark.usefixtures("online")
def test_push_error_masks_a_token_cut_short(tmp_path, monkeypatch, capsys):
    token = "hf_SECRETsecretSECRET1234"

    def unauthorized(self, *args, **kwargs):
        raise PermissionError(f"401 Unauthorized: invalid token {token[:-4]}")

    monkeypatch.setattr(HfApi, "create_repo", unauthorized)
    folder = saved(tmp_path / "ckpt", 1)
    capsys.readouterr()
    code, line = exit_code_and_line(["push", str(folder), "someone/tiny", "--token", token], capsys)
    assert code == 2 and "<token>" in line and token[:-4] not in line and token[4:12] not in line


def test_data_that_is_not_text_is_refused_while_parsing(tmp_path, capsys):
    random_bytes = tmp_path / "random.bin"
    random_bytes.write_bytes(os.urandom(20000).replace(b"\0", b"\1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [
        (os.path.realpath(sys.executable), "not a text file (it holds NUL bytes"),
        (str(random_bytes), "of its first bytes are not UTF-8"),
        ("/dev/null", "not a regular file or folder"),
        (str(empty), "is empty"),
    ]
    for data, expected in cases:
        line = recipe_refusal("train_gpt2", ["--data", data, "--output-dir", str(tmp_path / "o")], capsys)
        assert expected in line and "does not exist" not in line, line
        code, line = exit_code_and_line(["demo", "--data", data, "--output-dir", str(tmp_path / "d")], capsys)
        assert code == 2 and expected in line, line
    assert not (tmp_path / "o").exists() and not (tmp_path / "d").exists()


def test_accelerate_resume_checks_its_state_and_can_continue_from_the_weights_alone(trained_run, tmp_path, capsys):
    recipe = load_recipe("train_gpt2_accelerate")
    run = tmp_path / "accelerate"
    corpus = trained_run.parent / "corpus.txt"
    argv = ["--data", str(corpus), *TINY_RECIPE_ARGS, "--output-dir", str(run), "--max-steps", "2", "--save-steps", "2"]
    recipe.main(argv)
    trained_checksum = (run / "parameter_sha256_rank0.txt").read_text()
    (run / "checkpoint-2" / "optimizer.bin").unlink()
    with pytest.raises(ValueError, match=r"optimizer\.bin \(optimizer state\) is missing.*--resume-weights-only"):
        recipe.main([*argv, "--resume"])
    # From the weights alone, with no step left to train: the model is the checkpoint's, parameter for parameter.
    (run / "parameter_sha256_rank0.txt").unlink()
    result = recipe.main([*argv, "--resume", "--resume-weights-only"])
    assert result["global_step"] == 2
    assert (run / "parameter_sha256_rank0.txt").read_text() == trained_checksum


HOLD_DEMO_FOLDER = textwrap.dedent(
    """
    import sys
    from damcha_hf.safe_files.atomic_files import hold_lock
    hold_lock({lock!r}, what="demo")
    print("holding", flush=True)
    sys.stdin.read()
    """
)


def test_a_second_demo_on_a_folder_is_refused_naming_the_first(tmp_path, capsys):
    output = tmp_path / "ow"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_DEMO_FOLDER.format(lock=str(tmp_path / ".ow.lock"))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "holding"
        code, line = exit_code_and_line(["demo", "--output-dir", str(output), "--max-steps", "1"], capsys)
        assert code == 2 and f"in use by another run (process {first.pid}" in line, line
    finally:
        first.communicate("")
    assert sorted(path.name for path in tmp_path.iterdir()) == []
