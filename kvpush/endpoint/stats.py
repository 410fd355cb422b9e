"""One stats ledger per endpoint: plain counters for stats(), mirrored into Prometheus as they change.

Prometheus collectors are process-wide (every endpoint in a process shares them, told apart by labels);
the ledger is the only code that touches them, so a counter cannot be defined and then forgotten.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, fields

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from ..errors import ConfigError
from ..protocol.reasons import Failure

LABELS = ("role", "engine_id", "rank")

BYTES = Counter("kvpush_bytes_total", "KV bytes pushed (prefill) or received (decode)", LABELS)
DESCRIPTORS = Counter("kvpush_descriptors_total", "Transfer descriptors posted", LABELS)
BLOCKS = Counter("kvpush_blocks_total", "Source blocks covered by posted transfers", LABELS)
WRITES = Counter("kvpush_writes_total", "WRITEs posted", LABELS)
REQUESTS = Counter("kvpush_requests_total", "Requests finished, by outcome", (*LABELS, "outcome"))
WIRE_ERRORS = Counter("kvpush_wire_errors_total", "Messages refused at decoding or matching", LABELS)
DISCARDED = Counter("kvpush_discarded_total", "Messages that matched nothing live (late or stale)", LABELS)
FAILURES = Counter(
    "kvpush_failures_total", "Requests failed, by kind (protocol.reasons.Failure)", (*LABELS, "reason")
)
EXPIRED = Counter("kvpush_expired_total", "Leases and registrations that expired", LABELS)
REFUSED = Counter("kvpush_refused_total", "Handshakes and messages refused (auth, identity, limits)", LABELS)
NO_PREFILL_DONE = Counter(
    "kvpush_no_prefill_done_total",
    "Streamed requests ended without the terminal prefill_done within a lease (an engine bug: its "
    "kv_ready blocks wait for a SendResult that only prefill_done brings)",
    LABELS,
)
PEERS = Gauge("kvpush_peers", "Peers with a completed handshake", LABELS)
IN_FLIGHT_BYTES = Gauge("kvpush_in_flight_bytes", "Bytes of WRITEs posted and not yet settled", LABELS)
PENDING = Gauge("kvpush_pending_requests", "Requests the endpoint's state machine tracks", LABELS)
READY_LATENCY = Histogram(
    "kvpush_transfer_seconds",
    "prefill_done -> all WRITEs complete (prefill side)",
    LABELS,
    buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30),
)
# The decode waits through the prefill's queue and compute too, so its buckets reach further.
WAIT_LATENCY = Histogram(
    "kvpush_receive_seconds",
    "expect (blocks registered) -> KV ready (decode side): queue + prefill + transfer",
    LABELS,
    buckets=(0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
)


class Count(enum.Enum):
    """The counters an endpoint adds to (each value is its field in `Counters`, and in stats())."""

    BYTES = "bytes"
    DESCRIPTORS = "descriptors"
    BLOCKS = "blocks"
    WRITES = "writes"
    OK = "ok"
    FAILED = "failed"
    WIRE_ERRORS = "wire_errors"
    DISCARDED = "discarded"
    REGISTRATION_FIRST = "registration_first"  # the sender's StartWrite.order, counted per WRITE
    PREFILL_FIRST = "prefill_first"
    EXPIRED = "expired"
    REFUSED = "refused"
    PEERS_GONE = "peers_gone"
    WRITE_TIMEOUTS = "write_timeouts"
    NUDGES = "nudges"
    PREPARED_LISTS = "prepared_lists"  # descriptor lists prepared at handshake (two per pair)
    PREPARED_DESCRIPTORS = "prepared_descriptors"  # descriptors the data plane holds in them
    OWED_NOTHING = "owed_nothing"  # prefill_done on a rank that owes no decode rank KV (never `ok`)
    FAILED_EXPIRED = "failed_expired"  # requests ended by a lease or registration running out
    ARMED = "armed"  # WRITEs that posted what was made ahead of prefill_done (source_blocks)
    ENGINE_POSTS = "engine_posts"  # prefill_done calls run on the engine's thread (loop.run_inline)
    NO_PREFILL_DONE = "no_prefill_done"  # streamed requests ended, no terminal prefill_done in a lease


class High(enum.Enum):
    """High-water marks of the prefill's in-flight budget (config max_inflight_*)."""

    INFLIGHT_BYTES_MAX = "inflight_bytes_max"
    INFLIGHT_DESCRIPTORS_MAX = "inflight_descriptors_max"
    INFLIGHT_WRITES_MAX = "inflight_writes_max"


_MIRROR = {
    Count.BYTES: BYTES,
    Count.DESCRIPTORS: DESCRIPTORS,
    Count.BLOCKS: BLOCKS,
    Count.WRITES: WRITES,
    Count.WIRE_ERRORS: WIRE_ERRORS,
    Count.DISCARDED: DISCARDED,
    Count.EXPIRED: EXPIRED,
    Count.REFUSED: REFUSED,
    Count.NO_PREFILL_DONE: NO_PREFILL_DONE,
}

