"""Writing files without losing any: atomic writes, saves that survive a kill, one run per folder, and the checks
that an output folder may be written or replaced and that an input file is not damaged.

The project's rule: no command or function deletes or overwrites a file it did not write. The helpers enforce it:

- `atomic_path` / `atomic_write`: a file is written under a temporary name beside its target and renamed onto it, so
  it is never left half-written. Temporary files and folders are created with the permissions the umask allows (not
  `tempfile`'s forced 0600/0700), so checkpoints and images are as readable as any other file the user writes.
- `write_save_record`: a checkpoint save lists the files it wrote in `SAVE_RECORD_FILE`, written last; a folder is
  replaced only when it holds nothing but what its record lists. A save in a training run also carries the run's id.
- `record_run_entry` / `read_run_record`: a training run names itself (a run id) and each folder it writes in place (a
  checkpoint being saved, tracker logs) in its run folder's `RUN_RECORD_FILE`, before writing it;
  `earlier_run_entries` and `remove_entries` then replace an earlier run with nothing but what its records say it
  wrote, crash-safely (each entry renamed aside, then deleted).
- `check_checkpoint_folder` (a folder that is replaced as a whole, e.g. `save_hub_checkpoint`'s or the demo's) and
  `check_run_folder` (a folder a training recipe writes into): they refuse, before any training starts, a path that is
  a file, cannot be created, is the current folder, one of its parents, the home folder, or a folder holding files
  the program did not write, with the path and the fix.
- `recover_interrupted_saves`: what a killed save left (`.NAME.tmp-*`, `.NAME.old-*`) is restored or removed on the
  next start, said in one line.
- `hold_lock`: one run per output folder (`fcntl`), refusing a second one by the process id of the first;
  `wait_for_lock`: one save at a time into a folder (`save_lock_file`), a second one waiting for the first.
- `check_checkpoint_files`, `check_safetensors_file`, `check_pickled_archive`, `read_json_file`, `reading`: a
  truncated, garbage or mismatched input file becomes one `CorruptFileError` line naming the file and the fault.

Standard library only, so the command line and the recipes check their output paths while parsing arguments, before
torch or transformers are imported.
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import json
import logging
import math
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

# The files of a checkpoint a push uploads (`damcha_hf.hub.upload_plan`), besides the weights and the model code.
CARD_FILE = "README.md"
LOSS_CURVE_FILE = "loss_curve.png"
METRIC_HEATMAP_FILE = "metric_heatmap.png"
SAMPLE_GRID_FILE = "sample_grid.png"
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
# The model_type prefix of this plugin's configs: a folder is "an earlier checkpoint of this plugin" only with it.
MODEL_TYPE_PREFIX = "damcha_"
# The `Software` text of the pictures this plugin draws (`png_text`): a picture that lacks it is never replaced.
PNG_SOFTWARE = "damcha-hf"


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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_text(path: str | os.PathLike, keyword: str) -> str | None:
    """The text of the PNG file's `tEXt` chunk `keyword` (e.g. "Software"), or None: not a PNG, or no such chunk
    before the image data."""
    with open(path, "rb") as handle:
        if handle.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
            return None
        while True:
            header = handle.read(8)
            length, kind = int.from_bytes(header[:4], "big"), header[4:]
            if len(header) < 8 or kind in (b"IDAT", b"IEND") or length > 1 << 20:
                return None
            data = handle.read(length)
            handle.read(4)  # the chunk's CRC
            if kind == b"tEXt":
                name, _, text = data.partition(b"\0")
                if name == keyword.encode("latin-1"):
                    return text.decode("latin-1")


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
    for path in _own_entries(Path(folder)):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def _own_entries(folder: Path) -> list[Path]:
    """The entries of `folder`, and those of its subfolders one level down (a tokenizer's own folder): a save
    writes nothing deeper."""
    entries = []
    for path in sorted(folder.iterdir()):
        entries.append(path)
        if path.is_dir() and not path.is_symlink():
            entries += sorted(path.iterdir())
    return entries


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


def check_writable_location(path: Path, *, argument: str = "") -> None:
    """Refuse, while parsing, an output path that cannot be created: its nearest existing parent must be a folder
    this user may write into (`/etc/passwd/x` is refused at once, not after training)."""
    existing = path
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} cannot be created: {existing} is a file, not a folder; choose a path inside "
            "a folder you can write to."
        )
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise UnsafeOutputError(
            f"{_subject(argument, path)} cannot be written: {existing} is not writable for this user; choose a path "
            "inside a folder you can write to."
        )


# ------------------------------------------------------------------------------------------ what a save wrote

# Written last by every checkpoint save: the names of the files that save wrote. Only they are ever replaced later;
# a checkpoint without it (plain `save_pretrained`, or a save of a damcha-hf release before the record) is never
# replaced, since its files cannot be told from files a user put beside them.
SAVE_RECORD_FILE = ".damcha-hf-files.json"


class CorruptFileError(ValueError):
    """A file that cannot be read as what it should be (truncated, garbage, of the wrong shape); the message names
    the file and what is wrong with it."""


def write_save_record(folder: str | os.PathLike, *, run_id: str | None = None) -> Path:
    """Record the files of `folder` (a staging folder holding only what the save just wrote) as the save's own; a
    checkpoint of a training run also records the run's id (`run_id`, see `RUN_RECORD_FILE`)."""
    folder = Path(folder)
    names = [
        entry.relative_to(folder).as_posix()
        for entry in _own_entries(folder)
        if entry.name != SAVE_RECORD_FILE and not (entry.is_dir() and not entry.is_symlink())
    ]
    record = {"written_by": "damcha-hf", "files": names, **({"run_id": run_id} if run_id else {})}
    return write_json(folder / SAVE_RECORD_FILE, record)


def _save_record(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / SAVE_RECORD_FILE
    if not path.exists() and not path.is_symlink():
        return None
    record = read_json_file(path, "the record of the files a save wrote")
    names = record.get("files") if isinstance(record, dict) else None
    if not isinstance(names, list) or not all(isinstance(name, str) and _recorded_name(name) for name in names):
        raise CorruptFileError(f"{path}: not a record of the files a save wrote (no list of plain file names)")
    return record


def saved_files(folder: str | os.PathLike) -> list[str] | None:
    """The file names the save record of `folder` lists (`name`, or `subfolder/name` one level down), or None when it
    has no record. A record that is not a readable list of such names raises `CorruptFileError` naming it."""
    record = _save_record(folder)
    return None if record is None else record["files"]


def saved_run_id(folder: str | os.PathLike) -> str | None:
    """The id of the training run whose save wrote `folder` (a checkpoint), or None: no save record (an unfinished
    save, a checkpoint of an older damcha-hf, or one put there by hand), or a save outside a run."""
    record = _save_record(folder)
    run_id = record.get("run_id") if record else None
    return run_id if isinstance(run_id, str) else None


def _plain_name(name: str) -> bool:
    return name == os.path.basename(name) and name not in ("", ".", "..") and "\\" not in name


def _recorded_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) <= 2 and all(_plain_name(part) for part in parts)


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


def foreign_entries(folder: Path) -> list[str]:
    """Entries of `folder` that no save of this plugin recorded as its own (all of them without a readable save
    record): what replacing the folder would destroy."""
    entries = sorted(entry.name for entry in folder.iterdir())
    try:
        recorded = saved_files(folder)
    except CorruptFileError:
        recorded = None
    if recorded is None:
        return entries
    ours = {*recorded, SAVE_RECORD_FILE}

    def owned(name: str) -> bool:
        path = folder / name
        return name in ours and path.is_file() and not path.is_symlink()

    foreign = []
    for name in entries:
        path = folder / name
        if path.is_dir() and not path.is_symlink() and any(saved.startswith(f"{name}/") for saved in recorded):
            # A subfolder the save wrote (the tokenizer's) is its own only while it holds nothing but recorded files.
            foreign += [f"{name}/{entry.name}" for entry in sorted(path.iterdir()) if not owned(f"{name}/{entry.name}")]
        elif not owned(name):
            foreign.append(name)
    return foreign


def check_checkpoint_folder(folder: str | os.PathLike, *, argument: str = "folder", replace: bool = True) -> Path:
    """Check, before any work, that `folder` may receive a checkpoint that replaces it as a whole; return it absolute.

    First finishes what an interrupted save of this folder left beside it (`recover_interrupted_saves`). Allowed: a
    missing path (inside a writable folder), an empty folder, or (with `replace`) a folder that holds nothing but the
    files an earlier save of this plugin recorded (`SAVE_RECORD_FILE`). Refused with `UnsafeOutputError`: a file, a
    symbolic link, the current folder, one of its parents, the home folder, a path that cannot be created, and any
    folder holding other files (named in the message).
    """
    path = check_checkpoint_location(folder, argument=argument)
    if path.parent.is_dir():
        recover_interrupted_saves(path.parent, lambda name: name == path.name)
    if not path.is_dir() or not any(path.iterdir()):
        return path
    foreign = foreign_entries(path)
    if foreign:
        config = read_checkpoint_config(path)
        unrecorded = not (path / SAVE_RECORD_FILE).is_file() and config is not None
        hint = ""
        if unrecorded and str(config.get("model_type", "")).startswith(MODEL_TYPE_PREFIX):
            hint = (
                f" (a checkpoint saved without the record of its files, {SAVE_RECORD_FILE}, by `save_pretrained` or an "
                "older damcha-hf: its files cannot be told from files put beside them, so it is never replaced; move "
                "it away first)"
            )
        raise UnsafeOutputError(
            f"{_subject(argument, path)} holds files that are not a damcha-hf checkpoint's own ({_describe(foreign)})"
            f"{hint}; saving would replace the folder as a whole, so it is refused. Choose a new or empty folder."
        )
    if not replace:
        raise UnsafeOutputError(
            f"{_subject(argument, path)} already holds a damcha-hf checkpoint; pass overwrite=True to replace it, or choose a "
            "new folder."
        )
    return path


def check_checkpoint_location(folder: str | os.PathLike, *, argument: str = "folder") -> Path:
    """The checks of `check_checkpoint_folder` that do not read the folder's contents: refused with
    `UnsafeOutputError` are a symbolic link, a file, the current folder, one of its parents, the home folder and a path
    that cannot be created. Returns the path, absolute."""
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
    check_writable_location(path, argument=argument)
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
    refused with `UnsafeOutputError` naming the files, as are a file path, a path that cannot be created, and the
    current folder, its parents and the home folder. A run's lock file (`RUN_LOCK_FILE`), and beside a folder the recipe
    writes the save lock a killed save left (`save_lock_file`) and the heatmap `damcha-hf inspect` draws of it
    (`NAME_metric_heatmap.png`), count as the recipe's.
    """
    path = Path(folder).expanduser().absolute()
    written, checkpoints = (*written, RUN_LOCK_FILE), tuple(checkpoints)
    if path.exists() and not path.is_dir():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is a file, not a folder; choose a folder path (it is created if missing)."
        )
    if path.resolve() in protected_folders():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is the current folder, one of its parents or the home folder; a run writes "
            f"checkpoints and results into its folder, so choose a new subfolder, e.g. {path / 'runs' / 'my-run'}."
        )
    check_writable_location(path, argument=argument)
    if not path.is_dir():
        return path
    entries = sorted(entry.name for entry in path.iterdir())

    def recipes_own(name: str) -> bool:
        # Beside a folder the recipe writes, e.g. `final`: the lock a killed save of it left, and the heatmap that
        # `damcha-hf inspect` draws of it by default (`final_metric_heatmap.png`).
        heatmap_suffix = f"_{METRIC_HEATMAP_FILE}"
        drawn_of = name[: -len(heatmap_suffix)] if name.endswith(heatmap_suffix) else None
        of = _save_lock_target(name) or drawn_of or name
        return any(fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(of, pattern) for pattern in written)

    foreign = [name for name in entries if not recipes_own(name)]
    if foreign:
        raise UnsafeOutputError(
            f"{_subject(argument, path)} holds files this recipe did not write ({_describe(foreign)}); choose a new or empty "
            "folder (the recipe writes checkpoints and results into it)."
        )
    for name in entries:
        if name in checkpoints:
            check_checkpoint_folder(path / name, argument=f"{argument} (its {name}/ folder)")
    return path


# ------------------------------------------------------------------------------------------- interrupted saves

# The temporary names of `_temporary_name` (`.NAME.tmp-PID-HEX`, a save in progress), of a folder moved aside
# while a new one takes its place (`.NAME.old-PID-HEX`), and of an entry moved aside to be deleted
# (`.NAME.del-PID-HEX`, `remove_entries`).
LEFTOVER_KINDS = ("tmp", "old", "del")
_LEFTOVER = re.compile(r"\.(?P<target>.+)\.(?P<kind>tmp|old|del)-(?P<pid>\d+)-[0-9a-f]{8}")


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def recover_interrupted_saves(parent: Path, is_target=None, *, held: bool = False) -> str | None:
    """Finish what saves into `parent` left when they were killed, and say so in one line on stderr (returned).

    A save writes `NAME` under `.NAME.tmp-PID-HEX` and renames it into place; a folder it replaces is first moved to
    `.NAME.old-PID-HEX` and deleted once the new one is in place. So: with `NAME` missing, its `.old` copy is the
    last complete checkpoint and is renamed back (a save cut short leaves what was there before it); every other
    leftover is an unfinished save, a copy already replaced or an entry being deleted (`.NAME.del-PID-HEX`, never
    restored), and is deleted. Only leftovers whose `NAME` passes
    `is_target` are touched, and (unless the caller holds `parent`'s run lock, `held`) only those of processes no
    longer running, so a save in progress elsewhere is left alone. The save lock of such a `NAME`
    (`save_lock_file`) is removed when no process holds it.
    """
    groups: dict[str, list[tuple[str, Path]]] = {}
    for entry in Path(parent).iterdir():
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None or entry.is_symlink() or (is_target is not None and not is_target(match["target"])):
            continue
        if not held and _process_alive(int(match["pid"])):
            continue
        groups.setdefault(match["target"], []).append((match["kind"], entry))
    restored, removed = [], []
    for target, leftovers in sorted(groups.items()):
        destination = Path(parent) / target
        copies = [entry for kind, entry in leftovers if kind == "old" and entry.is_dir()]
        if copies and not destination.exists() and not destination.is_symlink():
            newest = max(copies, key=lambda entry: entry.stat().st_mtime)
            os.replace(newest, destination)
            restored.append(target)
            leftovers = [(kind, entry) for kind, entry in leftovers if entry != newest]
        for _, entry in leftovers:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
    stale_locks = []
    for entry in sorted(Path(parent).iterdir()):
        target = _save_lock_target(entry.name)
        if target is None or entry.is_symlink() or (is_target is not None and not is_target(target)):
            continue
        if lock_holder(entry) is None:  # no save holds it: a killed save left it (one that waits for it retries)
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
            stale_locks.append(entry.name)
    if not restored and not removed and not stale_locks:
        return None
    done = []
    if restored:
        done.append(f"restored {', '.join(name + '/' for name in restored)} as it was before the save")
    if removed:
        done.append(f"removed {len(removed)} unfinished, replaced or discarded temporary copies ({_describe(removed)})")
    if stale_locks:
        done.append(f"removed the lock files it held ({_describe(stale_locks)})")
    message = f"{parent}: an earlier save was interrupted; " + "; ".join(done)
    print(message, file=sys.stderr, flush=True)
    return message


# --------------------------------------------------------------------------------------- a run and what it wrote

# Written in a run folder by the training run that writes into it: the run's id, which each checkpoint it saves
# carries in its save record (`write_save_record(..., run_id=...)`), and the entries of the folder it writes in place
# (a checkpoint being saved, tracker logs), each named before it is written. `--resume` continues only checkpoints of
# this run; replacing the run removes an entry only when a record says the program wrote it.
RUN_RECORD_FILE = ".damcha-hf-run.json"


def new_run_id() -> str:
    """A new run's id: when it started (UTC) and 8 random hex digits, e.g. `20260105T101502Z-3f9a0c1e`."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def read_run_record(folder: str | os.PathLike) -> dict | None:
    """The run record of `folder` (`{"run_id": ..., "entries": [...]}`), or None when it has none; a damaged one
    raises `CorruptFileError` naming it."""
    path = Path(folder) / RUN_RECORD_FILE
    if not path.exists() and not path.is_symlink():
        return None
    record = read_json_file(path, "the record of a training run")
    entries = record.get("entries") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("run_id"), str)
        or not isinstance(entries, list)
        or not all(isinstance(name, str) and _plain_name(name) for name in entries)
    ):
        raise CorruptFileError(f"{path}: not the record of a training run (no run_id and list of entries)")
    return record


