"""Writing files without losing any: atomic writes, and the checks that an output folder may be written or replaced.

The project's rule: no command or function deletes or overwrites a file it did not write. Two helpers enforce it:

- `atomic_path` / `atomic_write`: a file is written under a temporary name beside its target and renamed onto it, so
  it is never left half-written. Temporary files and folders are created with the permissions the umask allows (not
  `tempfile`'s forced 0600/0700), so checkpoints and images are as readable as any other file the user writes.
- `check_checkpoint_folder` (a folder that is replaced as a whole, e.g. `save_hub_checkpoint`'s or the demo's) and
  `check_run_folder` (a folder a training recipe writes into): they refuse, before any training starts, a path that is
  a file, the current folder, one of its parents, the home folder, or a folder holding files the program did not write,
  with the path and the fix.

Standard library only, so the command line and the recipes check their output paths while parsing arguments, before
torch or transformers are imported.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import json
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path

# What a checkpoint save writes (`save_pretrained`, `save_hub_checkpoint`), besides the weights and the model code.
CARD_FILE = "README.md"
LOSS_CURVE_FILE = "loss_curve.png"
METRIC_HEATMAP_FILE = "metric_heatmap.png"
CONFIG_FILES = ("config.json", "generation_config.json")
PREPROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "image_processor_config.json",
    "processor_config.json",
)
CHECKPOINT_FILES = (*CONFIG_FILES, *PREPROCESSOR_FILES, CARD_FILE, LOSS_CURVE_FILE, METRIC_HEATMAP_FILE)
CHECKPOINT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
# The model_type prefix of this plugin's configs: a folder is "an earlier checkpoint of this plugin" only with it.
MODEL_TYPE_PREFIX = "damcha_"


class UnsafeOutputError(FileExistsError):
    """An output path that would overwrite or delete files the program did not write; the message names the fix."""

    def __str__(self) -> str:  # OSError's own str() would prefix an errno tuple when given several arguments
        return self.args[0] if self.args else ""


# ------------------------------------------------------------------------------------------------------ atomic writes


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temporary_name(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; on success it is renamed onto `path`, on failure removed.

    with atomic_path("plot.png") as temporary:
        figure.savefig(temporary, format="png")
    """
    path = Path(path)
    if path.is_dir():
        raise UnsafeOutputError(f"{path} is a folder; give the path of a file to write (e.g. {path / 'out.png'}).")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_name(path, "tmp")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically, with the umask's permissions."""
    with atomic_path(path) as temporary, open(temporary, "xb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_json(path: str | os.PathLike, payload, *, indent: int = 2) -> Path:
    """`json.dump` atomically."""
    return atomic_write(path, json.dumps(payload, indent=indent) + "\n")


def make_staging_folder(target: str | os.PathLike) -> Path:
    """A new empty folder beside `target`, to be renamed onto it (`os.mkdir`, so the umask sets its mode)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _temporary_name(target, "tmp")
    os.mkdir(staging)
    return staging


def public_dataset_name(value: str) -> str | None:
    """A dataset name fit for a public model card: a Hub id as given; a local path (absolute, relative, `~`, a glob,
    or anything that exists on disk) by its base name only, since the path would reveal the machine's layout. None
    when nothing of it can be shown (e.g. `/`)."""
    text = str(value)
    looks_local = (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or any(char in text for char in "*?[\\")
        or os.path.exists(text)
        or text.count("/") > 1
    )
    if not looks_local:
        return text
    parts = [part for part in Path(text.replace("\\", "/")).parts if part not in ("/", ".", "..", "~")]
    parts = [part for part in parts if not any(char in part for char in "*?[")]  # glob patterns name no dataset
    return parts[-1] if parts else None


def apply_umask(folder: Path) -> None:
    """Give the files of `folder` the permissions the umask allows for a new file (0644 under the usual 022): some
    writers (safetensors shards via a temporary file) leave 0600 whatever the umask."""
    mode = 0o666 & ~_umask()
    for path in Path(folder).iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


# ---------------------------------------------------------------------------------------------- output folder checks


def protected_folders() -> set[Path]:
    """The current folder, each of its parents and the home folder: never replaced, never a checkpoint's place."""
    cwd = Path.cwd().resolve()
    return {cwd, *cwd.parents, Path.home().resolve()}


def _subject(argument: str, path: Path) -> str:
    return f"{argument} {path}" if argument else str(path)


def _describe(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def code_files_of(folder: Path, config: dict) -> set[str]:
    """Python files of `folder` that its `config.json`'s `auto_map` names (as plain module names), and what they
    import with single-dot relative imports: the remote code a save copies next to the weights."""
    auto_map = config.get("auto_map") or {}
    pending = []
    for reference in auto_map.values() if isinstance(auto_map, dict) else ():
        if isinstance(reference, str):
            module = reference.split("--")[-1].rpartition(".")[0]
            if module.isidentifier():
                pending.append(module)
    found: set[str] = set()
    while pending:
        name = f"{pending.pop()}.py"
        path = folder / name
        if name in found or path.is_symlink() or not path.is_file():
            continue
        found.add(name)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and node.module.isidentifier():
                pending.append(node.module)
    return found


def read_checkpoint_config(folder: Path) -> dict | None:
    """The folder's `config.json` if it is a regular file holding a JSON object, else None."""
    path = folder / "config.json"
    if path.is_symlink() or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, OSError):
        return None
    return config if isinstance(config, dict) else None


def foreign_entries(folder: Path, also_written: Iterable[str] = ()) -> list[str]:
    """Entries of `folder` that are not part of an earlier checkpoint of this plugin (all of them when `folder` has
    no `damcha_*` config.json): what replacing the folder would destroy."""
    entries = sorted(entry.name for entry in folder.iterdir())
    config = read_checkpoint_config(folder)
    if config is None or not str(config.get("model_type", "")).startswith(MODEL_TYPE_PREFIX):
        return entries
    ours = set(CHECKPOINT_FILES) | set(also_written) | code_files_of(folder, config)
    foreign = []
    for name in entries:
        path = folder / name
        written = name in ours or any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_PATTERNS)
        if not written or path.is_symlink() or not path.is_file():
            foreign.append(name)
    return foreign


