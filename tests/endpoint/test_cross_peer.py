"""Issue 16 finding 2 as the soak plays it (kvpush/apps/soak/attacker.py): a key holder bound under its
own identity registers for, and aborts, another decode's live requests. The ownership rule lives in
protocol/sender.py and protocol/claims.py; this test failed (an expected failure) before it landed."""

from __future__ import annotations

import time

import zmq

from kvpush.apps.soak.attacker import Attacker
from kvpush.apps.soak.common import CROSS_MARK
from kvpush.apps.soak.tap import FrameTapControl
from kvpush.endpoint import PrefillAddress
from kvpush.endpoint.control import ZmqControl
from kvpush.transport.memory import MemoryHub
from tests.endpoint.test_hardening import caches, push_ok, start_decode, start_prefill, wait

KEY = b"a-shared-secret-of-32-bytes-long"


def test_a_key_holder_under_its_own_identity_cannot_touch_another_decodes_requests():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, hmac_key=KEY)
    tap = FrameTapControl(ZmqControl())
    d = start_decode(hub, dst, hmac_key=KEY, control=tap)
    ctx = zmq.Context()
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        assert push_ok(p, d, addr, "before")[1].ok
        d.expect("owned", [1, 2], 8, addr)
        d.expect("aborted", [3, 4], 8, addr)
        time.sleep(0.2)
        attacker = Attacker(ctx, addr.port, None, KEY)
        sent, _ = attacker.play_holder("cross_peer", [("owned", 8), ("aborted", 8)], [9, 10], tap.captured())
        assert sent > 1, "the key holder's hello was not answered"
        p.prefill_done("owned", [3, 4], 8)
        p.prefill_done("aborted", [5, 6], 8)
        got = {r.request_id: r for r in wait(d, timeout=10)}
        if len(got) < 2:
            got.update({r.request_id: r for r in wait(d, timeout=10)})
        assert CROSS_MARK not in got["aborted"].reason and got["aborted"].ok, got["aborted"]
        assert got["owned"].ok, got["owned"]  # its KV went to the owner, not into blocks 9 and 10
    finally:
        d.close()
        p.close()
        ctx.term()
