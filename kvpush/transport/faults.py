"""A test double of the Transport contract: a decorator around a real transport that loses, repeats and
delays what a lossy or slow network would, so a soak can show the protocol survives it.

It intercepts only the members whose behaviour a fault changes (the WRITE posts, poll, release and
drain_notifs); every other member, including any the contract gains later, goes to the inner transport
unchanged.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .base import Descs, Indices, PreparedList, Transport, XferHandle, XferState

NOTIF_DROP, NOTIF_DUP, NOTIF_REORDER = "notif_drop", "notif_dup", "notif_reorder"
SLOW_WRITE_COMPLETE, SLOW_WRITE_POST = "slow_write_complete", "slow_write_post"
FAULT_KINDS = (NOTIF_DROP, NOTIF_DUP, NOTIF_REORDER, SLOW_WRITE_COMPLETE, SLOW_WRITE_POST)


@dataclass
class _SlowHandle:
    """A WRITE the fault injector holds back (not posted until post_at) or reports late (done_at)."""

    inner: XferHandle | None
    post: Callable[[], XferHandle] | None
    post_at: float = 0.0
    done_at: float = 0.0


class FaultInjectingTransport:
    """A Transport around a real one (NixlTransport in the soak) that drops, duplicates and reorders
    received notifications, and holds WRITEs back before posting them or reports their completion late.

    `rates` maps a kind in FAULT_KINDS to the chance that one notification (drop, dup, reorder) or one
    WRITE (the slow kinds) gets it; a kind not named never happens. The endpoint cannot tell these
    faults from a lossy or slow network, which is the point: the protocol must survive them without
    leaking a block or letting a byte land after a free. Counts per kind are read by another thread
    (`take_counts`)."""

    def __init__(self, inner: Transport, rates: Mapping[str, float], seed: int, max_delay_s: float) -> None:
        unknown = sorted(set(rates) - set(FAULT_KINDS))
        if unknown:
            raise ConfigError(f"unknown transport fault kinds {unknown}; known: {list(FAULT_KINDS)}")
        self.inner = inner
        self.name = inner.name
        self.rates = dict(rates)
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.held: list[tuple[float, tuple[str, bytes]]] = []  # (due, notification) held to reorder
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, attr: str) -> Any:
        """Every member this double does not intercept is the inner transport's, unchanged."""
        if attr == "inner":  # not set yet (copy, pickle): no recursion through the lookup below
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def take_counts(self) -> dict[str, int]:
        """The faults injected since the last call, by kind."""
        with self._lock:
            out, self._counts = dict(self._counts), Counter()
        return out

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def _slow(self, post: Callable[[], XferHandle]) -> XferHandle:
        r, now = self.rng.random(), time.monotonic()
        hold = self.rates.get(SLOW_WRITE_POST, 0.0)
        late = self.rates.get(SLOW_WRITE_COMPLETE, 0.0)
        if r < hold:
            self._count(SLOW_WRITE_POST)
            return _SlowHandle(None, post, post_at=now + self.rng.uniform(0.05, self.max_delay_s))
        if r < hold + late:
            self._count(SLOW_WRITE_COMPLETE)
            return _SlowHandle(post(), None, done_at=now + self.rng.uniform(0.05, self.max_delay_s))
        return post()

    # -- the intercepted members of the Transport contract -------------------------------------------
    def post_write(self, peer: str, local: Descs, remote: Descs, notif: bytes, mem_type: str) -> XferHandle:
        return self._slow(lambda: self.inner.post_write(peer, local, remote, notif, mem_type))

    def post_prepared(
        self, local: PreparedList, local_idx: Indices, remote: PreparedList, remote_idx: Indices, notif: bytes
    ) -> XferHandle:
        return self._slow(lambda: self.inner.post_prepared(local, local_idx, remote, remote_idx, notif))

    def poll(self, handle: XferHandle) -> XferState:
        if not isinstance(handle, _SlowHandle):
            return self.inner.poll(handle)
        now = time.monotonic()
        if handle.inner is None:
            if now < handle.post_at or handle.post is None:
                return "PROC"
            handle.inner, handle.post = handle.post(), None
        state = self.inner.poll(handle.inner)
        return "PROC" if state == "DONE" and now < handle.done_at else state

    def release(self, handle: XferHandle) -> None:
        if not isinstance(handle, _SlowHandle):
            self.inner.release(handle)
        elif handle.inner is not None:
            self.inner.release(handle.inner)
        else:
            handle.post = None  # abandoned before it was posted: it never will be

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        now = time.monotonic()
        out: list[tuple[str, bytes]] = []
        drop = self.rates.get(NOTIF_DROP, 0.0)
        dup = drop + self.rates.get(NOTIF_DUP, 0.0)
        reorder = dup + self.rates.get(NOTIF_REORDER, 0.0)
        for item in self.inner.drain_notifs():
            r = self.rng.random() if item[1] else 1.0  # empty liveness probes pass untouched
            if r < drop:
                self._count(NOTIF_DROP)
            elif r < dup:
                self._count(NOTIF_DUP)
                out += [item, item]
            elif r < reorder:
                self._count(NOTIF_REORDER)
                self.held.append((now + self.rng.uniform(0.002, 0.05), item))
            else:
                out.append(item)
        due = [h for h in self.held if h[0] <= now]
        if due:
            self.held = [h for h in self.held if h[0] > now]
            out += [item for _t, item in due]  # after the newer ones: reordered
        return out
