"""The code a saved checkpoint carries: its family's files, its variant's and the shared core, nothing of the others.

transformers' `save_pretrained` copies the model's and the config's files and, transitively, every file they import
with a single-dot relative import (`dynamic_module_utils.get_relative_imports`, what `trust_remote_code=True` reads to
fetch them). The variant registry (`variants.py`) imports every `variant_*.py` file, and each of those its torch module,
so that copy is every variant's code. After the copy, `keep_only_the_saved_code` rewrites the checkpoint's copy of the
registry to import only the saved variant and plain attention (`"none"`, the fallback the error messages name), and
removes the files that nothing in the checkpoint's code imports any more, among those the save itself just copied: a
file of the folder that is not the copy of a file of this code is never touched.

Part of the remote-code payload: a model loaded with `trust_remote_code=True` saves again through it.
"""

import ast
import os
import tempfile
from collections.abc import Collection, Iterable
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_imports

# The module that lists the variants, and the name under which it lists every variant of the plugin.
REGISTRY_MODULE = "variants"
PLUGIN_VARIANTS_NAME = "PLUGIN_VARIANTS"
VARIANT_MODULE_PREFIX = "variant_"


def imported_code(folder: Path, modules: Iterable[str]) -> set[str]:
    """The modules of `folder` that `modules` import, transitively, with single-dot relative imports (`modules`
    included), as transformers' loader follows them. A module without a file in `folder` is left out."""
    found: set[str] = set()
    pending = list(modules)
    while pending:
        module = pending.pop()
        path = folder / f"{module}.py"
        if module in found or not path.is_file():
            continue
        found.add(module)
        pending += [name for name in get_relative_imports(path) if name.isidentifier()]
    return found


def registry_source(source: str, kept_modules: Collection[str], plugin_variants: tuple[str, ...]) -> str:
    """The registry's text `source` importing only the `variant_*` modules `kept_modules` (dropped from its table of
    variants too), with `PLUGIN_VARIANTS` written out as the names `plugin_variants`. Raises `ValueError` when the
    result would still name a dropped variant or is not valid Python."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))

    def offset(line: int, column: int) -> int:  # ast's columns count UTF-8 bytes
        return line_starts[line - 1] + len(lines[line - 1].encode()[:column].decode())

    edits: list[tuple[int, int, str]] = []
    dropped: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module.startswith(VARIANT_MODULE_PREFIX):
            if node.module not in kept_modules:
                dropped.update(alias.asname or alias.name for alias in node.names)
                edits.append((line_starts[node.lineno - 1], line_starts[node.end_lineno], ""))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == PLUGIN_VARIANTS_NAME for target in targets):
                value = node.value
                edits.append(
                    (
                        offset(value.lineno, value.col_offset),
                        offset(value.end_lineno, value.end_col_offset),
                        repr(tuple(plugin_variants)),
                    )
                )
    for node in ast.walk(tree):  # the table: `(DAMCHA, TALKING_HEADS, ...)` keeps the variants imported
        if isinstance(node, ast.Tuple) and any(isinstance(item, ast.Name) and item.id in dropped for item in node.elts):
            kept = [
                ast.get_source_segment(source, item) for item in node.elts if getattr(item, "id", None) not in dropped
            ]
            text = "(" + ", ".join(kept) + ("," if len(kept) == 1 else "") + ")"
            edits.append((offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset), text))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    left = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)} & dropped
    if left:
        raise ValueError(f"{REGISTRY_MODULE}.py still names the variants {sorted(left)} once their imports are dropped")
    compile(source, f"{REGISTRY_MODULE}.py", "exec")
    return source


def keep_only_the_saved_code(
    folder: str | os.PathLike,
    code_folder: str | os.PathLike,
    entry_modules: Iterable[str],
    kept_variant_modules: Collection[str],
    plugin_variants: tuple[str, ...],
) -> list[str]:
    """Reduce the code a save just copied from `code_folder` into `folder` to what `entry_modules` (the files
    `auto_map` names) need with the registry importing only `kept_variant_modules`; returns the removed file names.

    Only files that are byte-for-byte copies of `code_folder`'s files of this code are rewritten or removed. The
    registry is written to a temporary file beside it and renamed over it."""
    folder, code_folder, entry_modules = Path(folder), Path(code_folder), list(entry_modules)
    copied = {
        module
        for module in imported_code(code_folder, entry_modules)
        if (folder / f"{module}.py").is_file()
        and (folder / f"{module}.py").read_bytes() == (code_folder / f"{module}.py").read_bytes()
    }
    if REGISTRY_MODULE not in copied:  # not this code's copy (or already reduced): nothing of it to change
        return []
    registry = folder / f"{REGISTRY_MODULE}.py"
    text = registry_source(registry.read_text(encoding="utf-8"), kept_variant_modules, plugin_variants)
    mode = registry.stat().st_mode & 0o777
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{REGISTRY_MODULE}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, registry)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    removed = sorted(copied - imported_code(folder, entry_modules))
    for module in removed:
        (folder / f"{module}.py").unlink()
    return [f"{module}.py" for module in removed]