def record_run_entry(folder: str | os.PathLike, run_id: str, name: str) -> None:
    """Name `name` in the run record of `folder` as an entry the run `run_id` writes in place, before it writes it;
    entries no longer there are dropped. The record is written atomically, so a kill leaves the old one or the new."""
    folder = Path(folder)
    record = read_run_record(folder) or {"entries": []}
    entries = [entry for entry in record["entries"] if entry != name and (folder / entry).exists()]
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / RUN_RECORD_FILE, {"written_by": "damcha-hf", "run_id": run_id, "entries": [*entries, name]})


def earlier_run_entries(
    folder: str | os.PathLike, *, argument: str = "--output-dir", written: Iterable[str], files: Iterable[str]
) -> list[Path]:
    """The entries of `folder` that replacing the earlier run in it removes, checked before anything is removed.

    `written`: the names (glob patterns) a run writes directly in `folder`; other entries are not the run's and are
    left alone (`check_run_folder` refuses them). `files`: those among them that are files the run writes whole (its
    results), the run's by their name. A folder is the run's when its save record lists every file in it, when the
    run record names it (a save the run had begun, tracker logs) and it has no save record, or when it is empty. Any
    other entry that the run's names match (a checkpoint without a save record, one holding files its save did not
    write, a link) raises `UnsafeOutputError` naming it: nothing is removed that the program did not write. The run
    record itself is the last entry returned, so that it goes last.
    """
    path = Path(folder).expanduser().absolute()
    if not path.is_dir():
        return []
    written, files = tuple(written), tuple(files)
    record = read_run_record(path)
    begun = set(record["entries"]) if record else set()
    removable, refused = [], []
    for entry in sorted(path.iterdir()):
        name = entry.name
        if name in (RUN_LOCK_FILE, RUN_RECORD_FILE) or _LEFTOVER.fullmatch(name):
            continue  # the lock is this run's; leftovers of killed saves are `recover_interrupted_saves`'
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in written):
            continue
        if entry.is_symlink():
            refused.append(f"{name} is a symbolic link")
        elif entry.is_dir():
            foreign = foreign_entries(entry) if (entry / SAVE_RECORD_FILE).exists() else None
            if foreign:
                refused.append(f"{name}/ holds files its save did not write ({_describe(foreign)})")
            elif foreign is not None or name in begun or not any(entry.iterdir()):
                removable.append(entry)
            else:
                refused.append(f"{name}/ has no record of what wrote it (no {SAVE_RECORD_FILE}: written by an older "
                               "damcha-hf or put there by hand)")  # fmt: skip
        elif any(fnmatch.fnmatchcase(name, pattern) for pattern in files):
            removable.append(entry)
        else:
            refused.append(f"{name} is a file where a run writes a folder")
    if refused:
        shown = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
        raise UnsafeOutputError(
            f"{_subject(argument, path)}: {shown}; replacing the earlier run removes only what it wrote, so move "
            f"{'it' if len(refused) == 1 else 'them'} out of {path}, or choose another folder."
        )
    if record is not None:
        removable.append(path / RUN_RECORD_FILE)
    return removable


