"""The vLLM serving benchmark's arithmetic and argument checks (experiments/vllm_serving.py), without vLLM: the timing
itself runs in vLLM's interpreter (marker-free, since nothing here needs vLLM)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import vllm_serving  # noqa: E402

NATIVE, STOCK, DAMCHA = vllm_serving.NATIVE, vllm_serving.STOCK, vllm_serving.DAMCHA


def synthetic_result(rounds: int = 5) -> dict:
    """Rounds where the stock model takes 1 s of wall and 2 CPU-s for 100 tokens (plus a drift that every row of a
    round shares), vLLM's own implementation is 1.25 times faster, and DAMCHA takes 1/0.96 of the stock time and
    1.1 times its CPU."""
    result = {"rounds": [], "tokens": {NATIVE: [[1, 2]], STOCK: [[1, 2]], DAMCHA: [[3, 4]]}}
    for index in range(rounds):
        drift = 1 + 0.2 * index
        result["rounds"].append(
            {
                NATIVE: {"tokens": 100, "wall_seconds": drift / 1.25, "cpu_seconds": 2 * drift / 1.25},
                STOCK: {"tokens": 100, "wall_seconds": drift, "cpu_seconds": 2 * drift},
                DAMCHA: {"tokens": 100, "wall_seconds": drift / 0.96, "cpu_seconds": 2.2 * drift},
            }
        )
    return result


def test_paired_ratios_cancel_a_drift_every_row_of_a_round_shares():
    summary = vllm_serving.summarize(synthetic_result())
    assert summary[STOCK]["speed_ratio"] == pytest.approx(1.0)
    assert summary[DAMCHA]["speed_ratio"] == pytest.approx(0.96)
    assert summary[DAMCHA]["speed_ratio_interval"] == pytest.approx((0.96, 0.96))
    assert summary[DAMCHA]["cpu_ratio"] == pytest.approx(1.1)
    assert summary[NATIVE]["speed_ratio"] == pytest.approx(1.25)
    # the middle round's: 100 tokens over 1.4 s (the median drift of 5 rounds)
    assert summary[STOCK]["tokens_per_second"] == pytest.approx(100 / 1.4)
    assert summary[STOCK]["cpu_seconds_per_token"] == pytest.approx(2 * 1.4 / 100)
    assert summary["verdicts"][f"DAMCHA against {STOCK}, goal 0.95"] == "resolved: above 0.95"
    assert summary["verdicts"][f"DAMCHA against {STOCK}"] == "resolved: below 1"
    assert summary["verdicts"][f"{NATIVE} against {STOCK}"] == "resolved: above 1"
    assert summary["stock_tokens_equal_across_implementations"] is True
    # GPT-2 runs without the stock model in the Transformers backend: the reference is vLLM's own implementation.
    without_stock = synthetic_result()
    for round_ in without_stock["rounds"]:
        del round_[STOCK]
    assert vllm_serving.summarize(without_stock)[DAMCHA]["speed_ratio"] == pytest.approx(0.96 / 1.25)
    assert [row[0] for row in vllm_serving.rows_for("gpt2-small")] == [NATIVE, DAMCHA]
    table = vllm_serving.table({**synthetic_result(), "summary": summary})
    assert "0.960 [0.960, 0.960]" in table and "1.100" in table


def test_bad_arguments_are_refused_before_anything_is_built(tmp_path, capsys):
    existing = tmp_path / "result.json"
    existing.write_text("{}")
    for argv, message in (
        ([], "--vllm-python is required"),
        (["--vllm-python", "python", "--rounds", "0"], "--rounds must be at least 1"),
        (["--vllm-python", "python", "--out", str(existing)], "exists; name a new file"),
        (["--vllm-python", "python", "--shape", "gpt3"], "invalid choice"),
    ):
        with pytest.raises(SystemExit):
            vllm_serving.main(argv)
        assert message in capsys.readouterr().err
