"""The transfer thread: one per endpoint, the thread that owns the endpoint's state and transport.

Besides it, the library starts only the optional posting threads (posting.py, `posting.workers`: they post
and poll WRITEs the push thread hands them, and touch no state of its own) and prometheus_client's metrics
server (`metrics.port`).

Engine-facing calls put a command on a queue and ring a doorbell (a pipe), then return. The thread owns
everything else: it reads the side channel, feeds the sans-IO state machines, posts WRITEs and drives them
to completion itself (so decode-ready never waits for the engine's next step), drains NIXL notifications,
and ticks the clock. While work is in flight it sleeps `busy_poll_s` between rounds; when idle it blocks on
the doorbell and the side channel for up to `idle_poll_s`, so an idle endpoint costs almost no CPU. With
`spin_s` it first keeps the busy cadence that long after its last activity (a request's second event often
follows its first closely, and a thread woken from a block starts slow).

The thread holds `work` (a lock) for each round and lets go of it only to wait. `run_inline` lets an
engine call run its command on the engine's own thread instead, when it can take that lock without
waiting (the thread is between rounds and nothing is queued): the thread hop, the largest part of a small
request's cost, is then skipped; otherwise the command is queued as usual. The engine never waits here.

The loop is a collaborator, not a base: a `TransferLoop` drives one role (the push or the receive thread's
work, `LoopRole`), which it builds with itself as the argument (the role registers its sockets on the
loop's poller and rings its doorbell) and calls only through the role's hooks.

Death is sticky: if the thread's loop raises, `fatal` holds the exception, the role's teardown still
runs (it fails what is live), and every later engine-facing call raises EndpointClosed from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import zmq

from ..config_groups import Pacing
from ..errors import EndpointClosed, EndpointTimeout

log = logging.getLogger("kvpush")


class Doorbell:
    """A pipe whose read end a zmq.Poller can wait on: ringing it (from any thread; a pipe is safe to
    write from anywhere) wakes the thread blocked there. Idempotent close; a closed bell rings nothing."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def ring(self) -> None:
        try:  # noqa: SIM105 - not contextlib.suppress: this runs on the engine thread, on the clock
            os.write(self.write_fd, b"x")
        except OSError:  # already ringing (BlockingIOError), or closed
            pass

    def clear(self) -> None:
        """Empty the pipe, in one read when it holds less than 4 KiB (each system call here may hand the
        GIL to another thread; a raised BlockingIOError costs more than the read)."""
        try:
            while len(os.read(self.read_fd, 4096)) == 4096:
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class LoopRole(Protocol):
    """What a TransferLoop drives: the role's hooks, all called on the loop's thread under its `work` lock
    (wound_down after it)."""

    name: str  # the thread's name

    def setup(self) -> None:
        """Before the first round: create the transport and side channel; an exception here is raised from
        start()."""

    def teardown(self) -> None:
        """After the last round (or the loop's death): release what setup made, report live requests
        failed."""

    def step(self, now: float) -> bool:
        """One round of I/O; True if anything happened (keeps the loop in busy mode)."""

    def busy(self) -> bool:
        """True while transfers are in flight or expected: poll fast."""

    def in_flight(self) -> bool:
        """True while a transfer the role posted is on the wire: poll without backing off."""

    def idle_wait_ms(self) -> int:
        """How long to block when not busy (`idle_wait_ms` below, or shorter)."""

    def wound_down(self) -> None:
        """The thread's last act, after teardown reported everything it had to."""


def idle_wait_ms(pacing: Pacing, tracked: int) -> int:
    """A tick every idle_poll_s while anything is tracked (leases, timeouts), five times longer when
    nothing is (only the doorbell or a message can matter)."""
    return max(1, int(pacing.idle_poll_s * (1000 if tracked else 5000)))


RoleT = TypeVar("RoleT", bound=LoopRole, covariant=True)


