"""Two processes saving a checkpoint into one folder: the second waits for the first (or, without `overwrite`, then
refuses in one line), the folder ends as one complete checkpoint, and nothing is left beside it.

The processes are forked from the test, so they start without importing torch again and share its tiny models.
"""

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from conftest import randomize_cross_head, tiny_damcha_gpt2_config
from safetensors.torch import load_file

import damcha_hf
from damcha_hf.hub import save_hub_checkpoint
from damcha_hf.safe_files import SAVE_RECORD_FILE, UnsafeOutputError, check_run_folder, recover_interrupted_saves
from damcha_hf.safe_files.atomic_files import save_lock_file, wait_for_lock

FORK = multiprocessing.get_context("fork")
# How long a step may take before the test gives up: a failure's bound, never a measured figure.
PATIENCE_SECONDS = 120


@pytest.fixture
def processes():
    """Forked processes, ended at the end of the test whatever happens (a failed test leaves none waiting)."""
    started = []

    def start(**kwargs):
        kwargs["args"][2].touch()  # the log, there to be read from the start
        process = FORK.Process(target=save_in_child, daemon=True, **kwargs)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.is_alive():
            process.kill()
        process.join()


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(n_layer=1))
    randomize_cross_head(model, seed=seed)
    return model


def save_in_child(model, target: Path, log: Path, overwrite: bool, rounds: int = 1, start=None, pause: Path = None):
    """Runs in a forked process: its output goes to `log`; an error is written there as `Type: message`, exit code 2.
    With `pause`, the save stops where it has moved the old folder aside and not yet put the new one in place (the
    moment a concurrent save would break it), touches `pause/paused` and goes on once `pause/resume` exists."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # pytest's capture would keep what they print
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()  # the log holds what the save says, nothing else
    if pause is not None:
        rename = os.replace

        def pausing_rename(source, destination):
            if Path(source).name.startswith(f".{target.name}.tmp-") and Path(destination) == target:
                (pause / "paused").touch()
                deadline = time.monotonic() + PATIENCE_SECONDS
                while not (pause / "resume").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            rename(source, destination)

        os.replace = pausing_rename
    if start is not None:
        start.wait()
    try:
        for _ in range(rounds):
            save_hub_checkpoint(model, target, overwrite=overwrite, metric_heatmap=False)
    except Exception as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def wait_until(condition, what: str, processes=()):
    deadline = time.monotonic() + PATIENCE_SECONDS
    while not condition():
        finished = [process for process in processes if not process.is_alive()]
        assert not finished, f"a process ended (exit code {finished[0].exitcode}) before {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def assert_one_complete_checkpoint_of(folder: Path, model) -> None:
    """`folder` holds exactly the files its save record lists, and its weights are `model`'s."""
    recorded = json.loads((folder / SAVE_RECORD_FILE).read_text())["files"]
    present = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    assert present == sorted([*recorded, SAVE_RECORD_FILE])
    saved = load_file(folder / "model.safetensors")
    expected = model.state_dict()
    assert saved and all(torch.equal(tensor, expected[name]) for name, tensor in saved.items())


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_second_save_waits_for_the_first_then_replaces_or_refuses(tmp_path, processes, overwrite):
    place, signals = tmp_path / "place", tmp_path / "signals"
    place.mkdir()
    signals.mkdir()
    target = place / "ck"
    first, second = tiny_model(1), tiny_model(2)
    save_hub_checkpoint(tiny_model(0), target, metric_heatmap=False)  # an earlier save: the first one replaces it

    saving = processes(args=(first, target, signals / "first.log", True), kwargs={"pause": signals})
    wait_until(lambda: (signals / "paused").exists(), "the first save moved the old folder aside", [saving])
    assert not target.exists() and save_lock_file(target).exists()
    waiting = processes(args=(second, target, signals / "second.log", overwrite))
    wait_until(lambda: "waiting for it to finish" in (signals / "second.log").read_text(), "the second save to wait",
               [saving, waiting])  # fmt: skip
    (signals / "resume").touch()
    for process in (saving, waiting):
        process.join(PATIENCE_SECONDS)

    second_log = (signals / "second.log").read_text().splitlines()
    assert saving.exitcode == 0, (signals / "first.log").read_text()
    assert (
        second_log[0]
        == f"save_hub_checkpoint folder {target}: process {saving.pid} is writing it; waiting for it to finish"
    )
    if overwrite:
        assert waiting.exitcode == 0 and len(second_log) == 1, second_log
        assert_one_complete_checkpoint_of(target, second)
    else:
        assert waiting.exitcode == 2 and len(second_log) == 2, second_log
        assert second_log[1] == (
            f"UnsafeOutputError: save_hub_checkpoint folder {target} already holds a damcha-hf checkpoint; pass "
            "overwrite=True to replace it, or choose a new folder."
        )
        assert_one_complete_checkpoint_of(target, first)
    assert sorted(os.listdir(place)) == ["ck"]  # no lock file, no staging or moved-aside folder


