"""The prefill's data-plane peer table (endpoint/peers.py): a decode rank's prepared descriptor lists are
released when its peer is pruned (the decode went silent and nothing writes to it any more) and when the
endpoint closes; before, pruning removed the NIXL peer and left its prepared lists held (issue 40)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.endpoint.peers import DecodePeers
from kvpush.endpoint.stats import Ledger
from kvpush.errors import PeerGone
from kvpush.protocol.handshake import Session
from kvpush.protocol.layout import KVLayout
from kvpush.protocol.wire import Codec
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


def _peers() -> tuple[DecodePeers, CountingTransport, KVLayout, Session]:
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    dst = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    _CACHES[:] = [src, dst]
    pt = CountingTransport("P-agent", hub)
    pt.register(src.layout.regions, "DRAM")
    for name in ("D-old", "D-new"):
        MemoryTransport(name, hub).register(dst.layout.regions, "DRAM")
        pt.add_peer(name.encode())
    peers = DecodePeers(src.layout, "DRAM", pt, Ledger("prefill", "P", 0))
    session = Session(Codec(1 << 20), None, b"d" * 16, b"p" * 16, "prefill")
    return peers, pt, dst.layout, session


def test_route_names_the_missing_peer_or_session():
    peers, _pt, d_layout, session = _peers()
    with pytest.raises(PeerGone, match="no handshake with decode 'D' rank 0"):
        peers.route(("D", 0))
    peers.bind(("D", 0), "D-old", d_layout, session)
    assert peers.route(("D", 0))[1] is session
    peers.unbind(("D", 0))
    with pytest.raises(PeerGone, match="no live session with decode 'D' rank 0"):
        peers.route(("D", 0))


def test_a_replaced_peer_keeps_its_lists_while_written_to_then_releases_them():
    peers, pt, d_layout, session = _peers()
    peers.bind(("D", 0), "D-old", d_layout, session)
    old = peers.get(("D", 0))
    assert old is not None and pt.made == 2
    peers.bind(("D", 0), "D-old", d_layout, session)  # a reconnect of the same agent keeps its lists
    assert peers.get(("D", 0)) is old and pt.made == 2
    peers.bind(("D", 0), "D-new", d_layout, session)  # a new agent: new lists, the old ones retired
    assert pt.made == 4 and pt.freed == 0
    writing = True
    peers.prune({("D", 0)}, lambda e, r: writing, set())
    assert pt.freed == 0  # a WRITE queued for the old agent may still index them
    writing = False
    peers.prune({("D", 0)}, lambda e, r: writing, set())
    assert pt.freed == 2 and pt.removed == ["D-old"] and pt.live_prepared == 2
    peers.prune(set(), lambda e, r: False, set())  # unbound and idle: the peer goes, with its lists
    assert pt.freed == 4 and pt.live_prepared == 0 and len(peers) == 0


def test_source_blocks_never_finished_leave_nothing_on_the_engine_side():
    """source_blocks for a request whose prefill_done never comes: its checked table is dropped with the
    request when the lease ends (it was bounded only by a bulk clear at 4,096 entries before)."""
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    _CACHES[:] = [src]
    cfg = KVPushConfig.from_mapping(dict(engine_id="P", port=0, lease_s=0.5, ready_timeout_s=1.0))
    p = PrefillEndpoint(cfg, src.layout, transport=MemoryTransport("P-agent", hub))
    p.start()
    try:
        p.source_blocks("never", [1, 2], 8)
        assert p.kept_state()["engine_sourced"] == 1
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(p.kept_state().values()):
            time.sleep(0.05)
        assert not any(p.kept_state().values()), p.kept_state()
    finally:
        p.close()
