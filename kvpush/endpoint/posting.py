"""Posting threads: they post WRITEs and poll them to completion on the push thread's behalf.

The push thread keeps the state machine (single-threaded); a posting thread only posts a job's `spec`
(a WRITE described as data: make + post on the shared transport), polls the handle until it settles, releases it, and hands the job
back through `results` plus a wake-up call (the push thread's doorbell). Several jobs can be in flight
on one worker; the push thread decides which worker a job goes to (kvpush keeps one destination on one
worker while it has WRITEs in flight there, so that destination's posts stay in order).

NIXL 1.5.1: one agent is shared by every worker. Under NIXL_THREAD_SYNC_STRICT (kvpush's mode) each
agent call is serialised by the agent's lock, which makes concurrent calls safe; measured on UCX loopback
(a 2-core box, 32 x 4 MiB scattered 16 KiB WRITEs), 1/2/4 threads gave 2.68/2.62/2.35 GB/s under STRICT
and 2.82/1.50/0.93 under RW (the UCX worker's lock contends), and NONE crashed with 2 threads. So on
loopback the copy inside post does not parallelise; workers pay off where the post returns before the
data moves (RDMA, cuda_ipc) and cores are spare.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..errors import ConfigError, TransportError
from ..protocol.plan import TransferPlan
from ..protocol.prepared import IndexPlan
from ..transport.base import Descs, Indices, PreparedList, Transport, XferHandle

log = logging.getLogger("kvpush")


@dataclass(frozen=True)
class PreparedWrite:
    """A WRITE by index into a pair's prepared lists (the per-request path)."""

    local: PreparedList
    local_idx: Indices
    remote: PreparedList
    remote_idx: Indices
    notif: bytes


@dataclass(frozen=True)
class DescWrite:
    """A WRITE of fresh descriptor lists (the fallback when a pair has no prepared lists)."""

    peer: str
    local: Descs
    remote: Descs
    notif: bytes
    mem_type: str


@dataclass(frozen=True, eq=False)
class MadeWrite:
    """A WRITE made ahead of its trigger (endpoint/armed.py): posting it is one repost of `handle`, which
    its owner releases exactly once: after it settles, or unposted through `discard`."""

    handle: XferHandle


WriteSpec = PreparedWrite | DescWrite | MadeWrite


class Lists(Protocol):
    """A pair's prepared lists (peers.py `Prepared`)."""

    @property
    def local(self) -> PreparedList: ...
    @property
    def remote(self) -> PreparedList: ...


def write_spec(
    plan: TransferPlan | IndexPlan,
    notif: bytes,
    agent: str,
    mem_type: str,
    prepared: Lists | None,
) -> WriteSpec:
    """The WRITE as data, for whichever thread posts it: indices into the pair's prepared lists (its
    `local` and `remote`) for an index plan, fresh descriptor lists otherwise."""
    if isinstance(plan, TransferPlan):
        local, remote = plan.nixl_descs()
        return DescWrite(agent, local, remote, notif, mem_type)
    assert prepared is not None  # an index plan indexes the pair's prepared lists
    return PreparedWrite(prepared.local, plan.src_idx, prepared.remote, plan.dst_idx, notif)


def post(transport: Transport, spec: WriteSpec) -> XferHandle:
    """Make and post one WRITE; the only place a WRITE leaves kvpush (push or posting thread). A made
    WRITE that fails to post is released here (as post_prepared releases what it made)."""
    if isinstance(spec, MadeWrite):
        try:
            transport.repost(spec.handle)
        except TransportError:
            with contextlib.suppress(TransportError):
                transport.release(spec.handle)
            raise
        return spec.handle
    if isinstance(spec, PreparedWrite):
        return transport.post_prepared(spec.local, spec.local_idx, spec.remote, spec.remote_idx, spec.notif)
    return transport.post_write(spec.peer, spec.local, spec.remote, spec.notif, spec.mem_type)


def discard(transport: Transport, spec: WriteSpec) -> None:
    """A WRITE that will never be posted: release what was made ahead for it (nothing for the others)."""
    if isinstance(spec, MadeWrite):
        try:
            transport.release(spec.handle)
        except TransportError as exc:
            log.warning("kvpush: could not release a WRITE made ahead: %s", exc)


