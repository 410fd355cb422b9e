"""Issue 12's findings, end to end over the in-memory transport and a real ZeroMQ side channel: hostile
frames, hijacking, one-sided keys, restarts, dead peers, slow WRITEs, floods and limits."""

from __future__ import annotations

import threading
import time
import urllib.request

import msgspec
import numpy as np
import pytest
import zmq

from kvpush.apps.ports import free_port_range
from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, MemoryControl, PrefillAddress, PrefillEndpoint
from kvpush.endpoint.control import ZmqControl
from kvpush.errors import ConfigError, PeerGone, PeerRefused
from kvpush.protocol.handshake import hello_frame
from kvpush.protocol.layout import KVLayout
from kvpush.protocol.wire import PLAIN, Abort, Codec, Registration
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.util import until

GEO = dict(num_layers=2, total_kv_heads=2, head_dim=8, dtype_size=2)
enc = msgspec.msgpack.Encoder().encode
DEEP = b"\x83" + enc("kind") + enc("reg") + enc("v") + enc(2) + enc("x") + b"\x91" * 1000 + b"\xc0"
FAST = dict(lease_s=2.0, ready_timeout_s=3.0, ping_interval_s=0.1, peer_timeout_s=0.6, write_linger_s=0.2)


def caches():
    src = HostKVCache(KVLayout(block_size=4, num_blocks=32, **GEO))
    dst = HostKVCache(KVLayout(block_size=4, num_blocks=32, **GEO))
    src.buffer[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    return src, dst


def start_prefill(hub, src, name="P-agent", port=0, **cfg):
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=port, **{**FAST, **cfg})),
        src.layout,
        transport=MemoryTransport(name, hub),
    )
    p.start()
    return p


def start_decode(hub, dst, name="D-agent", engine="D", control=None, **cfg):
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id=engine, **{**FAST, **cfg})),
        dst.layout,
        transport=MemoryTransport(name, hub),
        control=control,
    )
    d.start()
    return d


def wait(ep, timeout=8.0):
    return until(ep.finished, timeout)


def push_ok(p, d, addr, rid, blocks=(1, 2)):
    d.expect(rid, list(blocks), 8, addr)
    p.prefill_done(rid, [3, 4], 8)
    got_p, got_d = wait(p), wait(d)
    return got_p[0], got_d[0]


@pytest.fixture
def world():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src)
    d = start_decode(hub, dst)
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    yield hub, src, dst, p, d, addr
    d.close()
    p.close()


def dealer(port):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def test_a_deeply_nested_frame_on_the_side_channel_and_as_a_notification_kills_nothing(world):
    hub, src, dst, p, d, addr = world
    sock = dealer(addr.port)
    for frame in (DEEP, bytes([PLAIN]) + DEEP, b"\x02" + DEEP + b"\0" * 40):
        sock.send(frame)
    assert sock.poll(5000)
    hub.agents["D-agent"].inbox.append(("P-agent", bytes([PLAIN]) + DEEP))  # as a NIXL notification
    hub.agents["D-agent"].inbox.append(("P-agent", DEEP))
    time.sleep(0.2)
    rp, rd = push_ok(p, d, addr, "after-bomb")
    assert rp.ok and rd.ok, (rp, rd)
    assert p.stats()["wire_errors"] >= 3 and d.stats()["wire_errors"] >= 2
    sock.close()


def test_a_third_process_cannot_hijack_register_or_abort_for_a_live_decode(world):
    hub, src, dst, p, d, addr = world
    MemoryTransport("evil-agent", hub)
    sock = dealer(addr.port)
    codec = Codec()
    # an abort and a registration without a hello: refused, nothing happens to the live request
    d.expect("victim", [1, 2], 8, addr)
    time.sleep(0.1)
    abort = Abort(request_id="victim", attempt=0, decode_engine_id="D", decode_rank=0, reason="evil")
    sock.send(bytes([PLAIN]) + codec.encode(abort))
    assert sock.poll(3000) and b"hello_first" in sock.recv()
    # a hello reusing the victim's engine id with another agent: refused while the victim lives
    evil = p._push.hello  # any valid layout; the role and identity are what matter
    from kvpush.protocol.handshake import make_hello

    forged = make_hello(
        "D", "decode", "evil-agent", b"evil-agent", "DRAM", dst.layout, nonce=b"n" * 16, clock=1.0
    )
    sock.send(hello_frame(codec, forged, None))
    assert sock.poll(3000)
    reply = sock.recv()
    assert b"identity_in_use" in reply, reply
    reg = Registration(
        request_id="victim",
        attempt=5,
        decode_engine_id="D",
        decode_rank=0,
        decode_tp=1,
        block_ids=[9, 10],
        num_tokens=8,
        expires_at=1e9,
    )
    sock.send(bytes([PLAIN]) + codec.encode(reg))
    assert sock.poll(3000) and b"hello_first" in sock.recv()
    p.prefill_done("victim", [3, 4], 8)
    rp, rd = wait(p)[0], wait(d)[0]
    assert rp.ok and rd.ok and rd.block_ids == (1, 2)
    assert hub.agents["evil-agent"].inbox == []  # nothing was ever sent towards the attacker
    assert p.stats()["refused"] >= 1
    del evil
    sock.close()


