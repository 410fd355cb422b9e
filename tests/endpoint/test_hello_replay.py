"""Found by `kvpush soak`: with a shared key, a captured Hello replayed on another connection bound the
victim decode's identity to the replayer once the victim looked gone (frozen or restarting), so the
prefill answered the replayer with a Hello and refused the victim's own next Hello (identity_in_use)
until the replayer's connection went silent. A Hello now binds an identity only once its connection's
first sealed message opens, which needs the key and that connection's fresh nonces."""

from __future__ import annotations

import time

from kvpush.apps.soak import FrameTapControl
from kvpush.endpoint import PrefillAddress
from kvpush.endpoint.control import ZmqControl
from kvpush.protocol.wire import HELLO_MAC
from kvpush.transport.memory import MemoryHub

from .test_hardening import caches, dealer, push_ok, start_decode, start_prefill, wait

KEY = b"a-shared-secret-of-32-bytes-long"


def test_a_replayed_hello_binds_nothing_and_the_victim_handshakes_at_once_after_a_prefill_restart():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, hmac_key=KEY)
    tap = FrameTapControl(ZmqControl())
    d = start_decode(hub, dst, hmac_key=KEY, control=tap)
    addr = PrefillAddress("P", *p.address)
    p2 = None
    try:
        d.connect(addr)
        assert push_ok(p, d, addr, "before")[1].ok
        captured = [f for f in tap.captured() if f[:1] == bytes([HELLO_MAC])]
        assert captured, "the decode's Hello was not captured"
        p.close()  # the prefill restarts on the same port; nothing is bound on the new one yet
        p2 = start_prefill(hub, src, name="P-agent-2", port=addr.port, hmac_key=KEY)
        sock = dealer(addr.port)
        sock.send(captured[-1])  # the victim's Hello, replayed on the attacker's own connection first
        assert sock.poll(2000)
        sock.recv()  # answered or not, the replayer cannot use a session without the key
        t0 = time.monotonic()
        # right after the restart: held until the new instance answers the decode's fresh Hello, then
        # served by it (issue 16 finding 6; it used to fail, sent to the dead instance)
        d.expect("during", [1, 2], 8, addr)
        p2.prefill_done("during", [3, 4], 8)
        assert wait(d)[0].ok and wait(p2)[0].ok
        rp, rd = push_ok(p2, d, addr, "after")
        assert rp.ok and rd.ok, (rp, rd)
        # before the fix the replay had bound the identity: the victim's Hello was refused
        # (identity_in_use) until the replayer's connection went silent
        assert p2.stats()["refused"] == 0, p2.stats()
        assert time.monotonic() - t0 < 2.0
        sock.close()
    finally:
        d.close()
        if p2 is not None:
            p2.close()
