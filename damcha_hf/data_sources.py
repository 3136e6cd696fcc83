"""Where the data lives and whether it is there, checked while parsing (standard library only; pyarrow, imported
when asked, reads a parquet file's schema).

`damcha_hf.data` loads the data; this module answers, in a fraction of a second, whether a `--data` value can be
loaded at all, so that a missing dictionary or a badly laid-out image folder is reported before any import or work.
The data flags of transformers' examples (--dataset-name, --train-file, the split and column flags) are checked the
same way: a data file's extension, emptiness and columns (read from its head), a Hub id while the Hub is offline.
"""

from __future__ import annotations

import os

GCIDE_PATH = "/usr/share/dictd/gcide.dict.dz"  # where Debian's dict-gcide puts the dictionary
GCIDE_PATH_VARIABLE = "DAMCHA_GCIDE_PATH"  # names a copy elsewhere (any gzip-compatible file, e.g. a dictd .dict.dz)
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # where Debian's dataset-fashion-mnist puts the idx files
# The idx files of each split, plain or gzipped (`<name>.gz`), as Fashion-MNIST is distributed.
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
IMAGE_FOLDER_LAYOUT = (
    "<folder>/<label>/<image> (one folder per class), or <folder>/train/<label>/<image> with "
    "<folder>/validation/<label>/<image> (or test/)"
)
SPLIT_FOLDERS = ("train", "validation", "test")


def gcide_path() -> str:
    """Where `--data gcide` reads the GCIDE dictionary: the file named by $DAMCHA_GCIDE_PATH, else GCIDE_PATH."""
    return os.environ.get(GCIDE_PATH_VARIABLE) or GCIDE_PATH


def missing_gcide_message(
    path: str | None = None, otherwise: str = "pass --data stdlib or a text file, folder or glob"
) -> str | None:
    """Why the GCIDE dictionary cannot be read from `path` (default: `gcide_path()`), or None when it can; the message
    ends with `otherwise`, what else the program can do."""
    named_by_variable = path is None and bool(os.environ.get(GCIDE_PATH_VARIABLE))
    path = path or gcide_path()
    if os.path.isfile(path):
        return None
    where = f"{path} (${GCIDE_PATH_VARIABLE})" if named_by_variable else path
    return (
        f"the GCIDE dictionary is not at {where}; install it (Debian/Ubuntu: `apt-get install dict-gcide`) or set "
        f"{GCIDE_PATH_VARIABLE} to a copy, or {otherwise}"
    )


def fashion_mnist_file(folder: str, name: str) -> str | None:
    """The path of the idx file `name` in `folder`, gzipped or plain, or None when neither is there."""
    for candidate in (f"{name}.gz", name):
        if os.path.isfile(os.path.join(folder, candidate)):
            return os.path.join(folder, candidate)
    return None


def missing_fashion_mnist_message(folder: str, splits=("train", "test"), otherwise: str = "") -> str | None:
    """Why Fashion-MNIST's idx files of `splits` cannot be read from `folder`, or None when they can; the message
    ends with `otherwise`, what else the program can do (a flag naming another folder, say)."""
    if not os.path.isdir(folder):
        found = "does not exist"
    else:
        missing = [
            name for split in splits for name in FASHION_MNIST_FILES[split] if not fashion_mnist_file(folder, name)
        ]
        if not missing:
            return None
        found = f"has no {', '.join(missing)}(.gz)"
    return (
        f"the Fashion-MNIST folder {folder} {found}; install it (Debian/Ubuntu: `apt-get install "
        f"dataset-fashion-mnist` puts the idx files in {FASHION_MNIST_DIR}){', or ' + otherwise if otherwise else ''}"
    )


def _images_in(folder: str) -> int:
    with os.scandir(folder) as entries:
        return sum(1 for entry in entries if entry.is_file() and entry.name.lower().endswith(IMAGE_SUFFIXES))


