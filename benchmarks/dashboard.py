"""The benchmarks' dashboard: the latest headline figures of every benchmark and the table made of them.

Each benchmark run that finishes with valid figures writes ``benchmarks/results/<benchmark>.json``
(:func:`benchmarks.common.publish`): its figures, the UTC date, the 1-minute load average and the
machine's cores. The table between :data:`START` and :data:`END` in ``benchmarks/README.md`` is made from
those files alone, one row per figure, sorted by benchmark. Run from the repository root::

    .venv/bin/python -m benchmarks.dashboard          # rewrite the README's table from the JSON files
    .venv/bin/python -m benchmarks.dashboard --check  # exit 1 when the README's table differs from them

A result file holds::

    {"benchmark": "tokenize", "date": "2026-11-23 23:17", "load_average": 0.0, "cores": 2,
     "command": "benchmarks/tokenize.py", "note": null,
     "figures": [{"name": "...", "value": 5253.0, "unit": "/s", "reference_name": "bare aiohttp",
                  "reference_value": 38371.0, "goal": "ratio ≥ 0.10"}]}

``load_average`` is a number, or text where a figure was taken from the README's history and the
history gives a range ("0.1 to 1.8"); null (shown "n/a") where it gives none. ``date`` and ``cores``
may be null for the same reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
START = "<!-- dashboard:start -->"
END = "<!-- dashboard:end -->"

BENCHMARKS = (
    "account_updater",
    "broker_publish",
    "documents",
    "fuzz",
    "key_rotation",
    "lease_backlog",
    "network_tokens",
    "payment_methods",
    "proxy",
    "reactor_invocations",
    "reactors",
    "sandbox_account_updates",
    "soak",
    "statements",
    "task_send",
    "tokenize",
    "webhooks",
)
"""The benchmarks that publish figures (module names under ``benchmarks/``)."""


@dataclass(frozen=True)
class Figure:
    """One headline figure of a benchmark run.

    ``value`` in ``unit`` (e.g. ``"ms"``, ``"/s"``); ``reference_value`` is the bare reference measured
    in the same run (same unit), named by ``reference_name``; ``goal`` is the target as the benchmark's
    docstring or README states it (text, e.g. ``"ratio ≤ 2.0"``, ``"≥ 20,000/s"``), None where none is
    stated.
    """

    benchmark: str
    name: str
    value: float
    unit: str
    reference_name: str | None = None
    reference_value: float | None = None
    goal: str | None = None

    @property
    def ratio(self) -> float | None:
        """value / reference_value; None without a reference (or a reference of 0)."""
        if not self.reference_value:
            return None
        return self.value / self.reference_value


@dataclass(frozen=True)
class Result:
    """The figures of one benchmark's latest run and its conditions (see the module's docstring)."""

    benchmark: str
    date: str | None
    load_average: float | str | None
    cores: int | None
    figures: list[Figure] = field(default_factory=list)
    command: str | None = None
    note: str | None = None

    def to_json(self) -> dict:
        """The file's content: figures without their (repeated) benchmark name."""
        data = asdict(self)
        for figure in data["figures"]:
            del figure["benchmark"]
            for key in ("value", "reference_value"):
                if isinstance(figure[key], float):
                    figure[key] = float(f"{figure[key]:.4g}")  # four significant digits are plenty
        return data

    @classmethod
    def from_json(cls, data: dict) -> Result:
        """Read a result file's content; KeyError/TypeError when a field is missing or unknown."""
        figures = [Figure(benchmark=data["benchmark"], **figure) for figure in data["figures"]]
        return cls(**{**data, "figures": figures})


def result_path(benchmark: str) -> Path:
    """``benchmarks/results/<benchmark>.json``; ValueError for a benchmark not in :data:`BENCHMARKS`."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")
    return RESULTS / f"{benchmark}.json"


def save(result: Result) -> Path:
    """Write the result file of ``result.benchmark`` (replacing the previous one); its path."""
    if any(figure.benchmark != result.benchmark for figure in result.figures):
        raise ValueError(f"figures of another benchmark than {result.benchmark!r}")
    path = result_path(result.benchmark)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2, ensure_ascii=False) + "\n")
    return path


def load_results() -> list[Result]:
    """Every result file, sorted by benchmark."""
    results = [Result.from_json(json.loads(path.read_text())) for path in sorted(RESULTS.glob("*.json"))]
    return sorted(results, key=lambda r: r.benchmark)


# ---- the table -----------------------------------------------------------------------------------


def number(value: float) -> str:
    """Three significant digits, thousands separated, no exponent: 38,371 / 11.8 / 1.59 / 0.115."""
    if value == 0:
        return "0"
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    decimals = 1 if size >= 10 else 2 if size >= 1 else 3
    while size < 0.1 and decimals < 6:
        size *= 10
        decimals += 1
    return f"{value:.{decimals}f}"


def _quantity(value: float, unit: str) -> str:
    return f"{number(value)} {unit}".strip() if not unit.startswith("/") else f"{number(value)}{unit}"


def _load(result: Result) -> str:
    if result.load_average is None:
        load = "n/a"
    elif isinstance(result.load_average, str):
        load = result.load_average
    else:
        load = f"{result.load_average:.1f}"
    return f"{load} / {result.cores} cores" if result.cores else load


def table(results: list[Result]) -> str:
    """The Markdown table: one row per figure, benchmarks in order, then the benchmarks without one."""
    lines = [
        "| benchmark | figure | value | reference | ratio | goal | date (UTC) | load (1 min) |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for result in results:
        for figure in result.figures:
            reference = ""
            if figure.reference_value is not None:
                reference = f"{_quantity(figure.reference_value, figure.unit)} ({figure.reference_name})"
            ratio = figure.ratio
            cells = [
                f"`{result.benchmark}`",
                figure.name,
                _quantity(figure.value, figure.unit),
                reference,
                "" if ratio is None else number(ratio),
                figure.goal or "",
                result.date or "n/a",
                _load(result),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    published = {r.benchmark for r in results}
    missing = [name for name in BENCHMARKS if name not in published]
    if missing:
        lines += ["", "No figures recorded yet: " + ", ".join(f"`{name}`" for name in missing) + "."]
    return "\n".join(lines)


def render(readme: str, results: list[Result]) -> str:
    """``readme`` with the text between the markers replaced by the table; ValueError without markers."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{README} has no {START} ... {END} section")
    return readme[: start + len(START)] + "\n" + table(results) + "\n" + readme[end:]


def write_readme() -> bool:
    """Rewrite the README's table from the result files; True when it changed."""
    before = README.read_text()
    after = render(before, load_results())
    if after != before:
        README.write_text(after)
    return after != before


def main(argv: list[str] | None = None) -> int:
    """0 when the table was written (or, with ``--check``, is up to date); 1 when ``--check`` finds it stale."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the table is stale")
    args = parser.parse_args(argv)
    if args.check:
        current = README.read_text()
        if render(current, load_results()) != current:
            print(f"{README.relative_to(HERE.parent)}: the dashboard table differs from benchmarks/results/*.json")
            print("run: python -m benchmarks.dashboard", file=sys.stderr)
            return 1
        print("dashboard up to date")
        return 0
    print("dashboard table rewritten" if write_readme() else "dashboard table already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
