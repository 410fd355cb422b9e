"""expect() twice for one request id: the second attempt supersedes the first (docs/contract.md). Issue 21:
the first attempt's Abort reached the prefill before the second registration, ended the whole request
there, and both attempts failed."""

from __future__ import annotations

import time

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout
from kvpush.protocol.reasons import Failure
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.util import until

GEO = dict(num_layers=1, total_kv_heads=1, head_dim=8, dtype_size=2, block_size=4, num_blocks=32)


def test_a_second_expect_supersedes_the_first_and_is_written():
    hub = MemoryHub()
    src, dst = HostKVCache(KVLayout(**GEO)), HostKVCache(KVLayout(**GEO))
    src.buffer[:] = 7
    cfg = dict(lease_s=5.0, ready_timeout_s=6.0)
    p = PrefillEndpoint(
        KVPushConfig(engine_id="P", port=0, **cfg), src.layout, transport=MemoryTransport("P-a", hub)
    )
    d = DecodeEndpoint(KVPushConfig(engine_id="D", **cfg), dst.layout, transport=MemoryTransport("D-a", hub))
    p.start()
    d.start()
    try:
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        d.expect("r", [1, 2], 8, addr)
        d.expect("r", [3, 4], 8, addr)
        time.sleep(0.2)  # both registrations reach the prefill before its KV is done (see contract.md)
        p.prefill_done("r", [5, 6], 8)
        got = until(d.finished)
        while len(got) < 2:
            got += until(d.finished)
        first, second = sorted(got, key=lambda r: r.block_ids)
        assert (first.ok, first.failure) == (False, Failure.SUPERSEDED)
        assert second.ok and second.block_ids == (3, 4), second
        assert until(p.finished)[0].ok
        assert all(dst.block_view(0, 0, b).min() == 7 for b in (3, 4))
    finally:
        d.close()
        p.close()
