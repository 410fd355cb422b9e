"""The WRITE scheduler: planned WRITEs from queue to settlement, on the push thread.

A planned WRITE waits in its destination's FIFO queue until the in-flight budget (bytes and descriptors)
has room; destinations take turns. It is then posted on the push thread or handed to a posting thread
(one destination stays on one posting thread while it has WRITEs in flight, so its posts stay in order),
polled, and settled exactly once: done, failed, or abandoned at write_timeout_s. Every settlement comes
back as one `Settled` value; the push thread feeds each to the sender machine from one place.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Posting
from ..errors import LayoutError, PeerGone, TransportError
from ..protocol.plan import TransferPlan
from ..protocol.prepared import IndexPlan
from ..protocol.reasons import Failure
from ..protocol.sender import StartWrite
from ..transport.base import Transport, XferHandle
from .posting import MadeWrite, PostingPool, PostJob, WriteSpec, discard, made_now, post
from .stats import Count, High, Ledger

log = logging.getLogger("kvpush")

Dest = tuple[str, int]  # (decode engine id, decode rank)


@dataclass(frozen=True)
class Settled:
    """One WRITE's outcome: what the sender machine needs (`action`, ok, reason, abandoned) and the
    timeline marks it collected (0.0: not reached)."""

    action: StartWrite
    ok: bool
    nbytes: int
    reason: str = ""
    abandoned: bool = False  # given up at write_timeout_s while posted: its bytes may still land
    kind: Failure = Failure.WRITE_FAILED  # when not ok
    made_at: float = 0.0
    posted_at: float = 0.0
    complete_at: float = 0.0


@dataclass(eq=False)
class _Write:
    """A WRITE as data: queued (its destination's FIFO), then in flight (posted here, `handle`; or on a
    posting thread, `job`), then settled exactly once."""

    action: StartWrite
    plan: TransferPlan | IndexPlan
    spec: WriteSpec
    dest: Dest
    queued_at: float  # write_timeout_s counts from here, so a WRITE that waited is never posted late
    handle: XferHandle | None = None
    made_at: float = 0.0
    posted_at: float = 0.0
    job: PostJob | None = None
    worker: int = -1

    def settled(
        self,
        ok: bool,
        reason: str = "",
        at: float = 0.0,
        abandoned: bool = False,
        kind: Failure = Failure.WRITE_FAILED,
    ) -> Settled:
        nbytes = self.plan.nbytes if ok else 0
        return Settled(self.action, ok, nbytes, reason, abandoned, kind, self.made_at, self.posted_at, at)


def failure_of(exc: Exception) -> Failure:
    """A WRITE that could not even be queued: the decode rank is gone, its blocks do not fit, or the
    source could not be made ready (barrier, staging)."""
    if isinstance(exc, PeerGone):
        return Failure.PEER_GONE
    return Failure.REFUSED if isinstance(exc, LayoutError) else Failure.WRITE_FAILED


class WriteScheduler:
    """Per-destination queues, the in-flight budget, posting-thread placement, progress and settlement."""

    def __init__(
        self,
        posting: Posting,
        write_timeout_s: float,
        poll_s: float,
        transport: Transport,
        ledger: Ledger,
        wake: Callable[[], None],
    ) -> None:
        """posting: the budget and posting threads; write_timeout_s: a WRITE not complete that long after
        it was queued is given up (leases); poll_s: how often a posting thread polls (pacing.busy_poll_s)."""
        self.posting, self.write_timeout_s = posting, write_timeout_s
        self.transport = transport
        self.ledger = ledger
        self.writes: list[_Write] = []  # in flight, in posting order
        self.queues: dict[Dest, deque[_Write]] = {}  # per destination: planned, waiting for the budget
        self.inflight_bytes = 0
        self.inflight_descs = 0
        self.pool: PostingPool | None = None
        self.pool_writes: dict[PostJob, _Write] = {}
        self.dest_worker: dict[Dest, int] = {}  # which posting thread a destination's WRITEs are on
        self.dest_flight: dict[Dest, int] = {}
        self.worker_load: list[int] = []
        self.nudges: list[StartWrite] = []  # posted since the last take_nudges(): tell their decodes
        self._turn = 0  # which destination queue goes first in the next dispatch
        if posting.workers:
            self.pool = PostingPool(transport, posting.workers, wake, poll_s)
            self.worker_load = [0] * posting.workers

    def busy(self) -> bool:
        """A WRITE this thread posted needs polling (a posting thread rings the doorbell itself)."""
        return any(w.job is None for w in self.writes)

    def queue(self, act: StartWrite, plan: TransferPlan | IndexPlan, spec: WriteSpec, now: float) -> None:
        dest = (act.decode_engine_id, act.decode_rank)
        self.queues.setdefault(dest, deque()).append(_Write(act, plan, spec, dest, now))

    def take_nudges(self) -> list[StartWrite]:
        """WRITEs posted since the last call, whose decodes get a Posted hint (after the first poll)."""
        nudges, self.nudges = self.nudges, []
        return nudges

    def close(self, reason: str) -> list[Settled]:
        """Teardown: stop the posting threads, release every handle, and fail every WRITE not settled."""
        if self.pool is not None:
            self.pool.close()  # they stop and release what they hold in flight
        writes, self.writes = self.writes, []
        writes += [w for q in self.queues.values() for w in q]
        self.queues.clear()
        for w in writes:
            if w.handle is not None:
                with contextlib.suppress(TransportError):
                    self.transport.release(w.handle)
            elif w.job is None:
                discard(self.transport, w.spec)  # queued, never posted: a WRITE made ahead is released
        return [w.settled(False, reason, kind=Failure.CLOSED) for w in writes]

    # ---- dispatch -------------------------------------------------------------------------------
    def _fits(self, w: _Write) -> bool:
        """Within the in-flight budget (or nothing in flight: a WRITE over the budget still goes alone)."""
        cfg = self.posting
        return not self.writes or (
            self.inflight_bytes + w.plan.nbytes <= cfg.max_inflight_bytes
            and self.inflight_descs + w.plan.num_descriptors <= cfg.max_inflight_descriptors
        )

    def dispatch(self) -> tuple[list[Settled], bool]:
        """Post queued WRITEs while the budget allows: each destination's queue in FIFO order (a head
        that does not fit holds back its queue, never overtaken), destinations taking turns. Returns the
        WRITEs that failed to post, and whether anything was posted on this thread."""
        failed: list[Settled] = []
        posted_inline = False
        progress = True
        while progress and self.queues:
            progress = False
            dests = list(self.queues)
            k = self._turn % len(dests)
            self._turn += 1
            for dest in dests[k:] + dests[:k]:
                q = self.queues.get(dest)
                if not q or not self._fits(q[0]):
                    continue
                w = q.popleft()
                if not q:
                    del self.queues[dest]
                progress = True
                got = self._post(w)
                if got is None:
                    posted_inline = posted_inline or w.job is None
                else:
                    failed.append(got)
        return failed, posted_inline

    def _post(self, w: _Write) -> Settled | None:
        """Put one WRITE in flight (here, or on a posting thread); None on success, else its failure."""
        now = time.monotonic()
        if now - w.queued_at >= self.write_timeout_s:
            discard(self.transport, w.spec)
            return w.settled(False, "WRITE not posted within write_timeout_s", now, kind=Failure.TIMEOUT)
        if self.pool is None:
            made = made_now(w.spec)
            try:
                w.handle = post(self.transport, w.spec)
            except TransportError as exc:
                return w.settled(False, str(exc), now)
            w.posted_at = time.monotonic()
            w.made_at = made or self.transport.made_at() or 0.0
        else:
            flying = self.dest_flight.get(w.dest, 0)
            if flying and w.dest in self.dest_worker:
                worker = self.dest_worker[w.dest]  # keep the destination's posts in order on one thread
            else:
                worker = min(range(len(self.worker_load)), key=self.worker_load.__getitem__)
            self.dest_worker[w.dest] = worker
            w.worker = worker
            w.job = PostJob(w.spec, w.queued_at + self.write_timeout_s)
            self.pool_writes[w.job] = w
            self.worker_load[worker] += 1
            self.pool.submit(w.job, worker)
        self.writes.append(w)
        self.dest_flight[w.dest] = self.dest_flight.get(w.dest, 0) + 1
        self.inflight_bytes += w.plan.nbytes
        self.inflight_descs += w.plan.num_descriptors
        self.ledger.high(High.INFLIGHT_BYTES_MAX, self.inflight_bytes)
        self.ledger.high(High.INFLIGHT_DESCRIPTORS_MAX, self.inflight_descs)
        self.ledger.high(High.INFLIGHT_WRITES_MAX, len(self.writes))
        self.ledger.add(Count.WRITES)
        self.ledger.add(Count.DESCRIPTORS, w.plan.num_descriptors)
        self.ledger.add(Count.BLOCKS, w.plan.num_blocks)
        if isinstance(w.spec, MadeWrite):
            self.ledger.add(Count.ARMED)
        if self.posting.nudge:
            self.nudges.append(w.action)
        return None

    def _unflight(self, w: _Write) -> None:
        """w leaves the in-flight set (settled or abandoned): its budget and thread slot come back."""
        self.writes.remove(w)
        self.inflight_bytes -= w.plan.nbytes
        self.inflight_descs -= w.plan.num_descriptors
        left = self.dest_flight[w.dest] - 1
        if left:
            self.dest_flight[w.dest] = left
        else:
            del self.dest_flight[w.dest]
            self.dest_worker.pop(w.dest, None)
        if w.job is not None:
            self.pool_writes.pop(w.job, None)
            self.worker_load[w.worker] -= 1

    # ---- progress -------------------------------------------------------------------------------
    def progress(self, now: float) -> list[Settled]:
        """Settle what the posting threads handed back, then poll every WRITE this thread posted once
        (each WRITE settles exactly once)."""
        out: list[Settled] = []
        if self.pool is not None:
            while True:
                try:
                    job = self.pool.results.get_nowait()
                except queue.Empty:
                    break
                w = self.pool_writes.get(job)
                if w is None:
                    continue  # abandoned (and settled) here before the posting thread handed it back
                self._unflight(w)
                w.made_at, w.posted_at = job.made_at, job.posted_at
                kind = Failure.TIMEOUT if job.state == "skipped" else Failure.WRITE_FAILED
                out.append(w.settled(job.state == "done", job.error, job.complete_at or now, kind=kind))
        for w in list(self.writes):
            if now - w.queued_at >= self.write_timeout_s:
                out.append(self._abandon(w))  # checked before polling: an overdue WRITE is not advanced
                continue
            if w.job is not None:
                continue  # a posting thread polls it
            assert w.handle is not None
            try:
                if self.transport.poll(w.handle) == "PROC":
                    continue
                ok, reason = True, ""
            except TransportError as exc:
                ok, reason = False, str(exc)
            try:
                self.transport.release(w.handle)
            except TransportError as exc:
                log.warning("kvpush prefill: %s", exc)
            self._unflight(w)
            out.append(w.settled(ok, reason, time.monotonic()))
        return out

    def _abandon(self, w: _Write) -> Settled:
        """A WRITE past write_timeout_s: release its handle (or tell its posting thread to); the decode
        is told it was abandoned and keeps the blocks until its fence."""
        self._unflight(w)
        if w.job is not None:
            w.job.abandoned = True
        elif w.handle is not None:
            with contextlib.suppress(TransportError):
                self.transport.release(w.handle)
        self.ledger.add(Count.WRITE_TIMEOUTS)
        reason = f"WRITE not complete after {self.write_timeout_s}s: abandoned"
        return w.settled(False, reason, time.monotonic(), abandoned=True, kind=Failure.TIMEOUT)
