"""A TCP relay on 127.0.0.1 that can reset every connection through it, like a middlebox or conntrack
(kvpush soak: side-channel resets between the decode and the prefill; tests/endpoint/test_reset_side_channel.py)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading


class Relay:
    """Listens on an ephemeral port and forwards each connection to target_port; reset() sends a TCP RST
    both ways on every connection it carries, and keeps listening. While `blackhole` is set, new
    connections are accepted and never forwarded (a partition behind the middlebox).

    ranks > 1 (a TP prefill, rank r at base port + r): it listens on `ranks` consecutive ports from
    listen_port and forwards port + r to target_port + r, so a decode dials it as it would the prefill."""

    def __init__(
        self, target_port: int, host: str = "127.0.0.1", ranks: int = 1, listen_port: int = 0
    ) -> None:
        if ranks > 1 and not listen_port:
            raise ValueError("a relay for several ranks needs listen_port: a range of free ports")
        self.servers = {
            socket.create_server((host, listen_port + r if listen_port else 0)): (host, target_port + r)
            for r in range(ranks)
        }
        self.server = next(iter(self.servers))  # rank 0's
        self.port: int = self.server.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        for server in self.servers:
            self.sel.register(server, selectors.EVENT_READ)
        self.pairs: dict[socket.socket, socket.socket] = {}
        self.lock = threading.Lock()
        self.resets = 0
        self.blackhole = False
        self.held: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self.sel.select(0.05):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                with self.lock:
                    if sock in self.servers:
                        self._accept(sock)
                    elif sock in self.pairs:
                        self._forward(sock)

    def _accept(self, server: socket.socket) -> None:
        client, _ = server.accept()
        if self.blackhole:
            self.held.append(client)
            return
        try:
            upstream = socket.create_connection(self.servers[server], timeout=2)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ)
        self.pairs[client], self.pairs[upstream] = upstream, client

    def _forward(self, sock: socket.socket) -> None:
        other = self.pairs[sock]
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._close(sock, other, rst=False)
            return
        try:
            other.setblocking(True)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            self._close(sock, other, rst=False)

    def _close(self, a: socket.socket, b: socket.socket, rst: bool) -> None:
        for s in (a, b):
            self.pairs.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(s)
            if rst:  # SO_LINGER 0: close() sends a RST, as a middlebox dropping the flow would
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()

    def reset(self) -> None:
        with self.lock:
            done: set[socket.socket] = set()
            for a, b in list(self.pairs.items()):
                if a not in done:
                    done |= {a, b}
                    self._close(a, b, rst=True)
            self.resets += 1

    def heal(self) -> None:
        """End the partition: connections held in it are reset (their clients connect again)."""
        with self.lock:
            self.blackhole = False
            held, self.held = self.held, []
        for s in held:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.reset()
        self.heal()
        self.sel.close()
        for server in self.servers:
            server.close()
