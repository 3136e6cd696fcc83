"""The built wheel installs everything under the `damcha_hf` namespace, with the model files and metric modules."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
RECIPE_NAMES = ("train_gpt2", "train_gpt2_accelerate", "train_vit", "finetune_lora", "train_diffusion")
HEAVY = ("torch", "transformers", "accelerate", "peft", "datasets")


def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (this one has torch loaded already), stdin closed."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, check=False
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # Build from a copy, so the build leaves no build/ or egg-info folder in the checkout.
    source = tmp_path_factory.mktemp("source") / "damcha-hf"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "__pycache__", "docs", "damcha-demo", "runs", "outputs"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("damcha_hf-*.whl")
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def wheel_names(wheel) -> list[str]:
    return wheel.namelist()


def test_no_generic_top_level_name_lands_in_site_packages(wheel_names):
    top_level = {name.split("/")[0] for name in wheel_names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"damcha_hf"}


def test_model_files_install_as_damcha_hf_modeling(wheel_names):
    for module in ("metric.py", "configuration_damcha_gpt2.py", "modeling_damcha_gpt2.py"):
        assert f"damcha_hf/modeling/{module}" in wheel_names


def test_console_script_is_declared(wheel, wheel_names):
    (entry_points,) = [name for name in wheel_names if name.endswith("entry_points.txt")]
    assert "damcha-hf = damcha_hf.cli:main" in wheel.read(entry_points).decode()


def test_hub_package_installs_every_module(wheel_names):
    # damcha_hf.hub is a subpackage: setup.cfg lists packages explicitly, so a missing entry would drop it silently.
    hub_modules = sorted(path.name for path in (REPO / "damcha_hf" / "hub").glob("*.py"))
    assert hub_modules and all(f"damcha_hf/hub/{name}" in wheel_names for name in hub_modules)


def test_import_is_lazy_and_the_auto_classes_still_resolve_damcha_types():
    """`import damcha_hf` imports neither torch nor transformers; afterwards the Auto classes know every DAMCHA type
    without trust_remote_code, and each module runs once (one class object per class)."""
    completed = run_python(
        f"""
import json, sys
import damcha_hf
heavy_after_import = sorted(name for name in {HEAVY!r} if name in sys.modules)
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification
config = AutoConfig.for_model("damcha_gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
model = AutoModelForCausalLM.from_config(config)
vit = AutoModelForImageClassification.from_config(AutoConfig.for_model(
    "damcha_vit", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32, image_size=8,
    patch_size=4))
from damcha_hf.safe_files import UnsafeOutputError
import damcha_hf.cli, damcha_hf.commands.demo, damcha_hf.safe_files as safe_files
print(json.dumps({{
    "heavy_after_import": heavy_after_import,
    "config": type(config).__name__, "model": type(model).__name__, "vit": type(vit).__name__,
    "same_class": model.__class__ is damcha_hf.DamchaGPT2LMHeadModel,
    "one_error_class": UnsafeOutputError is safe_files.UnsafeOutputError,
}}))
"""
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["heavy_after_import"] == []
    assert (report["config"], report["model"], report["vit"]) == (
        "DamchaGPT2Config",
        "DamchaGPT2LMHeadModel",
        "DamchaViTForImageClassification",
    )
    assert report["same_class"] and report["one_error_class"]


@pytest.mark.parametrize(
    "first_use",
    [
        "damcha_hf.DamchaGPT2LMHeadModel",  # a model file first: it imports transformers' GPT-2, then the Auto module
        # the family table first, from inside the package (slow: a second fresh interpreter)
        pytest.param("__import__('damcha_hf.hub').hub.save_hub_checkpoint", marks=pytest.mark.slow),
    ],
)
def test_any_public_name_used_first_imports_and_registers(first_use):
    """Whatever a fresh process touches first, the model files load once and every Auto class then resolves them."""
    completed = run_python(
        f"""
import damcha_hf
{first_use}
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM
causal = AutoModelForCausalLM.from_config(AutoConfig.for_model("damcha_gpt2", n_layer=1, n_embd=32, n_head=4))
seq2seq = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(
    "damcha_bart", d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32))
print(type(causal).__name__, type(seq2seq).__name__, type(causal) is damcha_hf.DamchaGPT2LMHeadModel)
"""
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.split() == ["DamchaGPT2LMHeadModel", "DamchaBartForConditionalGeneration", "True"]


def test_parsers_build_without_torch():
    """Every parser (the command line, each subcommand, each recipe) is built and answers --help without importing
    torch, transformers or the data libraries."""
    code = f"""