def test_two_processes_racing_to_save_leave_one_complete_checkpoint(tmp_path, processes):
    place = tmp_path / "place"
    place.mkdir()
    target = place / "ck"
    models = [tiny_model(1), tiny_model(2)]
    start = FORK.Barrier(2)
    racers = [
        processes(args=(model, target, tmp_path / f"{index}.log", True), kwargs={"rounds": 4, "start": start})
        for index, model in enumerate(models)
    ]
    for racer in racers:
        racer.join(PATIENCE_SECONDS)
    for index, racer in enumerate(racers):
        log = (tmp_path / f"{index}.log").read_text()
        assert racer.exitcode == 0 and "Error" not in log, log
    saved = load_file(target / "model.safetensors")
    last = next(model for model in models if torch.equal(saved["transformer.wte.weight"], model.transformer.wte.weight))
    assert_one_complete_checkpoint_of(target, last)
    assert sorted(os.listdir(place)) == ["ck"]


def hold_the_save_lock_and_die(target: Path) -> None:
    wait_for_lock(save_lock_file(target), what="a save that is killed")
    os._exit(9)  # as a kill would: no release, the kernel drops the lock and the file stays


def test_the_lock_file_a_killed_save_left_is_taken_over_and_removed(tmp_path, capfd):
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    target = run_folder / "final"
    killed = FORK.Process(target=hold_the_save_lock_and_die, args=(target,))
    killed.start()
    killed.join(PATIENCE_SECONDS)
    assert killed.exitcode == 9 and save_lock_file(target).exists()
    # The recipe that owns the run folder counts the leftover lock of its `final` folder as its own ...
    check_run_folder(run_folder, written=["final", "checkpoint-*"], checkpoints=["final"])
    (run_folder / ".notes.damcha-hf-save.lock").write_text("a lock of nothing the recipe writes")
    with pytest.raises(
        UnsafeOutputError, match=r"holds files this recipe did not write \(\.notes\.damcha-hf-save\.lock\)"
    ):
        check_run_folder(run_folder, written=["final", "checkpoint-*"], checkpoints=["final"])
    # ... and the next save into `final` takes the lock over without waiting, and removes it when done.
    model = tiny_model(3)
    save_hub_checkpoint(model, target, metric_heatmap=False)
    assert "waiting" not in capfd.readouterr().err
    assert_one_complete_checkpoint_of(target, model)
    assert sorted(os.listdir(run_folder)) == [".notes.damcha-hf-save.lock", "final"]


def test_the_next_start_removes_a_killed_saves_lock_file_and_leaves_a_held_one(tmp_path, capfd):
    target = tmp_path / "final"
    killed = FORK.Process(target=hold_the_save_lock_and_die, args=(target,))
    killed.start()
    killed.join(PATIENCE_SECONDS)
    assert killed.exitcode == 9 and save_lock_file(target).exists()
    held = wait_for_lock(save_lock_file(tmp_path / "busy"), what="a save in progress")
    try:
        message = recover_interrupted_saves(tmp_path, lambda name: name in ("final", "busy"))
        assert message == (
            f"{tmp_path}: an earlier save was interrupted; removed the lock files it held (.final.damcha-hf-save.lock)"
        )
        assert capfd.readouterr().err == message + "\n"
        assert sorted(os.listdir(tmp_path)) == [".busy.damcha-hf-save.lock"]  # a save in progress keeps its lock
    finally:
        held.release()
    assert os.listdir(tmp_path) == []
