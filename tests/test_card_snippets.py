"""Every Python snippet of a model card runs as written: non-interactively (stdin closed, so transformers' "Do you wish
to run the custom code? [y/N]" prompt would fail the run), offline, with the checkpoint folder in place of the Hub id;
the "without the plugin" snippets in a fresh interpreter where `damcha_hf` cannot be imported."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_damcha_gpt2_config, tiny_damcha_vit_config

import damcha_hf
from damcha_hf import hub
from damcha_hf.data import byte_level_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

# Runs each snippet file given on the command line in its own namespace; `damcha_hf` is made unimportable first when
# asked, and the source checkout is taken off the path, so only an installed plugin or the checkpoint's code can load.
SNIPPET_RUNNER = textwrap.dedent(
    """
    import sys

    without_plugin = sys.argv[1] == "without-plugin"
    if without_plugin:
        sys.modules["damcha_hf"] = None
        sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]
    for path in sys.argv[2:]:
        namespace = {{"__name__": "__main__"}}
        exec(compile(open(path).read(), path, "exec"), namespace)
        loaded = [type(value).__name__ for value in namespace.values() if hasattr(value, "from_pretrained")
                  or hasattr(value, "save_pretrained")]
        print(path, "OK", *loaded)
    """
)


def card_snippets(folder: Path) -> list[str]:
    """The card's Python code blocks, with the placeholder Hub id replaced by the checkpoint folder."""
    card = (folder / "README.md").read_text()
    blocks = PYTHON_BLOCK.findall(card)
    assert blocks, "the card has no Python snippet"
    return [block.replace(hub.REPO_PLACEHOLDER, str(folder)) for block in blocks]


def run_snippets(snippets: list[str], work_dir: Path, *, plugin: bool) -> str:
    work_dir.mkdir(parents=True, exist_ok=True)
    runner = work_dir / "run_snippets.py"
    runner.write_text(SNIPPET_RUNNER.format(repo_root=str(REPO_ROOT)))
    files = []
    for index, snippet in enumerate(snippets):
        files.append(work_dir / f"snippet_{index}.py")
        files[-1].write_text(snippet)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(work_dir / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-I", str(runner), "with-plugin" if plugin else "without-plugin", *map(str, files)],
        check=False,
        cwd=work_dir,
        env=env,
        stdin=subprocess.DEVNULL,  # an interactive prompt reads EOF and fails instead of waiting
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "Do you wish to run the custom code" not in completed.stdout + completed.stderr
    return completed.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """A DAMCHA GPT-2 with its tokenizer and a DAMCHA ViT with its image processor, saved with their cards."""
    from transformers import ViTImageProcessor

    root = tmp_path_factory.mktemp("cards")
    tokenizer = byte_level_tokenizer()
    language_model = damcha_hf.DamchaGPT2LMHeadModel(tiny_damcha_gpt2_config(vocab_size=len(tokenizer)))
    hub.save_hub_checkpoint(language_model, root / "gpt2", tokenizer_or_processor=tokenizer)
    vision_model = damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config())
    processor = ViTImageProcessor(size={"height": 16, "width": 16})
    hub.save_hub_checkpoint(vision_model, root / "vit", tokenizer_or_processor=processor, heatmap_inputs=None)
    return [root / "gpt2", root / "vit"]


def test_every_card_snippet_runs_non_interactively_as_written(checkpoints, tmp_path):
    with_plugin, without_plugin = [], []
    for folder in checkpoints:
        for snippet in card_snippets(folder):
            (with_plugin if "import damcha_hf" in snippet else without_plugin).append(snippet)
    assert len(with_plugin) == len(without_plugin) == len(checkpoints)

    printed = run_snippets(without_plugin, tmp_path / "without", plugin=False)
    # The model class came from the checkpoint's own code, and the tokenizer / image processor loaded too.
    assert printed.count(" OK ") == len(without_plugin)
    assert "DamchaGPT2LMHeadModel" in printed and "DamchaViTForImageClassification" in printed
    assert "TokenizersBackend" in printed or "Tokenizer" in printed
    assert "ImageProcessor" in printed

    printed = run_snippets(with_plugin, tmp_path / "with", plugin=True)
    assert printed.count(" OK ") == len(with_plugin) and "DamchaGPT2LMHeadModel" in printed


def test_a_lora_adapter_reloads_with_plain_peft_without_the_plugin(tmp_path):
    """`AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)`, as the adapter's card says, gives
    the trained model: the same logits as the merged checkpoint the recipe writes."""
    import importlib.util

    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    spec = importlib.util.spec_from_file_location("snippets_finetune_lora", REPO_ROOT / "recipes" / "finetune_lora.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    tokenizer = byte_level_tokenizer()
    base = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {index} of a small corpus for the adapter\n" for index in range(200)))
    run = tmp_path / "run"
    recipe.main(["--base", str(base), "--data", str(corpus), "--output-dir", str(run), "--max-steps", "3",
                 "--block-size", "32", "--batch-size", "4", "--metric-hidden-size", "8", "--learning-rate", "1e-2",
                 "--max-eval-samples", "4", "--num-threads", "1", "--merge"])  # fmt: skip
    adapter = run / "adapter"
    card = (adapter / "README.md").read_text()
    assert "AutoPeftModelForCausalLM" in card and "[More Information Needed]" not in card

    input_ids = torch.tensor([tokenizer("line 7 of a small")["input_ids"]])
    merged = AutoModelForCausalLM.from_pretrained(run / "merged").eval()
    with torch.no_grad():
        expected = merged(input_ids=input_ids).logits
    torch.save(input_ids, tmp_path / "input_ids.pt")
    snippets = [block.replace(recipe.ADAPTER_PLACEHOLDER, str(adapter)) for block in PYTHON_BLOCK.findall(card)]
    assert len(snippets) == 1
    check = textwrap.dedent(
        f"""
        import torch
        with torch.no_grad():
            logits = model.eval()(input_ids=torch.load({str(tmp_path / "input_ids.pt")!r})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        print(type(model.get_base_model()).__module__)
        """
    )
    printed = run_snippets([snippets[0] + check], tmp_path / "without", plugin=False)
    assert "transformers_modules" in printed  # the base model's class came from its own code, not the plugin
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-4, atol=1e-5)
