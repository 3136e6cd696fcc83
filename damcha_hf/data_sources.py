"""Where the data lives and whether it is there, checked while parsing (standard library only).

`damcha_hf.data` loads the data; this module answers, in a fraction of a second, whether a `--data` value can be
loaded at all, so that a missing dictionary or a badly laid-out image folder is reported before any import or work.
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
