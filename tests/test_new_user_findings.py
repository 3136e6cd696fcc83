"""What a new user met on a fresh install: optional packages found missing only after minutes of work, transformers'
warnings on the documented conversion route, a missing attention mask, a heatmap written into the current folder, docs
listing only some families, and a README snippet that cannot run offline."""

import importlib.util
import logging
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_recipe, quick_runs
from safetensors.torch import load_file, save_file
from tiny_checkpoints import stock_decoder, write_stock_decoder

import damcha_hf
from damcha_hf.families import FAMILIES, family_for_model_type
from damcha_hf.optional_packages import EXTRAS

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def extra_needs() -> list[tuple[str, str, str]]:
    """(quick-run command, extra, module of that extra) for every extra the README's quick-run table names."""
    return [(run.command, extra, module) for run in quick_runs() for extra in run.extras
            for module, _, _ in EXTRAS[extra]]  # fmt: skip


def test_the_quick_runs_name_the_extras_their_scripts_need():
    needed = {(command.split()[1], extra) for command, extra, _ in extra_needs()}
    assert needed >= {("recipes/train_bart.py", "seq2seq"), ("experiments/speed.py", "experiments"),
                      ("experiments/quality.py", "experiments")}  # fmt: skip


@pytest.mark.parametrize("command, extra, missing", extra_needs())
def test_a_missing_optional_package_is_named_with_its_extra_before_any_work(
    command, extra, missing, tmp_path, monkeypatch, capsys
):
    """Each quick run the README says needs an extra, as written, with one of that extra's packages missing."""
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: find_spec answers None
    monkeypatch.chdir(tmp_path)
    script, *argv = shlex.split(command)[1:]
    module = load_script(REPO_ROOT / script)
    output_dir = ["--output-dir", str(tmp_path / "run")] if script.startswith("recipes") else []
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args([*argv, *output_dir])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    pip_name = {"rouge_score": "rouge-score"}.get(missing, missing)
    assert pip_name in line and f'pip install -e ".[{extra}]"' in line, line
    assert list(tmp_path.iterdir()) == []  # no run folder, no data, no results


def test_help_answers_without_the_optional_packages(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)
    with pytest.raises(SystemExit) as exit_info:
        load_recipe("train_bart").parse_args(["--help"])
    assert exit_info.value.code == 0 and "--model-name-or-path" in capsys.readouterr().out


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    """Every message logged by transformers (whose logger does not propagate) and by the DAMCHA model files."""
    handler = Records()
    loggers = [logging.getLogger("transformers"), logging.getLogger("damcha_hf")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.lines
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.mark.parametrize("model_type", ["qwen2", "gpt2"])
def test_loading_a_stock_folder_into_a_damcha_class_says_one_line(model_type, tmp_path, log_lines):
    folder = write_stock_decoder(tmp_path / "stock", model_type)
    damcha_class = family_for_model_type(model_type).task_head.model_class
    model = damcha_class.from_pretrained(folder).eval()
    text = "\n".join(log_lines)
    assert "You are using a model of type" not in text and "LOAD REPORT" not in text and "MISSING" not in text, text
    (line,) = [line for line in log_lines if "converted" in line]
    assert f"converted from stock `{model_type}`" in line and "starts at the identity" in line
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock_decoder(model_type)(ids).logits)


def test_weights_a_stock_folder_lacks_besides_the_generator_are_still_reported(tmp_path, log_lines):
    folder = write_stock_decoder(tmp_path / "stock", "qwen2")
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    damcha_hf.DamchaQwen2ForCausalLM.from_pretrained(folder)
    text = "\n".join(log_lines)
    assert "LOAD REPORT" in text and "model.norm.weight" in text and "MISSING" in text
    assert "cross_head_metric" not in text


