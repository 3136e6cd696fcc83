"""What a run writes to a log: written to a pipe or a file (no terminal), a training loop's progress takes a line at a
sane rate, not a redraw per step; tokenizing whole documents before cutting them into blocks raises no "sequence
length is longer than the specified maximum" warning, and the saved tokenizer keeps the model's context."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.utils import logging as transformers_logging

from damcha_hf.cli import main as cli_main
from damcha_hf.data import byte_level_tokenizer, group_into_blocks
from damcha_hf.training import PROGRESS_SECONDS, progress_bar_options

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TOO_LONG = "Token indices sequence length is longer than the specified maximum"


def segments(output: str) -> list[str]:
    """The output as a log viewer shows it: a carriage return (a bar's redraw) starts a new line too."""
    return [segment for segment in re.split(r"[\r\n]", output) if segment.strip()]


class Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self):
        return self.terminal


def test_progress_bars_redraw_live_on_a_terminal_and_rarely_in_a_log():
    assert progress_bar_options(Stream(terminal=True)) == {}
    assert progress_bar_options(Stream(terminal=False)) == {"mininterval": PROGRESS_SECONDS,
                                                            "maxinterval": PROGRESS_SECONDS}  # fmt: skip
    assert 30 <= PROGRESS_SECONDS <= 60


def test_demo_progress_in_a_log_is_a_line_at_the_start_and_one_at_the_end(tmp_path, capsys):
    """capsys's standard error is no terminal, as a pipe is not: 200 steps leave the bar's first and last lines (and
    a redraw a minute, which a run of seconds never reaches), where a live bar would redraw on every step."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(300)))
    assert cli_main(["demo", "--data", str(corpus), "--output-dir", str(tmp_path / "demo"), "--max-steps", "200",
                     "--time-budget", "0", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                     "--batch-size", "4", "--metric-hidden-size", "4", "--eval-blocks", "4", "--sample-tokens", "2",
                     "--num-threads", "1"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    bar = [segment for segment in segments(captured.err + captured.out) if "training DAMCHA and MHA" in segment]
    assert 1 <= len(bar) <= 3, bar
    assert "200/200" in bar[-1]


def write_documents(folder: Path, count: int = 12) -> Path:
    """A folder of text files, one document each, every one far longer than the 32-token context below."""
    folder.mkdir()
    for index in range(count):
        (folder / f"doc_{index}.txt").write_text(
            "".join(f"line {line} of document {index}: the quick brown fox\n" for line in range(40))
        )
    return folder


def test_tokenizing_whole_documents_for_blocks_raises_no_length_warning(tmp_path):
    """Oracle: the same tokenizer on one such document warns; `group_into_blocks` on all of them does not, and leaves
    the tokenizer's model_max_length (what a saved tokenizer truncates at) as it was."""
    import datasets

    texts = [path.read_text() for path in sorted(write_documents(tmp_path / "docs").iterdir())]
    logged = []
    handler = transformers_logging.logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = transformers_logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        blocks = group_into_blocks(datasets.Dataset.from_dict({"text": texts}), byte_level_tokenizer(32), 32)
        assert not [message for message in logged if TOO_LONG in message]
        control = byte_level_tokenizer(32)
        control(texts[0])
        assert [message for message in logged if TOO_LONG in message]  # the check the blocks skip does fire
    finally:
        logger.removeHandler(handler)
    total = sum(len(text.encode()) + 1 for text in texts)  # bytes plus one end-of-text token per document
    assert len(blocks) == total // 32 and all(len(ids) == 32 for ids in blocks["input_ids"])
    assert control.model_max_length == 32


@pytest.mark.slow  # about 20 s each: a recipe in a fresh interpreter
@pytest.mark.parametrize("recipe", ["train_gpt2", "train_gpt2_accelerate"])
def test_a_recipe_piped_to_a_log_writes_its_logs_not_a_redraw_per_step(tmp_path, recipe):
    """A recipe with standard output and error to a pipe, as `... > run.log 2>&1` or `| tee` has them: one line per
    --logging-steps log and no training bar (the Trainer's and the Accelerate loop's are shown on a terminal only);
    no length warning; the saved tokenizer still cuts at the model's context."""
    documents = write_documents(tmp_path / "docs", count=30)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    steps, logging_steps = 40, 10
    completed = subprocess.run(
        [sys.executable, str(RECIPES / f"{recipe}.py"), "--data", str(documents), "--output-dir", str(tmp_path / "run"),
         "--max-steps", str(steps), "--logging-steps", str(logging_steps), "--n-layer", "1", "--n-embd", "16",
         "--n-head", "2", "--block-size", "32", "--batch-size", "4", "--metric-hidden-size", "4",
         "--max-eval-samples", "8", "--num-threads", "1"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = segments(completed.stdout + completed.stderr)
    assert not [line for line in lines if f"/{steps} [" in line], "\n".join(lines)
    assert len([line for line in lines if "'loss'" in line]) == steps // logging_steps, "\n".join(lines)
    assert not [line for line in lines if TOO_LONG in line]
    assert len(lines) < 60, "\n".join(lines)  # a bar redrawn per step would add a line per step and evaluation
    config = json.loads((tmp_path / "run" / "final" / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 32
