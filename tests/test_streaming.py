"""--streaming: blocks tokenized and packed on the fly, each process of the Accelerate recipe reading its own share
(`split_dataset_by_node`), and a resume that skips what was seen. The corpus is a local parquet file of documents of
exactly one block each (31 bytes + end-of-text with the byte-level tokenizer), so that one process with a batch of 8
sees the same blocks in each step as two processes with 4 each: their losses must agree to float32 rounding."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RECIPES_FOLDER, load_recipe, write_rows

BLOCK_SIZE = 32
MODEL_FLAGS = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", str(BLOCK_SIZE),
               "--metric-hidden-size", "8", "--learning-rate", "3e-3", "--logging-steps", "1",
               "--max-eval-samples", "8", "--num-threads", "1"]  # fmt: skip
# One process and two differ only in the order float32 sums are taken (a batch's mean over 8 blocks, against the mean
# of two means over 4, and the gradients' all-reduce): each such sum is exact to about one unit in the last place
# (float32's epsilon, relative), and 8 steps of training carry it forward without amplifying it much. 32 epsilons
# (3.8e-6) leaves room for that; one measured run differed by 1e-7, one unit at these losses. Overlapping or missing
# shares would change the batches and the losses by far more.
FLOAT32_ORDER_TOLERANCE = 32 * torch.finfo(torch.float32).eps


def one_block_documents(count: int, seed: int) -> list[str]:
    """Documents of BLOCK_SIZE - 1 letters: with the end-of-text token each is exactly one block."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefgh "))
    return ["".join(rng.choice(letters, BLOCK_SIZE - 1)) for _ in range(count)]


@pytest.fixture(scope="module")
def stream_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    train = write_rows(folder / "train.parquet", [{"body": text} for text in one_block_documents(48, seed=1)])
    validation = write_rows(folder / "validation.parquet", [{"body": text} for text in one_block_documents(8, seed=2)])
    return ["--train-file", train, "--validation-file", validation, "--text-column-name", "body", "--streaming"]


def run_accelerate(args, *, processes: int = 1, timeout: int = 400):
    if processes == 1:
        launcher = [sys.executable]
    else:
        launcher = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                    os.path.join(RECIPES_FOLDER, "accelerate_configs", "cpu_ddp_2proc.yaml"),
                    "--main_process_port", str(29600 + os.getpid() % 1000)]  # fmt: skip
    command = [*launcher, os.path.join(RECIPES_FOLDER, "train_gpt2_accelerate.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def loop_state(folder) -> dict:
    return json.loads((Path(folder) / "loop_state.json").read_text())


def train_losses(log_history) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry}


def eval_losses(log_history) -> dict[int, float]:
    return {entry["step"]: entry["eval_loss"] for entry in log_history if "eval_loss" in entry}


def test_a_streamed_accelerate_run_resumes_where_it_stopped(tmp_path, stream_files):
    # 48 blocks, 8 a step: a pass over the stream is 6 steps, so step 8 is 2 steps into the second pass.
    flags = [*stream_files, *MODEL_FLAGS, "--batch-size", "8", "--max-steps", "8", "--save-steps", "4",
             "--eval-steps", "4"]  # fmt: skip
    run_accelerate([*flags, "--output-dir", str(tmp_path / "full")])
    assert loop_state(tmp_path / "full" / "checkpoint-4")["stream_positions"] == [{"pass": 0, "blocks": 32}]
    full = loop_state(tmp_path / "full" / "checkpoint-8")
    assert full["stream_positions"] == [{"pass": 1, "blocks": 16}]
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    completed = run_accelerate([*flags, "--output-dir", str(tmp_path / "resumed"), "--resume"])
    assert "at step 4" in completed.stdout
    resumed = loop_state(tmp_path / "resumed" / "checkpoint-8")
    assert resumed["stream_positions"] == full["stream_positions"]
    expected = train_losses(full["log_history"])
    assert {step: train_losses(resumed["log_history"])[step] for step in range(5, 9)} == pytest.approx(
        {step: expected[step] for step in range(5, 9)}, rel=1e-6
    )
    assert (tmp_path / "resumed" / "parameter_sha256_rank0.txt").read_text() == (
        tmp_path / "full" / "parameter_sha256_rank0.txt"
    ).read_text()


def test_a_resume_refuses_a_checkpoint_of_a_run_that_did_not_stream(tmp_path, stream_files):
    flags = [*stream_files[:-1], *MODEL_FLAGS, "--batch-size", "8", "--max-steps", "2"]
    run_accelerate([*flags, "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="not trained with --streaming"):
        load_recipe("train_gpt2_accelerate").main([*flags, "--streaming", "--max-steps", "4", "--output-dir",
                                                          str(tmp_path), "--resume"])  # fmt: skip


@pytest.mark.slow  # about 90 s: three launches, two of them of two processes
def test_two_streaming_processes_read_disjoint_shares_and_match_one_process(tmp_path, stream_files):
    common = [*stream_files, *MODEL_FLAGS, "--max-steps", "8", "--save-steps", "4", "--eval-steps", "4"]
    run_accelerate([*common, "--batch-size", "8", "--output-dir", str(tmp_path / "one")])
    run_accelerate([*common, "--batch-size", "4", "--output-dir", str(tmp_path / "two")], processes=2)
    one, two = loop_state(tmp_path / "one" / "checkpoint-8"), loop_state(tmp_path / "two" / "checkpoint-8")
    # Each process read 24 of the 48 blocks a pass (its share), 4 a step: 8 steps are 2 steps into the second pass.
    assert two["stream_positions"] == [{"pass": 1, "blocks": 8}, {"pass": 1, "blocks": 8}]
    # The same global batch of 8 blocks, split 4 + 4 between the processes: the same losses. Had the shares
    # overlapped, the two processes' batches would not be one process's batch, and the losses would differ.
    assert train_losses(two["log_history"]) == pytest.approx(
        train_losses(one["log_history"]), rel=FLOAT32_ORDER_TOLERANCE
    )
    assert eval_losses(two["log_history"]) == pytest.approx(
        eval_losses(one["log_history"]), rel=FLOAT32_ORDER_TOLERANCE
    )
    sums = [(tmp_path / "two" / f"parameter_sha256_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert sums[0] == sums[1]

    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "two" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    run_accelerate([*common, "--batch-size", "4", "--output-dir", str(tmp_path / "resumed"), "--resume"], processes=2)
    resumed = loop_state(tmp_path / "resumed" / "checkpoint-8")
    assert resumed["stream_positions"] == two["stream_positions"]
    expected = train_losses(two["log_history"])
    assert {step: train_losses(resumed["log_history"])[step] for step in range(5, 9)} == pytest.approx(
        {step: expected[step] for step in range(5, 9)}, rel=1e-6
    )


def test_the_trainer_recipe_streams_and_resumes_past_what_it_saw(tmp_path, stream_files):
    recipe = load_recipe("train_gpt2")
    flags = [*stream_files, *MODEL_FLAGS, "--batch-size", "8", "--max-steps", "8", "--save-steps", "4",
             "--eval-steps", "4"]  # fmt: skip
    recipe.main([*flags, "--output-dir", str(tmp_path / "full")])
    full = json.loads((tmp_path / "full" / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    load_recipe("train_gpt2").main([*flags, "--output-dir", str(tmp_path / "resumed"), "--resume"])
    resumed = json.loads((tmp_path / "resumed" / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    expected = train_losses(full)
    assert len(expected) == 8
    assert {step: train_losses(resumed)[step] for step in range(5, 9)} == pytest.approx(
        {step: expected[step] for step in range(5, 9)}, rel=1e-6
    )
