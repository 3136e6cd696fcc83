"""transformers' own common model tests, taken from the installed release's source distribution at test time.

transformers' wheel ships no tests; its sdist ships `tests/test_modeling_common.py` (`ModelTesterMixin`) and
`tests/test_configuration_common.py` (`ConfigTester`). `import_common_tests()` downloads the sdist of exactly the
installed version with pip, extracts those two files and every module they import relatively, and imports them as the
package `transformers_common_tests`. The extracted files are cached per version under
`$XDG_CACHE_HOME/damcha-hf/transformers-tests/<version>/` (`~/.cache/...` without XDG_CACHE_HOME), written to a
temporary folder and renamed into place, so an interrupted download never leaves a partial cache.

The sdist lacks three modules the common tests import; `tests/upstream_stand_ins/` holds small stand-ins of our own
for them (each docstring says what it keeps), used only where the sdist has no file of that name.
"""

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

import transformers

PACKAGE = "transformers_common_tests"
ENTRY_MODULES = ("test_modeling_common", "test_configuration_common")
STAND_INS = Path(__file__).resolve().parent / "upstream_stand_ins"
DOWNLOAD_TIMEOUT_S = 900


class CommonTestsUnavailable(RuntimeError):
    """The sdist of the installed transformers could not be downloaded (no package index, no such sdist)."""


def cache_dir(version: str = transformers.__version__) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "damcha-hf" / "transformers-tests" / version


def relative_imports(module: str, source: str) -> list[str]:
    """The modules, as dotted paths under `tests/`, that `module` (also a dotted path there) imports relatively."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - (node.level - 1)]
        if node.module:
            found.append(".".join([*base, node.module]))
        else:  # `from . import name`: each name is a module
            found.extend(".".join([*base, alias.name]) for alias in node.names)
    return found


def extract_common_tests(sdist: Path, destination: Path, entry_modules=ENTRY_MODULES) -> list[str]:
    """Extract the entry modules and, transitively, every module they import relatively from `tests/` of `sdist`.

    Returns the modules imported but absent from the sdist (the stand-ins answer for them).
    """
    missing = []
    with tarfile.open(sdist) as archive:
        tests_prefix = archive.getnames()[0].split("/")[0] + "/tests/"
        pending, seen = list(entry_modules), set()
        while pending:
            module = pending.pop()
            if module in seen:
                continue
            seen.add(module)
            relative_path = module.replace(".", "/") + ".py"
            try:
                member = archive.extractfile(tests_prefix + relative_path)
            except KeyError:
                member = None
            if member is None:
                missing.append(module)
                continue
            source = member.read()
            target = destination / relative_path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source)
            pending.extend(relative_imports(module, source.decode()))
    # Every folder becomes a regular package: subfolders so that a stand-in package of the same name cannot merge
    # into them, the top one because test_configuration_common.py executes its folder's `__init__.py`.
    destination.mkdir(parents=True, exist_ok=True)
    for folder in [destination, *(path for path in destination.rglob("*") if path.is_dir())]:
        (folder / "__init__.py").touch()
    return sorted(missing)


def download_sdist(version: str, destination: Path) -> Path:
    """`pip download` transformers `version`'s sdist into `destination`; returns the tarball."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               f"transformers=={version}", "--dest", str(destination)]  # fmt: skip
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise CommonTestsUnavailable(f"`pip download` of its sdist took over {DOWNLOAD_TIMEOUT_S} s") from error
    if completed.returncode != 0:
        last_line = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        raise CommonTestsUnavailable(f"`pip download` of its sdist failed: {last_line}")
    (sdist,) = destination.glob("transformers-*.tar.gz")
    return sdist


def fetch_common_tests(version: str = transformers.__version__) -> Path:
    """The folder holding `version`'s common test files, downloading and extracting its sdist on first use."""
    final = cache_dir(version)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=final.parent))
    try:
        sdist = download_sdist(version, work / "sdist")
        missing = extract_common_tests(sdist, work / "tests")
        unanswered = [module for module in missing if not (STAND_INS / (module.replace(".", "/") + ".py")).is_file()]
        if unanswered:
            raise RuntimeError(
                f"transformers {version}'s common tests import {unanswered}, which its sdist does not ship: "
                f"add a stand-in for each under {STAND_INS}"
            )
        shutil.rmtree(work / "sdist")
        try:
            (work / "tests").rename(final)
        except OSError:
            if not final.is_dir():  # another run renamed its copy into place first: use that one
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def import_common_tests(version: str = transformers.__version__) -> dict[str, ModuleType]:
    """Import `version`'s common test modules; returns them by name (`"test_modeling_common"`, ...).

    Raises `CommonTestsUnavailable` where the sdist cannot be downloaded.
    """
    if PACKAGE not in sys.modules:
        folder = fetch_common_tests(version)
        # The upstream files first, the stand-ins after: a stand-in is imported only where the sdist has no module.
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [str(folder), str(STAND_INS)]
        sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)
    return {name: importlib.import_module(f"{PACKAGE}.{name}") for name in ENTRY_MODULES}
