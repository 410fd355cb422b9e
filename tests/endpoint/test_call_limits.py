"""Engine calls the wire could not carry fail at once, by name, before anything is sent (issue 16, finding 1:
a 600-character request id used to be accepted by expect() and hang to the ready timeout)."""

from __future__ import annotations

import pytest

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.errors import LayoutError, RequestError
from kvpush.protocol.layout import KVLayout
from kvpush.transport.memory import MemoryHub, MemoryTransport

GEO = dict(num_layers=1, total_kv_heads=1, head_dim=8, dtype_size=2, block_size=1, num_blocks=300_000)


@pytest.fixture
def pair():
    hub = MemoryHub()
    cache = HostKVCache(KVLayout(**GEO))
    layout = cache.layout
    p = PrefillEndpoint(KVPushConfig(engine_id="P", port=0), layout, transport=MemoryTransport("P-a", hub))
    d = DecodeEndpoint(
        KVPushConfig(engine_id="D", max_message_bytes=1 << 16), layout, transport=MemoryTransport("D-a", hub)
    )
    p.start()
    d.start()
    yield p, d, PrefillAddress("P", *p.address)
    d.close()
    p.close()
    del cache


def test_a_request_id_longer_than_the_wire_carries_is_refused_by_both_calls(pair):
    p, d, addr = pair
    rid = "x" * 600
    with pytest.raises(RequestError, match="600 characters; the wire carries 1..512"):
        d.expect(rid, [1, 2], 2, addr)
    with pytest.raises(RequestError, match="600 characters"):
        p.prefill_done(rid, [1, 2], 2)
    assert d.pending() == 0 and p.pending() == 0


def test_a_registration_over_max_message_bytes_is_refused_naming_the_setting(pair):
    _p, d, addr = pair
    n = 20_000  # ids >= 2^16 are 5 bytes on the wire: ~100 KB, over the decode's 64 KiB limit
    with pytest.raises(RequestError, match="over max_message_bytes 65536"):
        d.expect("big", list(range(70_000, 70_000 + n)), n, addr)
    d.expect("fits", list(range(1000)), 1000, addr)  # a smaller table still goes
    assert d.pending() == 1


def test_kv_ready_refuses_bad_ranges_at_once(pair):
    p, _d, _addr = pair
    with pytest.raises(LayoutError, match=r"layers \(0, 2\) outside 0..1"):
        p.kv_ready("s", [1, 2], 2, layers=(0, 2))
    with pytest.raises(LayoutError, match="cannot hold"):
        p.kv_ready("s", [1], 2)
    with pytest.raises(RequestError, match="600 characters"):
        p.kv_ready("x" * 600, [1, 2], 2)
    assert p.pending() == 0
