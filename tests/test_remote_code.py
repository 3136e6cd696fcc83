"""Remote code: a saved checkpoint carries `auto_map` and its code, and loads where `damcha_hf` cannot be imported."""

import ast
import json
import sys

import pytest
import torch
from conftest import (
    expected_auto_map,
    load_in_fresh_process,
    randomize_cross_head,
    tiny_damcha_gpt2_config,
    tiny_damcha_llama_config,
    tiny_damcha_vit_config,
)

import damcha_hf

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
