"""fxquant's version (pyproject.toml's): here, at the bottom, so any module can read it without
importing the package facade above it."""

__version__ = "0.1.0"
