#!/usr/bin/env python
"""Run transformers' own per-family model tests (`tests/models/<family>/test_modeling_<family>.py`) against the DAMCHA
classes, and list every test whose outcome differs from the stock classes'.

transformers' sdist does not ship those files, and this repository holds no copy of them: pass a folder holding them
(any layout: each `test_modeling_<family>.py` and the `causal_lm_tester.py` they import are found by name), taken from
the transformers repository at a commit you name. The script builds, in a temporary folder, the package those files
expect (`tests/models/<family>/...`, `tests/causal_lm_tester.py`, and the common test modules they import, from the
installed release's sdist, downloaded once and cached as `upstream_common_tests.py` caches it), then runs pytest on
it twice in fresh interpreters:

- stock: the files as they are;
- DAMCHA: with each family's stock config and model classes replaced, in `transformers`' namespace, by the DAMCHA
  classes its declaration lists (`DamchaFamily.heads`), before the test files are imported, so that every class the
  tests name or build is DAMCHA's, and with the DAMCHA class names listed in transformers' Auto name mappings next to
  the stock ones (tests find a head's labels and loss by its class name there). The metric generator gets random
  non-zero weights wherever a model is built (`--zero-generator`: left at zero, the stock model's outputs), so that
  the tests run where the cross-head metric changes the attention.

Names the stored files import that the installed release has dropped are given to both runs alike
(`COMPATIBILITY_NAMES`). The outcome of each test in both runs is compared; the script prints the counts and every
test that passes on stock and not on DAMCHA (exit code 1 when there is one), and writes both runs' outcomes as JSON
with `--report`.

    python tests/run_upstream_family_tests.py path/to/upstream-tests --families qwen2 qwen3 --report out.json
    python tests/run_upstream_family_tests.py FOLDER -- -k "not generate"   # arguments after -- go to pytest
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import upstream_common_tests  # noqa: E402  (the sdist download and extraction, shared with the common tests)

# The test modules of the sdist that the per-family files and `causal_lm_tester.py` import (with what they import).
SDIST_MODULES = ("test_modeling_common", "test_configuration_common")
# The pipeline tests of the family files: the sdist's mixin reads transformers' source tree (`src/transformers`) and
# the Hub's tiny-model summary at import, neither of which an installed release has, and every family file here skips
# its pipeline tests (`is_pipeline_test_to_skip`); an empty mixin stands in for it in both runs.
PIPELINE_MIXIN_STAND_IN = '''"""Stand-in for the pipeline tests (run_upstream_family_tests.py): none run."""


class PipelineTesterMixin:
    pass
'''
SUBSTITUTE_VARIABLE = "DAMCHA_SUBSTITUTE_FAMILIES"
BUILT_PACKAGE = "tests"  # the package the upstream files' relative imports expect (`from ...causal_lm_tester`)
ZERO_GENERATOR_VARIABLE = "DAMCHA_ZERO_GENERATOR"

# Names the stored upstream files import that the installed release no longer has, given to the stock and DAMCHA runs
# alike, as pass-through decorators: SDPA is always available in the torch releases transformers 5 supports, and the
# tests that need a Hub token (gated checkpoints) are slow integration tests, which never run offline.
COMPATIBILITY_NAMES = {"require_torch_sdpa": lambda test: test, "require_read_token": lambda test: test}

# The built package's conftest.py: `prepare_pytest_run` below, run before pytest imports the test files.
CONFTEST = f"""import sys

sys.path.insert(0, {str(HERE)!r})
import run_upstream_family_tests  # noqa: E402

