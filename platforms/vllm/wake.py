"""Let an idle vLLM engine sleep until a transfer settles, instead of stepping in a tight loop.

vLLM keeps stepping its engine while any request exists, including requests that only wait for KV
(decode, waiting through the whole prefill in push mode) or whose blocks wait for a WRITE (prefill).
Each of those empty steps runs the scheduler and a round trip to the worker; back to back they keep a
CPU core busy. On a GPU host that core is spare, but wherever engines share cores (CPU serving, a test
box) it is taken from the other engine's compute.

The scheduler-side connector owns an `IdleWaiter` (a ZeroMQ PULL socket on an ipc:// path in the
temporary directory). When a step schedules no tokens, has nothing to send to the worker, and only
transfers are outstanding, it sleeps in `wait()` for at most `idle_wait_ms`. The worker-side connector
gets the path through the step metadata and hands an `IdleWaker` to kvpush's endpoint as its result
listener: the transfer thread pings the waiter the moment a result is ready, so a finished transfer is
never delayed by the sleep. New requests are: one arriving while the engine sleeps waits at most
`idle_wait_ms` to be scheduled.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from typing import Any

import zmq

_PREFIX = "kvpush-wake-"


def new_wake_path() -> str:
    """A fresh ipc:// endpoint in the temporary directory, unique to this process and call."""
    remove_stale_sockets()
    name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return "ipc://" + os.path.join(tempfile.gettempdir(), name)


def remove_stale_sockets(directory: str | None = None) -> int:
    """Unlink socket files left by engines that were killed (atexit does not run on SIGKILL); only
    files whose owning process no longer exists. Returns how many were removed."""
    directory = directory or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        try:
            pid = int(name[len(_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # still alive (or not ours to signal): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed += 1
    return removed


class IdleWaiter:
    """The scheduler side: sleep until woken or until the time is up; created and used on one thread."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or new_wake_path()
        self._ctx: Any = zmq.Context.instance()
        self._sock: Any = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 64)
        self._sock.bind(self.path)
        self.sleeps = 0
        self.woken = 0

    def wait(self, timeout_s: float) -> bool:
        """Block up to timeout_s; True if a wake-up came. Drains every pending wake-up first, so one
        that arrived while the engine was busy does not cut the next sleep short for nothing."""
        self.sleeps += 1
        woke = self.drain()
        if not woke and timeout_s > 0 and self._sock.poll(int(timeout_s * 1000)):
            woke = self.drain()
        self.woken += woke
        return woke

    def drain(self) -> bool:
        got = False
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True

    def close(self) -> None:
        self._sock.close(0)
        if self.path.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.path[len("ipc://") :])


class IdleWaker:
    """The worker side: wake the waiter. Used only from the thread that calls `wake` (kvpush's transfer
    thread); the socket is created there on first use. Never blocks: a full queue means the waiter is
    already woken."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: Any = None

    def wake(self) -> None:
        if self._sock is None:
            sock: Any = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)
            sock.connect(self.path)
            self._sock = sock
        with contextlib.suppress(zmq.Again):
            self._sock.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
