"""Argument checks shared by the command line and the recipes, run while parsing (standard library only).

    parser.add_argument("--batch-size", type=positive_int, default=16)
    args = parser.parse_args(argv)
    check_heads_divide_width(parser, args.n_embd, args.n_head, width_flag="--n-embd", heads_flag="--n-head")

A bad value ends the program at once with argparse's one-line `error:` message and exit code 2, before any import of
torch, data loading or training.
"""

from __future__ import annotations

import argparse
import copy
import math
import re


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with errors on one line (no usage dump): `prog: error: message (see prog --help)`, and no
    abbreviated options (`--max-step` is not taken for `--max-steps`: a typo must not pick a flag)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its example commands keep their lines; a one-line description is wrapped) and
    each option's default in its help, as `ArgumentDefaultsHelpFormatter` shows it (0 included); options without a
    default (None) or flags (False) show none."""

    def _fill_text(self, text, width, indent):
        # A description on one line (no example commands to keep) is wrapped to the terminal like argparse's own.
        if "\n" not in text.strip():
            return argparse.HelpFormatter._fill_text(self, text, width, indent)
        return super()._fill_text(text, width, indent)

    def _format_action(self, action):
        # argparse prints no help line for an option without help text: give it one that shows the default.
        if action.help is None and action.option_strings and not _no_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        help_text = action.help or ""
        if "%(default)" in help_text or "(default" in help_text or _no_default(action):
            return help_text
        return super()._get_help_string(action)


def _no_default(action: argparse.Action) -> bool:
    """An option whose default says nothing: None, a flag's False, or suppressed. Compared by identity, since
    `0 in (None, False)` is true and a default of 0 or 0.0 (a seed, a dropout rate) must be shown."""
    return action.default is None or action.default is False or action.default is argparse.SUPPRESS


def positive_int(text: str) -> int:
    """An integer >= 1 (a batch size, a step count, a width)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text!r}")
    return value


