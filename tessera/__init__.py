"""Tessera: a self-hosted tokenization platform."""

__version__ = "0.1.0"
