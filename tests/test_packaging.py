"""The built wheel installs everything under the `damcha_hf` namespace, with the model files and metric modules."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
    # damcha_hf_cli.py: the console script's torch-free entry point (it cannot live inside the package, whose
    # __init__ imports torch to register the models).
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"damcha_hf", "damcha_hf_cli.py"}


def test_model_files_install_as_damcha_hf_modeling(wheel_names):
    for module in ("metric.py", "configuration_damcha_gpt2.py", "modeling_damcha_gpt2.py"):
        assert f"damcha_hf/modeling/{module}" in wheel_names


def test_console_script_is_declared(wheel, wheel_names):
    (entry_points,) = [name for name in wheel_names if name.endswith("entry_points.txt")]
    assert "damcha-hf = damcha_hf_cli:main" in wheel.read(entry_points).decode()


def test_hub_package_installs_every_module(wheel_names):
    # damcha_hf.hub is a subpackage: setup.cfg lists packages explicitly, so a missing entry would drop it silently.
    hub_modules = sorted(path.name for path in (REPO / "damcha_hf" / "hub").glob("*.py"))
    assert hub_modules and all(f"damcha_hf/hub/{name}" in wheel_names for name in hub_modules)
