"""What a transfer thread keeps per request, counted part by part.

Every record or map a thread keys by request must empty once the request ends: one that keeps an entry
after its request left the state machine is a slow memory leak that no block count shows (the planned
destination of a registration whose prefill never came was one). `Endpoint.kept_state()` reports these
counts; at rest (nothing pending, leases run out) each is 0, which the tests and `kvpush soak` check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import Any, Protocol

from ..protocol.wire import Abort

# What the counts read, as protocols: kept.py imports neither thread (no import circle), and a map renamed
# in a thread fails mypy here rather than going uncounted.


class _Scheduler(Protocol):
    @property
    def writes(self) -> Sized: ...
    @property
    def queues(self) -> Mapping[Any, Sized]: ...


class _Record(Protocol):
    """push_request.PushRequest, as far as the counts read it."""

    @property
    def marks(self) -> Sized: ...
    @property
    def prefill_done_at(self) -> float | None: ...
    @property
    def barriers(self) -> Sized | None: ...
    @property
    def staged(self) -> bool: ...
    @property
    def reads_until(self) -> float: ...
    @property
    def src_half(self) -> object: ...
    @property
    def dst_half(self) -> Sized | None: ...


class _Requests(Protocol):
    """push_request.PushRequests, as far as the counts read it."""

    @property
    def records(self) -> Mapping[str, _Record]: ...
    @property
    def held(self) -> Sized: ...


class _EngineSide(Protocol):
    @property
    def sourced(self) -> Sized: ...
    @property
    def streaming(self) -> Sized: ...


class _PushMaps(Protocol):
    @property
    def state(self) -> Sized: ...
    @property
    def requests(self) -> _Requests: ...
    @property
    def early(self) -> Sized: ...
    @property
    def armed(self) -> Sized: ...
    @property
    def scheduler(self) -> _Scheduler: ...
    @property
    def engine(self) -> _EngineSide: ...


class _ReceiveRequests(Protocol):
    @property
    def state(self) -> Sized: ...
    @property
    def records(self) -> Sized: ...
    @property
    def held(self) -> int: ...
    @property
    def announced(self) -> int: ...


class _PrefillRank(Protocol):
    @property
    def backlog(self) -> Sequence[object]: ...
    @property
    def waiters(self) -> Sized: ...


class _ReceiveConns(Protocol):
    @property
    def prefills(self) -> Mapping[Any, _PrefillRank]: ...


def prefill_kept(t: _PushMaps) -> dict[str, int]:
    """The prefill's per-request state, on the push thread and the engine's side (tombstones aside: they
    expire on their own clock). `push_requests` counts the records; the keys after it count the records
    holding each part (the names of the maps these parts once were), so a part left behind is named."""
    recs = list(t.requests.records.values())
    return {
        "requests": len(t.state),
        "push_requests": len(recs),
        "prefill_done_at": sum(r.prefill_done_at is not None for r in recs),
        "kv_written": sum(bool(r.barriers) for r in recs),
        "staged": sum(r.staged for r in recs),
        "timeline": sum(bool(r.marks) for r in recs),
        "reads_until": sum(r.reads_until > 0 for r in recs),
        "held_releases": len(t.requests.held),
        "held_kv_ready": len(t.early),
        "src_half": sum(r.src_half is not None for r in recs),
        "dst_half": sum(bool(r.dst_half) for r in recs),
        "armed": len(t.armed),
        "writes_in_flight": len(t.scheduler.writes),
        "writes_queued": sum(len(q) for q in t.scheduler.queues.values()),
        "engine_sourced": len(t.engine.sourced),
        "engine_streaming": len(t.engine.streaming),
    }


def decode_kept(requests: _ReceiveRequests, conns: _ReceiveConns) -> dict[str, int]:
    """The receive thread's per-request state: the machine's live attempts, the one record per request
    (where its KV comes from, when it was expected, held for a re-handshake, announced WRITEs) and the
    messages and waiters that prefill ranks keep for requests until their handshake is answered."""
    ranks = conns.prefills.values()
    return {
        "requests": len(requests.state),
        "records": len(requests.records),
        "held_requests": requests.held,
        "announced": requests.announced,
        # registrations waiting for a handshake (Aborts there are for requests that already ended, or
        # cancelled ones: bounded per rank, sent at the answer or dropped with the rank)
        "backlog_registrations": sum(1 for p in ranks for m in p.backlog if not isinstance(m, Abort)),
        "connect_waiters": sum(len(p.waiters) for p in ranks),
    }
