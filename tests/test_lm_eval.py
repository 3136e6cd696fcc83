"""lm-evaluation-harness on a DAMCHA checkpoint (the `hf` model, `trust_remote_code=True`) with the shipped task whose
data is a local file: every choice's log-likelihood equals the one computed directly from the model in float64, and
the accuracies follow from them."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import randomize_cross_head
from tiny_checkpoints import stock_decoder

import damcha_hf
from damcha_hf.data import byte_level_tokenizer
from damcha_hf.lm_eval_tasks import TASKS_DIR

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra (in `dev`)")

REPO_ROOT = Path(__file__).resolve().parents[1]
TASK = "damcha_local_choice"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A converted tiny Qwen2 whose generator is away from the identity (so DAMCHA's mixing counts), saved with its
    byte-level tokenizer."""
    folder = tmp_path_factory.mktemp("lm-eval") / "ckpt"
    model = damcha_hf.convert_to_damcha(stock_decoder("qwen2"))
    randomize_cross_head(model)
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


def rows() -> list[dict]:
    lines = (TASKS_DIR / "local_choice.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def oracle_log_likelihoods(folder: Path) -> list[list[float]]:
    """log P(" choice" | question) of every row's choices, from the model in float64: one byte is one token."""
    model = damcha_hf.DamchaQwen2ForCausalLM.from_pretrained(folder).double().eval()
    scores = []
    for row in rows():
        context = list(row["question"].encode())
        row_scores = []
        for choice in row["choices"]:
            ids = context + list(f" {choice}".encode())
            with torch.no_grad():
                log_probs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0], -1)
            row_scores.append(sum(log_probs[t - 1, ids[t]].item() for t in range(len(context), len(ids))))
        scores.append(row_scores)
    return scores


def accuracies(scores: list[list[float]]) -> tuple[float, float]:
    """(acc, acc_norm) as lm-eval defines them: the highest log-likelihood, or per character of the choice."""
    acc = norm = 0
    for row, row_scores in zip(rows(), scores, strict=True):
        acc += max(range(len(row_scores)), key=lambda i: row_scores[i]) == row["answer"]
        per_char = [score / len(choice) for score, choice in zip(row_scores, row["choices"], strict=True)]
        norm += max(range(len(per_char)), key=lambda i: per_char[i]) == row["answer"]
    return acc / len(scores), norm / len(scores)


def harness_log_likelihoods(samples: list[dict]) -> list[list[float]]:
    by_doc = sorted(samples, key=lambda sample: sample["doc_id"])
    return [[float(response[0][0]) for response in sample["resps"]] for sample in by_doc]


def check_against_the_oracle(scores: list[list[float]], acc: float, acc_norm: float, folder: Path) -> None:
    oracle = oracle_log_likelihoods(folder)
    # lm-eval computes in the checkpoint's float32: a float32 tolerance on sums of about 5 log-probabilities.
    torch.testing.assert_close(torch.tensor(scores, dtype=torch.float64), torch.tensor(oracle, dtype=torch.float64),
                               rtol=1e-5, atol=1e-4)  # fmt: skip
    assert (acc, acc_norm) == pytest.approx(accuracies(oracle))


def test_lm_eval_scores_a_damcha_checkpoint_as_the_model_does(checkpoint):
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={checkpoint},trust_remote_code=True",
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        device="cpu",
        batch_size=4,  # padded batches, as a real run has
        log_samples=True,
    )
    task = results["results"][TASK]
    assert task["sample_len"] == len(rows())
    check_against_the_oracle(
        harness_log_likelihoods(results["samples"][TASK]), task["acc,none"], task["acc_norm,none"], checkpoint
    )


def test_the_task_folder_is_printed_for_include_path():
    printed = subprocess.run([sys.executable, "-m", "damcha_hf.lm_eval_tasks"], capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
    assert Path(printed) == TASKS_DIR and (TASKS_DIR / f"{TASK}.yaml").is_file()


CLI_WITHOUT_PLUGIN = textwrap.dedent(
    """
    import sys

    sys.modules["damcha_hf"] = None  # the checkpoint's own code must define the model
    sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *sys.argv[1:]]
    cli_evaluate()
    """
)


@pytest.mark.slow
def test_the_lm_eval_command_scores_a_damcha_checkpoint_without_the_plugin(checkpoint, tmp_path):
    script = tmp_path / "lm_eval_without_plugin.py"
    script.write_text(CLI_WITHOUT_PLUGIN.format(repo_root=str(REPO_ROOT)))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-I", str(script), "--model", "hf", "--model_args",
               f"pretrained={checkpoint},trust_remote_code=True", "--include_path", str(TASKS_DIR), "--tasks", TASK,
               "--device", "cpu", "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    subprocess.run(command, cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=600)
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    (samples_file,) = (tmp_path / "out").rglob(f"samples_{TASK}_*.jsonl")
    task = json.loads(results_file.read_text())["results"][TASK]
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    check_against_the_oracle(harness_log_likelihoods(samples), task["acc,none"], task["acc_norm,none"], checkpoint)


@pytest.mark.slow  # about 20 s on 2 busy cores: the default suite stays near its budget
def test_the_task_reads_your_own_file_through_metadata(checkpoint, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    mine = [{"question": "One plus one is", "choices": ["two", "three"], "answer": 0},
            {"question": "Snow is", "choices": ["black", "white"], "answer": 1}]  # fmt: skip
    data_file = tmp_path / "mine.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in mine))
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={checkpoint},trust_remote_code=True",
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS_DIR), metadata={"data_file": str(data_file)}),
        device="cpu",
        log_samples=True,
    )
    docs = [sample["doc"] for sample in sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])]
    assert docs == mine and results["results"][TASK]["sample_len"] == 2
