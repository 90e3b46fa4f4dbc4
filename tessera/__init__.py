"""Tessera: a self-hosted tokenization platform (the ``tessera`` command)."""

from config import __version__

__all__ = ["__version__"]
