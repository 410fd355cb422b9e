"""What the prefill endpoint keeps of one request, in one place per thread.

On the push thread: one `PushRequest` record per request (its prefill_done time, the engine's KV-written
barriers, whether staging copied its blocks, its timeline marks, how long an abandoned WRITE may still read
its source, the plan sides made before the trigger), keyed once by request id in `PushRequests`, which
also holds releases back while an abandoned WRITE may still read: forgetting a request is one `pop`. On the engine's side: `EngineSide`, the checked table of source_blocks and whether a kv_ready went to
the push thread, dropped by the engine's own calls or, when the engine never makes them, by the push thread
as it forgets the request (kept.py counts both, so a leak shows).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..protocol.groups import BlockIds
from ..protocol.prepared import Half
from ..protocol.sender import Forget, ReleaseSource
from .armed import ArmedStore
from .stats import Count, Ledger
from .writes import Settled

log = logging.getLogger("kvpush")


@dataclass(eq=False, slots=True)
class PushRequest:
    """One request on the push thread, from its first event until its SendResult (or until forgotten)."""

    marks: dict[str, float] = field(default_factory=dict)  # TIMELINE marks so far
    prefill_done_at: float | None = None
    barriers: list[Callable[[], None]] | None = None  # the engine's KV-written barriers, until called
    staged: bool = False  # the hooks staged its source blocks already
    # an abandoned WRITE may still read the source until write_linger_s after it was given up: the engine
    # gets the source blocks back only then
    reads_until: float = 0.0
    src_half: Half | None = None  # the source side of its plan, made at prefill_done before any registration
    dst_half: dict[tuple[int, int], Half] | None = None  # (attempt, decode rank) -> side made at registration

    def add_barrier(self, barrier: Callable[[], None]) -> None:
        if self.barriers is None:
            self.barriers = [barrier]
        else:
            self.barriers.append(barrier)


class EngineSide:
    """Per request, what engine calls leave for a later engine call: source_blocks' checked table
    (prefill_done naming the same ids skips the check) and the requests with a kv_ready sent to the push
    thread (not held).
    Engine threads add and take; the push thread drops a request it forgets. Single dict and set operations,
    each atomic under the GIL: no lock on the engine's path."""

    def __init__(self) -> None:
        self.sourced: dict[str, tuple[int, BlockIds]] = {}
        self.streaming: set[str] = set()

    def drop(self, request_id: str) -> None:
        self.sourced.pop(request_id, None)
        self.streaming.discard(request_id)


class PushRequests:
    """The push thread's records, one per request and keyed once, and the releases held back while an
    abandoned WRITE may still read their source: when a request's record goes, and with it what was made
    ahead for it (armed) and what engine calls kept for it (engine)."""

    def __init__(self, engine: EngineSide, ledger: Ledger, linger_s: float) -> None:
        self.records: dict[str, PushRequest] = {}
        # released sources an abandoned WRITE may still read: (when, release), in order of `when`
        self.held: deque[tuple[float, ReleaseSource]] = deque()
        self.closing = False  # the transport is closed: nothing can read a source any more, nothing is held
        self._engine = engine
        self._armed: ArmedStore | None = None  # from setup, once the transport exists (`made_in`)
        self._ledger = ledger
        self._linger_s = linger_s

    def made_in(self, armed: ArmedStore) -> None:
        """Where WRITEs are made ahead (at setup): a request's go when its record does."""
        self._armed = armed

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"PushRequests({list(self.records)}, held={len(self.held)})"

    def get(self, request_id: str) -> PushRequest | None:
        return self.records.get(request_id)

    def of(self, request_id: str) -> PushRequest:
        """request_id's record, made at its first event."""
        req = self.records.get(request_id)
        if req is None:
            req = self.records[request_id] = PushRequest()
        return req

    def settled(self, s: Settled) -> None:
        """A WRITE's outcome on its request's record: its timeline marks, and how long an abandoned WRITE
        may still read the source."""
        rid = s.action.request_id
        req = self.records.get(rid)  # as `of`, inline: this runs once per WRITE
        if req is None:
            req = self.records[rid] = PushRequest()
        marks = req.marks
        if s.made_at:
            marks["made"] = min(marks.get("made", s.made_at), s.made_at)
        if s.posted_at:
            marks["posted"] = min(marks.get("posted", s.posted_at), s.posted_at)
        if s.complete_at:
            marks["complete"] = s.complete_at
        if s.abandoned:
            req.reads_until = max(req.reads_until, s.complete_at + self._linger_s)

    def unregister(self, request_id: str, req: PushRequest, fresh: bool, had: bool) -> None:
        """The machine refused (or had finished) the registration that marked req: no release will take
        its marks, so the record goes back to what it was (if it was not released meanwhile)."""
        if self.records.get(request_id) is not req:
            return  # released: its marks went with its SendResult
        if fresh and req.prefill_done_at is None:
            del self.records[request_id]
        elif not had:
            req.marks.pop("registered", None)

    def release(self, act: ReleaseSource, now: float) -> tuple[bool, PushRequest | None]:
        """(True, None): the release is held back while an abandoned WRITE may still read its source;
        else (False, the record, dropped: `drop`) and the request ends now."""
        req = self.records.get(act.request_id)
        until = 0.0
        if req is not None:
            until, req.reads_until = req.reads_until, 0.0
        if until > now and not self.closing:
            self.held.append((until, act))  # write_linger_s is one value: `until` only grows along held
            return True, None
        return False, self.drop(act.request_id)

    def due(self, now: float) -> list[ReleaseSource]:
        """The held releases whose source nothing can read any more."""
        out = []
        while self.held and self.held[0][0] <= now:
            out.append(self.held.popleft()[1])
        return out

    def close(self) -> list[ReleaseSource]:
        """The transport is closed: every held release is due, and none is held from here on."""
        self.closing = True
        out = [act for _, act in self.held]
        self.held.clear()
        return out

    def drop(self, request_id: str) -> PushRequest | None:
        """The request ends here: its record, anything still made ahead for it (a Disarm normally came)
        and what engine calls kept for it go."""
        if self._armed:
            self._armed.drop_request(request_id)
        self._engine.drop(request_id)
        return self.records.pop(request_id, None)

    def forget(self, act: Forget) -> None:
        """The machine forgot a request that never heard prefill_done: so does the push thread (a
        destination planned ahead, its marks). An engine that reported blocks with kv_ready and then
        never made the terminal call still waits for them: say so, and count it."""
        req = self.drop(act.request_id)
        if req is not None and req.reads_until > time.monotonic():
            self.records[act.request_id] = PushRequest(reads_until=req.reads_until)  # a later prefill_done
        if act.ready_blocks is None:
            log.debug("kvpush prefill: forgot %s (%s): no prefill_done came", act.request_id, act.reason)
            return
        self._ledger.add(Count.NO_PREFILL_DONE)
        log.warning(
            "kvpush prefill: request %r ended (%s) and prefill_done never came within the lease: the "
            "engine still holds the %d blocks it reported with kv_ready, and only prefill_done returns "
            "them (a SendResult, failed); call prefill_done after abort() (docs/contract.md)",
            act.request_id,
            act.reason,
            len(act.ready_blocks),
        )