import contextlib, io, json, runpy, sys
from damcha_hf.cli import build_parser
parser = build_parser()
helps = {{}}
for argv in ([], ["demo"], ["info"], ["inspect"], ["push"]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        parser.parse_args([*argv, "--help"])
    helps[" ".join(argv)] = "usage:" in out.getvalue()
sys.path.insert(0, {str(RECIPES)!r})
for name in {RECIPE_NAMES!r}:
    recipe = runpy.run_path({str(RECIPES)!r} + "/" + name + ".py", run_name="recipe")
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        recipe["parse_args"](["--help"])
    helps[name] = "usage:" in out.getvalue()
print(json.dumps({{"helps": helps, "heavy": sorted(name for name in {HEAVY!r} if name in sys.modules)}}))
"""
    completed = run_python(code)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert all(report["helps"].values()) and len(report["helps"]) == 5 + len(RECIPE_NAMES), report
    assert report["heavy"] == []


@pytest.mark.parametrize("argv", [["demo", "--help"], ["--help"], ["demo", "--max-step", "5"]])
def test_console_script_answers_at_once(argv):
    """The installed `damcha-hf` script: help, and a mistake (an abbreviated flag is not taken for --max-steps)."""
    script = Path(sys.executable).parent / "damcha-hf"
    completed = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120, check=False)
    if argv[-1] == "--help":
        assert completed.returncode == 0 and "usage: damcha-hf" in completed.stdout
    else:
        assert completed.returncode == 2
        assert completed.stderr.strip().splitlines() == [
            "damcha-hf: error: unrecognized arguments: --max-step 5 (see damcha-hf --help)"
        ]


def test_the_lazy_public_names_are_every_model_files_classes():
    """Every family's configuration and model file's public classes are public in `damcha_hf`, as the same objects:
    the families are read from their declarations, so a family added there is checked too."""
    import importlib

    import damcha_hf
    from damcha_hf.families import FAMILIES, NATIVE_FAMILIES

    families = (*FAMILIES, *NATIVE_FAMILIES)
    assert len(families) == len({family.damcha_model_type for family in families}) >= 10
    for family in families:
        modules = {family.config_class.__module__, *(head.model_class.__module__ for head in family.heads)}
        assert {module.rsplit(".", 1)[-1].split("_damcha_")[0] for module in modules} == {"configuration", "modeling"}
        for module in map(importlib.import_module, modules):
            exported = [name for name in module.__all__ if name != "DAMCHA_FAMILY" and "PreTrained" not in name]
            assert exported, module.__name__
            for name in exported:
                assert name in damcha_hf.__all__, f"{module.__name__}.{name} is not public in damcha_hf"
                assert getattr(damcha_hf, name) is getattr(module, name)


def test_the_model_files_import_each_other_without_a_circle():
    """The relative imports between the model files, those inside functions included, form no circle: a deferred
    import that closes one would hide it from Python and not from a reader."""
    import ast

    imports = {}
    for path in (REPO / "modeling").glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
        imports[path.stem] = found
    assert {"metric", "variant_damcha", "dispatch"} <= imports.keys()

    def circle_from(module, path):
        if module in path:
            return [*path[path.index(module) :], module]
        return next(
            filter(None, (circle_from(imported, [*path, module]) for imported in imports.get(module, ()))), None
        )

    for module in imports:
        assert circle_from(module, []) is None


def test_every_model_class_a_model_file_defines_is_a_declared_head_and_exported():
    """A family's model classes are the heads its declaration lists: a DAMCHA class extending a model class the stock
    transformers file exports, left out of the declaration, would be neither registered, converted to nor public. The
    file's `__all__` is derived from the declaration, so every head is exported."""
    import importlib

    from damcha_hf.families import FAMILIES, NATIVE_FAMILIES

    for family in (*FAMILIES, *NATIVE_FAMILIES):
        heads = {head.model_class for head in family.heads}
        (module_name,) = {cls.__module__ for cls in heads}
        module = importlib.import_module(module_name)
        assert len(heads) == len(family.heads) and module.__all__[0] == "DAMCHA_FAMILY"
        assert {cls.__name__ for cls in heads} <= set(module.__all__)
        assert all(getattr(module, name) is not None for name in module.__all__)
        if family in NATIVE_FAMILIES:  # no stock file to read the model classes from
            continue
        stock = importlib.import_module(family.heads[0].stock_class.__module__)
        stock_models = {getattr(stock, name) for name in stock.__all__}
        # The stock base class every head extends (`BartPreTrainedModel`) is not a model of its own.
        stock_models = {cls for cls in stock_models if not all(issubclass(head, cls) for head in heads)}
        defined = {
            value for value in vars(module).values() if isinstance(value, type) and value.__module__ == module_name
        }
        models = {cls for cls in defined if any(issubclass(cls, stock_model) for stock_model in stock_models)}
        assert models == heads, (module_name, models ^ heads)
