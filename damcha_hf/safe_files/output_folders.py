"""Never deleting or overwriting a file the program did not write: the checks that an output folder may be written or
replaced, the records of what a save or a run wrote, and finishing what a killed save left.

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

Writing atomically and the locks are `atomic_files`'; checking an input checkpoint is `checkpoint_checks`'.
Standard library only, so the command line and the recipes check their output paths
while parsing arguments, before torch or transformers are imported.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from .atomic_files import UnsafeOutputError, current_umask, lock_holder, save_lock_target, temporary_name, write_json
from .checkpoint_checks import CorruptFileError, plain_file_name, read_json_file

# The heatmap of the learned metric drawn of a checkpoint: by a save inside it, by `damcha-hf inspect` beside it.
METRIC_HEATMAP_FILE = "metric_heatmap.png"

# The model_type prefix of this plugin's configs: a folder is "an earlier checkpoint of this plugin" only with it.
MODEL_TYPE_PREFIX = "damcha_"

# The `Software` text of the pictures this plugin draws (`png_text`): a picture that lacks it is never replaced.
PNG_SOFTWARE = "damcha-hf"
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


def apply_umask(folder: Path) -> None:
    """Give the files of `folder` the permissions the umask allows for a new file (0644 under the usual 022): some
    writers (safetensors shards via a temporary file) leave 0600 whatever the umask."""
    mode = 0o666 & ~current_umask()
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


# Written last by every checkpoint save: the names of the files that save wrote. Only they are ever replaced later;
# a checkpoint without it (plain `save_pretrained`, or a save of a damcha-hf release before the record) is never
# replaced, since its files cannot be told from files a user put beside them.
SAVE_RECORD_FILE = ".damcha-hf-files.json"


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


def _recorded_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) <= 2 and all(plain_file_name(part) for part in parts)


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


def check_output_location(path: Path, *, argument: str, file_fix: str, protected_fix: str) -> None:
    """Refuse with `UnsafeOutputError` a file where an output folder goes (`file_fix` says what to do instead), the
    current folder, one of its parents or the home folder (`protected_fix` says why and what to do), and a path that
    cannot be created."""
    if path.exists() and not path.is_dir():
        raise UnsafeOutputError(f"{_subject(argument, path)} is a file, not a folder; {file_fix}.")
    if path.resolve() in protected_folders():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is the current folder, one of its parents or the home folder{protected_fix}."
        )
    check_writable_location(path, argument=argument)


def check_checkpoint_location(folder: str | os.PathLike, *, argument: str = "folder") -> Path:
    """The checks of `check_checkpoint_folder` that do not read the folder's contents: refused with
    `UnsafeOutputError` are a symbolic link, a file, the current folder, one of its parents, the home folder and a path
    that cannot be created. Returns the path, absolute."""
    path = Path(folder).expanduser().absolute()
    if path.is_symlink():
        raise UnsafeOutputError(
            f"{_subject(argument, path)} is a symbolic link; pass the folder it points to ({path.resolve()}) or a new folder."
        )
    example = f" (e.g. {path.with_name(path.name + '-checkpoint')})" if path.name else ""  # `/` has no name, is no file
    check_output_location(
        path,
        argument=argument,
        file_fix="choose a folder path that does not exist yet" + example,
        protected_fix=f", which a checkpoint save would replace as a whole; choose a new subfolder, e.g. "
        f"{path / 'damcha-checkpoint'}",
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
    refused with `UnsafeOutputError` naming the files, as are a file path, a path that cannot be created, and the
    current folder, its parents and the home folder. A run's lock file (`RUN_LOCK_FILE`), and beside a folder the recipe
    writes the save lock a killed save left (`save_lock_file`) and the heatmap `damcha-hf inspect` draws of it
    (`NAME_metric_heatmap.png`), count as the recipe's.
    """
    path = Path(folder).expanduser().absolute()
    written, checkpoints = (*written, RUN_LOCK_FILE), tuple(checkpoints)
    check_output_location(
        path,
        argument=argument,
        file_fix="choose a folder path (it is created if missing)",
        protected_fix=f"; a run writes checkpoints and results into its folder, so choose a new subfolder, e.g. "
        f"{path / 'runs' / 'my-run'}",
    )
    if not path.is_dir():
        return path
    entries = sorted(entry.name for entry in path.iterdir())

    def recipes_own(name: str) -> bool:
        # Beside a folder the recipe writes, e.g. `final`: the lock a killed save of it left, and the heatmap that
        # `damcha-hf inspect` draws of it by default (`final_metric_heatmap.png`).
        heatmap_suffix = f"_{METRIC_HEATMAP_FILE}"
        drawn_of = name[: -len(heatmap_suffix)] if name.endswith(heatmap_suffix) else None
        of = save_lock_target(name) or drawn_of or name
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


# The temporary names of `temporary_name` (`.NAME.tmp-PID-HEX`, a save in progress), of a folder moved aside
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
        target = save_lock_target(entry.name)
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
        or not all(isinstance(name, str) and plain_file_name(name) for name in entries)
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
        moved = temporary_name(Path(entry), "del")
        os.replace(entry, moved)
        aside.append((Path(entry).name, moved))
    for _, moved in aside:
        if moved.is_dir() and not moved.is_symlink():
            shutil.rmtree(moved)
        else:
            moved.unlink()
    return [name for name, _ in aside]


RUN_LOCK_FILE = ".damcha-hf-run.lock"
__all__ = [
    "METRIC_HEATMAP_FILE",
    "RUN_LOCK_FILE",
    "RUN_RECORD_FILE",
    "SAVE_RECORD_FILE",
    "apply_umask",
    "check_checkpoint_folder",
    "check_checkpoint_location",
    "check_run_folder",
    "check_writable_location",
    "earlier_run_entries",
    "foreign_entries",
    "new_run_id",
    "png_text",
    "read_run_record",
    "record_run_entry",
    "recover_interrupted_saves",
    "remove_entries",
    "saved_files",
    "saved_run_id",
    "write_save_record",
]