def _label_folders(folder: str) -> dict[str, int]:
    """{label folder name: images directly in it} for the subfolders of `folder`."""
    with os.scandir(folder) as entries:
        return {entry.name: _images_in(entry.path) for entry in entries if entry.is_dir() and entry.name[0] != "."}


def image_folder_error(folder: str) -> str | None:
    """Why `folder` is not an image-classification folder (naming the expected layout and what it holds), or None."""
    if not os.path.isdir(folder):
        return f"{folder} is not a folder; expected {IMAGE_FOLDER_LAYOUT}"
    subfolders = _label_folders(folder)
    splits = [name for name in SPLIT_FOLDERS if name in subfolders]
    if "train" in splits:
        problems = []
        for split in splits:
            labels = _label_folders(os.path.join(folder, split))
            if not any(labels.values()):
                problems.append(f"{split}/ has {_describe(os.path.join(folder, split), labels)}")
        if problems:
            return f"{folder}: {'; '.join(problems)}; expected {IMAGE_FOLDER_LAYOUT}"
        return None
    if any(subfolders.values()):
        return None
    return f"{folder} has {_describe(folder, subfolders)}; expected {IMAGE_FOLDER_LAYOUT}"


def _describe(folder: str, subfolders: dict[str, int]) -> str:
    """What an image folder holds, said in a few words: loose images, subfolders without images, nothing."""
    loose = _images_in(folder)
    parts = []
    if loose:
        parts.append(f"{loose} image(s) but no label folders")
    if subfolders:
        names = ", ".join(sorted(subfolders)[:5]) + (", ..." if len(subfolders) > 5 else "")
        parts.append(f"{len(subfolders)} subfolder(s) ({names}) with no images in them")
    return " and ".join(parts) or "no images and no subfolders"


# ------------------------------------------------------------------------------- datasets by name or by file

# A data file's loader (`datasets.load_dataset`'s packaged builders) by its extension, as transformers' examples pick it.
DATA_FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
                      ".parquet": "parquet"}  # fmt: skip
# What `save_to_disk` writes into its folder: a `DatasetDict` (dataset_dict.json) or a `Dataset` (state.json).
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def data_file_builder(path: str) -> str | None:
    """The `datasets` loader of a data file by its extension (`.jsonl.gz` counts as `.jsonl`), or None."""
    name = path.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(compressed):
            name = name[: -len(compressed)]
    return DATA_FILE_BUILDERS.get(os.path.splitext(name)[1])


def data_file_error(path: str) -> str | None:
    """Why `path` cannot be a --train-file / --validation-file (missing, not a file, an unknown extension, empty), or
    None."""
    kinds = ", ".join(DATA_FILE_BUILDERS)
    if not os.path.exists(path):
        return f"{path} does not exist; give a data file ({kinds})"
    if not os.path.isfile(path):
        return f"{path} is not a file; give a data file ({kinds}), or a dataset folder as --dataset-name"
    if data_file_builder(path) is None:
        return f"{path}: unknown extension {os.path.splitext(path)[1] or '(none)'!r}; data files are {kinds}"
    if os.path.getsize(path) == 0:
        return f"{path} is empty; give a file holding data"
    return None


def data_file_columns(path: str) -> list[str] | None:
    """The columns a data file will load with, read from its head (a CSV header, the first JSON-lines object, the
    parquet schema; `text` for a text file), or None when the head does not say (a JSON array, a compressed file)."""
    import csv
    import json

    builder = data_file_builder(path)
    if builder == "text":
        return ["text"]
    if path.lower().endswith((".gz", ".bz2", ".xz", ".zst")):
        return None
    if builder == "parquet":
        import pyarrow.parquet

        try:
            return list(pyarrow.parquet.read_schema(path).names)
        except Exception as error:  # pyarrow says why in its own words: not parquet, truncated, ...
            raise ValueError(f"{path} is not a readable parquet file ({str(error).splitlines()[0]})") from None
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as handle:
        if builder == "csv":
            header = next(csv.reader(handle), None)
            return [name for name in header] if header else None
        for line in handle:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return None  # one JSON document over several lines: `datasets` reads it whole
                return list(row) if isinstance(row, dict) else None
    return None


