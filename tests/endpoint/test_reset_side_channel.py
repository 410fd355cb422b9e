"""Issue 16 finding 3: a closed side channel is a hint, never proof of death. A relay between decode and
prefill (a middlebox, conntrack) resets the connection while a slow WRITE is in flight: the decode keeps
the blocks until the WRITE can no longer land, and the pair recovers."""

from __future__ import annotations

import time

import numpy as np

from kvpush.apps.soak.relay import Relay
from kvpush.endpoint import PrefillAddress
from kvpush.transport.memory import MemoryHub
from tests.endpoint.test_hardening import caches, push_ok, start_decode, start_prefill, wait

SENTINEL = 0xAB


def test_a_reset_side_channel_never_lets_a_write_land_in_reused_blocks():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, write_timeout_s=2.0)
    relay = Relay(p.address[1])
    d = start_decode(hub, dst, write_timeout_s=2.0)
    try:
        addr = PrefillAddress("P", "127.0.0.1", relay.port, 1)
        d.connect(addr)
        hub.hold_writes = True  # a slow WRITE: in flight until released
        t0 = time.monotonic()
        d.expect("slow", [1, 2], 8, addr)
        time.sleep(0.1)
        p.prefill_done("slow", [3, 4], 8)
        while not hub.held:
            assert time.monotonic() - t0 < 5, "the WRITE was never posted"
            time.sleep(0.005)
        relay.blackhole = True  # the middlebox drops the flow: RST now, nothing gets through for a while
        relay.reset()  # the decode's side-channel connection closes; the prefill lives and holds the WRITE
        handed_back_at = released_at = None
        while handed_back_at is None or released_at is None:
            now = time.monotonic()
            assert now - t0 < 15, "the decode never handed the blocks back"
            if released_at is None and now - t0 >= 1.8:  # within the WRITE bound (write_timeout_s 2.0)
                hub.hold_writes = False
                hub.release_held()
                released_at = now
            if d.finished():  # the engine reuses the blocks at once: another request's bytes go in
                handed_back_at = time.monotonic()
                dst.buffer[:] = SENTINEL
            time.sleep(0.005)
        time.sleep(0.3)
        assert np.all(dst.buffer == SENTINEL), "a WRITE landed in blocks the decode had handed back"
        assert handed_back_at >= released_at, (handed_back_at - t0, released_at - t0)
        relay.heal()
        wait(p)  # the prefill's result for "slow", whatever it is
        d.connect(addr, timeout=10)  # a fresh handshake through the healed relay
        rp, rd = push_ok(p, d, addr, "after-reset")  # the pair recovers through the relay
        assert rp.ok and rd.ok, (rp, rd)
    finally:
        hub.hold_writes = False
        hub.release_held()
        d.close()
        p.close()
        relay.close()


def test_a_reset_alone_ends_nothing_the_write_in_flight_still_completes_the_request():
    """The same decode process handshakes again at once; the prefill moves its registrations to the new
    connection, and the notification sealed under the old session still opens (keyed: the session
    matters)."""
    hub = MemoryHub()
    src, dst = caches()
    key = b"a-shared-secret-of-32-bytes-long"
    p = start_prefill(hub, src, write_timeout_s=2.0, hmac_key=key)
    relay = Relay(p.address[1])
    d = start_decode(hub, dst, write_timeout_s=2.0, hmac_key=key)
    try:
        addr = PrefillAddress("P", "127.0.0.1", relay.port, 1)
        d.connect(addr)
        hub.hold_writes = True
        d.expect("through-reset", [1, 2], 8, addr)
        time.sleep(0.1)
        p.prefill_done("through-reset", [3, 4], 8)
        t0 = time.monotonic()
        while not hub.held:
            assert time.monotonic() - t0 < 5, "the WRITE was never posted"
            time.sleep(0.005)
        relay.reset()
        time.sleep(0.3)  # the decode noticed, handshook again through the relay
        hub.hold_writes = False
        hub.release_held()
        rd, rp = wait(d)[0], wait(p)[0]
        assert rd.ok and rp.ok, (rd, rp)
        assert d.stats()["peers_gone"] == 0 and p.stats()["peers_gone"] == 0
        rp, rd = push_ok(p, d, addr, "after")
        assert rp.ok and rd.ok, (rp, rd)
    finally:
        hub.hold_writes = False
        hub.release_held()
        d.close()
        p.close()
        relay.close()