def test_keys_one_sided_short_or_missing_beyond_loopback_are_refused_with_a_reason():
    with pytest.raises(ConfigError, match="at least 16"):
        KVPushConfig.from_mapping(dict(hmac_key=b""))
    with pytest.raises(ConfigError, match="at least 16"):
        KVPushConfig.from_mapping(dict(hmac_key=b"short"))
    with pytest.raises(ConfigError, match="beyond loopback"):
        KVPushConfig.from_mapping(dict(host="10.0.0.5")).check_listen()
    KVPushConfig.from_mapping(dict(engine_id="p0", host="10.0.0.5", require_auth=False)).check_listen()
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, hmac_key=b"k" * 32)
    d = start_decode(hub, dst)
    try:
        with pytest.raises(PeerRefused, match="hmac_key"):
            d.connect(PrefillAddress("P", *p.address), timeout=5)
    finally:
        d.close()
        p.close()


def test_with_the_same_key_on_both_sides_pushes_work():
    hub = MemoryHub()
    src, dst = caches()
    key = b"a-shared-secret-of-32-bytes-long"
    p = start_prefill(hub, src, hmac_key=key)
    d = start_decode(hub, dst, hmac_key=key)
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        rp, rd = push_ok(p, d, addr, "keyed")
        assert rp.ok and rd.ok
    finally:
        d.close()
        p.close()


def test_a_prefill_restarted_on_the_same_address_is_rehandshaken_and_the_next_request_works(world):
    hub, src, dst, p, d, addr = world
    assert push_ok(p, d, addr, "before")[1].ok
    p.close()
    p2 = start_prefill(hub, src, name="P-agent-2", port=addr.port)
    try:
        # right after the restart: held until the new instance answers the decode's fresh Hello, then
        # served by it (issue 16 finding 6; it used to fail, its registration sent to the dead instance)
        d.expect("during", [1, 2], 8, addr)
        p2.prefill_done("during", [3, 4], 8)
        got = wait(d)[0]
        assert got.ok and wait(p2)[0].ok, got
        rp, rd = push_ok(p2, d, addr, "after")
        assert rp.ok and rd.ok, (rp, rd)
    finally:
        p2.close()


def test_a_dead_prefill_fails_the_decodes_requests_within_seconds(world):
    hub, src, dst, p, d, addr = world
    d.expect("orphan", [1, 2], 8, addr)
    time.sleep(0.1)
    t0 = time.monotonic()
    p.close()
    got = wait(d, timeout=5)[0]
    assert not got.ok and time.monotonic() - t0 < 3.0
    assert "gone" in got.reason or "silent" in got.reason, got.reason


class _RefusingTransport(MemoryTransport):
    """A decode agent whose notifications a frozen prefill's agent refuses (as NIXL's does)."""

    refuse = False

    def send_notif(self, peer, msg):
        if self.refuse:
            raise PeerGone(f"peer {peer} does not answer (frozen)")
        super().send_notif(peer, msg)


def test_a_frozen_prefill_keeps_the_decodes_blocks_until_the_fence():
    # kvpush soak: a SIGSTOPped prefill refuses NIXL notifications, which counted as proof of death; its
    # requests' blocks came back after peer_timeout_s + linger and its WRITE landed in them on SIGCONT.
    # Frozen here: its worker thread is stuck, its side-channel connection stays open.
    hub = MemoryHub()
    src, dst = caches()
    fast = dict(lease_s=1.0, ready_timeout_s=1.5, write_timeout_s=0.3, write_linger_s=0.2)
    p = start_prefill(hub, src, **fast)
    transport = _RefusingTransport("D-agent", hub)
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", **{**FAST, **fast})), dst.layout, transport=transport
    )
    d.start()
    thaw = threading.Event()
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        p._loop.submit(lambda: thaw.wait(30))  # the prefill freezes: it answers nothing from here on
        transport.refuse = True
        t0 = time.monotonic()
        d.expect("frozen", [1, 2], 8, addr)
        got = wait(d, timeout=10)[0]
        elapsed = time.monotonic() - t0
        assert not got.ok and "silent" in got.reason, got.reason
        # not after peer_timeout_s + linger (0.8 s): at the fence, expiry + write_timeout_s + write_linger_s
        assert elapsed >= 1.5 + 0.3 + 0.2 - 0.05, (elapsed, got.reason)
    finally:
        thaw.set()
        d.close()
        p.close()


