"""A saved checkpoint carries only the code it runs: its family's files, its variant's (and plain attention's), and the
shared core; nothing of another family or variant. It loads without the plugin, refuses a variant it does not carry,
and a checkpoint that carries every variant's code (as saves used to) still loads."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from conftest import REPO_ROOT, denoiser, load_checkpoints_in_fresh_process, tiny_damcha_gpt2_config
from family_cases import CASES, first_output, trained_model
from shipped_code import MODELING, expected_code, variant_module

from damcha_hf.hub.push import upload_plan
from damcha_hf.modeling.variants import CROSS_HEAD_VARIANTS, VARIANTS

# The Python files a checkpoint carries, per family at the default variant and per variant on GPT-2 (before a
# checkpoint carried its own code only: 24 files for GPT-2 and 25 for Llama, whatever the variant). The sets themselves
# are derived from the import graph below; these counts say how big they are, and change only with that graph.
FAMILY_FILE_COUNTS = {
    "gpt2": 18, "llama": 19, "vit": 18, "bart": 18, "mistral": 19, "qwen2": 19, "qwen3": 19, "phi3": 19,
    "gemma2": 19, "vit_denoiser": 20,
}  # fmt: skip
GPT2_VARIANT_FILE_COUNTS = {"damcha": 18, "talking_heads": 17, "dcmha": 17, "colmha": 16, "moa": 16, "none": 14}


def python_files(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("*.py")}


def entry_modules(folder: Path) -> set[str]:
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    return {reference.rpartition(".")[0] for reference in auto_map.values()}


def assert_ships_only_its_code(folder: Path, variant: str) -> set[str]:
    shipped = python_files(folder)
    expected = expected_code(entry_modules(folder), variant)
    other_variants = {f"{variant_module(name)}.py" for name in VARIANTS if name not in (variant, "none")}
    assert not shipped & other_variants, f"another variant's declaration shipped: {sorted(shipped & other_variants)}"
    assert shipped == expected, (sorted(shipped - expected), sorted(expected - shipped))
    # What a push uploads is the same code (it follows the imports from auto_map too).
    assert {name for name in upload_plan(folder) if name.endswith(".py")} == shipped
    return shipped


def other_family_files(folder: Path, family_modules: set[str]) -> set[str]:
    """Family files (`modeling_damcha_*`, `configuration_damcha_*`) in `folder` beyond those `family_modules` import."""
    family_files = {name for name in python_files(folder) if name.startswith(("modeling_damcha_", "configuration_"))}
    return family_files - expected_code(family_modules, "none")


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_family_ships_its_own_code_at_the_default_variant(name, tmp_path):
    model = trained_model(name, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    shipped = assert_ships_only_its_code(tmp_path, "damcha")
    assert not other_family_files(tmp_path, entry_modules(tmp_path))
    assert len(shipped) == FAMILY_FILE_COUNTS[name], sorted(shipped)


def test_the_denoiser_ships_its_own_code_and_the_vit_files_it_builds_on(tmp_path):
    denoiser().save_pretrained(tmp_path)
    shipped = assert_ships_only_its_code(tmp_path, "damcha")
    assert {"modeling_damcha_vit.py", "configuration_damcha_vit.py"} <= shipped  # it extends the ViT encoder
    assert len(shipped) == FAMILY_FILE_COUNTS["vit_denoiser"], sorted(shipped)


@pytest.mark.parametrize("variant", CROSS_HEAD_VARIANTS)
def test_each_variant_ships_its_own_code(variant, tmp_path):
    model = trained_model("gpt2", dtype=torch.float32, cross_head_variant=variant)
    model.save_pretrained(tmp_path)
    shipped = assert_ships_only_its_code(tmp_path, variant)
    assert len(shipped) == GPT2_VARIANT_FILE_COUNTS[variant], sorted(shipped)


def test_the_counts_cover_every_family_and_variant():
    assert sorted(FAMILY_FILE_COUNTS) == sorted([*CASES, "vit_denoiser"])
    assert sorted(GPT2_VARIANT_FILE_COUNTS) == sorted(CROSS_HEAD_VARIANTS)


def test_a_file_the_save_did_not_copy_is_never_removed(tmp_path):
    # `moa.py` is GPT-2's code's name for MoA's module, which transformers' save copies over (and so replaces) before
    # the checkpoint drops it; a file of any other name is the user's and stays.
    (tmp_path / "notes.py").write_text("x = 1\n")
    (tmp_path / "variant_notes.py").write_text("y = 2\n")
    trained_model("gpt2", dtype=torch.float32).save_pretrained(tmp_path)
    assert (tmp_path / "notes.py").read_text() == "x = 1\n"
    assert (tmp_path / "variant_notes.py").read_text() == "y = 2\n"
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no temporary file left


def test_save_pretrained_pushing_to_the_hub_uploads_only_the_saved_code(tmp_path, monkeypatch):
    if not all(hasattr(transformers.modeling_utils, name) for name in ("hf_api", "create_and_tag_model_card")):
        pytest.skip("this transformers release reaches the Hub through other names than the fakes below replace")
    uploaded = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

    def fake_upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        uploaded.extend(sorted(name for name in os.listdir(working_dir) if name.endswith(".py")))

    monkeypatch.setattr(transformers.modeling_utils, "hf_api", lambda: FakeApi())
    monkeypatch.setattr(transformers.modeling_utils, "create_and_tag_model_card", lambda *a, **k: _NoCard())
    model = trained_model("gpt2", dtype=torch.float32, cross_head_variant="moa")
    monkeypatch.setattr(transformers.PreTrainedModel, "_upload_modified_files", fake_upload)
    model.save_pretrained(tmp_path / "pushed", push_to_hub=True, repo_id="someone/tiny")
    assert uploaded and set(uploaded) == expected_code(entry_modules(tmp_path / "pushed"), "moa")


class _NoCard:
    def save(self, path):
        Path(path).write_text("card\n")


# --- loading without the plugin ---------------------------------------------------------------------------------------


def test_every_variant_loads_without_the_plugin_and_computes_the_same(tmp_path):
    checkpoints, expected = [], []
    for name in ("gpt2", "llama"):
        inputs = CASES[name].inputs()
        for variant in CROSS_HEAD_VARIANTS:
            model = trained_model(name, dtype=torch.float32, cross_head_variant=variant)
            folder = tmp_path / f"{name}-{variant}"
            model.save_pretrained(folder)
            with torch.no_grad():
                expected.append(((name, variant), first_output(model(**inputs))))
            checkpoints.append((folder, inputs, [CASES[name].family.task_head.auto_class]))
    reports = load_checkpoints_in_fresh_process(checkpoints, tmp_path / "fresh")
    for (what, logits), report in zip(expected, reports, strict=True):
        assert report["damcha_hf_importable"] is False and report["plugin_modules"] == []
        assert torch.equal(report["logits"], logits), what


# Loads a checkpoint's config and model as remote code in a fresh interpreter without the plugin, tries to switch the
# variant, and saves the model again.
SWITCH_AND_RESAVE = textwrap.dedent(
    """
    import json, os, sys

    sys.modules["damcha_hf"] = None
    sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]

    import transformers

    folder, other_variant, resaved = sys.argv[1:]
    report = {{}}
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    try:
        config.cross_head_variant = other_variant
    except ValueError as error:
        report["setattr"] = str(error)
    try:
        transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True, cross_head_variant=other_variant)
    except ValueError as error:
        report["from_pretrained"] = str(error)
    try:
        transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True, cross_head_variant="damhca")
    except ValueError as error:
        report["misspelt"] = str(error)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    model.save_pretrained(resaved)
    report["resaved_files"] = sorted(name for name in os.listdir(resaved) if name.endswith(".py"))
    report["resaved_variant"] = json.load(open(os.path.join(resaved, "config.json")))["cross_head_variant"]
    print(json.dumps(report))
    """
)


def run_without_the_plugin(script: str, args: list[str], work_dir: Path) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "script.py"
    path.write_text(script.format(repo_root=str(REPO_ROOT)))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(work_dir / "hf_home"), HF_MODULES_CACHE=str(work_dir / "hf_modules"), HF_HUB_OFFLINE="1")
    completed = subprocess.run(
        [sys.executable, "-I", str(path), *args], cwd=work_dir, env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_a_checkpoint_refuses_a_variant_whose_code_it_does_not_carry_and_saves_again_the_same(tmp_path):
    model = trained_model("gpt2", dtype=torch.float32, cross_head_variant="moa")
    model.save_pretrained(tmp_path / "moa")
    report = run_without_the_plugin(
        SWITCH_AND_RESAVE, [str(tmp_path / "moa"), "damcha", str(tmp_path / "resaved")], tmp_path / "fresh"
    )
    for how in ("setattr", "from_pretrained"):
        message = report[how]
        assert "\n" not in message and "`cross_head_variant='damcha'` is not in this checkpoint's code" in message
        assert "'moa' and 'none'" in message and "import damcha_hf" in message
    assert "unknown `cross_head_variant` 'damhca'" in report["misspelt"]  # a misspelling is still called one
    assert report["resaved_files"] == sorted(python_files(tmp_path / "moa"))
    assert report["resaved_variant"] == "moa"


CONFIG_WITHOUT_THE_PLUGIN = textwrap.dedent(
    """
    import json, sys

    sys.modules["damcha_hf"] = None
    sys.path = [entry for entry in sys.path if entry.rstrip("/") not in ("", {repo_root!r})]

    import transformers

    config = transformers.AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)
    print(json.dumps({{"class": type(config).__name__, "variant": config.cross_head_variant,
                      "moa_top_k": config.moa_top_k}}))
    """
)


@pytest.mark.parametrize("variant", ["damcha", "moa"])
def test_a_config_saved_alone_ships_only_its_variant_s_code_and_loads_without_the_plugin(variant, tmp_path):
    config = tiny_damcha_gpt2_config(cross_head_variant=variant, moa_top_k=2)
    config.save_pretrained(tmp_path / "config")
    shipped = python_files(tmp_path / "config")
    assert shipped == expected_code(entry_modules(tmp_path / "config"), variant)
    assert shipped < expected_code(entry_modules(tmp_path / "config"), None)  # not every variant's
    report = run_without_the_plugin(CONFIG_WITHOUT_THE_PLUGIN, [str(tmp_path / "config")], tmp_path / "fresh")
    assert report == {"class": type(config).__name__, "variant": variant, "moa_top_k": 2}


# --- checkpoints that carry every variant's code ----------------------------------------------------------------------


def with_every_variant_s_code(folder: Path) -> None:
    """Turn `folder` into a checkpoint as saves wrote it before they carried only their own code: every file the
    family's files import through the plugin's registry, which imports every variant."""
    for name in expected_code(entry_modules(folder), None):
        shutil.copyfile(MODELING / name, folder / name)


def test_a_checkpoint_carrying_every_variant_s_code_still_loads_with_and_without_the_plugin(tmp_path):
    inputs = CASES["gpt2"].inputs()
    model = trained_model("gpt2", dtype=torch.float32, cross_head_variant="moa")
    folder = tmp_path / "full"
    model.save_pretrained(folder)
    with_every_variant_s_code(folder)
    assert (folder / "variants.py").read_bytes() == (MODELING / "variants.py").read_bytes()
    assert {f"{variant_module(name)}.py" for name in VARIANTS} <= python_files(folder)
    with torch.no_grad():
        logits = first_output(model(**inputs))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(loaded) is type(model)
        assert torch.equal(first_output(loaded(**inputs)), logits)
    (report,) = load_checkpoints_in_fresh_process([(folder, inputs, ["AutoModelForCausalLM"])], tmp_path / "fresh")
    assert report["damcha_hf_importable"] is False
    assert torch.equal(report["logits"], logits)
    # Saved again with the plugin, it carries its own code only.
    loaded.save_pretrained(tmp_path / "resaved")
    assert_ships_only_its_code(tmp_path / "resaved", "moa")