def saved_dataset_folder(path: str) -> bool:
    """Whether `path` is a folder `save_to_disk` wrote (read with `load_from_disk`), not a folder of data files."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name)) for name in SAVED_DATASET_MARKERS)


def hub_offline() -> str | None:
    """The variable that puts the Hub offline (`HF_HUB_OFFLINE=1`), or None."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):
            return name
    return None


def looks_like_path(name: str) -> bool:
    """A --dataset-name written as a path (not a Hub id `owner/name`): absolute, relative (`./`, `../`, `~`), or
    with more than one `/`."""
    return name.startswith((os.sep, ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def dataset_name_error(name: str) -> str | None:
    """Why --dataset-name cannot be loaded at all, found while parsing: a path that does not exist, a Hub id while the
    Hub is offline. None when it may load (a local folder, or a Hub id while online)."""
    if os.path.exists(name):
        if not os.path.isdir(name):
            return (f"{name} is a file, not a dataset folder; give it as --train-file (a "
                    f"{', '.join(DATA_FILE_BUILDERS)} file)")  # fmt: skip
        return None
    if looks_like_path(name):
        return f"{name}: no such folder; give a dataset folder, a save_to_disk folder or a Hub dataset id"
    offline = hub_offline()
    if offline:
        return (f"{name} is not a local folder, and the Hub cannot be reached ({offline}=1); give a local dataset "
                "folder, a save_to_disk folder or --train-file, or unset it on a machine with network access")  # fmt: skip
    return None


def add_dataset_arguments(group, *, task_columns: dict[str, tuple[str | None, str]], streaming: bool = False) -> None:
    """The flags of transformers' examples (run_clm and its siblings) that name data through `datasets`:
    --dataset-name / --dataset-config-name, --train-file / --validation-file, the splits, the held-out share, and
    `task_columns` (flag -> (default column, help)); --streaming where the recipe can stream."""
    kinds = ", ".join(DATA_FILE_BUILDERS)
    group.add_argument("--dataset-name", help="a Hub dataset id, a local dataset folder (data files `datasets` "
                       "reads) or a folder written by `save_to_disk`")  # fmt: skip
    group.add_argument("--dataset-config-name", help="the --dataset-name configuration (its subset)")
    group.add_argument("--train-file", help=f"a training data file, read by its extension ({kinds})")
    group.add_argument("--validation-file", help="a validation data file (the same kinds); without it the "
                       "--validation-split of the dataset, else a held-out share of training")  # fmt: skip
    group.add_argument("--train-split", default="train", help="the split of --dataset-name to train on")
    group.add_argument("--validation-split", help="the split to validate on (default: 'validation' where the dataset "
                       "has one, else --validation-split-percentage of the training split, held out)")  # fmt: skip
    group.add_argument("--validation-split-percentage", type=_percentage,
                       help="the percentage of the training rows held out for validation when there is no validation "
                       "split or file (default: --validation-fraction x 100)")  # fmt: skip
    for flag, (default, text) in task_columns.items():
        group.add_argument(flag, default=default, help=text)
    if streaming:
        group.add_argument("--streaming", action="store_true", help="read the data as a stream (a corpus larger than "
                           "memory): tokenized and packed on the fly; needs --max-steps, and a resume skips what was "
                           "seen")  # fmt: skip


def _percentage(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a percentage, e.g. 5") from None
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 100 (exclusive); give a percentage, e.g. 5")
    return value


def uses_datasets_flags(args) -> bool:
    """Whether the data come through --dataset-name or --train-file (else from the recipe's --data preset)."""
    return bool(getattr(args, "dataset_name", None) or getattr(args, "train_file", None))


# Flags of the shipped sources only, by `args` attribute: refused with --dataset-name / --train-file, which never read
# them.
PRESET_ONLY_FLAGS = ("file_pattern", "max_data_bytes", "fashion_mnist_dir")


def held_out_share_flag(args) -> str | None:
    """The flag that set the held-out share on the command line (--validation-split-percentage or
    --validation-fraction), or None when it is the default."""
    explicit = getattr(args, "explicit", set())
    for name in ("validation_split_percentage", "validation_fraction"):
        if name in explicit:
            return f"--{name.replace('_', '-')}"
    return None


def check_dataset_arguments(parser, args, *, columns: dict[str, str], preset_flag: str = "--data") -> None:
    """The data flags that fit together, checked while parsing (argparse errors, one line): one source (--data, or
    --dataset-name, or --train-file); --dataset-config-name and the split flags only with --dataset-name;
    --validation-file only with --train-file, and without a held-out share; the presets' own flags only with a
    preset; each file readable by its extension, non-empty and holding the columns of `columns` (column flag ->
    `args` attribute). Sets `args.validation_fraction` from --validation-split-percentage."""
    explicit = getattr(args, "explicit", set())
    if uses_datasets_flags(args):
        unused = [name for name in PRESET_ONLY_FLAGS if name in explicit]
        if unused:
            parser.error(f"--{unused[0].replace('_', '-')} applies to {preset_flag} (a shipped source), not to "
                         "--dataset-name / --train-file; leave it out")  # fmt: skip
    if args.validation_file and held_out_share_flag(args):
        parser.error(f"{held_out_share_flag(args)} holds out training rows, which --validation-file replaces; give "
                     "one of them")  # fmt: skip
    if args.validation_split_percentage is not None:
        if "validation_fraction" in explicit:
            parser.error("give --validation-split-percentage or --validation-fraction, not both (the same share)")
        args.validation_fraction = args.validation_split_percentage / 100
    if args.dataset_name and args.train_file:
        parser.error("give --dataset-name or --train-file, not both: one names a dataset, the other its files")
    if uses_datasets_flags(args) and "data" in explicit:
        source = "--dataset-name" if args.dataset_name else "--train-file"
        parser.error(f"give {preset_flag} or {source}, not both ({preset_flag} picks a shipped source or local text)")
    if not args.dataset_name:
        for flag in ("dataset_config_name", "validation_split"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} applies to --dataset-name; add it, or leave the flag out")
        if "train_split" in explicit:
            parser.error("--train-split applies to --dataset-name; add it, or leave the flag out")
    if args.validation_file and not args.train_file:
        parser.error("--validation-file goes with --train-file; add a training file, or use --dataset-name with "
                     "--validation-split")  # fmt: skip
    if not uses_datasets_flags(args):
        given = [flag for flag, attribute in columns.items() if attribute in explicit]
        if given:
            parser.error(f"{given[0]} applies to --dataset-name or --train-file (the shipped sources have fixed "
                         "columns); add one, or leave the flag out")  # fmt: skip
        return
    if args.dataset_name:
        message = dataset_name_error(args.dataset_name)
        if message:
            parser.error(f"--dataset-name {message}")
        if args.dataset_config_name and saved_dataset_folder(args.dataset_name):
            parser.error(f"--dataset-config-name: {args.dataset_name} is a save_to_disk folder, which has no "
                         "configurations; leave the flag out")  # fmt: skip
        return
    for flag, path in (("--train-file", args.train_file), ("--validation-file", args.validation_file)):
        if path is None:
            continue
        message = data_file_error(path)
        if message:
            parser.error(f"{flag} {message}")
        try:
            found = data_file_columns(path)
        except ValueError as error:
            parser.error(f"{flag} {error}")
        if found is None:
            continue
        for column_flag, attribute in columns.items():
            column = getattr(args, attribute)
            if column is not None and column not in found:
                parser.error(f"{flag} {path} has no column {column!r} ({column_flag}); its columns are {found}; "
                             f"name one with {column_flag}")  # fmt: skip
