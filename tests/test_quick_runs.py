"""The README's quick runs take about as long as it says (slow: each runs in full, as a user types it).

The oracle is the README's own table of quick runs (command, measured wall time, the load average it was measured
under): each command runs as written (quality.py writes into a temporary --out-dir), from an empty folder (the
recipes' default output folders land there) with a fresh Hugging Face cache, and must finish within twice its stated
time, scaled by how much busier the machine is now than when the figure was measured. This is a loose check that the
documentation still holds, not a benchmark."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
# | `python recipes/train_gpt2.py --data stdlib --max-steps 5` | 21 s | 1.2 GB | 2.1 |
QUICK_RUN_ROW = re.compile(
    r"^\| `(?P<command>python [^`]+)` \| (?P<time>[\d.]+) (?P<unit>s|min) \|[^|]*\| (?P<load>[\d.]+) \|$", re.MULTILINE
)
SECONDS = {"s": 1, "min": 60}


def quick_runs() -> list[tuple[str, float, float]]:
    """(command, stated seconds, load average when measured) of every row of the README's quick-run table."""
    return [
        (match["command"], float(match["time"]) * SECONDS[match["unit"]], float(match["load"]))
        for match in QUICK_RUN_ROW.finditer(README.read_text())
    ]


def test_the_readme_lists_the_quick_runs():
    """The table the slow test reads: the Trainer recipes' quick runs and the speed benchmark's --quick preset (a
    experiments/quality.py --quick row is checked the same way once it has a measured time)."""
    commands = [command for command, _, _ in quick_runs()]
    for expected in ("recipes/train_gpt2.py", "recipes/train_vit.py", "experiments/speed.py"):
        assert any(expected in command for command in commands), expected
    assert any("--tokenizer bpe" in command for command in commands)


def busy_factor(load_average: float) -> float:
    """How many times longer a CPU-bound run takes at this load than alone on the machine's cores."""
    return max(1.0, load_average / (os.cpu_count() or 1))


@pytest.mark.slow
@pytest.mark.parametrize(("command", "stated_seconds", "measured_load"), quick_runs(), ids=lambda value: str(value))
def test_a_quick_run_finishes_within_twice_its_stated_time(tmp_path, command, stated_seconds, measured_load):
    argv = shlex.split(command)
    assert argv[0] == "python"
    argv = [sys.executable, str(REPO_ROOT / argv[1]), *argv[2:]]
    if not Path(argv[1]).is_file():
        pytest.fail(f"the README's quick run {command!r} names a script that does not exist")
    if argv[1].endswith("quality.py"):  # its default output folder is inside the repository
        argv += ["--out-dir", str(tmp_path / "quality")]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    budget = 2 * stated_seconds * busy_factor(os.getloadavg()[0]) / busy_factor(measured_load)
    started = time.monotonic()
    completed = subprocess.run(
        argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=budget + 60
    )
    seconds = time.monotonic() - started
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert seconds < budget, (
        f"{command} took {seconds:.0f} s; the README states {stated_seconds:.0f} s (measured at load average "
        f"{measured_load}), so within {budget:.0f} s at today's load average {os.getloadavg()[0]:.1f}"
    )
