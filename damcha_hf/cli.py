"""The `damcha-hf` command line: one subcommand per module in `damcha_hf.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets `func` to the function that
runs it with the parsed arguments and returns an exit code.
"""

import argparse
import importlib
import sys

# Subcommand modules, in the order `damcha-hf --help` lists them.
COMMAND_MODULES = [
    "damcha_hf.commands.demo",
    "damcha_hf.commands.info",
    "damcha_hf.commands.inspect",
    "damcha_hf.commands.push",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="damcha-hf",
        description="DAMCHA attention for Hugging Face Transformers: train, inspect and share DAMCHA models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
