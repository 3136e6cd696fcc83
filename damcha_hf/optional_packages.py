"""The packages some recipes and scripts need beyond `pip install -e .`, by the setup.cfg extra that installs them.

A script checks its extras when its arguments are parsed, before any data is read or any model trained, and names the
extra to install in one line: a missing package found only when its first use comes (after minutes of training) wastes
the run. Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.util

# extra -> (module, pip name, what it is used for), as setup.cfg's [options.extras_require] lists them.
EXTRAS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "seq2seq": (
        ("sacrebleu", "sacrebleu", "BLEU and chrF"),
        ("rouge_score", "rouge-score", "ROUGE"),
    ),
    "experiments": (("scipy", "scipy", "the statistics of the comparisons"),),
    "diffusion": (("diffusers", "diffusers", "the noise schedules"),),
    "trl": (("trl", "trl", "the SFTTrainer"),),
    "eval": (("lm_eval", "lm-eval", "lm-evaluation-harness"),),
}


def importable(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        return False


def missing_extras_message(what: str, *extras: str) -> str | None:
    """One line naming the packages of `extras` that `what` needs and cannot import, and the install command; None
    when every one is installed."""
    missing = [(extra, package) for extra in extras for package in EXTRAS[extra] if not importable(package[0])]
    if not missing:
        return None
    needed = sorted({extra for extra, _ in missing}, key=list(EXTRAS).index)
    packages = ", ".join(f"{pip_name} ({purpose})" for _, (_, pip_name, purpose) in missing)
    return (
        f"{what} needs {packages}, not installed here; install the {' and '.join(needed)} "
        f'extra{"s" * (len(needed) > 1)}: pip install -e ".[{",".join(needed)}]" in a clone of damcha-hf '
        f"(or pip install {' '.join(pip_name for _, (_, pip_name, _) in missing)})"
    )


def check_extras(parser: argparse.ArgumentParser, what: str, *extras: str) -> None:
    """`parser.error` (one line, exit code 2) when a package of `extras` is missing."""
    message = missing_extras_message(what, *extras)
    if message:
        parser.error(message)
