"""`damcha-hf demo` on a tiny slice: trains DAMCHA and MHA from the same start, reports both, saves a checkpoint."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import damcha_hf
from damcha_hf.cli import main


def tiny_corpus(folder: Path) -> Path:
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300)))
    return corpus


TINY_DEMO_ARGS = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--batch-size", "8",
                  "--metric-hidden-size", "8", "--eval-blocks", "8", "--sample-tokens", "10", "--no-progress",
                  "--num-threads", "1"]  # fmt: skip


def loss_curves_drawn(monkeypatch) -> dict[str, list[float]]:
    """{legend label: y values} of every line of the loss-curve figures drawn from now on (read as they are closed)."""
    import matplotlib.pyplot as plt

    curves, close = {}, plt.close

    def recording_close(figure=None):
        for axis in getattr(figure, "axes", []):
            if axis.get_ylabel() == "loss":
                curves.update({line.get_label(): list(line.get_ydata()) for line in axis.get_lines()})
        return close(figure)

    monkeypatch.setattr(plt, "close", recording_close)
    return curves


def test_demo_tiny_run_writes_a_loadable_checkpoint(tmp_path, capsys, monkeypatch):
    corpus = tiny_corpus(tmp_path)
    output = tmp_path / "demo"
    curves = loss_curves_drawn(monkeypatch)
    exit_code = main(["demo", "--data", str(corpus), "--output-dir", str(output), "--max-steps", "20",
                      "--time-budget", "0", "--learning-rate", "3e-3", *TINY_DEMO_ARGS])  # fmt: skip
    assert exit_code == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "DAMCHA" in printed and "MHA" in printed and "bits per byte" in printed

    report = json.loads((output / "demo_results.json").read_text())
    assert report["steps"] == 20
    damcha_log = [entry["loss"] for entry in report["log_history"]["DAMCHA"] if "loss" in entry]
    mha_log = [entry["loss"] for entry in report["log_history"]["MHA"] if "loss" in entry]
    # Same weights and batch at step 1 (the converted model's generator starts at zero): the same loss.
    assert math.isclose(damcha_log[0], mha_log[0], rel_tol=1e-5)
    for losses in (damcha_log, mha_log):
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    for name in ("DAMCHA", "MHA"):
        row = report["results"][name]
        assert math.isclose(row["eval_bits_per_byte"], row["eval_loss"] / math.log(2), rel_tol=1e-6)
        assert row["eval_bits_per_byte"] < 8.0  # uniform over 257 tokens would be ~8.0 bits per byte

    model = AutoModelForCausalLM.from_pretrained(output)
    assert isinstance(model, damcha_hf.DamchaGPT2LMHeadModel)
    generator_weight = model.transformer.cross_head_metric.generators[0].fc_out.weight
    assert generator_weight.abs().sum() > 0  # the metric was learned
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert tokenizer("def")["input_ids"] == list(b"def")
    with torch.no_grad():
        ids = torch.tensor([list(b"def function_1(x):\n")])
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss / math.log(2) < 8.0

    # The card compares the two models; the baseline's numbers are not listed as this model's metrics.
    card = (output / "README.md").read_text()
    front_matter, body = card.split("\n---\n", 1)
    assert "mha" not in front_matter.lower() and "perplexity_per_byte" in front_matter
    comparison = body.split("## Comparison", 1)[1].split("\n## ", 1)[0]
    for label, name in (("damcha-demo (this model)", "DAMCHA"), ("MHA baseline", "MHA")):
        row = next(line for line in comparison.splitlines() if line.startswith(f"| {label}"))
        assert f"{report['results'][name]['eval_bits_per_byte']:.4f}" in row
    assert "demo's training loop" in body and "`Trainer` log history" not in body
    assert "pip install damcha-hf" not in card  # no index serves it: the card says how to install it instead
    assert "not on PyPI: in a clone of its repository, `pip install -e .`" in card
    assert "not expected to read as code" in body and "does not read as code" in printed
    # The card's loss curve draws both models' training losses, each as logged.
    assert curves["damcha-demo: training loss"] == pytest.approx(damcha_log)
    assert curves["MHA baseline: training loss"] == pytest.approx(mha_log)
    assert "MHA baseline: validation loss" in curves

    # The tokenizer knows the model's context: 32 positions (--block-size), not transformers' 1e30 default.
    saved_tokenizer_config = json.loads((output / "tokenizer_config.json").read_text())
    assert saved_tokenizer_config["model_max_length"] == model.config.n_positions == 32
    assert len(tokenizer("x" * 100, truncation=True)["input_ids"]) == 32

    # The printed difference is DAMCHA - MHA, with its interval and a verdict; the card says which data gave it.
    comparison = report["comparison"]
    bits = {name: report["results"][name]["eval_bits_per_byte"] for name in ("DAMCHA", "MHA")}
    assert comparison["difference_bits_per_byte"] == pytest.approx(bits["DAMCHA"] - bits["MHA"], abs=1e-9)
    low, high = comparison["interval_95"]
    assert low <= comparison["difference_bits_per_byte"] <= high
    assert f"DAMCHA - MHA: {comparison['difference_bits_per_byte']:+.4f} bits per byte" in printed
    assert comparison["verdict"] in printed and "compare several seeds before drawing a conclusion" in printed
    validation = f"8 blocks of 32 bytes drawn at random (seed 0) from {comparison['documents']} held-out sections"
    assert validation in report["validation"] and f"Validation figures (both models): {validation}" in body
    assert 3 <= comparison["documents"] <= 8

    # `inspect` draws the card's heatmap from the same built-in sample by default: the same figures.
    assert "averaged over the tokens of the built-in sample" in body
    card_masses = re.findall(r"^\| (\d+) \| (\d\.\d{4}) \|$", body, flags=re.MULTILINE)
    assert main(["inspect", str(output), "--output", str(tmp_path / "map.png")]) == 0
    inspected = re.findall(r"layer (\d+): off-diagonal mass (\d\.\d{4})", capsys.readouterr().out)
    assert card_masses and inspected == card_masses

    # An earlier run is replaced only with --overwrite-output-dir: refused in one line, the folder untouched.
    before = {path: path.read_bytes() for path in output.rglob("*") if path.is_file()}
    exit_code = main(["demo", "--data", str(corpus), "--output-dir", str(output), "--max-steps", "5",
                      "--time-budget", "0", *TINY_DEMO_ARGS])  # fmt: skip
    assert exit_code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "holds an earlier demo run" in error[0] and "--overwrite-output-dir" in error[0]
    assert {path: path.read_bytes() for path in output.rglob("*") if path.is_file()} == before


@pytest.mark.slow  # about 15 s: the demo in a fresh interpreter and Hugging Face cache
def test_demo_prints_no_download_bars_or_loss_type_warnings(tmp_path):
    """As a user sees it: a fresh process and Hugging Face cache (in-process, a warning transformers gives once per
    process, or a dataset already cached, would hide them)."""
    # A folder of files, as the default stdlib corpus is: `datasets` shows "Downloading data" over many local files.
    corpus = tmp_path / "sources"
    corpus.mkdir()
    text = tiny_corpus(tmp_path).read_text()
    for index in range(30):
        (corpus / f"part_{index}.txt").write_text(text[index * 300 : (index + 1) * 300])
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-m", "damcha_hf.cli", "demo", "--data", str(corpus), "--output-dir", str(tmp_path / "demo"),
         "--max-steps", "4", "--time-budget", "0", *TINY_DEMO_ARGS],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = completed.stdout + completed.stderr
    assert "bits per byte" in completed.stdout
    assert "Downloading data" not in printed and "loss_type" not in printed, completed.stderr[-3000:]


def test_demo_keeps_to_its_time_budget_when_the_pace_changes(tmp_path, capsys, monkeypatch):
    """A clock that runs twice as fast after a while (the machine got busier): the demo states its plan once, re-plans
    from the measured pace and ends within 3% of the budget, evaluations included. The clock moves on each reading, so
    the run's own code paces it."""
    from damcha_hf.commands import demo

    clock = {"now": 0.0, "readings": 0}

    def perf_counter():
        clock["readings"] += 1
        clock["now"] += 0.01 if clock["readings"] < 150 else 0.02
        return clock["now"]

    monkeypatch.setattr(demo, "time", SimpleNamespace(perf_counter=perf_counter))
    output = tmp_path / "demo"
    exit_code = main(["demo", "--data", str(tiny_corpus(tmp_path)), "--output-dir", str(output), "--time-budget",
                      "0.05", *TINY_DEMO_ARGS])  # fmt: skip
    assert exit_code == 0
    captured = capsys.readouterr()
    plans = re.findall(r"plan: (\d+) steps fit the 0.05-minute budget", captured.out + captured.err)
    report = json.loads((output / "demo_results.json").read_text())
    timing = report["time"]
    assert len(plans) == 1 and int(plans[0]) == timing["first_plan"]
    assert timing["budget_seconds"] == 3.0 and 0.97 * 3.0 <= timing["seconds"] <= 1.03 * 3.0, timing
    assert report["steps"] < timing["first_plan"]  # the slower pace cut the plan
    # Evaluations a shorter plan moved into the past are skipped, not caught up one step after another.
    evaluations = [entry["step"] for entry in report["log_history"]["DAMCHA"] if "eval_loss" in entry]
    assert len(evaluations) <= demo.EVALUATIONS + 1 and evaluations[-1] == report["steps"], evaluations
    assert f"trained {report['steps']} steps and evaluated in" in captured.out


