"""Where the data lives and whether it is there, checked while parsing (standard library only).

`damcha_hf.data` loads the data; this module answers, in a fraction of a second, whether a `--data` value can be
loaded at all, so that a missing dictionary or a badly laid-out image folder is reported before any import or work.
"""

from __future__ import annotations

import os

GCIDE_PATH = "/usr/share/dictd/gcide.dict.dz"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
IMAGE_FOLDER_LAYOUT = (
    "<folder>/<label>/<image> (one folder per class), or <folder>/train/<label>/<image> with "
    "<folder>/validation/<label>/<image> (or test/)"
)
SPLIT_FOLDERS = ("train", "validation", "test")


def missing_gcide_message(path: str | None = None) -> str | None:
    """Why the GCIDE dictionary cannot be read from `path` (default: `GCIDE_PATH`), or None when it can."""
    path = path or GCIDE_PATH
    if os.path.isfile(path):
        return None
    return (
        f"the GCIDE dictionary is not at {path}; install it (Debian/Ubuntu: `apt-get install dict-gcide`), or pass "
        "--data stdlib or a text file, folder or glob"
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
