"""A standalone notification (the failure notice of an aborted streamed request, the done notice of one
whose ranges all landed before prefill_done) reaches the decode even when the prefill has nothing left in
flight once it is sent. NIXL hands such a notice to UCX untracked; 1.3.2 held the first message on a
connection until both sides had progressed some 27 ms, and a prefill with no live request stopped
progressing, so the notice sat queued until close ("UCX AM send failed ... Request canceled"). The push
thread now keeps draining while its transport says progress is owed (Transport.progress_owed).

The double below holds each standalone notification until its sender has been progressed (drain_notifs)
HOLD_S after sending it: with the drain condition that consulted live requests only, both tests time out."""

from __future__ import annotations

import time

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout
from kvpush.protocol.reasons import Failure
from kvpush.transport.memory import MemoryHub, MemoryTransport
from kvpush.transport.nixl import NOTIF_PROGRESS_S, NixlTransport
from tests.endpoint.util import until

GEO = dict(num_layers=2, total_kv_heads=2, head_dim=8, dtype_size=2, block_size=4, num_blocks=32)
HOLD_S = 0.1  # well past a tick (idle_poll_s / 2), far below the decode's fence


class HoldsNotices(MemoryTransport):
    """send_notif queues; a queued notice leaves at the first drain_notifs HOLD_S after it was sent (the
    sender's progress moves it, as UCX's does). progress_owed: while one waits."""

    def __init__(self, name: str, hub: MemoryHub) -> None:
        super().__init__(name, hub)
        self.outbox: list[tuple[float, str, bytes]] = []
        self.delivered = 0

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._alive(peer)
        self.outbox.append((time.monotonic(), peer, msg))

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        now = time.monotonic()
        due = [x for x in self.outbox if now - x[0] >= HOLD_S]
        self.outbox = [x for x in self.outbox if now - x[0] < HOLD_S]
        for _t, peer, msg in due:
            super().send_notif(peer, msg)
            self.delivered += bool(msg)  # not the empty liveness probes
        return super().drain_notifs()

    def progress_owed(self, now: float) -> bool:
        return bool(self.outbox)


@pytest.fixture
def pair():
    hub = MemoryHub()
    src, dst = HostKVCache(KVLayout(**GEO)), HostKVCache(KVLayout(**GEO))
    leases = dict(lease_s=20.0, ready_timeout_s=30.0)  # the decode's fence: far beyond the test
    p_transport = HoldsNotices("P-agent", hub)
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(
            dict(engine_id="P", port=0, streaming={"min_tokens": 0, "min_bytes": 0}, **leases)
        ),
        src.layout,
        transport=p_transport,
    )
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", **leases)),
        dst.layout,
        transport=MemoryTransport("D-agent", hub),
    )
    p.start()
    d.start()
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    yield p_transport, src, dst, p, d, addr
    d.close()
    p.close()


def test_failure_notice_after_an_aborted_stream_reaches_the_decode(pair):
    p_transport, src, _dst, p, d, addr = pair
    n, pb, db = 32, list(range(1, 9)), list(range(10, 18))
    fill(src.to_host(), src.layout, pb, n, 1)
    d.expect("a", db, n, addr)
    until(lambda: [1] if len(p._push.state) else [])  # registered
    p.kv_ready("a", pb[:4], 16)  # a range moves without a notification
    until(lambda: [1] if p.stats()["writes"] else [])
    p.abort("a", "client went away")  # the failure notice goes alone...
    p.prefill_done("a", pb, n)  # ...and then nothing is live on the prefill
    [sent] = until(p.finished)
    assert not sent.ok and tuple(sent.block_ids) == tuple(pb)
    [got] = until(d.finished, timeout=5.0)
    assert not got.ok and got.failure is Failure.ABORTED and "client went away" in got.reason
    assert tuple(got.block_ids) == tuple(db) and d.pending() == 0
    assert p_transport.delivered == 1 and not p_transport.outbox


def test_done_notice_sent_alone_reaches_the_decode(pair):
    p_transport, src, dst, p, d, addr = pair
    n, pb, db = 32, list(range(1, 9)), list(range(10, 18))
    fill(src.to_host(), src.layout, pb, n, 2)
    d.expect("b", db, n, addr)
    until(lambda: [1] if len(p._push.state) else [])
    p.kv_ready("b", pb, n)  # every token: the only WRITE carries no notification
    until(lambda: [1] if p.stats()["writes"] and not p._push.scheduler.writes else [])
    p.prefill_done("b", pb, n)  # every range landed: the done notice goes alone
    [sent] = until(p.finished)
    assert sent.ok and p.stats()["writes"] == 1
    [got] = until(d.finished, timeout=5.0)
    assert got.ok and count_wrong_bytes(dst.to_host(), dst.layout, db, n, 2) == 0
    assert p_transport.delivered == 1 and not p_transport.outbox


def test_owed_progress_keeps_the_tick_cadence_while_nothing_is_tracked(pair):
    p_transport, _src, _dst, p, _d, _addr = pair
    push, idle = p._push, p._push.config.pacing.idle_poll_s
    assert p._loop.call(push.idle_wait_ms, 5.0) == int(idle * 5000)  # nothing tracked, nothing owed
    # a notice that will not leave within the test, queued on the push thread (the outbox's one user)
    p._loop.call(lambda: p_transport.outbox.append((time.monotonic() + 60, "D-agent", b"")), 5.0)
    assert p._loop.call(push.idle_wait_ms, 5.0) == int(idle * 1000)


class _Agent:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.sent.append((peer, msg))


def test_nixl_transport_owes_progress_for_a_bounded_window_after_a_notification():
    t = NixlTransport.__new__(NixlTransport)  # only the agent: no NIXL needed
    t._agent = _Agent()
    assert not t.progress_owed(time.monotonic())
    t.send_notif("d0", b"notice")
    sent = time.monotonic()
    assert t._agent.sent == [("d0", b"notice")]
    assert t.progress_owed(sent) and t.progress_owed(sent + NOTIF_PROGRESS_S - 0.5)
    assert not t.progress_owed(sent + NOTIF_PROGRESS_S)
