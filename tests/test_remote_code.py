"""Remote code: a saved checkpoint carries `auto_map` and its code, and loads where `damcha_hf` cannot be imported."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import randomize_cross_head, tiny_damcha_gpt2_config, tiny_damcha_llama_config, tiny_damcha_vit_config

import damcha_hf
from damcha_hf.families import family_of

REPO_ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter (`python -I`: no PYTHONPATH, no cwd on the path) with the plugin made unimportable, so
# that only the files copied next to the weights can define the model.
FRESH_PROCESS_LOADER = textwrap.dedent(
    """
    import sys

    sys.modules["damcha_hf"] = None  # `import damcha_hf` (and its submodules) now raises ImportError
    sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]  # no source checkout

    import torch
    import transformers

    spec_file, output_file = sys.argv[1:]
    reports = []
    for folder, inputs, auto_class_names in torch.load(spec_file):
        report = {{"classes": {{}}}}
        for index, auto_class_name in enumerate(auto_class_names):
            model = getattr(transformers, auto_class_name).from_pretrained(folder, trust_remote_code=True)
            report["classes"][auto_class_name] = (type(model).__module__, type(model).__name__)
            if index == 0:
                model.eval()
                with torch.no_grad():
                    report["logits"] = model(**inputs)[0]  # the logits (a denoiser: the predicted noise)
        reports.append(report)
    try:
        import damcha_hf  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    plugin_modules = sorted(m for m in sys.modules if m.startswith("damcha_hf") and sys.modules[m])
    for report in reports:
        report.update(damcha_hf_importable=importable, plugin_modules=plugin_modules)
    torch.save(reports, output_file)
    """
)


def load_in_fresh_process(folder: Path, inputs: dict, auto_class_names: list[str], work_dir: Path) -> dict:
    """Load `folder` with each Auto class and `trust_remote_code=True` in a new interpreter without the plugin.

    Returns the loaded class of each Auto class, the first one's logits on `inputs`, and whether damcha_hf was
    importable there. HF_HOME and the dynamic-module cache live in `work_dir`, and the Hub is offline.
    """
    (report,) = load_checkpoints_in_fresh_process([(folder, inputs, auto_class_names)], work_dir)
    return report


def load_checkpoints_in_fresh_process(checkpoints: list[tuple[Path, dict, list[str]]], work_dir: Path) -> list[dict]:
    """`load_in_fresh_process` for several (folder, inputs, Auto class names), in one new interpreter."""
    work_dir.mkdir(parents=True, exist_ok=True)
    script = work_dir / "load_without_plugin.py"
    script.write_text(FRESH_PROCESS_LOADER.format(repo_root=str(REPO_ROOT)))
    spec_file, output_file = work_dir / "checkpoints.pt", work_dir / "reports.pt"
    torch.save([(str(folder), inputs, list(names)) for folder, inputs, names in checkpoints], spec_file)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(
        HF_HOME=str(work_dir / "hf_home"),
        HF_MODULES_CACHE=str(work_dir / "hf_modules"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # The same thread count as this process, so that the CPU kernels reduce in the same order: identical logits.
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    completed = subprocess.run(
        [sys.executable, "-I", str(script), str(spec_file), str(output_file)],
        check=False,
        cwd=work_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return torch.load(output_file)


def expected_auto_map(config_class) -> dict[str, str]:
    """The `auto_map` a checkpoint of this family must carry: every head of its declaration, by file name."""

    def reference(cls) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    auto_map = {"AutoConfig": reference(config_class)}
    heads = [head for head in family_of(config_class).heads if head.auto_class]  # DoubleHeads has no Auto class
    auto_map.update({head.auto_class: reference(head.model_class) for head in heads})
    return auto_map


ALLOWED_TOP_LEVEL_IMPORTS = {"torch", "transformers", "huggingface_hub", *sys.stdlib_module_names}


def imported_packages(source: str) -> tuple[set[str], list[str]]:
    """(absolute top-level packages, relative module names) a Python source imports."""
    absolute, relative = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            absolute.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.level == 1, f"only single-dot relative imports work as remote code: {ast.unparse(node)}"
                relative.append(node.module)
            else:
                absolute.add(node.module.split(".")[0])
    return absolute, relative


FAMILIES = [
    (damcha_hf.DamchaGPT2Model, tiny_damcha_gpt2_config),
    (damcha_hf.DamchaGPT2LMHeadModel, tiny_damcha_gpt2_config),
    (damcha_hf.DamchaGPT2ForSequenceClassification, tiny_damcha_gpt2_config),
    (damcha_hf.DamchaLlamaModel, tiny_damcha_llama_config),
    (damcha_hf.DamchaLlamaForCausalLM, tiny_damcha_llama_config),
    (damcha_hf.DamchaLlamaForSequenceClassification, tiny_damcha_llama_config),
    (damcha_hf.DamchaViTModel, tiny_damcha_vit_config),
    (damcha_hf.DamchaViTForImageClassification, tiny_damcha_vit_config),
]


@pytest.mark.parametrize("model_class, make_config", FAMILIES, ids=lambda x: getattr(x, "__name__", ""))
def test_auto_map_lists_the_whole_family_whichever_class_is_saved(model_class, make_config, tmp_path):
    config = make_config()
    model_class(config).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == expected_auto_map(type(config))
    expected_heads = {"AutoModelForCausalLM", "AutoModelForSequenceClassification"}
    if isinstance(config, damcha_hf.DamchaViTConfig):
        expected_heads = {"AutoModelForImageClassification"}
    assert set(auto_map) >= {"AutoConfig", "AutoModel", *expected_heads}
    # Every referenced class is defined in a file that was copied next to the weights, and that file's relative
    # imports were copied too; nothing imports more than torch, transformers, huggingface_hub and the stdlib.
    python_files = {path.name: path.read_text() for path in tmp_path.glob("*.py")}
    for reference in auto_map.values():
        module, class_name = reference.split(".")
        assert f"class {class_name}(" in python_files[f"{module}.py"]
    for name, source in python_files.items():
        absolute, relative = imported_packages(source)
        assert absolute <= ALLOWED_TOP_LEVEL_IMPORTS, f"{name} imports {absolute - ALLOWED_TOP_LEVEL_IMPORTS}"
        assert all(f"{module}.py" in python_files for module in relative), (name, relative)


def test_vit_hub_checkpoint_loads_with_trust_remote_code_without_the_plugin(tmp_path):
    from test_vit import tiny_damcha_vit_config
    from transformers import ViTImageProcessor

    from damcha_hf.hub import save_hub_checkpoint

    model = damcha_hf.DamchaViTForImageClassification(tiny_damcha_vit_config()).eval()
    randomize_cross_head(model)
    processor = ViTImageProcessor(size={"height": 28, "width": 28}, image_mean=[0.5], image_std=[0.5])
    folder = save_hub_checkpoint(model, tmp_path / "vit", tokenizer_or_processor=processor, metric_heatmap=False)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == expected_auto_map(damcha_hf.DamchaViTConfig)
    assert {"AutoConfig", "AutoModel", "AutoModelForImageClassification"} <= set(auto_map)

    config = model.config
    inputs = {"pixel_values": torch.randn(2, config.num_channels, config.image_size, config.image_size)}
    with torch.no_grad():
        expected = model(**inputs).logits
    auto_classes = ["AutoModelForImageClassification", "AutoModel"]
    report = load_in_fresh_process(folder, inputs, auto_classes, tmp_path / "fresh")

    assert report["damcha_hf_importable"] is False and report["plugin_modules"] == []
    assert [report["classes"][name][1] for name in auto_classes] == [
        "DamchaViTForImageClassification",
        "DamchaViTModel",
    ]
    assert all(report["classes"][name][0].startswith("transformers_modules.") for name in auto_classes)
    assert torch.equal(report["logits"], expected)
