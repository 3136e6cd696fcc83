"""The `damcha-hf` console script's entry point, and `light_import` for the recipes: argument parsing without torch.

Importing any module of the `damcha_hf` package first runs `damcha_hf/__init__.py`, which registers the DAMCHA models
with transformers' Auto classes, and so imports torch and transformers (seconds of CPU). Parsing a command line needs
none of that: `damcha-hf --help`, a recipe's `--help` and a bad argument must answer at once. This module sits
outside the package so that the console script can start without running that `__init__`: it reads the
standard-library-only modules the parsers need (`damcha_hf.cli`, `damcha_hf.commands.*`, `damcha_hf.safe_files`,
`damcha_hf.modeling.damcha_config`) with `light_import`, parses, and only then imports the package to run the
command.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


def _find_spec(name: str, path):
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path) if find_spec is not None else None
        if spec is not None:
            return spec
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def light_import(name: str) -> ModuleType:
    """Import `damcha_hf.<...>`, a module that imports only the standard library, without running the `__init__.py`
    of its parent packages (which imports torch and transformers).

    When `damcha_hf` is already imported this is `importlib.import_module(name)`. Otherwise the module is executed
    on its own and not entered in `sys.modules`, so a later `import damcha_hf` is unaffected.
    """
    if name.split(".")[0] in sys.modules:
        return importlib.import_module(name)
    parts = name.split(".")
    path = None
    spec = None
    for depth in range(1, len(parts) + 1):
        spec = _find_spec(".".join(parts[:depth]), path)
        path = spec.submodule_search_locations
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    """The console script: `damcha_hf.cli.main`, with its parser read by `light_import`."""
    return light_import("damcha_hf.cli").main(argv, load=light_import)


if __name__ == "__main__":
    sys.exit(main())
