"""`run_upstream_family_tests.py` on a per-family test file written here: the DAMCHA run sees the DAMCHA classes under
the stock names, and an outcome that differs from the stock run's is listed and fails the run.

Marked `common`: it builds the package from the installed release's sdist, as transformers' common tests do.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.common

SCRIPT = Path(__file__).resolve().parent / "run_upstream_family_tests.py"

# A per-family test file in the shape of transformers' own: relative imports of the common test modules, the stock
# classes imported from `transformers`.
FAMILY_TEST_FILE = """
from transformers import Qwen2Config, Qwen2ForCausalLM

from ...test_modeling_common import ids_tensor


def test_the_classes_the_file_names():
    config = Qwen2Config(vocab_size=11, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    assert type(model).__name__ == "Qwen2ForCausalLM"  # fails where the DAMCHA class stands in for it


def test_a_forward_pass():
    config = Qwen2Config(vocab_size=11, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    assert Qwen2ForCausalLM(config)(ids_tensor([1, 4], 11)).logits.shape == (1, 4, 11)
"""


def test_the_damcha_run_substitutes_the_classes_and_lists_what_differs(tmp_path):
    upstream = tmp_path / "upstream"
    (upstream / "qwen2").mkdir(parents=True)
    (upstream / "qwen2" / "test_modeling_qwen2.py").write_text(FAMILY_TEST_FILE)
    report = tmp_path / "report.json"
    completed = subprocess.run([sys.executable, str(SCRIPT), str(upstream), "--report", str(report)],
                               capture_output=True, text=True, timeout=600)  # fmt: skip
    if "CommonTestsUnavailable" in completed.stderr:
        pytest.skip("the installed release's sdist is unavailable")
    result = json.loads(report.read_text())
    assert result["families"] == ["qwen2"]
    name_test = "tests.models.qwen2.test_modeling_qwen2::test_the_classes_the_file_names"
    forward_test = "tests.models.qwen2.test_modeling_qwen2::test_a_forward_pass"
    assert result["stock"] == {name_test: "passed", forward_test: "passed"}
    assert result["damcha"] == {name_test: "failed", forward_test: "passed"}
    assert result["differences"] == {name_test: ["passed", "failed"]}
    assert completed.returncode == 1 and f"passed on stock,  failed on DAMCHA: {name_test}" in completed.stdout
