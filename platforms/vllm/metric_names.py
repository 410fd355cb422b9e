"""The series kvpush adds to vLLM's own /metrics (vllm_stats.KVPushPromMetrics), apart from vLLM so that
the dashboard and alert tests can name them without importing vLLM. name -> Prometheus type."""

from __future__ import annotations

PROM_REQUESTS = "vllm:kvpush_requests"
PROM_STARTED = "vllm:kvpush_started"
PROM_BYTES = "vllm:kvpush_bytes"
PROM_SECONDS = "vllm:kvpush_transfer_seconds"

VLLM_SERIES = {
    PROM_REQUESTS: "counter",
    PROM_STARTED: "counter",
    PROM_BYTES: "counter",
    PROM_SECONDS: "histogram",
}
