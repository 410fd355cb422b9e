"""Prometheus metrics, shared by every endpoint in a process and told apart by labels."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LABELS = ("role", "engine_id", "rank")

BYTES = Counter("kvpush_bytes_total", "KV bytes pushed (prefill) or received (decode)", LABELS)
DESCRIPTORS = Counter("kvpush_descriptors_total", "Transfer descriptors posted", LABELS)
BLOCKS = Counter("kvpush_blocks_total", "Source blocks covered by posted transfers", LABELS)
REQUESTS = Counter("kvpush_requests_total", "Requests finished, by outcome", LABELS + ("outcome",))
WIRE_ERRORS = Counter("kvpush_wire_errors_total", "Messages refused at decoding or matching", LABELS)
READY_LATENCY = Histogram("kvpush_transfer_seconds", "prefill_done -> all WRITEs complete (prefill side)",
                          LABELS, buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30))
