"""The exceptions and error maps of the token package.

Token rules answer HTTP problems (:class:`infra.errors.Problem`, core spec section 7); what is
particular to tokens is kept here: :class:`ExpressionError` (the expression engine's one failure) and
:class:`FieldErrors`, the per-field ``errors`` map of a 400 problem, keyed by property path
(``card.data.number``, ``[2].containers[0]``).
"""

from __future__ import annotations


class ExpressionError(ValueError):
    """An expression could not be parsed or rendered.

    Raised for syntax errors, unknown filters, undefined variables, bad filter arguments and
    resource limit breaches. ``str(err)`` is a one-line message suitable for an API error.
    """


def field_key(path: str, name: str) -> str:
    """The error key of ``name`` under ``path``: ``card`` + ``data`` -> ``card.data``, ``[2]`` + ``id``
    -> ``[2].id``, ``""`` + ``id`` -> ``id``; a name starting with ``[`` is appended as an index."""
    if not path:
        return name
    return path + name if name.startswith("[") else f"{path}.{name}"


class FieldErrors(dict[str, list[str]]):
    """The ``errors`` map of a validation problem: property path -> messages, in the order found."""

    def add(self, key: str, message: str) -> None:
        """Append ``message`` to the messages of ``key``."""
        self.setdefault(key, []).append(message)
