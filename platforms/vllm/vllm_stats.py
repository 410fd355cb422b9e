"""kvpush's figures in vLLM's own stats: the connector-stats hooks, where the installed vLLM has them.

vLLM (the versions with `kv_connector/v1/metrics.py`) asks every worker's connector for
`get_kv_connector_stats()` after each step, sums the workers' objects with `aggregate`, ships the dict
to the API server, rebuilds it there with the class method `build_kv_connector_stats(data)`, logs
`reduce()` with its throughput line and hands the dict to the `KVConnectorPromMetrics` that
`build_prom_metrics` returned, whose metrics then appear on the API server's /metrics. Operators
scrape that one port per engine; kvpush's own `metrics_port` (one per rank) stays for per-rank detail.

What a worker reports is the change since its last report (role counters and the latencies observed
since), so the API server's counters add up to the workers' totals whatever the step cadence.
Feature-detected: on a vLLM without these classes the hooks return None and nothing else changes.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The names vLLM's /metrics shows (prometheus_client adds _total to counters); docs/metrics.md lists them.
from .metric_names import PROM_BYTES, PROM_REQUESTS, PROM_SECONDS, PROM_STARTED

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )

    HAVE_HOOKS = True
except ImportError:  # pragma: no cover - a vLLM without connector stats
    HAVE_HOOKS = False

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass


# Per role: the worker counters that become "vllm:kvpush_*" series (name in the counters -> what it is).
STARTED = {"prefill": "handoffs", "decode": "expects"}
OK = {"prefill": "sent_ok", "decode": "recv_ok"}
FAILED = {"prefill": "sent_failed", "decode": "recv_failed"}
BYTES = {"prefill": "send_bytes", "decode": "recv_bytes"}
LATENCIES = {"prefill": "push_s", "decode": "ready_s"}
MAX_LATENCIES = 4096  # per report: a bound on what one step ships, not on what is counted

PROM_BUCKETS = [0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]


def _empty(role: str) -> dict[str, Any]:
    return {"role": role, "started": 0, "ok": 0, "failed": 0, "bytes": 0, "latency_s": []}


class DeltaTracker:
    """Turns a worker's running counters into what changed since the last call (engine thread only)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._last: dict[str, int] = {}
        self._seen_latencies = 0

    def take(self, counters: Mapping[str, Any]) -> dict[str, Any] | None:
        """The change since the last take as KVPushStats data, or None when nothing changed."""
        out = _empty(self.role)
        for key, table in (("started", STARTED), ("ok", OK), ("failed", FAILED), ("bytes", BYTES)):
            name = table[self.role]
            now = int(counters.get(name, 0))
            out[key] = now - self._last.get(name, 0)
            self._last[name] = now
        lats = list(counters.get(LATENCIES[self.role], ()))
        out["latency_s"] = [float(x) for x in lats[self._seen_latencies :]][-MAX_LATENCIES:]
        self._seen_latencies = len(lats)
        return None if _is_empty(out) else out


def _is_empty(data: Mapping[str, Any]) -> bool:
    return not any(data.get(k) for k in ("started", "ok", "failed", "bytes", "latency_s"))


class KVPushStats(KVConnectorStats):  # type: ignore[misc]
    """One step's (or one interval's) change in kvpush's counters, summed over the TP workers."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty("")

    def to_dict(self) -> dict[str, Any]:
        """The payload vLLM >= 0.32 ships to the API server (0.29's base class has no to_dict and sends
        `data` itself: the same dict)."""
        return self.data

    def reset(self) -> None:
        self.data = _empty(str(self.data.get("role", "")))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine, theirs = self.data, other.data
        for key in ("started", "ok", "failed", "bytes"):
            mine[key] = int(mine.get(key, 0)) + int(theirs.get(key, 0))
        mine["latency_s"] = [*mine.get("latency_s", ()), *theirs.get("latency_s", ())]
        mine["role"] = mine.get("role") or theirs.get("role", "")
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows for the interval."""
        lats = list(self.data.get("latency_s", ()))
        out: dict[str, int | float] = {
            "kvpush_ok": int(self.data.get("ok", 0)),
            "kvpush_failed": int(self.data.get("failed", 0)),
            "kvpush_MiB": round(int(self.data.get("bytes", 0)) / 2**20, 3),
        }
        if lats:
            out["kvpush_p50_ms"] = round(statistics.median(lats) * 1000, 2)
            out["kvpush_max_ms"] = round(max(lats) * 1000, 2)
        return out

    def is_empty(self) -> bool:
        return _is_empty(self.data)


class KVPushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvpush's series on vLLM's /metrics, labelled like vLLM's own (model_name, engine) plus role."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        ktc = vllm_config.kv_transfer_config
        role = "prefill" if ktc is not None and ktc.is_kv_producer else "decode"
        names = [*labelnames, "role"]
        per_engine = {i: [*vals, role] for i, vals in per_engine_labelvalues.items()}
        # vLLM hands the classes to use (its own, or multiprocess-aware ones); their union type is not
        # one we can call methods of, so they are held untyped here
        counter_cls: Any = self._counter_cls
        histogram_cls: Any = self._histogram_cls
        requests = counter_cls(
            name=PROM_REQUESTS,
            documentation="kvpush transfers finished, by outcome (prefill: pushed; decode: received)",
            labelnames=[*names, "outcome"],
        )
        self.ok: dict[int, Any] = {i: requests.labels(*v, "ok") for i, v in per_engine.items()}
        self.failed: dict[int, Any] = {i: requests.labels(*v, "failed") for i, v in per_engine.items()}
        started = counter_cls(
            name=PROM_STARTED,
            documentation="Requests handed to kvpush (prefill: prompt done; decode: blocks registered)",
            labelnames=names,
        )
        self.started: dict[int, Any] = {i: started.labels(*v) for i, v in per_engine.items()}
        nbytes = counter_cls(
            name=PROM_BYTES, documentation="KV bytes pushed (prefill) or received (decode)", labelnames=names
        )
        self.bytes: dict[int, Any] = {i: nbytes.labels(*v) for i, v in per_engine.items()}
        seconds = histogram_cls(
            name=PROM_SECONDS,
            documentation="prefill: prompt done -> WRITEs complete; decode: blocks registered -> KV ready",
            labelnames=names,
            buckets=PROM_BUCKETS,
        )
        self.seconds: dict[int, Any] = {i: seconds.labels(*v) for i, v in per_engine.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for series, key in ((self.started, "started"), (self.ok, "ok"), (self.failed, "failed")):
            if int(data.get(key, 0)) > 0:
                series[engine_idx].inc(int(data[key]))
        if int(data.get("bytes", 0)) > 0:
            self.bytes[engine_idx].inc(int(data["bytes"]))
        for s in data.get("latency_s", ()):
            self.seconds[engine_idx].observe(float(s))
