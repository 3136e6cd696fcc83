"""Writing a file or folder so that it is never left half-written, and holding a lock file so that one process at a
time writes a folder.

- `atomic_path` / `atomic_write` / `write_json`: a file is written under a temporary name beside its target and renamed
  onto it. Temporary files and folders (`make_staging_folder`) are created with the permissions the umask allows (not
  `tempfile`'s forced 0600/0700), so checkpoints and images are as readable as any other file the user writes.
- `hold_lock`: one run per output folder (`fcntl`), refusing a second one by the process id of the first;
  `wait_for_lock`: one save at a time into a folder (`save_lock_file`), a second one waiting for the first;
  `lock_holder`: the process id of the holder, read without taking the lock.

Standard library only: the command line and the recipes use it while parsing arguments, before torch is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path


class UnsafeOutputError(FileExistsError):
    """An output path that would overwrite or delete files the program did not write; the message names the fix."""

    def __str__(self) -> str:  # OSError's own str() would prefix an errno tuple when given several arguments
        return self.args[0] if self.args else ""


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temporary_name(target: Path, kind: str) -> Path:
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
    temporary = temporary_name(path, "tmp")
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
    staging = temporary_name(target, "tmp")
    os.mkdir(staging)
    return staging


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
        descriptor = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666 & ~current_umask())
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


def save_lock_target(name: str) -> str | None:
    """The folder name whose save lock `name` is, or None when `name` is no save lock."""
    if name.startswith(".") and name.endswith(SAVE_LOCK_SUFFIX) and len(name) > len(SAVE_LOCK_SUFFIX) + 1:
        return name[1 : -len(SAVE_LOCK_SUFFIX)]
    return None


__all__ = [
    "FolderLock",
    "SAVE_LOCK_SUFFIX",
    "UnsafeOutputError",
    "atomic_path",
    "atomic_write",
    "current_umask",
    "hold_lock",
    "lock_holder",
    "make_staging_folder",
    "save_lock_file",
    "save_lock_target",
    "temporary_name",
    "wait_for_lock",
    "write_json",
]
