"""Subcommands of the `kestrel` CLI (registered in kestrel/cli.py)."""
