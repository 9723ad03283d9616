"""The package version (a module of its own, so that any stage can read it without importing the package)."""

__version__ = "0.1.0"
