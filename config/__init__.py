"""Settings of every Tessera process (the lowest layer: everything may read it)."""

__version__ = "0.1.0"
