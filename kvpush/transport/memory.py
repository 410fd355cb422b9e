"""An in-process transport: real memory copies between registered regions, plus faults.

The same contract as the NIXL transport (register, prepare, WRITE with a notification, poll), inside one
process: for tests, and for a first contact on the base install, which has no NIXL (README's first
example; exported as `kvpush.MemoryHub` / `kvpush.MemoryTransport`, with `kvpush.MemoryControl` for the
side channel). Nothing leaves the process: endpoints that share a hub (and a MemoryControl) pair.

Agents meet in a MemoryHub. A WRITE copies bytes with ctypes.memmove after checking that every
descriptor lies inside memory the two agents registered, then queues the notification at the target.
Faults: `hub.kill(name)` makes every operation involving that agent fail like a dead peer;
`hub.fail_next_writes[name] = n` fails the next n WRITEs posted towards `name`; `hub.hold_writes = True`
keeps WRITEs in flight until `hub.release_held()`.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol.layout import Region
from .base import Descs, Indices, Rows, TransportError, XferState, expand_rows


@dataclass
class _Xfer:
    src: str
    dst: str
    notif: bytes
    copies: list[tuple[int, int, int]]  # (to, from, len)
    state: str = "PROC"


@dataclass
class _Prepared:
    """A prepared list expanded to one (addr, len, device) row per index, like NIXL numbers them."""

    peer: str | None
    descs: Descs
    released: bool = False


@dataclass
class MemoryHub:
    agents: dict[str, MemoryTransport] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    fail_next_writes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    hold_writes: bool = False
    held: list[_Xfer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def kill(self, name: str) -> None:
        with self.lock:
            self.dead.add(name)

    def release_held(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for x in held:
            self._complete(x)

    def _complete(self, x: _Xfer) -> None:
        with self.lock:
            if x.dst in self.dead or x.src in self.dead:
                x.state = "ERR"
                return
            for to, frm, n in x.copies:
                ctypes.memmove(to, frm, n)
            x.state = "DONE"
            if x.notif:
                self.agents[x.dst].inbox.append((x.src, x.notif))


class MemoryTransport:
    def __init__(self, name: str, hub: MemoryHub, strided_lists: bool = True) -> None:
        """strided_lists=False stands for a data plane without strided lists (NIXL 1.3.x): this transport
        expands rows either way, so only what it reports changes (the endpoint's descriptor counts)."""
        self.name = name
        self.strided_lists = strided_lists
        self.hub = hub
        self.regions: list[Region] = []
        self.peers: set[str] = set()
        self.inbox: list[tuple[str, bytes]] = []
        self.live_prepared = 0  # prepared lists made and not yet released (a leak shows here)
        self._tls = threading.local()
        hub.agents[name] = self

    def _alive(self, peer: str | None = None) -> None:
        if self.name in self.hub.dead:
            raise TransportError(f"agent {self.name} is dead")
        if peer is not None and peer in self.hub.dead:
            raise TransportError(f"peer {peer} disconnected")

    def register(self, regions: Sequence[Region], mem_type: str) -> None:
        self.regions.extend(regions)

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode(errors="replace")
        if name not in self.hub.agents:
            raise TransportError(f"unknown peer metadata {name!r}")
        self.peers.add(name)
        return name

    def connect(self, peer: str) -> None:
        self._alive(peer)

    def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)

    @staticmethod
    def _inside(regions: list[Region], addr: int, n: int) -> bool:
        return any(r.addr <= addr and addr + n <= r.addr + r.nbytes for r in regions)

    def post_write(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> _Xfer:
        return self._post(peer, local, remote, notif, write=True)

    def _post(
        self, peer: str, local: Descs, remote: Descs, notif: bytes, write: bool, post: bool = True
    ) -> _Xfer:
        """A WRITE copies local -> remote; `write=False` is a READ (for tests of pull-style users).
        `post=False` checks and makes the transfer without starting it (see make_write)."""
        self._alive(peer)
        if peer not in self.peers:
            raise TransportError(f"{peer!r} is not a known peer of {self.name}")
        target = self.hub.agents[peer]
        copies = []
        for (la, ln, _ld), (ra, rn, _rd) in zip(local.tolist(), remote.tolist(), strict=True):
            if ln != rn:
                raise TransportError("descriptor lengths differ")
            if not self._inside(self.regions, la, ln) or not self._inside(target.regions, ra, rn):
                raise TransportError(f"descriptor {hex(la)}/{hex(ra)}+{ln} outside registered memory")
            copies.append((ra, la, ln) if write else (la, ra, ln))
        x = _Xfer(self.name, peer, notif, copies)
        if post:
            self._submit(x)
        return x

    def _submit(self, x: _Xfer) -> None:
        with self.hub.lock:
            failing = self.hub.fail_next_writes.get(x.dst, 0)
            if failing:
                self.hub.fail_next_writes[x.dst] = failing - 1
                x.state = "ERR"
                return
            if self.hub.hold_writes:
                self.hub.held.append(x)
                return
        self.hub._complete(x)

    def prepare(self, peer: str | None, rows: Rows, mem_type: str) -> _Prepared:
        if peer is not None:
            self._alive(peer)
            if peer not in self.peers:
                raise TransportError(f"{peer!r} is not a known peer of {self.name}")
        got = _Prepared(peer, expand_rows(rows))
        self.live_prepared += 1
        return got

    def make_write(
        self, local: _Prepared, local_idx: Indices, remote: _Prepared, remote_idx: Indices, notif: bytes
    ) -> _Xfer:
        if local.peer is not None or remote.peer is None:
            raise TransportError("make_write takes a local and a remote prepared list")
        if local.released or remote.released:
            raise TransportError("make_write on a released prepared list")
        try:
            ldescs, rdescs = local.descs[local_idx], remote.descs[remote_idx]
        except IndexError as exc:
            raise TransportError(f"prepared-list index out of range: {exc}") from exc
        x = self._post(remote.peer, ldescs, rdescs, notif, write=True, post=False)
        return x

    def repost(self, handle: _Xfer, notif: bytes | None = None) -> None:
        if notif is not None:
            handle.notif = notif
        handle.state = "PROC"
        self._submit(handle)

    def post_prepared(
        self, local: _Prepared, local_idx: Indices, remote: _Prepared, remote_idx: Indices, notif: bytes
    ) -> _Xfer:
        x = self.make_write(local, local_idx, remote, remote_idx, notif)
        self._tls.made_at = time.monotonic()
        self._submit(x)
        return x

    def made_at(self) -> float | None:
        got: float | None = getattr(self._tls, "made_at", None)
        return got

    def release_prepared(self, plist: _Prepared) -> None:
        """Like NIXL's release_dlist_handle: once per list; a second release is an error."""
        if plist.released:
            raise TransportError("prepared list released twice")
        plist.released = True
        self.live_prepared -= 1

    def poll(self, handle: _Xfer) -> XferState:
        if handle.state == "ERR" or (handle.state == "PROC" and handle.dst in self.hub.dead):
            raise TransportError(f"transfer to {handle.dst} failed (injected)")
        return "DONE" if handle.state == "DONE" else "PROC"

    def release(self, handle: _Xfer) -> None:
        pass

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._alive(peer)
        with self.hub.lock:
            target = self.hub.agents.get(peer)
            if target is None:  # closed: like NIXL's disconnect error, never a bare KeyError
                raise TransportError(f"peer {peer} is gone (closed)")
            target.inbox.append((self.name, msg))

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        with self.hub.lock:
            out, self.inbox = self.inbox, []
        return out

    def progress_owed(self, now: float) -> bool:
        return False  # a notification lands in the target's inbox inside send_notif

    def close(self) -> None:
        self.hub.agents.pop(self.name, None)