def test_paired_difference_interval_matches_normal_theory_and_uses_the_pairing():
    """The bootstrap interval of a mean difference against the closed form mean +- 1.96 sd / sqrt(n), on blocks
    whose own difficulty varies far more than the difference: pairing removes that variation."""
    from damcha_hf.commands.demo import paired_difference, verdict

    generator = torch.Generator().manual_seed(0)
    difficulty = 3.0 * torch.randn(2000, generator=generator, dtype=torch.float64)
    differences = -0.02 + 0.05 * torch.randn(2000, generator=generator, dtype=torch.float64)
    first, second = difficulty + differences, difficulty
    mean, low, high = paired_difference(first, second, seed=1)
    half_width = 1.96 * differences.std().item() / math.sqrt(len(differences))
    assert mean == pytest.approx(differences.mean().item())
    assert low == pytest.approx(mean - half_width, abs=0.25 * half_width)
    assert high == pytest.approx(mean + half_width, abs=0.25 * half_width)
    assert verdict(low, high) == "DAMCHA lower, resolved"
    assert verdict(-0.01, 0.02) == "not resolved at this length" and verdict(0.003, 0.02) == "MHA lower, resolved"
    assert verdict(-2e-7, -1e-7) == "not resolved at this length"  # identical models differ by rounding only
    assert paired_difference(first, second, seed=1) == (mean, low, high)  # the same for a seed


@pytest.mark.slow
def test_default_demo_is_the_quickstart_main_job(tmp_path):
    """The README's main job as a user runs it: the console script, default settings, the stdlib corpus."""
    output = tmp_path / "damcha-demo"
    script = Path(sys.executable).parent / "damcha-hf"
    started = time.monotonic()
    completed = subprocess.run(
        [str(script), "demo", "--output-dir", str(output), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    minutes = (time.monotonic() - started) / 60
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert minutes < 10, f"the demo took {minutes:.1f} minutes; the README promises under 10 on 2 cores"
    assert "sample (prompt" in completed.stdout
    report = json.loads((output / "demo_results.json").read_text())
    for name in ("DAMCHA", "MHA"):
        assert report["results"][name]["eval_bits_per_byte"] < 4.0  # learned well past uniform (8 bits per byte)
    for hub_file in ("README.md", "model.safetensors", "config.json", "loss_curve.png", "metric_heatmap.png"):
        assert (output / hub_file).exists(), hub_file
