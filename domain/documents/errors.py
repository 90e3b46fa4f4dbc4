"""The documents package's exceptions."""

from __future__ import annotations


class CorruptDocument(Exception):
    """The stored content does not match its row or does not authenticate."""