def test_the_control_planes_tell_a_closed_peer_from_a_silent_one():
    for plane in (MemoryControl(), ZmqControl()):
        listener = plane.listen("127.0.0.1", 0, 1 << 16)
        never = plane.connect(
            "127.0.0.1", listener.port + 1 if isinstance(plane, MemoryControl) else 1, 1 << 16
        )
        chan = plane.connect("127.0.0.1", listener.port, 1 << 16)
        try:
            chan.send(b"hello")
            deadline = time.monotonic() + 5
            while listener.recv() is None:  # connected: the listener has our message
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(0.1)
            assert not chan.peer_closed()  # connected, unanswered: silence is not a close
            never.send(b"x")
            assert not never.peer_closed()  # a peer never reached proves nothing
            listener.close()
            while not chan.peer_closed():
                assert time.monotonic() < deadline, plane
                time.sleep(0.005)
            assert chan.peer_closed()  # and it stays so
        finally:
            chan.close()
            never.close()


def test_a_stuck_write_is_abandoned_and_the_decode_keeps_its_blocks_until_the_fence():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, write_timeout_s=0.3)
    d = start_decode(hub, dst, write_timeout_s=0.3)
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        hub.hold_writes = True  # the WRITE never completes (a frozen decode, a stalled link)
        t0 = time.monotonic()
        d.expect("stuck", [1, 2], 8, addr)
        p.prefill_done("stuck", [3, 4], 8)
        rp = wait(p)[0]
        assert not rp.ok and "abandoned" in rp.reason and time.monotonic() - t0 < 2.0  # source freed
        rd = wait(d, timeout=10)[0]
        assert not rd.ok
        # not before the registration's expiry plus the WRITE bound
        assert time.monotonic() - t0 >= 3.0 + 0.3 + 0.2 - 0.1
    finally:
        hub.hold_writes = False
        d.close()
        p.close()


def test_registrations_are_checked_against_the_handshake_and_per_peer_limits(world):
    hub, src, dst, p, d, addr = world
    p.close()
    p2 = start_prefill(hub, src, name="P-agent-3", port=addr.port, max_pending_per_peer=2)
    d.close()
    d2 = start_decode(hub, dst, name="D-agent-2")
    try:
        d2.connect(addr)
        for i in range(3):
            d2.expect(f"r{i}", [1 + i], 4, addr)
        got = wait(d2)
        assert any(not r.ok and "too many pending" in r.reason for r in got), got
        assert p2.stats()["refused"] >= 1
    finally:
        d2.close()
        p2.close()


def test_prometheus_endpoint_serves_the_metrics_the_code_updates():
    hub = MemoryHub()
    src, dst = caches()
    # outside the ephemeral range: a port the OS handed out (and took back) can be any outgoing
    # connection's local port a moment later (CI: "Address already in use" on 37757)
    port = free_port_range(1)
    p = start_prefill(hub, src, metrics_port=port)
    try:
        s = dealer(p.address[1])
        s.send(b"\xc1junk")
        assert s.poll(3000)
        s.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'kvpush_wire_errors_total{engine_id="P",rank="0",role="prefill"}' in body
        for name in (
            "kvpush_peers",
            "kvpush_in_flight_bytes",
            "kvpush_failures_total",
            "kvpush_expired_total",
        ):
            assert name in body
    finally:
        p.close()


def test_a_decode_frozen_past_peer_timeout_fails_what_it_sent_by_name_then_pushes_again():
    # A starved decode (its thread stuck past peer_timeout_s) is dropped by the prefill, which then refuses
    # what that connection sends ("hello_first"). The registration sent right after the thaw used to be
    # lost: the decode re-handshook but waited for it until ready_timeout_s and the prefill held its blocks
    # until lease expiry. Now it fails at once by name on both sides, and the next request pushes (keyed:
    # the new session is proven again).
    hub = MemoryHub()
    src, dst = caches()
    key = b"a-shared-secret-of-32-bytes-long"
    p = start_prefill(hub, src, hmac_key=key, lease_s=30.0, ready_timeout_s=40.0)
    d = start_decode(hub, dst, hmac_key=key, lease_s=30.0, ready_timeout_s=40.0)
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        assert push_ok(p, d, addr, "before")[1].ok
        thaw = threading.Event()
        d._loop.submit(lambda: thaw.wait(30))  # the decode's thread freezes: silent to the prefill
        time.sleep(1.5)  # > peer_timeout_s 0.6: the prefill drops it
        thaw.set()
        t0 = time.monotonic()
        got_p, got_d = push_ok(p, d, addr, "right-after")  # sent on the connection the prefill dropped
        assert not got_d.ok and "no longer knows" in got_d.reason, got_d
        assert not got_p.ok, got_p  # freed by the decode's Abort, not at lease expiry
        assert time.monotonic() - t0 < 10.0
        rp, rd = push_ok(p, d, addr, "next")
        assert rp.ok and rd.ok, (rp, rd)
    finally:
        d.close()
        p.close()
