"""Subcommands of the `damcha-hf` command line (see `damcha_hf.cli`)."""
