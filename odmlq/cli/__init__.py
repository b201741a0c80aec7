"""The `odmlq` command line: ``odmlq --help``, ``odmlq COMMAND --help``."""

from odmlq.cli._main import main

__all__ = ["main"]
