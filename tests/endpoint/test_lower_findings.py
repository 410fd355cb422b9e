"""Issue 16 finding 6: the source comes back only once an abandoned WRITE can no longer read it, and a
prefill restarted on the same address serves the first batch sent right after the restart."""

from __future__ import annotations

import time

from kvpush.endpoint import PrefillAddress
from kvpush.transport.memory import MemoryHub
from tests.endpoint.test_hardening import caches, push_ok, start_decode, start_prefill, wait


def test_an_abandoned_writes_source_comes_back_only_after_the_linger():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, write_timeout_s=0.3, write_linger_s=0.6)
    d = start_decode(hub, dst, write_timeout_s=0.3, write_linger_s=0.6)
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        hub.hold_writes = True  # posted and never complete: abandoned at write_timeout_s
        d.expect("stuck", [1, 2], 8, addr)
        time.sleep(0.1)
        t0 = time.monotonic()
        p.prefill_done("stuck", [3, 4], 8)
        rp = wait(p)[0]
        # not at the abandonment (0.3 s) but once the WRITE's bytes can no longer be read (+0.6 s)
        assert not rp.ok and "abandoned" in rp.reason
        assert time.monotonic() - t0 >= 0.3 + 0.6 - 0.05, time.monotonic() - t0
        assert time.monotonic() - t0 < 3.0
        hub.hold_writes = False
        hub.release_held()
        wait(d, timeout=10)
        rp, rd = push_ok(p, d, addr, "next")
        assert rp.ok and rd.ok
    finally:
        hub.hold_writes = False
        hub.release_held()
        d.close()
        p.close()


def test_a_restarted_prefill_serves_the_first_batch_sent_right_after_the_restart():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src)
    d = start_decode(hub, dst)
    addr = PrefillAddress("P", *p.address)
    p2 = None
    try:
        d.connect(addr)
        assert push_ok(p, d, addr, "before")[1].ok
        d.expect("orphan", [20, 21], 8, addr)  # registered with the old process, which dies with it
        time.sleep(0.2)
        p.close()
        p2 = start_prefill(hub, src, name="P-agent-2", port=addr.port)
        for i in range(4):  # at once: the decode has not heard from the new process yet
            d.expect(f"first-{i}", [1 + 2 * i, 2 + 2 * i], 8, addr)
            p2.prefill_done(f"first-{i}", [3, 4], 8)
        got = []
        while len(got) < 5:
            got += wait(d)
        orphan = [r for r in got if r.request_id == "orphan"]
        assert len(orphan) == 1 and not orphan[0].ok and "restarted" in orphan[0].reason, orphan
        first = [r for r in got if r.request_id != "orphan"]
        assert all(r.ok for r in first), [(r.request_id, r.reason) for r in first]
        assert len(wait(p2)) >= 1
    finally:
        if p2 is not None:
            p2.close()
        d.close()