def check_checkpoint_folder(
    folder: str | os.PathLike,
    *,
    argument: str = "folder",
    replace: bool = True,
    also_written: Iterable[str] = (),
) -> Path:
    """Check, before any work, that `folder` may receive a checkpoint that replaces it as a whole; return it absolute.

    Allowed: a missing path, an empty folder, or (with `replace`) a folder that holds nothing but an earlier
    checkpoint of this plugin (a `damcha_*` config.json, the files a save writes and the `also_written` names the
    caller writes beside them). Refused with `UnsafeOutputError`: a file, a symbolic link, the current folder, one
    of its parents, the home folder, and any folder holding other files (named in the message).
    """
    path = Path(folder).expanduser().absolute()
    if path.is_symlink():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is a symbolic link; pass the folder it points to ({path.resolve()}) or a new folder."
        )
    if path.exists() and not path.is_dir():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is a file, not a folder; choose a folder path that does not exist yet (e.g. "
            f"{path.with_name(path.name + '-checkpoint')})."
        )
    if path.resolve() in protected_folders():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is the current folder, one of its parents or the home folder, which a checkpoint "
            f"save would replace as a whole; choose a new subfolder, e.g. {path / 'damcha-checkpoint'}."
        )
    if not path.is_dir() or not any(path.iterdir()):
        return path
    foreign = foreign_entries(path, also_written)
    if foreign:
        raise UnsafeOutputError(
            f"{_subject(argument, path)} holds files that are not a damcha-hf checkpoint ({_describe(foreign)}); saving would "
            "replace the folder as a whole, so it is refused. Choose a new or empty folder."
        )
    if not replace:
        raise UnsafeOutputError(
            f"{_subject(argument, path)} already holds a damcha-hf checkpoint; pass overwrite=True to replace it, or choose a "
            "new folder."
        )
    return path


def check_run_folder(
    folder: str | os.PathLike,
    *,
    argument: str = "--output-dir",
    written: Iterable[str],
    checkpoints: Iterable[str] = (),
) -> Path:
    """Check, before any training, that a recipe may write into `folder`; return it absolute.

    `written` are the names (glob patterns) the recipe writes directly in `folder` (e.g. `checkpoint-*`,
    `eval_results.json`); `checkpoints` those among them that are checkpoint folders it replaces as a whole (e.g.
    `final`), checked with `check_checkpoint_folder`. Anything else in `folder` means it belongs to someone else:
    refused with `UnsafeOutputError` naming the files, as are a file path and the home folder or its parents.
    """
    path = Path(folder).expanduser().absolute()
    written, checkpoints = tuple(written), tuple(checkpoints)
    if path.exists() and not path.is_dir():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is a file, not a folder; choose a folder path (it is created if missing)."
        )
    if not path.is_dir():
        return path
    entries = sorted(entry.name for entry in path.iterdir())
    foreign = [name for name in entries if not any(fnmatch.fnmatchcase(name, pattern) for pattern in written)]
    if foreign:
        raise UnsafeOutputError(
            f"{_subject(argument, path)} holds files this recipe did not write ({_describe(foreign)}); choose a new or empty "
            "folder (the recipe writes checkpoints and results into it)."
        )
    for name in entries:
        if name in checkpoints:
            check_checkpoint_folder(path / name, argument=f"{argument} (its {name}/ folder)")
    return path


__all__ = [
    "UnsafeOutputError",
    "atomic_path",
    "atomic_write",
    "check_checkpoint_folder",
    "check_run_folder",
    "make_staging_folder",
    "public_dataset_name",
    "write_json",
]
