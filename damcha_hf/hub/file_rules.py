"""The files of a Hub checkpoint: the card, the pictures, the config and preprocessor files a push uploads, and what
of a dataset's name a public card may show (`public_dataset_name`)."""

from __future__ import annotations

import os
from pathlib import Path

# The files of a checkpoint a push uploads (`damcha_hf.hub.upload_plan`), besides the weights and the model code.
CARD_FILE = "README.md"
LOSS_CURVE_FILE = "loss_curve.png"
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