run_upstream_family_tests.prepare_pytest_run()
"""


def prepare_pytest_run() -> None:
    """In the pytest process: the compatibility names, then the DAMCHA substitution for the families that
    SUBSTITUTE_VARIABLE names (none: the stock run)."""
    import transformers.testing_utils

    for name, value in COMPATIBILITY_NAMES.items():
        if not hasattr(transformers.testing_utils, name):
            setattr(transformers.testing_utils, name, value)
    families = list(filter(None, os.environ.get(SUBSTITUTE_VARIABLE, "").split(",")))
    for model_type in families:
        substitute_family(model_type, random_generator=not os.environ.get(ZERO_GENERATOR_VARIABLE))
    if families:
        # The mixin runs its weight-init check only for models whose config file carries a copyright year of 2023 or
        # later, which the DAMCHA files carry none of (the stock files of these families do): run it, as on stock.
        import importlib

        common = importlib.import_module(f"{BUILT_PACKAGE}.test_modeling_common")
        common.ModelTesterMixin.test_can_init_all_missing_weights_before_2023 = True


def substitute_family(model_type: str, random_generator: bool) -> None:
    """Put the family's DAMCHA config and model classes where its stock ones are found by name: transformers' and
    its model package's namespaces, and transformers' Auto name mappings (beside the stock names)."""
    import importlib

    import torch
    import transformers
    from transformers.models.auto import modeling_auto

    from damcha_hf.families import family_for_model_type

    family = family_for_model_type(model_type)
    stock_config = next(cls for cls in family.config_class.__mro__ if cls.__module__.startswith("transformers."))
    replacements = {stock_config.__name__: family.config_class}
    replacements.update({head.stock_class.__name__: head.model_class for head in family.heads})
    stock_package = importlib.import_module(f"transformers.models.{model_type}")
    for name, damcha_class in replacements.items():
        setattr(transformers, name, damcha_class)
        setattr(stock_package, name, damcha_class)
    for mapping_name in dir(modeling_auto):
        mapping = getattr(modeling_auto, mapping_name)
        if mapping_name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict) and model_type in mapping:
            stock_name = mapping[model_type]
            if isinstance(stock_name, str) and stock_name in replacements:
                mapping[family.damcha_model_type] = replacements[stock_name].__name__
    if random_generator:
        pretrained = family.heads[0].model_class._family_pretrained_class()
        original_init = pretrained._init_weights

        def init_then_randomize_the_generator(self, module):
            original_init(self, module)
            if type(module).__name__ == "MetricOutputLayer":  # the generator's output layer, zero after the init
                torch.nn.init.normal_(module.weight, std=0.5)
                torch.nn.init.normal_(module.bias, std=0.5)

        pretrained._init_weights = init_then_randomize_the_generator


def find_file(folder: Path, name: str) -> Path | None:
    found = sorted(folder.rglob(name))
    return found[0] if found else None


def build_package(upstream: Path, families: list[str], work: Path) -> list[Path]:
    """The package the upstream files expect, under `work/tests`; returns the test files to run."""
    package = work / BUILT_PACKAGE
    sdist_folder = upstream_common_tests.cache_dir().with_name(f"{upstream_common_tests.cache_dir().name}-sdist")
    sdist = next(sdist_folder.glob("transformers-*.tar.gz"), None) if sdist_folder.is_dir() else None
    if sdist is None:
        sdist_folder.mkdir(parents=True, exist_ok=True)
        sdist = upstream_common_tests.download_sdist(upstream_common_tests.transformers.__version__, sdist_folder)
    missing = upstream_common_tests.extract_common_tests(sdist, package, entry_modules=SDIST_MODULES)
    for module in missing:  # the stand-ins answer for the modules the sdist lacks, as for the common tests
        stand_in = upstream_common_tests.STAND_INS / (module.replace(".", "/") + ".py")
        if stand_in.is_file():
            target = package / stand_in.relative_to(upstream_common_tests.STAND_INS)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(stand_in, target)
    (package / "test_pipeline_mixin.py").write_text(PIPELINE_MIXIN_STAND_IN)
    tester = find_file(upstream, "causal_lm_tester.py")
    if tester is not None:
        shutil.copyfile(tester, package / "causal_lm_tester.py")
    test_files = []
    for family in families:
        source = find_file(upstream, f"test_modeling_{family}.py")
        if source is None:
            raise SystemExit(f"run_upstream_family_tests: no test_modeling_{family}.py under {upstream}")
        target = package / "models" / family / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        test_files.append(target)
    for folder in [package, *(path for path in package.rglob("*") if path.is_dir())]:
        (folder / "__init__.py").touch()
    (package / "conftest.py").write_text(CONFTEST)
    return test_files


def run_pytest(work: Path, test_files: list[Path], families: list[str], damcha: bool, zero_generator: bool,
               pytest_args: list[str]) -> dict[str, str]:  # fmt: skip
    """Run pytest in a fresh interpreter; returns {test id: passed / failed / error / skipped}."""
    report = work / ("damcha.xml" if damcha else "stock.xml")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "USE_HUB_KERNELS": "0"}
    environment[SUBSTITUTE_VARIABLE] = ",".join(families) if damcha else ""
    environment[ZERO_GENERATOR_VARIABLE] = "1" if zero_generator else ""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={work}",
               f"--junitxml={report}", "-o", "junit_family=xunit1", *map(str, test_files), *pytest_args]  # fmt: skip
    subprocess.run(command, cwd=work, env=environment, check=False)
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        children = {child.tag for child in case}
        outcome = next((tag for tag in ("failure", "error", "skipped") if tag in children), "passed")
        outcomes[test_id] = {"failure": "failed"}.get(outcome, outcome)
    return outcomes


def compare(stock: dict[str, str], damcha: dict[str, str]) -> dict:
    counts = {run: {outcome: list(outcomes.values()).count(outcome) for outcome in ("passed", "failed", "error",
                                                                                  "skipped")}
              for run, outcomes in (("stock", stock), ("damcha", damcha))}  # fmt: skip
    differences = {test: (stock.get(test, "absent"), damcha.get(test, "absent"))
                   for test in sorted(set(stock) | set(damcha)) if stock.get(test) != damcha.get(test)}  # fmt: skip
    return {"counts": counts, "differences": differences}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("upstream", type=Path, help="a folder holding the upstream test_modeling_<family>.py files")
    parser.add_argument("--families", nargs="+", help="model types to run (default: every file found for a decoder "
                        "family of damcha_hf)")  # fmt: skip
    parser.add_argument("--zero-generator", action="store_true", help="leave the metric generator at zero")
    parser.add_argument("--report", type=Path, help="write both runs' outcomes and the differences as JSON")
    parser.add_argument("--keep", type=Path, help="build the package in this (new) folder and keep it")
    args = parser.parse_args(argv)
    if not args.upstream.is_dir():
        parser.error(f"{args.upstream}: not a folder")
    if args.keep is not None and args.keep.exists():
        parser.error(f"--keep {args.keep}: exists; name a new folder")
    from damcha_hf.families import FAMILIES

    known = [family.model_type for family in FAMILIES if family.causal and not family.encoder_decoder]
    families = args.families or [name for name in known if find_file(args.upstream, f"test_modeling_{name}.py")]
    unknown = [name for name in families if name not in known]
    if unknown or not families:
        parser.error(f"--families: {unknown or 'none found'}; damcha_hf's decoder families are {', '.join(known)}")
    work = Path(tempfile.mkdtemp(prefix="upstream-family-tests-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    try:
        test_files = build_package(args.upstream, families, work)
        stock = run_pytest(work, test_files, families, False, args.zero_generator, pytest_args)
        damcha = run_pytest(work, test_files, families, True, args.zero_generator, pytest_args)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    result = compare(stock, damcha)
    for run, counts in result["counts"].items():
        print(f"{run:>7}: " + ", ".join(f"{count} {outcome}" for outcome, count in counts.items()))
    regressions = {test: pair for test, pair in result["differences"].items() if pair[0] == "passed"}
    for test, (on_stock, on_damcha) in result["differences"].items():
        print(f"  {on_stock:>7} on stock, {on_damcha:>7} on DAMCHA: {test}")
    if args.report is not None:
        args.report.write_text(json.dumps({"families": families, "stock": stock, "damcha": damcha, **result},
                                          indent=1))  # fmt: skip
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
