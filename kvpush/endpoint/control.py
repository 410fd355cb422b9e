"""The control plane: the side channel that carries handshakes, registrations, aborts and refusals.

The contract is two small objects. A prefill rank *listens* (`ControlListener`: receive one message from
some connection, answer that connection); a decode rank *connects* to each prefill rank it needs
(`ControlChannel`: send, receive). Messages are opaque bytes (wire.Codec frames); the endpoint owns their
meaning. Both objects expose `pollable`, something the endpoint's zmq.Poller can wait on (a ZeroMQ
socket or a file descriptor), so one poll covers the doorbell, the side channel and nothing else.

Two implementations: `ZmqControl` (ROUTER/DEALER over TCP; what deployments use) and `MemoryControl`
(in-process queues with pipe doorbells; fast, deterministic tests without sockets). Neither raises
anything but TransportError.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import TransportError
from .loop import Doorbell

Pollable = Any  # a zmq.Socket or an int file descriptor


class ControlListener(Protocol):
    """Prefill side: one bound address, many decode connections."""

    host: str
    port: int
    pollable: Pollable

    def recv(self) -> tuple[bytes, bytes | None] | None:
        """(connection id, message) for the next message, (connection id, None) for a malformed frame,
        or None when nothing is waiting. Never blocks."""
        ...

    def send(self, conn: bytes, data: bytes) -> None: ...
    def close(self) -> None: ...


class ControlChannel(Protocol):
    """Decode side: one connection to one prefill rank; messages arrive in the order they were sent."""

    pollable: Pollable

    def send(self, data: bytes) -> None: ...
    def recv(self) -> bytes | None: ...

    def peer_closed(self) -> bool:
        """True once an established connection was closed since we connected. A hint, never proof: a
        killed process's kernel closes its sockets, but so does a TCP reset from a middlebox, conntrack
        or a partition while the prefill lives on and may still write. A frozen (SIGSTOPped) process keeps
        them open, and a peer that never answered proves nothing: both stay False. Never blocks."""
        ...

    def close(self) -> None: ...


class ControlPlane(Protocol):
    def listen(self, host: str, port: int, max_message_bytes: int) -> ControlListener:
        """Bind host:port (port 0: any free port; `.port` says which)."""
        ...

    def connect(self, host: str, port: int, max_message_bytes: int) -> ControlChannel: ...

    def nobody_listens(self, host: str, port: int) -> bool:
        """True only when a fresh connection to host:port is refused now (nothing listens there: the
        process is gone or closed its endpoint). A listener, a timeout or any other error: False. Blocks
        at most PROBE_TIMEOUT_S (called only to verify a closed connection's hint)."""
        ...


PROBE_TIMEOUT_S = 0.25


# ---- ZeroMQ ------------------------------------------------------------------------------------------
REBIND_WAIT_S = 2.0  # how long a listener retries an address still held by the one it replaces


def _bind_retrying(sock: zmq.Socket[Any], address: str) -> None:
    """Bind, retrying EADDRINUSE briefly: ZeroMQ closes sockets asynchronously, so an endpoint restarted
    on its own port (in-process, or a process restarted at once) may find the old socket still there."""
    deadline = time.monotonic() + REBIND_WAIT_S
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


# pyzmq's options and flags as plain ints: combined with an int (EVENTS' answer, SNDMORE inside
# send_multipart) an IntFlag goes through Python-level enum code, on every loop round and every message
_OPT_EVENTS = int(zmq.EVENTS)
_POLLIN, _NOBLOCK, _NOBLOCK_MORE = int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)


