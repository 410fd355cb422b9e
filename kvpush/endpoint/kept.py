"""What a transfer thread keeps per request, counted map by map.

Every map a thread keys by request must empty once the request ends: a map that keeps an entry after its
request left the state machine is a slow memory leak that no block count shows (the planned destination
of a registration whose prefill never came was one). `Endpoint.kept_state()` reports these counts; at rest
(nothing pending, leases run out) each is 0, which the tests and `kvpush soak` check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decode import ReceiveThread
    from .prefill import PushThread


def prefill_kept(t: PushThread) -> dict[str, int]:
    """The push thread's per-request state (tombstones aside: they expire on their own clock)."""
    return {
        "requests": len(t.state),
        "prefill_done_at": len(t.prefill_done_at),
        "kv_written": len(t.kv_written),
        "staged": len(t.staged),
        "timeline": len(t.timeline),
        "reads_until": len(t.reads_until),
        "held_releases": len(t.held),
        "held_kv_ready": len(t.early),
        "src_half": len(t.src_half),
        "dst_half": len(t.dst_half),
        "armed": len(t.armed),
        "writes_in_flight": len(t.scheduler.writes),
        "writes_queued": sum(len(q) for q in t.scheduler.queues.values()),
    }


def decode_kept(t: ReceiveThread) -> dict[str, int]:
    """The receive thread's per-request state."""
    return {
        "requests": len(t.state),
        "held_requests": len(t.held),
        "route": len(t.route),
        "expected_at": len(t.expected_at),
        "announced": len(t.announced),
    }
