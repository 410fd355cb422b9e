"""An eavesdropper's capture for the soak: the decode's control plane, keeping copies of what it sends so
the attacker has real frames to replay."""

from __future__ import annotations

import threading
from collections import deque

from kvpush.endpoint.control import ControlChannel, ControlListener, ControlPlane


class _TapChannel:
    """A channel that hands a copy of every frame it sends to its tap."""

    def __init__(self, inner: ControlChannel, tap: FrameTapControl) -> None:
        self.inner, self.tap, self.pollable = inner, tap, inner.pollable

    def send(self, data: bytes) -> None:
        self.tap.keep(data)
        self.inner.send(data)

    def recv(self) -> bytes | None:
        return self.inner.recv()

    def peer_closed(self) -> bool:
        return self.inner.peer_closed()

    def close(self) -> None:
        self.inner.close()


class FrameTapControl:
    """Fault injector (an eavesdropper's capture): the ZeroMQ control plane, keeping copies of the last
    frames this decode sent (Hellos, sealed registrations, aborts, pings) for the attacker to replay."""

    def __init__(self, inner: ControlPlane, keep: int = 48) -> None:
        self.inner = inner
        self.frames: deque[bytes] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def keep(self, data: bytes) -> None:
        with self._lock:
            self.frames.append(bytes(data))

    def captured(self) -> list[bytes]:
        with self._lock:
            return list(self.frames)

    def listen(self, host: str, port: int, max_message_bytes: int) -> ControlListener:
        return self.inner.listen(host, port, max_message_bytes)

    def connect(self, host: str, port: int, max_message_bytes: int) -> ControlChannel:
        return _TapChannel(self.inner.connect(host, port, max_message_bytes), self)

    def nobody_listens(self, host: str, port: int) -> bool:
        return self.inner.nobody_listens(host, port)
