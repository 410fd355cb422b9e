"""FaultInjectingTransport, the soak's test double of the Transport contract: each fault kind does what it
says (and counts itself), and with no fault drawn every member behaves as the inner transport's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush.errors import ConfigError
from kvpush.protocol.layout import Region
from kvpush.transport.faults import FAULT_KINDS, FaultInjectingTransport
from kvpush.transport.memory import MemoryHub, MemoryTransport

N = 64
DELAY = 0.06  # the slow kinds wait uniform(0.05, DELAY) seconds


class Pair:
    """A sender A (wrapped in the fault injector) and a receiver B over one MemoryHub, 64 bytes each."""

    def __init__(self, rates: dict[str, float], wrap_receiver: bool = False) -> None:
        self.hub = MemoryHub()
        self.src = np.arange(N, dtype=np.uint8) + 1
        self.dst = np.zeros(N, dtype=np.uint8)
        self.a_inner = MemoryTransport("A", self.hub)
        self.b_inner = MemoryTransport("B", self.hub)
        self.a_inner.register([Region(int(self.src.ctypes.data), N)], "DRAM")
        self.b_inner.register([Region(int(self.dst.ctypes.data), N)], "DRAM")
        self.a = FaultInjectingTransport(self.a_inner, rates, seed=1, max_delay_s=DELAY)
        self.b = FaultInjectingTransport(self.b_inner, rates if wrap_receiver else {}, 2, DELAY)
        self.peer = self.a.add_peer(self.b.metadata())
        self.b.add_peer(self.a.metadata())

    def write(self, notif: bytes = b"w") -> object:
        local = np.array([[int(self.src.ctypes.data), N, 0]], dtype=np.int64)
        remote = np.array([[int(self.dst.ctypes.data), N, 0]], dtype=np.int64)
        return self.a.post_write(self.peer, local, remote, notif, "DRAM")

    def write_prepared(self, notif: bytes = b"p") -> object:
        local = self.a.prepare(None, np.array([[int(self.src.ctypes.data), N, 0]], dtype=np.int64), "DRAM")
        remote = self.a.prepare(
            self.peer, np.array([[int(self.dst.ctypes.data), N, 0]], dtype=np.int64), "DRAM"
        )
        idx = np.zeros(1, dtype=np.int32)
        return self.a.post_prepared(local, idx, remote, idx, notif)

    def copied(self) -> bool:
        return bool((self.dst == self.src).all())


def _poll_until_done(t: FaultInjectingTransport, handle: object, within: float = 2.0) -> float:
    start = time.monotonic()
    while t.poll(handle) == "PROC":
        assert time.monotonic() - start < within, "the WRITE never completed"
        time.sleep(0.002)
    return time.monotonic() - start


def test_with_no_fault_drawn_writes_and_notifications_pass_through_unchanged():
    p = Pair({})
    assert p.a.poll(p.write()) == "DONE" and p.copied()
    p.dst[:] = 0
    assert p.a.poll(p.write_prepared()) == "DONE" and p.copied()
    p.a.send_notif(p.peer, b"n1")
    p.a.send_notif(p.peer, b"n2")
    assert p.b.drain_notifs() == [("A", b"w"), ("A", b"p"), ("A", b"n1"), ("A", b"n2")]
    assert p.a.take_counts() == {} and p.b.take_counts() == {}


def test_members_it_does_not_intercept_are_the_inner_transports():
    p = Pair({kind: 1.0 for kind in FAULT_KINDS})
    assert p.a.name == "A" and p.a.metadata() == p.a_inner.metadata()
    assert p.a.hub is p.hub  # any attribute, including one the contract gains later
    local = p.a.prepare(None, np.array([[int(p.src.ctypes.data), N, 0]], dtype=np.int64), "DRAM")
    remote = p.a.prepare(p.peer, np.array([[int(p.dst.ctypes.data), N, 0]], dtype=np.int64), "DRAM")
    idx = np.zeros(1, dtype=np.int32)
    handle = p.a.make_write(local, idx, remote, idx, b"made")  # made and reposted: never slowed
    assert not p.copied()
    p.a.repost(handle)
    assert p.a.poll(handle) == "DONE" and p.copied()
    assert p.a.take_counts() == {}
    with pytest.raises(AttributeError):
        _ = p.a.no_such_member


def test_notif_drop_loses_every_notification_but_empty_liveness_probes():
    p = Pair({"notif_drop": 1.0}, wrap_receiver=True)
    for i in range(5):
        p.a.send_notif(p.peer, b"n%d" % i)
    p.a.send_notif(p.peer, b"")
    assert p.b.drain_notifs() == [("A", b"")]
    assert p.b.take_counts() == {"notif_drop": 5}
    assert p.b.take_counts() == {}  # taken: counted once


def test_notif_dup_delivers_each_notification_twice():
    p = Pair({"notif_dup": 1.0}, wrap_receiver=True)
    p.a.send_notif(p.peer, b"x")
    p.a.send_notif(p.peer, b"y")
    assert p.b.drain_notifs() == [("A", b"x"), ("A", b"x"), ("A", b"y"), ("A", b"y")]
    assert p.b.take_counts() == {"notif_dup": 2}


def test_notif_reorder_holds_a_notification_back_until_after_newer_ones():
    p = Pair({"notif_reorder": 1.0}, wrap_receiver=True)
    p.a.send_notif(p.peer, b"older")
    assert p.b.drain_notifs() == []  # held
    p.b.rates["notif_reorder"] = 0.0
    time.sleep(0.06)  # past the longest hold
    p.a.send_notif(p.peer, b"newer")
    assert p.b.drain_notifs() == [("A", b"newer"), ("A", b"older")]
    assert p.b.drain_notifs() == []  # delivered once
    assert p.b.take_counts() == {"notif_reorder": 1}


@pytest.mark.parametrize("prepared", [False, True])
def test_slow_write_post_holds_the_write_back_then_posts_it_from_poll(prepared):
    p = Pair({"slow_write_post": 1.0})
    handle = p.write_prepared() if prepared else p.write()
    assert p.a.poll(handle) == "PROC" and not p.copied()  # not posted: no byte moved
    assert p.b.drain_notifs() == []
    waited = _poll_until_done(p.a, handle)
    assert 0.03 < waited < 1.0 and p.copied()
    assert [m for _peer, m in p.b.drain_notifs()] == [b"p" if prepared else b"w"]
    p.a.release(handle)
    assert p.a.take_counts() == {"slow_write_post": 1}


def test_a_held_write_released_before_its_post_is_never_posted():
    p = Pair({"slow_write_post": 1.0})
    handle = p.write()
    p.a.release(handle)
    time.sleep(DELAY + 0.02)
    assert p.a.poll(handle) == "PROC"  # released: nothing left to post
    assert not p.copied() and p.b.drain_notifs() == []


def test_slow_write_complete_moves_the_bytes_now_and_reports_done_late():
    p = Pair({"slow_write_complete": 1.0})
    handle = p.write()
    assert p.copied() and p.b.drain_notifs() == [("A", b"w")]  # posted at once
    assert p.a.poll(handle) == "PROC"
    waited = _poll_until_done(p.a, handle)
    assert 0.03 < waited < 1.0
    p.a.release(handle)
    assert p.a.take_counts() == {"slow_write_complete": 1}


def test_an_unknown_fault_kind_is_refused_by_name():
    with pytest.raises(ConfigError, match="notif_lose"):
        Pair({"notif_lose": 0.5})
