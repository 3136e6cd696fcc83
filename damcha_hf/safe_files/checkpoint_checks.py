"""Checking an input checkpoint before loading it: a truncated, garbage or mismatched file becomes one
`CorruptFileError` line naming the file and the fault.

- `check_checkpoint_files`: the config is JSON and each weight file (`weight_files`) is complete
  (`check_safetensors_file` reads the safetensors header and compares it with the file's size);
- `check_pickled_archive`: a `torch.save` archive is complete, checked without unpickling anything;
- `read_json_file`: JSON, or the file named;
- `reading` / `loading_checkpoint`: the error a library raises on a damaged file (transformers' table of mismatched
  tensors included) as one line.

Standard library only: the recipes check --resume and --init-from checkpoints before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path


class CorruptFileError(ValueError):
    """A file that cannot be read as what it should be (truncated, garbage, of the wrong shape); the message names
    the file and what is wrong with it."""


def plain_file_name(name: str) -> bool:
    return name == os.path.basename(name) and name not in ("", ".", "..") and "\\" not in name


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
            isinstance(name, str) and plain_file_name(name) for name in weight_map.values()
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
    "check_checkpoint_files",
    "check_pickled_archive",
    "check_safetensors_file",
    "loading_checkpoint",
    "plain_file_name",
    "read_json_file",
    "reading",
    "weight_files",
]