def probability(text: str) -> float:
    """A number in [0, 1) (a dropout rate, a validation fraction)."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text!r}")
    return value


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def hub_id(text: str) -> str:
    """A full Hub repository id (`owner/name`), never a local path: a path written into a published file would leak
    the machine's folder layout and mean nothing to anyone else. A bare `name` is refused too: the Hub creates it as
    `<token owner>/name`, so a file naming it `name` would point at nothing."""
    import os

    if os.path.isabs(text) or text.startswith((".", "~")) or os.path.isdir(text) or text.count("/") > 1 or not text:
        raise argparse.ArgumentTypeError(
            f"{text!r} looks like a local path, not a Hub id; give the id the model is published under, e.g. "
            "'your-name/damcha-gpt2-base'"
        )
    message = repo_id_error(text)
    if message:
        raise argparse.ArgumentTypeError(message)
    if "/" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no namespace; give the full id the model is published under, e.g. 'your-name/{text}'"
        )
    return text


# huggingface_hub's rule for a repository id (`validate_repo_id`), without importing it: `name` or `namespace/name`
# of ASCII letters, digits, `_`, `-` and `.`, each at most 96 characters, no `--` or `..`, not ending in `.git`.
_REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", flags=re.ASCII)


def repo_id_error(text: str) -> str | None:
    """Why `text` is not a valid Hub repository id, or None when it is."""
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text or text.endswith(".git"):
        return (
            f"{text!r} is not a valid Hub repository id ('name' or 'namespace/name': letters, digits, '-', '_' and "
            "'.', no '--' or '..', the name at most 96 characters)"
        )
    return None


def text_data_source(text: str) -> str:
    """`--data` of a text recipe: 'stdlib', 'gcide', or an existing file, folder or glob that matches files; a file
    given (or matched) must hold text."""
    import glob
    import os

    if text == "gcide":
        from .data_sources import missing_gcide_message

        message = missing_gcide_message()
        if message:
            raise argparse.ArgumentTypeError(message)
    if text in ("stdlib", "gcide"):
        return text
    if os.path.exists(text):
        if not os.path.isfile(text) and not os.path.isdir(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a regular file or folder (a device, pipe or socket); give a text file, a folder of "
                ".txt files or a glob"
            )
        if os.path.isfile(text):
            check_text_file(text)
        return text
    matches = glob.glob(text, recursive=True) if glob.has_magic(text) else []
    if matches:
        for path in matches[:TEXT_FILES_CHECKED]:
            if os.path.isfile(path):
                check_text_file(path)
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither 'stdlib', 'gcide', an existing text file or folder, nor a glob that matches files"
    )


# How much of a --data file, and how many files of a glob, are read to tell text from a binary file.
TEXT_SAMPLE_BYTES = 1 << 16
TEXT_FILES_CHECKED = 100
# Text in a legacy 8-bit encoding has a few bytes that are not UTF-8 (accented letters); random bytes or a binary
# file have far more.
MAX_UNDECODABLE_SHARE = 0.1


def check_text_file(
    path: str, *, fix: str = "give a UTF-8 text file, a folder of .txt files or a glob of them"
) -> None:
    """Refuse (`ArgumentTypeError`) an empty file or one that is not text: NUL bytes (an executable, an archive, an
    image) or mostly bytes that are not UTF-8. `fix` says what the flag takes instead."""
    import codecs

    try:
        with open(path, "rb") as handle:
            sample = handle.read(TEXT_SAMPLE_BYTES)
    except OSError as error:  # e.g. a file this user may not read
        raise argparse.ArgumentTypeError(f"{path!r} cannot be read ({error.strerror}); {fix}") from None
    if not sample:
        raise argparse.ArgumentTypeError(f"{path!r} is empty; give a file holding text")
    decoded = codecs.getincrementaldecoder("utf-8")("replace").decode(sample, final=False)
    undecodable = decoded.count("\ufffd") / max(1, len(decoded))
    if b"\0" in sample or undecodable > MAX_UNDECODABLE_SHARE:
        kind = "it holds NUL bytes" if b"\0" in sample else f"{undecodable:.0%} of its first bytes are not UTF-8"
        raise argparse.ArgumentTypeError(
            f"{path!r} is not a text file ({kind}: a binary file such as a program, an archive or an image); {fix}"
        )


def text_file_or_folder(text: str) -> str:
    """`--data` of a command that reads a text file or a folder (of images): refuses, while parsing, a path that is
    missing, one that is neither a regular file nor a folder, and a file that is empty or not text. Which of the two
    the model needs is checked once the checkpoint is known."""
    import os

    fix = "give a UTF-8 text file (text models) or a folder of images (vision models)"
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist; {fix}")
    if not os.path.isfile(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file or folder (a device, pipe or socket); {fix}")
    if os.path.isfile(text):
        check_text_file(text, fix=fix)
    return text


def heads_divide_width_error(width: int, heads: int, *, width_flag: str, heads_flag: str) -> str | None:
    """The message when the attention heads do not split the width evenly (as the config requires), else None."""
    if width % heads == 0:
        return None
    divisors = sorted((h for h in range(1, width + 1) if width % h == 0), key=lambda h: (abs(h - heads), h))[:2]
    return f"{heads_flag} {heads} must divide {width_flag} {width}; use e.g. {heads_flag} " + " or ".join(
        map(str, sorted(divisors))
    )


def check_heads_divide_width(
    parser: argparse.ArgumentParser, width: int, heads: int, *, width_flag: str, heads_flag: str
) -> None:
    """`heads_divide_width_error` as `parser.error` (one line, exit code 2)."""
    message = heads_divide_width_error(width, heads, width_flag=width_flag, heads_flag=heads_flag)
    if message:
        parser.error(message)


def check_output(parser: argparse.ArgumentParser, check, *args, **kwargs):
    """Run a `damcha_hf.safe_files` check; its `UnsafeOutputError` or `CorruptFileError` becomes `parser.error` (one
    line, exit code 2)."""
    try:
        return check(*args, **kwargs)
    except (OSError, ValueError) as error:
        parser.error(str(error))


__all__ = [
    "ArgumentParser",
    "HelpFormatter",
    "check_heads_divide_width",
    "check_output",
    "heads_divide_width_error",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "probability",
    "repo_id_error",
    "text_data_source",
    "text_file_or_folder",
]
