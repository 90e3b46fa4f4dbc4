"""deploy/alerts.yml, the Prometheus rules README "Operating Tessera" ships: the structure Prometheus
loads (``promtool check rules`` when promtool is installed, the same shape checked by hand always),
the four signals the operator page names (queue age, dead letters, webhook failure rate, provider
error rate), and every series a rule reads is one the platform exports (infra/metrics.py), under a
label value the platform writes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

from infra import metrics
from storage.states import JobStatus

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "alerts.yml"
#: Series Prometheus itself makes (scrape health), not the platform.
PROMETHEUS_OWN = {"up"}
#: PromQL words that look like series names in an expression.
PROMQL_WORDS = {"sum", "max", "rate", "delta", "absent", "and", "or", "histogram_quantile"}


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}
    found = []
    for group in document["groups"]:
        assert set(group) == {"name", "rules"} and group["rules"], group.get("name")
        found += group["rules"]
    return found


def _exported_series() -> set[str]:
    """Every sample name GET /metrics can carry: the recorded metrics (infra/metrics.py's module-level
    Counter, Histogram and Gauge objects, expanded as the exposition writes them) and the scrape-time
    families OpsCollector yields (read from its source: they exist only while a database answers)."""
    names: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names |= {value._name + "_total", value._name + "_created"}
        elif isinstance(value, Histogram):
            names |= {value._name + suffix for suffix in ("_bucket", "_count", "_sum", "_created")}
        elif isinstance(value, Gauge):
            names.add(value._name)
    source = (ROOT / "infra" / "metrics.py").read_text()
    names |= set(re.findall(r'GaugeMetricFamily\(\s*"(tessera_\w+)"', source))
    return names


def test_the_rules_have_the_shape_prometheus_loads(rules):
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "an alert name twice"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Tessera[A-Z]\w+", rule["alert"])
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert "for" not in rule or re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: prometheus)")
def test_promtool_accepts_the_rules():
    result = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_series_a_rule_reads_is_exported(rules):
    exported = _exported_series()
    assert "tessera_queue_oldest_age_seconds" in exported and "tessera_webhook_deliveries_total" in exported
    for rule in rules:
        # no label matchers, ranges, strings or grouping labels
        expr = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)', "", rule["expr"])
        for name in set(re.findall(r"\b[a-z_][a-z0-9_]*\b", expr)) - PROMQL_WORDS:
            assert name in exported or name in PROMETHEUS_OWN, f"{rule['alert']} reads {name}, which nothing exports"


def _matched(rules: list[dict], label: str) -> set[str]:
    """Every value a rule matches ``label`` against (``="x"`` and the alternatives of ``=~"a|b"``)."""
    values: set[str] = set()
    for rule in rules:
        for operator, value in re.findall(rf'\b{label}\s*(=~|=|!~|!=)\s*"([^"]*)"', rule["expr"]):
            values |= set(value.split("|")) if operator.endswith("~") else {value}
    return values


def test_the_label_values_matched_are_ones_the_platform_writes(rules):
    webhooks = (ROOT / "domain" / "webhooks" / "deliveries.py").read_text()
    listed = re.search(r"``counts`` of each outcome \((.*?)\)", webhooks, re.S).group(1)
    outcomes = set(re.findall(r"``(\w+)``", listed))
    assert _matched(rules, "outcome") - {"server_error", "timeout", "unreachable", "throttled"} <= outcomes
    providers = (ROOT / "providers" / "__init__.py").read_text()
    for outcome in ("server_error", "timeout", "unreachable", "throttled"):
        assert f'"{outcome}"' in providers, outcome
    assert _matched(rules, "state") <= {status.value for status in JobStatus}
    assert _matched(rules, "component") <= {"beat", "relay"}
    assert _matched(rules, "reason") <= {"permanent", "dead", "exception"}


def test_the_four_signals_of_the_operator_page_are_alerted_on(rules):
    by_series = {name: [r["alert"] for r in rules if name in r["expr"]] for name in _exported_series()}
    assert by_series["tessera_queue_oldest_age_seconds"]  # queue age
    assert any('state="dead"' in r["expr"] for r in rules if "tessera_jobs" in r["expr"])  # dead letters
    assert by_series["tessera_webhook_deliveries_total"]  # webhook failure rate
    assert by_series["tessera_provider_call_duration_seconds_count"]  # provider error rate
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Operating Tessera", 1)[1].split("\n## ", 1)[0]
    assert "deploy/alerts.yml" in section
    for rule in rules:
        assert f"`{rule['alert']}`" in section, f"README does not explain {rule['alert']}"