def remove_entries(entries: Iterable[str | os.PathLike]) -> list[str]:
    """Delete `entries` (files or folders) so that a kill at any moment leaves each one whole or on its way out: all are
    first renamed aside, in order, to `.NAME.del-PID-HEX` (which `recover_interrupted_saves` deletes at the next start),
    then deleted. Returns their names."""
    aside = []
    for entry in entries:
        moved = _temporary_name(Path(entry), "del")
        os.replace(entry, moved)
        aside.append((Path(entry).name, moved))
    for _, moved in aside:
        if moved.is_dir() and not moved.is_symlink():
            shutil.rmtree(moved)
        else:
            moved.unlink()
    return [name for name, _ in aside]


# ----------------------------------------------------------------------------------------------- one run per folder

RUN_LOCK_FILE = ".damcha-hf-run.lock"
_held_locks: dict[str, FolderLock] = {}


class FolderLock:
    """An exclusive `fcntl` lock on a lock file, held until `release()` or the end of the process (the kernel drops
    it when the process dies, however it dies). `hold_lock` taken again by the same process gives the same lock."""

    def __init__(self, lock_file: Path, created: list[Path]):
        self.lock_file, self.created = lock_file, created
        self.descriptor: int | None = None

    def release(self) -> None:
        if self.descriptor is None:
            return
        _held_locks.pop(str(self.lock_file), None)
        with contextlib.suppress(FileNotFoundError):  # unlinked while held: no other process can hold this file
            self.lock_file.unlink()
        os.close(self.descriptor)
        self.descriptor = None
        for folder in self.created:  # folders made for the lock only, left empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def lock_holder(lock_file: str | os.PathLike) -> str | None:
    """The process id written in `lock_file` when another process holds its lock, else None (nothing is locked)."""
    import fcntl

    lock_file = Path(lock_file).absolute()
    if str(lock_file) in _held_locks:
        return None
    try:
        descriptor = os.open(lock_file, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(descriptor, 64, 0).decode("ascii", "replace").strip() or "unknown"
    finally:
        os.close(descriptor)  # drops the shared lock taken for the test
    return None


def hold_lock(lock_file: str | os.PathLike, *, what: str) -> FolderLock:
    """Lock `lock_file` (creating it and its missing parent folders) for the rest of this process, or refuse with
    `UnsafeOutputError` naming the process that holds it. `what` names the locked thing in that message."""
    lock_file = Path(lock_file).absolute()
    held = _held_locks.get(str(lock_file))
    if held is not None:
        return held
    lock = _take_lock(lock_file, what=what, wait=False)
    _held_locks[str(lock_file)] = lock
    atexit.register(lock.release)
    return lock


def wait_for_lock(lock_file: str | os.PathLike, *, what: str) -> FolderLock:
    """Lock `lock_file` (creating it and its missing parent folders) until `release()`, waiting, said in one line on
    stderr, while another process or another thread of this one holds it. The lock file, and the folders made for it,
    are removed on release."""
    return _take_lock(Path(lock_file).absolute(), what=what, wait=True)


def _take_lock(lock_file: Path, *, what: str, wait: bool) -> FolderLock:
    import fcntl

    created: list[Path] = []
    waiting_said = False
    while True:
        # Inside the loop: the holder before us may have removed the folders it made for the lock.
        created += [parent for parent in (lock_file.parent, *lock_file.parent.parents) if not parent.exists()]
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 64, 0).decode("ascii", "replace").strip() or "unknown"
            if not wait:
                os.close(descriptor)
                raise UnsafeOutputError(
                    f"{what} is in use by another run (process {holder}, which holds {lock_file}); wait for it to "
                    "finish, or choose another folder."
                ) from None
            if not waiting_said:
                print(f"{what}: process {holder} is writing it; waiting for it to finish", file=sys.stderr, flush=True)
                waiting_said = True
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            except BaseException:  # interrupted while waiting
                os.close(descriptor)
                raise
        # The holder before us may have unlinked the file after we opened it: lock the file at the path, not that one.
        try:
            same = os.stat(lock_file).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    lock = FolderLock(lock_file, created)
    lock.descriptor = descriptor
    return lock


