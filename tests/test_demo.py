"""`damcha-hf demo` on a tiny slice: trains DAMCHA and MHA from the same start, reports both, saves a checkpoint."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import damcha_hf
from damcha_hf.cli import main


def test_demo_tiny_run_writes_a_loadable_checkpoint(tmp_path, capsys):
    text = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    output = tmp_path / "demo"
    exit_code = main([
        "demo", "--data", str(corpus), "--output-dir", str(output), "--max-steps", "20", "--time-budget", "0",
        "--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "32", "--batch-size", "8",
        "--metric-hidden-size", "8", "--eval-blocks", "8", "--sample-tokens", "10", "--no-progress",
        "--learning-rate", "3e-3", "--num-threads", "1",
    ])  # fmt: skip
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
    assert "pip install damcha-hf" not in card
    assert "not expected to read as code" in body and "does not read as code" in printed
    assert "Downloading data" not in captured.err and "loss_type=None" not in captured.err


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
