"""The prefill's data-plane peer table (endpoint/peers.py): a decode rank's prepared descriptor lists are
released when its peer is pruned (the decode went silent and nothing writes to it any more) and when the
endpoint closes; before, pruning removed the NIXL peer and left its prepared lists held (issue 40)."""

from __future__ import annotations

import time

import numpy as np

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.util import until

GEO = dict(num_layers=2, total_kv_heads=2, head_dim=8, dtype_size=2)
FAST = dict(lease_s=2.0, ready_timeout_s=3.0, ping_interval_s=0.1, peer_timeout_s=0.6)


class CountingTransport(MemoryTransport):
    """Counts the prepared lists made and released through the Transport contract."""

    def __init__(self, name: str, hub: MemoryHub) -> None:
        super().__init__(name, hub)
        self.made = 0
        self.freed = 0
        self.removed: list[str] = []

    def prepare(self, peer, rows, mem_type):  # type: ignore[no-untyped-def]
        got = super().prepare(peer, rows, mem_type)
        self.made += 1
        return got

    def release_prepared(self, plist) -> None:  # type: ignore[no-untyped-def]
        super().release_prepared(plist)
        self.freed += 1

    def remove_peer(self, peer: str) -> None:
        super().remove_peer(peer)
        self.removed.append(peer)


_CACHES: list[HostKVCache] = []  # the registered memory stays alive while an endpoint may copy into it


def _pair() -> tuple[PrefillEndpoint, DecodeEndpoint, CountingTransport, PrefillAddress]:
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    dst = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    _CACHES[:] = [src, dst]
    src.buffer[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    pt = CountingTransport("P-agent", hub)
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, **FAST)), src.layout, transport=pt
    )
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", **FAST)),
        dst.layout,
        transport=MemoryTransport("D-agent", hub),
    )
    p.start()
    d.start()
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    return p, d, pt, addr


def _push_one(p: PrefillEndpoint, d: DecodeEndpoint, addr: PrefillAddress) -> None:
    d.expect("r", [1, 2], 8, addr)
    p.prefill_done("r", [3, 4], 8)
    [got] = until(d.finished)
    [sent] = until(p.finished)
    assert got.ok and sent.ok


def test_a_pruned_decode_peer_releases_its_prepared_lists():
    p, d, pt, _addr = _pair()
    try:
        _push_one(p, d, _addr)
        assert pt.made == 2 and pt.freed == 0  # one local and one remote list, made at handshake
        assert pt.live_prepared == 2
        d.close()  # the decode goes silent: dropped after peer_timeout_s, then pruned
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not pt.removed:
            time.sleep(0.02)
        assert pt.removed == ["D-agent"]
        assert pt.freed == 2 and pt.live_prepared == 0, (pt.made, pt.freed)
        assert not p._push.peers.values()
    finally:
        d.close()
        p.close()


def test_closing_the_prefill_releases_every_prepared_list():
    p, d, pt, addr = _pair()
    try:
        _push_one(p, d, addr)
        assert pt.made == 2 and pt.freed == 0
    finally:
        d.close()
        p.close()
    assert pt.freed == 2 and pt.live_prepared == 0