# A save into a folder that replaces it as a whole (`save_hub_checkpoint`) holds `.NAME.damcha-hf-save.lock` beside it:
# a second save of the same folder waits, and the folder is always one complete checkpoint.
SAVE_LOCK_SUFFIX = ".damcha-hf-save.lock"


def save_lock_file(folder: str | os.PathLike) -> Path:
    """The lock file of saves into `folder`: beside it, since the folder itself is replaced."""
    folder = Path(folder).absolute()
    return folder.with_name(f".{folder.name}{SAVE_LOCK_SUFFIX}")


def _save_lock_target(name: str) -> str | None:
    """The folder name whose save lock `name` is, or None when `name` is no save lock."""
    if name.startswith(".") and name.endswith(SAVE_LOCK_SUFFIX) and len(name) > len(SAVE_LOCK_SUFFIX) + 1:
        return name[1 : -len(SAVE_LOCK_SUFFIX)]
    return None


# ---------------------------------------------------------------------------------------------------- corrupt files

SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
# A larger header is not one safetensors writes (its own reader refuses headers over 100 MB).
SAFETENSORS_MAX_HEADER = 100_000_000


def read_json_file(path: str | os.PathLike, what: str = "JSON"):
    """The JSON in `path`, or `CorruptFileError` naming the file, what it should hold and what is wrong."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise CorruptFileError(f"{path}: not {what} (not UTF-8 text; the file is damaged)") from None
    except ValueError as error:
        raise CorruptFileError(f"{path}: not {what} (invalid JSON: {error}); the file is damaged") from None


def check_safetensors_file(path: str | os.PathLike) -> dict:
    """The header of a safetensors file after checking that the file holds every byte it describes; a truncated or
    garbage file raises `CorruptFileError` naming it and what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CorruptFileError(
                f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header size)"
            )
        header_size = int.from_bytes(prefix, "little")
        if header_size > min(SAFETENSORS_MAX_HEADER, size - 8):
            raise CorruptFileError(
                f"{path}: not a safetensors file, or truncated (its header claims {header_size:,} bytes; the file "
                f"holds {size:,})"
            )
        raw = handle.read(header_size)
    try:
        header = json.loads(raw.decode("utf-8"))
        spans = [(name, entry) for name, entry in header.items() if name != "__metadata__"]
        data_size = size - 8 - header_size
        end = 0
        for name, entry in spans:
            begin, stop = entry["data_offsets"]
            count = math.prod(entry["shape"]) * SAFETENSORS_DTYPE_BYTES.get(entry["dtype"], 0)
            if entry["dtype"] in SAFETENSORS_DTYPE_BYTES and stop - begin != count:
                raise CorruptFileError(f"{path}: tensor {name!r} has {stop - begin} bytes for shape {entry['shape']}")
            end = max(end, stop)
    except CorruptFileError:
        raise
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
        raise CorruptFileError(f"{path}: not a safetensors file (its header is not a tensor table)") from None
    if end != data_size:
        raise CorruptFileError(
            f"{path}: truncated safetensors file (its header describes {end:,} bytes of tensor data, the file holds "
            f"{data_size:,})"
            if end > data_size
            else f"{path}: damaged safetensors file ({data_size - end:,} bytes after the last tensor)"
        )
    return header


