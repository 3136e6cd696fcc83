"""The README's quick runs take about as long as it says (slow: each runs in full, as a user types it), and those
that need a Debian data set stop at once, in one line naming the package, where it is not installed.

The oracle is the README's own table of quick runs (command, what it needs, measured wall time, the load average it was
measured under): each command runs as written (quality.py writes into a temporary --out-dir), from an empty folder (the
recipes' default output folders land there) with a fresh Hugging Face cache, and must finish within twice its stated
time, scaled by how much busier the machine is now than when the figure was measured. This is a loose check that the
documentation still holds, not a benchmark. A run whose data set is not installed on this machine runs on a generated
sample of it in the same on-disk format instead (named with --fashion-mnist-dir / $DAMCHA_GCIDE_PATH), and says so
in its failure message."""

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DATA_SETS, INSTALL_COMMAND, README, quick_runs

from damcha_hf import data_sources
from damcha_hf.optional_packages import EXTRAS

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_lists_the_quick_runs():
    """The table the slow test reads: the Trainer recipes' quick runs, the speed and quality benchmarks' --quick
    presets, what each needs (nothing, or Debian data sets), and the one command that installs those."""
    runs = quick_runs()
    commands = [run.command for run in runs]
    for expected in ("recipes/train_gpt2.py", "recipes/train_vit.py", "experiments/speed.py", "experiments/quality.py"):
        assert any(expected in command for command in commands), expected
    assert any("--tokenizer bpe" in command for command in commands)
    for run in runs:
        assert set(run.needs) <= set(DATA_SETS), f"{run.command}: needs {run.needs}; expected 'nothing' or {DATA_SETS}"
        assert set(run.extras) <= set(EXTRAS), f"{run.command}: needs the extras {run.extras}; setup.cfg has {EXTRAS}"
    assert {name for run in runs for name in run.needs} == set(DATA_SETS)
    assert f"`{INSTALL_COMMAND}`" in " ".join(README.read_text().split())
    assert all(data_set.package in INSTALL_COMMAND for data_set in DATA_SETS.values())


def command_line(command: str) -> list[str]:
    argv = shlex.split(command)
    assert argv[0] == "python"
    return [sys.executable, str(REPO_ROOT / argv[1]), *argv[2:]]


def clean_environment(tmp_path: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    return env


NEEDS_DATA = [run for run in quick_runs() if run.needs]


@pytest.mark.parametrize("run", NEEDS_DATA, ids=str)
def test_a_quick_run_without_its_data_says_in_one_line_what_to_install(tmp_path, run):
    """As typed on a machine without the data set (here, or hidden: --fashion-mnist-dir and $DAMCHA_GCIDE_PATH
    pointed at nothing): exit code 2 at once, one line on stderr naming the Debian package of each missing data set,
    nothing written."""
    argv, env = command_line(run.command), clean_environment(tmp_path)
    installed = {name for name in run.needs if not DATA_SETS[name].missing_here()}
    if "Fashion-MNIST" in installed:
        argv += ["--fashion-mnist-dir", str(tmp_path / "no-fashion-mnist")]
    if "GCIDE" in installed:
        env[data_sources.GCIDE_PATH_VARIABLE] = str(tmp_path / "no-gcide.dict.dz")
    if argv[1].endswith("quality.py"):
        argv += ["--out-dir", str(tmp_path / "quality")]
    folder = tmp_path / "cwd"
    folder.mkdir()
    completed = subprocess.run(argv, cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=120)  # fmt: skip
    assert completed.returncode == 2, completed.stderr[-3000:]
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    for name in run.needs:
        assert "apt-get" in lines[0] and DATA_SETS[name].package in lines[0], lines[0]
    assert list(folder.iterdir()) == [] and not (tmp_path / "quality").exists()


def busy_factor(load_average: float) -> float:
    """How many times longer a CPU-bound run takes at this load than alone on the machine's cores."""
    return max(1.0, load_average / (os.cpu_count() or 1))


@pytest.mark.slow
@pytest.mark.parametrize("run", quick_runs(), ids=str)
def test_a_quick_run_finishes_within_twice_its_stated_time(tmp_path, run):
    argv = command_line(run.command)
    if not Path(argv[1]).is_file():
        pytest.fail(f"the README's quick run {run.command!r} names a script that does not exist")
    if argv[1].endswith("quality.py"):  # its default output folder is inside the repository
        argv += ["--out-dir", str(tmp_path / "quality")]
    env = clean_environment(tmp_path)
    generated = [name for name in run.needs if DATA_SETS[name].missing_here()]
    for name in generated:
        extra_arguments, extra_environment = DATA_SETS[name].point_at_sample(tmp_path)
        argv += extra_arguments
        env.update(extra_environment)
    on = f" on generated {' and '.join(generated)} ({', '.join(generated)} not installed here)" if generated else ""
    folder = tmp_path / "cwd"
    folder.mkdir()
    budget = 2 * run.stated_seconds * busy_factor(os.getloadavg()[0]) / busy_factor(run.measured_load)
    started = time.monotonic()
    completed = subprocess.run(
        argv, cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=budget + 60
    )
    seconds = time.monotonic() - started
    assert completed.returncode == 0, f"{run.command}{on}: " + completed.stderr[-3000:]
    assert seconds < budget, (
        f"{run.command}{on} took {seconds:.0f} s; the README states {run.stated_seconds:.0f} s (measured at load "
        f"average {run.measured_load}), so within {budget:.0f} s at today's load average {os.getloadavg()[0]:.1f}"
    )
