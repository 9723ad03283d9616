"""The ``autotune`` command line: one parser builder and one action per subcommand."""

from autotune._cli.main import main

__all__ = ["main"]
