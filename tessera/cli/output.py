"""What the ``tessera`` commands print: JSON and plain text tables."""

from __future__ import annotations

import json


def print_json(value) -> None:
    print(json.dumps(value, indent=2, default=str), flush=True)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Rows as a plain text table: ``columns`` is ``[(key, heading), ...]``."""
    cells = [[heading for _, heading in columns]]
    for row in rows:
        cells.append(["-" if row.get(key) is None else str(row.get(key)) for key, _ in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def short(text: str | None, width: int = 60) -> str | None:
    if text is None:
        return None
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