class TransferLoop(Generic[RoleT]):
    """The thread that runs `role.step()` until stopped: its doorbell, command queue, poller, round lock
    and sticky death. `role` is built by `make_role(loop)`, on the caller's thread."""

    def __init__(self, pacing: Pacing, make_role: Callable[[TransferLoop[RoleT]], RoleT]) -> None:
        self.pacing = pacing
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.doorbell = Doorbell()
        self.poller = zmq.Poller()
        self.poller.register(self.doorbell.read_fd, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.fatal: BaseException | None = None
        self.closed = False
        self._doorbell_closed = False
        self._rang = False  # the doorbell woke the thread and is emptied at the end of this round
        # held by the thread for each round (commands, step, teardown); released only to wait. An engine
        # call may take it without waiting and run its command itself (run_inline).
        self.work = threading.Lock()
        self._looping = False  # the loop runs: inline commands are allowed (set and cleared under work)
        self.role: RoleT = make_role(self)
        self.name = self.role.name

    # lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self.closed = True
            raise self._start_error

    def stop(self) -> None:
        """Stop the thread (it tears its transport down), then close the doorbell; idempotent.

        The doorbell is closed only once the thread has ended: it polls that pipe until its last round.
        """
        self.closed = True
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self.doorbell.ring()
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.error("kvpush thread %s did not stop within 30 s; leaving its doorbell open", self.name)
                return
        if not self._doorbell_closed:
            self._doorbell_closed = True
            self.doorbell.close()

    def alive_or_raise(self) -> None:
        """Raise EndpointClosed (from the thread's fatal error, if any) once the endpoint cannot work."""
        if self.fatal is not None:
            raise EndpointClosed(f"kvpush {self.name} thread died: {self.fatal!r}") from self.fatal
        if self.closed:
            raise EndpointClosed(f"kvpush {self.name} endpoint is closed")
        if self._thread is None:
            raise EndpointClosed(f"kvpush {self.name} endpoint was never started (call start())")

    def submit(self, fn: Callable[[], None]) -> None:
        self.alive_or_raise()
        self.commands.put(fn)
        self.doorbell.ring()

    def run_inline(self, fn: Callable[[], None], allowed: Callable[[], bool]) -> bool:
        """Run fn on the calling thread if the transfer thread is between rounds (its lock is free at once),
        nothing is queued before it and allowed() (checked under the lock) says so; else do nothing.
        True: fn ran (or raised: the endpoint then dies as if its thread had, and the thread is stopped).
        The thread is rung afterwards: whatever fn posted, it polls to completion."""
        if self.fatal is not None or self.closed or not self.work.acquire(blocking=False):
            return False
        try:
            if not (self._looping and self.commands.empty() and allowed()):
                return False
            try:
                fn()
            except BaseException as exc:
                self.fatal = exc
                self._stop.set()
                log.exception("kvpush thread %s died (a command run on the engine's thread)", self.name)
        finally:
            self.work.release()
        self.doorbell.ring()
        return True

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run fn on the transfer thread and wait for its result (start-up and tests only)."""
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def run() -> None:
            try:
                box.put((True, fn()))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller as is
                box.put((False, exc))

        self.submit(run)
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, value = box.get(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                self.alive_or_raise()  # the thread died (or closed) while we waited
                if time.monotonic() >= deadline:
                    raise EndpointTimeout(
                        f"kvpush {self.name} thread did not answer within {timeout}s"
                    ) from None
        if not ok:
            raise value
        return value

    # loop ---------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.role.setup()
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException as exc:
            self.fatal = exc
            log.exception("kvpush thread %s died", self.name)
        finally:
            with self.work:
                self._looping = False
                try:
                    self.role.teardown()
                except Exception:
                    log.exception("kvpush thread %s: teardown failed", self.name)
            self.role.wound_down()

    def _loop(self) -> None:
        fast, slowest = self.pacing.busy_poll_s, self.pacing.max_busy_poll_s
        spin = self.pacing.spin_s
        role = self.role
        nap = fast
        active = 0.0  # when a command or a round last did something (the spin window counts from here)
        commands = self.commands
        work = self.work
        with work:
            self._looping = True
        while not self._stop.is_set():
            with work:
                # asked with empty() (C) rather than a raised queue.Empty: one consumer, so nothing takes
                # a command between the two calls, and an idle round builds no exception
                while not commands.empty():
                    commands.get_nowait()()
                    nap = fast
                    active = time.monotonic()
                now = time.monotonic()
                if role.step(now):
                    nap = fast
                    active = now
                    continue
                if self._rang:
                    # empty the doorbell only now, after the work it announced (its read is a system
                    # call that may hand the GIL to the engine's thread before that work starts), then
                    # look for commands again before any wait: a ring after this read wakes the next
                    # wait, and a command whose ring this read took is found by that second look
                    self._rang = False
                    self.doorbell.clear()
                    continue
                busy = role.busy()
                wait_ms = 0 if busy else role.idle_wait_ms()
            # the lock is free while the thread waits: an engine call may run its command meanwhile
            if busy:
                # back off towards `slowest` while nothing happens; from 1 ms on, nap in the poller
                # so that a doorbell (new work) or a side-channel message cuts the nap short
                if nap >= 1e-3:
                    self._wait(int(nap * 1000))
                else:
                    time.sleep(nap)
                # a WRITE in flight is polled at the fast cadence (with UCX its notification leaves only
                # when we poll); back off only while nothing of ours is on the wire
                with work:
                    nap = fast if role.in_flight() else min(nap * 2, slowest)
            elif spin and now - active < spin:
                time.sleep(fast)  # the spin window: the next command or message is picked up warm
            else:
                self._wait(wait_ms)
                nap = fast

    def _wait(self, timeout_ms: int) -> None:
        """Block for a doorbell or a side-channel message. The doorbell is not emptied here: the loop does
        it after the work the ring announced (a message that woke the thread needs no read at all)."""
        bell = self.doorbell.read_fd
        for fd, _ in self.poller.poll(timeout_ms):
            if fd == bell:
                self._rang = True  # emptied once the round's work is done (_loop)
                return