_served: dict[tuple[str, int], bool] = {}
_served_lock = threading.Lock()


def serve_metrics(host: str, port: int) -> None:
    """Start (once per address and process) prometheus_client's HTTP endpoint on host:port."""
    with _served_lock:
        if (host, port) in _served:
            return
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            raise ConfigError(f"cannot serve Prometheus metrics on {host}:{port}: {exc}") from exc
        _served[(host, port)] = True


@dataclass
class Counters:
    """What stats() reports; each field that has a Prometheus twin is mirrored by Ledger.add."""

    bytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    writes: int = 0
    ok: int = 0
    failed: int = 0
    wire_errors: int = 0
    discarded: int = 0
    registration_first: int = 0
    prefill_first: int = 0
    expired: int = 0
    refused: int = 0
    peers_gone: int = 0
    write_timeouts: int = 0
    # high-water marks of the prefill's in-flight budget (config max_inflight_*), and Posted nudges
    inflight_bytes_max: int = 0
    inflight_descriptors_max: int = 0
    inflight_writes_max: int = 0
    nudges: int = 0
    # prepared lists and the descriptors they hold: one per strided row where the data plane takes
    # strided lists (NIXL >= 1.5), one per unit where it does not (NIXL 1.3.x expands them)
    prepared_lists: int = 0
    prepared_descriptors: int = 0
    # requests released at once, ok, by a prefill rank that owes no decode rank KV (replicated heads)
    owed_nothing: int = 0
    # failed requests whose lease or registration ran out (on a prefill with no registration: the decode
    # never heard of the request, e.g. its client left before the decode's API server passed it on)
    failed_expired: int = 0
    # WRITEs that posted what was made ahead (source_blocks before prefill_done: planned, sealed and made
    # while the engine computed; prefill_done only posted them)
    armed: int = 0
    # prefill_done calls that posted their armed WRITE on the engine's own thread (no thread hop; small
    # requests while the push thread was between rounds: engine_post_max_bytes)
    engine_posts: int = 0
    # streamed requests that ended (abort, lease) and then waited a lease in vain for the terminal
    # prefill_done: the engine still holds their kv_ready blocks (docs/contract.md; a warning names each)
    no_prefill_done: int = 0


class Ledger:
    """Counters of one endpoint, written only by its transfer thread (reads from others are racy gauges)."""

    def __init__(self, role: str, engine_id: str, rank: int) -> None:
        self.labels = (role, engine_id, str(rank))
        self.counters = Counters()
        self._latency = WAIT_LATENCY if role == "decode" else READY_LATENCY
        # each counter's labelled child, looked up once: labels() takes a lock and builds a key, and
        # a WRITE adds to several counters on the push thread's per-WRITE path
        # keyed by the counter's name: an Enum member's hash and its .value are Python code, its _value_
        # a plain attribute (the push thread adds per WRITE, often just woken with its pages cold)
        self._children = {c.value: m.labels(*self.labels) for c, m in _MIRROR.items()}

    def add(self, count: Count, n: int = 1) -> None:
        name: str = count._value_
        setattr(self.counters, name, getattr(self.counters, name) + n)
        child = self._children.get(name)
        if child is not None:
            child.inc(n)

    def high(self, mark: High, value: int) -> None:
        """Raise a high-water mark (no Prometheus twin)."""
        if value > getattr(self.counters, mark.value):
            setattr(self.counters, mark.value, value)

    def finished(
        self,
        ok: bool,
        latency_s: float | None = None,
        failure: Failure | None = None,
        owed_nothing: bool = False,
    ) -> None:
        """A request finished; a failed one is labelled by its kind (a failure without one: `unknown`).
        latency_s: prefill_done -> WRITEs complete on a prefill, expect -> KV ready on a decode.
        owed_nothing: a prefill rank had nothing to write; counted on its own, neither ok nor failed."""
        if owed_nothing:
            self.add(Count.OWED_NOTHING)
            return
        self.add(Count.OK if ok else Count.FAILED)
        REQUESTS.labels(*self.labels, "ok" if ok else "failed").inc()
        if not ok:
            FAILURES.labels(*self.labels, "unknown" if failure is None else failure.value).inc()
            if failure is Failure.EXPIRED:
                self.add(Count.FAILED_EXPIRED)
        if ok and latency_s is not None:
            self._latency.labels(*self.labels).observe(latency_s)

    def pending(self, n: int) -> None:
        PENDING.labels(*self.labels).set(n)

    def peers(self, n: int) -> None:
        PEERS.labels(*self.labels).set(n)

    def in_flight_bytes(self, n: int) -> None:
        IN_FLIGHT_BYTES.labels(*self.labels).set(n)

    def snapshot(self) -> dict[str, int]:
        return {f.name: int(getattr(self.counters, f.name)) for f in fields(self.counters)}