def check_pickled_archive(path: str | os.PathLike, what: str) -> None:
    """A `torch.save` file (a zip archive) that is complete and whose every member has its checksum; else
    `CorruptFileError` naming it and `what` it should hold. Nothing in it is unpickled."""
    import zipfile

    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError):
        raise CorruptFileError(f"{path}: not a readable {what} file (truncated or not a torch.save archive)") from None
    if damaged is not None:
        raise CorruptFileError(f"{path}: damaged {what} file (the checksum of {damaged} does not match)")


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The weight files a checkpoint's loader reads, by exact name: the shards its safetensors index lists (with the
    index), else `model.safetensors` or a PEFT adapter's `adapter_model.safetensors`."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        table = read_json_file(index, "a safetensors index")
        weight_map = table.get("weight_map") if isinstance(table, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and _plain_name(name) for name in weight_map.values()
        ):
            raise CorruptFileError(f"{index}: not a safetensors index (no weight_map of file names)")
        return [index.name, *sorted(set(weight_map.values()))]
    return [name for name in ("model.safetensors", "adapter_model.safetensors") if (folder / name).is_file()]


def check_checkpoint_files(folder: str | os.PathLike) -> None:
    """Check, before loading, that a checkpoint folder's config is JSON and each weight file is complete: a damaged
    file raises `CorruptFileError` (a `ValueError`: one line at every entry point) naming it and what is wrong."""
    folder = Path(folder)
    for name in ("config.json", "adapter_config.json"):
        if (folder / name).is_file() and not isinstance(read_json_file(folder / name, "a config"), dict):
            raise CorruptFileError(f"{folder / name}: not a config (a JSON object)")
    for name in weight_files(folder):
        path = folder / name
        if not path.is_file():
            raise CorruptFileError(f"{path}: missing, though {folder}/model.safetensors.index.json lists it")
        if name.endswith(".safetensors"):
            check_safetensors_file(path)