def made_now(spec: WriteSpec) -> float:
    """The timeline's `made` for a WRITE made ahead: now, as it is posted (0.0: the post times it)."""
    return time.monotonic() if isinstance(spec, MadeWrite) else 0.0


JobState = Literal["queued", "posted", "done", "failed", "skipped"]


@dataclass(eq=False)
class PostJob:
    """One WRITE for a worker. The owner sets `abandoned` (a plain bool: written by the owner, read by the
    worker) to make the worker drop the job: not posted if it was not yet, else its handle released and no
    result handed back."""

    spec: WriteSpec
    deadline: float  # monotonic: the worker never posts at or after it
    state: JobState = "queued"
    error: str = ""
    abandoned: bool = False
    made_at: float = 0.0  # after the transfer was made, before it was posted (NIXL: the copy starts)
    posted_at: float = 0.0
    complete_at: float = 0.0
    handle: Any = None


class PostingPool:
    """N worker threads over one transport; `results` holds every job that settled (done, failed, or
    skipped because it was abandoned or past its deadline before posting), each exactly once."""

    def __init__(self, transport: Transport, workers: int, wake: Callable[[], None], poll_s: float) -> None:
        if workers < 1:
            raise ConfigError(f"a posting pool needs at least one worker, got {workers}")
        self.transport = transport
        self.wake = wake
        self.poll_s = poll_s
        self.results: queue.SimpleQueue[PostJob] = queue.SimpleQueue()
        self._inbox: list[queue.SimpleQueue[PostJob | None]] = [queue.SimpleQueue() for _ in range(workers)]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"kvpush-post-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, job: PostJob, worker: int) -> None:
        self._inbox[worker].put(job)

    def close(self) -> None:
        """Stop the workers; what they still hold in flight is released (its result is never handed
        back: the owner fails those requests itself at teardown)."""
        self._stop.set()
        for box in self._inbox:
            box.put(None)
        for t in self._threads:
            t.join(timeout=10)
        for box in self._inbox:  # never started: what was made ahead for them is released
            while True:
                try:
                    job = box.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    discard(self.transport, job.spec)

    def _settle(self, job: PostJob, state: JobState, error: str = "") -> None:
        job.state, job.error = state, error
        if job.handle is not None:
            try:
                self.transport.release(job.handle)
            except TransportError as exc:
                log.warning("kvpush posting thread: %s", exc)
            job.handle = None
        if not job.abandoned:
            self.results.put(job)
            self.wake()

    def _start(self, job: PostJob) -> bool:
        """Post one job; True if it is now in flight."""
        if job.abandoned:
            discard(self.transport, job.spec)
            return False  # the owner settled it already
        if time.monotonic() >= job.deadline:
            discard(self.transport, job.spec)
            self._settle(job, "skipped", "not posted: its WRITE deadline passed while it was queued")
            return False
        made = made_now(job.spec)
        try:
            job.handle = post(self.transport, job.spec)
        except TransportError as exc:
            self._settle(job, "failed", str(exc))
            return False
        job.made_at = made or self.transport.made_at() or 0.0
        job.posted_at = time.monotonic()
        job.state = "posted"
        return True

    def _run(self, i: int) -> None:
        box = self._inbox[i]
        flight: list[PostJob] = []
        while not self._stop.is_set():
            try:  # block only while nothing of ours is on the wire
                got = box.get() if not flight else box.get_nowait()
            except queue.Empty:
                got = None
            else:
                if got is None:
                    break
                if self._start(got):
                    flight.append(got)
                continue  # take everything queued first: posts go out back to back
            still: list[PostJob] = []
            for job in flight:
                if job.abandoned:
                    with contextlib.suppress(TransportError):
                        self.transport.release(job.handle)
                    job.handle = None
                    continue
                try:
                    state = self.transport.poll(job.handle)
                except TransportError as exc:
                    job.complete_at = time.monotonic()
                    self._settle(job, "failed", str(exc))
                    continue
                if state == "PROC":
                    still.append(job)
                    continue
                job.complete_at = time.monotonic()
                self._settle(job, "done")
            if len(still) == len(flight) and still:
                time.sleep(self.poll_s)
            flight = still
        for job in flight:
            with contextlib.suppress(TransportError):
                self.transport.release(job.handle)
            job.handle = None