class _ZmqListener:
    def __init__(self, ctx: zmq.Context[Any], host: str, port: int, max_bytes: int) -> None:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        try:
            if port:
                _bind_retrying(sock, f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            sock.close()
            raise TransportError(f"side channel cannot listen on {host}:{port}: {exc}") from exc
        self.sock, self.host, self.port, self.pollable = sock, host, port, sock

    def recv(self) -> tuple[bytes, bytes | None] | None:
        # every loop round asks; an empty socket answers from EVENTS at half the cost of a raised Again
        # (plain ints: `int & zmq.POLLIN` builds a new IntFlag through the enum machinery each time)
        sock = self.sock
        if not sock.getsockopt(_OPT_EVENTS) & _POLLIN:
            return None
        # frames, not bytes: a frame says whether more parts follow (`more`) without getsockopt(RCVMORE),
        # whose option lookup runs Python enum code per part
        try:
            frames = [sock.recv(_NOBLOCK, copy=False)]
        except zmq.Again:
            return None
        while frames[-1].more:  # a message's parts arrive together: the rest are here
            frames.append(sock.recv(_NOBLOCK, copy=False))
        if len(frames) != 2:
            return frames[0].bytes, None
        return frames[0].bytes, frames[1].bytes

    def send(self, conn: bytes, data: bytes) -> None:
        try:
            self.sock.send(conn, _NOBLOCK_MORE)
            self.sock.send(data, _NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransportError(f"side channel reply failed: {exc}") from exc

    def close(self) -> None:
        self.sock.close()


class _ZmqChannel:
    # A DISCONNECTED counts only after a completed ZMTP handshake: libzmq also reports one when a handshake
    # times out (handshake_ivl), which is what a frozen prefill's kernel-accepted connection does
    _EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self, ctx: zmq.Context[Any], host: str, port: int, max_bytes: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        try:
            monitor = sock.get_monitor_socket(self._EVENTS)
        except zmq.ZMQError as exc:
            sock.close()
            raise TransportError(f"side channel cannot monitor its connection: {exc}") from exc
        monitor.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        self.sock, self.monitor, self.pollable = sock, monitor, sock
        self._established = self._closed = False

    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransportError(f"side channel send failed: {exc}") from exc

    def recv(self) -> bytes | None:
        # asked per prefill rank every loop round, mostly of an empty socket: EVENTS answers that without
        # the raised Again (as _ZmqListener.recv)
        sock = self.sock
        if not sock.getsockopt(_OPT_EVENTS) & _POLLIN:
            return None
        try:
            return bytes(sock.recv(_NOBLOCK))
        except zmq.Again:
            return None

    def peer_closed(self) -> bool:
        while not self._closed and not self.monitor.closed:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:  # zmq.Again: nothing more to read
                break
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._established = True
            elif event == zmq.EVENT_DISCONNECTED and self._established:
                self._closed = True
        return self._closed

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


class ZmqControl:
    """ROUTER (prefill) / DEALER (decode) over TCP. Bind to 127.0.0.1 unless a deployment says otherwise."""

    def __init__(self, ctx: zmq.Context[Any] | None = None) -> None:
        self.ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context.instance()

    def listen(self, host: str, port: int, max_message_bytes: int) -> _ZmqListener:
        return _ZmqListener(self.ctx, host, port, max_message_bytes)

    def connect(self, host: str, port: int, max_message_bytes: int) -> _ZmqChannel:
        return _ZmqChannel(self.ctx, host, port, max_message_bytes)

    def nobody_listens(self, host: str, port: int) -> bool:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:  # a timeout, no route: a partition looks like this, and proves nothing
            return False


# ---- in memory ---------------------------------------------------------------------------------------
@dataclass
class _Inbox:
    items: deque[Any] = field(default_factory=deque)
    bell: Doorbell = field(default_factory=Doorbell)
    closed: bool = False

    def put(self, item: Any, lock: threading.Lock) -> None:
        with lock:
            if self.closed:
                raise TransportError("side channel peer is closed")
            self.items.append(item)
        self.bell.ring()

    def get(self, lock: threading.Lock) -> Any:
        with lock:
            if not self.items:
                self.bell.clear()
                return None
            return self.items.popleft()


class _MemoryListener:
    def __init__(self, plane: MemoryControl, host: str, port: int, max_bytes: int) -> None:
        self.plane, self.host, self.port, self.max_bytes = plane, host, port, max_bytes
        self.inbox = _Inbox()
        self.pollable = self.inbox.bell.read_fd
        self.conns: dict[bytes, _MemoryChannel] = {}

    def recv(self) -> tuple[bytes, bytes | None] | None:
        item: tuple[bytes, bytes] | None = self.inbox.get(self.plane.lock)
        if item is None:
            return None
        conn, data = item
        return conn, (data if len(data) <= self.max_bytes else None)

    def send(self, conn: bytes, data: bytes) -> None:
        chan = self.conns.get(conn)
        if chan is None:
            raise TransportError(f"side channel reply to unknown connection {conn!r}")
        chan.inbox.put(data, self.plane.lock)

    def close(self) -> None:
        self.inbox.closed = True
        self.plane.listeners.pop((self.host, self.port), None)
        self.inbox.bell.close()


class _MemoryChannel:
    def __init__(self, plane: MemoryControl, host: str, port: int, conn: bytes) -> None:
        self.plane, self.address, self.conn = plane, (host, port), conn
        self.inbox = _Inbox()
        self.pollable = self.inbox.bell.read_fd
        self.peer: _MemoryListener | None = None  # the listener this connection reached, once it has
        self.closed_seen = False

    def send(self, data: bytes) -> None:
        listener = self.plane.listeners.get(self.address)
        if listener is None:
            return  # like TCP to a closed port: nobody answers, the endpoint's timeouts decide
        if self.peer_closed() or self.peer is None:
            self.peer = listener  # a restarted listener is reached again, like a DEALER's reconnect
        listener.conns[self.conn] = self
        listener.inbox.put((self.conn, data), self.plane.lock)

    def recv(self) -> bytes | None:
        data: bytes | None = self.inbox.get(self.plane.lock)
        return data

    def peer_closed(self) -> bool:
        if self.peer is not None and self.peer.inbox.closed:
            self.closed_seen = True  # like the DEALER's monitor: once seen, a reconnect does not undo it
        return self.closed_seen

    def close(self) -> None:
        self.inbox.closed = True
        self.inbox.bell.close()


class MemoryControl:
    """An in-process control plane: listeners keyed by (host, port), one inbox per connection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listeners: dict[tuple[str, int], _MemoryListener] = {}
        self._ports = itertools.count(41000)
        self._conns = itertools.count(1)

    def listen(self, host: str, port: int, max_message_bytes: int) -> _MemoryListener:
        with self.lock:
            if not port:
                port = next(p for p in self._ports if (host, p) not in self.listeners)
            if (host, port) in self.listeners:
                raise TransportError(f"side channel cannot listen on {host}:{port}: address in use")
            listener = self.listeners[(host, port)] = _MemoryListener(self, host, port, max_message_bytes)
        return listener

    def connect(self, host: str, port: int, max_message_bytes: int) -> _MemoryChannel:
        with self.lock:
            conn = f"conn-{next(self._conns)}".encode()
        return _MemoryChannel(self, host, port, conn)

    def nobody_listens(self, host: str, port: int) -> bool:
        with self.lock:
            return (host, port) not in self.listeners