# Exceptions that loading a damaged file raises in the libraries (by name: safetensors' and pickle's are not
# OSErrors, and torch and transformers report a damaged archive or a tensor of the wrong shape as a RuntimeError).
_LOADING_ERRORS = ("SafetensorError", "UnpicklingError", "HeaderTooLarge", "EOFError", "BadZipFile")
_LOADING_MESSAGES = ("size mismatch", "PytorchStreamReader", "invalid load key", "Error(s) in loading state_dict",
                     "ignore_mismatched_sizes", "incomplete metadata")  # fmt: skip
# transformers logs a table of mismatched tensors before raising: kept back, and its first row made the message.
_LOADING_REPORT_LOGGER = "transformers.modeling_utils"
_MISMATCH_ROW = re.compile(
    r"(?P<key>[\w.]+)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\((?P<saved>\[[^\]]*\])\)\s*vs\s*model:\s*"
    r"torch\.Size\((?P<model>\[[^\]]*\])\)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn the error a library raises inside the block on a damaged file, or on weights of other shapes than the
    model's, into one `CorruptFileError` line: `path: cannot be read as <what> (<the fault>)`."""
    report_logger = logging.getLogger(_LOADING_REPORT_LOGGER)
    collect, propagate = _Collect(), report_logger.propagate
    report_logger.addHandler(collect)
    report_logger.propagate = False
    failed = False
    try:
        yield
    except CorruptFileError:
        failed = True
        raise
    except Exception as error:
        failed = True
        text = " ".join(str(error).split())
        damaged = type(error).__name__ in _LOADING_ERRORS or (
            isinstance(error, RuntimeError) and any(marker in text for marker in _LOADING_MESSAGES)
        )
        if not damaged:
            raise
        report = _ANSI.sub("", "\n".join(record.getMessage() for record in collect.records))
        mismatch = _MISMATCH_ROW.search(report) or re.search(
            r"size mismatch for (?P<key>[^:]+): copying a param with shape torch\.Size\((?P<saved>\[[^\]]*\])\) from "
            r"checkpoint, the shape in current model is torch\.Size\((?P<model>\[[^\]]*\])\)",
            text,
        )
        if mismatch:
            detail = (
                f"its weights do not fit the model its config describes: {mismatch['key']} has shape "
                f"{mismatch['saved']} in the file, {mismatch['model']} in the model"
            )
        else:
            detail = f"damaged or not such a file: {text[:300]}"
        raise CorruptFileError(f"{path}: cannot be read as {what} ({detail})") from error
    finally:
        report_logger.removeHandler(collect)
        report_logger.propagate = propagate
        if not failed:  # a load that worked prints its report as usual
            for record in collect.records:
                report_logger.handle(record)


@contextlib.contextmanager
def loading_checkpoint(folder: str | os.PathLike, what: str) -> Iterator[None]:
    """`check_checkpoint_files(folder)`, then `reading` its weights inside the block: a damaged config or weight file,
    or weights of other shapes than the config's model, is one `CorruptFileError` line naming the file."""
    check_checkpoint_files(folder)
    weights = weight_files(folder)
    # transformers' "Loading weights" bar would stand above the one line of a failed load; a checked load of a
    # local checkpoint is quick, so the bar is left out.
    progress = sys.modules.get("transformers.utils.logging")
    hide = progress is not None and progress.is_progress_bar_enabled()
    if hide:
        progress.disable_progress_bar()
    try:
        with reading(Path(folder) / (weights[0] if weights else "config.json"), what):
            yield
    finally:
        if hide:
            progress.enable_progress_bar()


__all__ = [
    "CorruptFileError",
    "FolderLock",
    "UnsafeOutputError",
    "atomic_path",
    "atomic_write",
    "check_checkpoint_files",
    "check_checkpoint_folder",
    "check_checkpoint_location",
    "check_run_folder",
    "earlier_run_entries",
    "hold_lock",
    "loading_checkpoint",
    "make_staging_folder",
    "new_run_id",
    "png_text",
    "public_dataset_name",
    "read_run_record",
    "reading",
    "record_run_entry",
    "recover_interrupted_saves",
    "remove_entries",
    "save_lock_file",
    "saved_run_id",
    "wait_for_lock",
    "write_json",
    "write_save_record",
]
