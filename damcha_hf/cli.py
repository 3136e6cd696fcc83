"""The `damcha-hf` command line: one subcommand per module in `damcha_hf.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets `func` to the function that
runs it with the parsed arguments and returns an exit code. Parsing imports only the standard library (`import
damcha_hf` is lazy), so `--help` and bad arguments answer at once; a command imports torch and transformers when it
runs.

Errors: a bad argument, a missing file, an unsafe output folder, an invalid config or a failed push end the command
with one line on stderr and exit code 2. `--debug` (or the environment variable `DAMCHA_HF_DEBUG=1`) shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .argument_checks import ArgumentParser

# Subcommand modules, in the order `damcha-hf --help` lists them.
COMMAND_MODULES = [
    "damcha_hf.commands.demo",
    "damcha_hf.commands.info",
    "damcha_hf.commands.inspect",
    "damcha_hf.commands.push",
]
DEBUG_VARIABLE = "DAMCHA_HF_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="damcha-hf",
        description="DAMCHA attention for Hugging Face Transformers: train, inspect and share DAMCHA models.",
        epilog=f"Errors print one line and exit with code 2; --debug or {DEBUG_VARIABLE}=1 shows the traceback.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for subparser in subparsers.choices.values():  # also accepted after the command: `damcha-hf demo --debug`
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def debug_requested(argv: list[str] | None = None) -> bool:
    """`--debug` among the arguments, or `DAMCHA_HF_DEBUG` set to 1/true/yes/on."""
    arguments = sys.argv[1:] if argv is None else argv
    return "--debug" in arguments or os.environ.get(DEBUG_VARIABLE, "").lower() in ("1", "true", "yes", "on")


def is_user_error(error: BaseException) -> bool:
    """Errors whose message says what to fix, shown as one line: the plugin's own, file-system and config errors."""
    if isinstance(error, (OSError, ValueError)):  # includes FileNotFoundError, UnsafeOutputError, config errors
        return True
    module = type(error).__module__ or ""
    # HubPushError, and huggingface_hub's strict-dataclass validation errors (a config field that fails validation).
    return module.startswith("damcha_hf") or type(error).__name__.startswith("StrictDataclass")


def one_line(error: BaseException) -> str:
    """The error's message on one line; a config validation error is reported by its cause, which names the field."""
    if type(error).__name__.startswith("StrictDataclass") and error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in text:
        text = f"{text}: {error.filename}"
    return text or type(error).__name__


def report(prog: str, error: BaseException) -> int:
    """Print `prog: error: message` on stderr and return the exit code 2."""
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return 2


def run_guarded(prog: str, function, *args, debug: bool = False) -> int:
    """`function(*args)` as a command: user errors become one line on stderr and exit code 2, unless `debug`."""
    try:
        return int(function(*args) or 0)
    except Exception as error:
        if debug or not is_user_error(error):
            raise
        return report(prog, error)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_guarded(f"damcha-hf {args.command}", args.func, args, debug=args.debug or debug_requested([]))


if __name__ == "__main__":
    sys.exit(main())