def test_a_damcha_checkpoint_missing_its_generator_is_still_refused(tmp_path):
    folder = write_stock_decoder(tmp_path / "stock", "qwen2")
    model = damcha_hf.DamchaQwen2ForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "damcha")
    weights = load_file(tmp_path / "damcha" / "model.safetensors")
    weights = {name: value for name, value in weights.items() if "cross_head_metric" not in name}
    save_file(weights, tmp_path / "damcha" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks metric-generator weights"):
        damcha_hf.DamchaQwen2ForCausalLM.from_pretrained(tmp_path / "damcha")


def test_every_family_is_declared_where_the_findings_looked():
    assert {family.model_type for family in FAMILIES} == {
        "gpt2", "llama", "vit", "bart", "mistral", "qwen2", "qwen3", "phi3", "gemma2"
    }  # fmt: skip


def test_the_demo_evaluates_with_an_attention_mask_and_the_same_losses(log_lines):
    """Blocks hold the end-of-text token, which is also the padding token: without a mask transformers warns (the
    check below shows it would), with the demo's all-ones mask it does not, and the losses are the unmasked ones."""
    import transformers

    from damcha_hf.commands.demo import block_nll

    config = damcha_hf.DamchaGPT2Config(vocab_size=257, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                        pad_token_id=256, eos_token_id=256, bos_token_id=256)  # fmt: skip
    model = damcha_hf.DamchaGPT2LMHeadModel(config).eval()
    blocks = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    blocks[:, 0] = 256  # a document boundary at the start of every block
    warning = "We strongly recommend passing in an `attention_mask`"
    transformers.utils.logging.get_logger().warning_once.cache_clear()  # a once-only warning: allow it again
    with torch.no_grad():
        logits = model(input_ids=blocks).logits
    assert any(warning in line for line in log_lines)
    log_lines.clear()
    transformers.utils.logging.get_logger().warning_once.cache_clear()
    nll = block_nll(model, blocks, batch_size=2)
    assert not any(warning in line for line in log_lines), log_lines
    by_hand = -torch.log_softmax(logits.double()[:, :-1], -1).gather(-1, blocks[:, 1:, None])[..., 0].mean(dim=1)
    torch.testing.assert_close(nll, by_hand, rtol=1e-5, atol=1e-6)  # the model ran in float32


def test_the_usage_page_lists_every_family_and_every_info_preset():
    from damcha_hf.families import presets

    usage = (REPO_ROOT / "docs" / "usage.md").read_text()
    for family in FAMILIES:
        row = f"| {family.display_name} | `{family.config_class.__name__}` | "
        assert row + ", ".join(f"`{head.model_class.__name__}`" for head in family.heads) + " |" in usage, row
    (info_line,) = [line for line in usage.splitlines() if line.startswith("| `damcha-hf info")]
    assert info_line.split("`")[1] == "damcha-hf info [CHECKPOINT\\|" + "\\|".join(presets()) + "]"


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "gpt2"])
def test_the_model_card_names_the_family_its_code_extends(model_type):
    from damcha_hf.hub import build_model_card

    model = damcha_hf.convert_to_damcha(stock_decoder(model_type))
    card = str(build_model_card(model))
    limitations = card[card.index("## Limitations") :]
    family = family_for_model_type(model_type)
    assert f"extends transformers' {family.display_name} internals" in limitations
    others = [f.display_name for f in FAMILIES if f is not family and f.display_name not in family.display_name]
    assert not any(f"{name} internals" in limitations or f"{name}," in limitations for name in others)


def test_the_demo_card_note_points_nowhere_it_cannot(tmp_path):
    """The note under the evaluation table and under the training table is one sentence: it names no direction."""
    source = (REPO_ROOT / "damcha_hf" / "commands" / "demo.py").read_text()
    start = source.index("log_evaluation = (")
    sentence = source[start : source.index("_save(damcha", start)]
    assert "below" not in sentence and "above" not in sentence and "evaluation results use all" in sentence


def test_the_readme_usage_snippet_runs_offline_as_written(tmp_path):
    """The README's Usage block, run as written in an empty folder with the Hub offline; then its conversion is
    checked against the stock model it converted (the outputs unchanged)."""
    import os
    import re
    import subprocess

    readme = (REPO_ROOT / "README.md").read_text()
    usage = readme[readme.index("## Usage") :]
    snippet = re.search(r"```python\n(.*?)```", usage, re.DOTALL).group(1)
    check = (
        "\nimport torch\nstock = GPT2LMHeadModel.from_pretrained('stock-gpt2').eval()\nmodel.eval()\n"
        "ids = torch.randint(0, stock.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))\n"
        "with torch.no_grad():\n    torch.testing.assert_close(model(ids).logits, stock(ids).logits)\n"
        "print('OK', type(model).__name__)\n"
    )
    (tmp_path / "usage.py").write_text(snippet + check)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run([sys.executable, "usage.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=300, check=False)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().endswith("OK DamchaGPT2LMHeadModel")
