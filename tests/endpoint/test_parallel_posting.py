"""Parallel posting over the in-memory transport: posting workers, the in-flight budget, one FIFO queue
per destination, and exactly-once settlement, with WRITEs held in flight so the bound can be watched."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.errors import ConfigError
from kvpush.protocol.layout import KVLayout
from kvpush.transport.memory import MemoryHub, MemoryTransport

GEO = dict(num_layers=3, total_kv_heads=2, head_dim=8, dtype_size=2)
TOKENS = 8
REQ_BYTES = TOKENS * 2 * 8 * 2 * 3 * 2  # tokens x heads x head_dim x dtype x layers x (K, V)


class RecordingTransport(MemoryTransport):
    """Records, per destination agent, the first source unit index of every post (a request's id here)."""

    def __init__(self, name: str, hub: MemoryHub) -> None:
        super().__init__(name, hub)
        self.posts: list[tuple[str, int]] = []

    def post_prepared(self, local, local_idx, remote, remote_idx, notif):  # type: ignore[no-untyped-def]
        self.posts.append((remote.peer, int(local_idx[0])))
        return super().post_prepared(local, local_idx, remote, remote_idx, notif)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_budget_order_and_exactly_once_with_workers(workers):
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=64, **GEO))
    src.buffer[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    dsts = [HostKVCache(KVLayout(block_size=8, num_blocks=16, **GEO)) for _ in range(2)]
    pt = RecordingTransport("P-agent", hub)
    cfg = KVPushConfig.from_mapping(
        dict(
            engine_id="P",
            port=0,
            post_workers=workers,
            max_inflight_bytes=2 * REQ_BYTES,
            lease_s=5.0,
            ready_timeout_s=8.0,
        )
    )
    p = PrefillEndpoint(cfg, src.layout, transport=pt)
    ds = [
        DecodeEndpoint(
            KVPushConfig.from_mapping(dict(engine_id=f"D{i}", lease_s=5.0, ready_timeout_s=8.0)),
            c.layout,
            transport=MemoryTransport(f"D{i}-agent", hub),
        )
        for i, c in enumerate(dsts)
    ]
    try:
        p.start()
        for d in ds:
            d.start()
        addr = PrefillAddress("P", *p.address)
        for d in ds:
            d.connect(addr)
        hub.hold_writes = True
        reqs = []  # (rid, decode index, source blocks, destination blocks)
        for k in range(8):
            i = k % 2
            reqs.append((f"r{k}", i, [4 * k, 4 * k + 1], [k // 2]))
        for rid, i, _sb, db in reqs:
            ds[i].expect(rid, db, TOKENS, addr)
        time.sleep(0.1)  # registrations in: each prefill_done starts a WRITE at once
        for rid, _i, sb, _db in reqs:
            p.prefill_done(rid, sb, TOKENS)
        sent: dict[str, list] = {}
        ready: dict[str, list] = {}
        deadline = time.monotonic() + 20
        while len(ready) < len(reqs) and time.monotonic() < deadline:
            time.sleep(0.05)  # let the workers post what the budget allows
            with hub.lock:
                held = len(hub.held)
            assert held <= 2, f"{held} WRITEs in flight, budget is 2 requests' bytes"
            hub.release_held()
            for r in p.finished():
                sent.setdefault(r.request_id, []).append(r)
            for d in ds:
                for r in d.finished():
                    ready.setdefault(r.request_id, []).append(r)
        time.sleep(0.1)
        for r in p.finished():
            sent.setdefault(r.request_id, []).append(r)
        assert sorted(ready) == sorted(sent) == sorted(r[0] for r in reqs)
        assert all(len(v) == 1 and v[0].ok for v in sent.values()), sent  # released exactly once
        assert all(len(v) == 1 and v[0].ok for v in ready.values()), ready
        for rid, _i, sb, _db in reqs:
            assert sent[rid][0].block_ids == tuple(sb)
        for rid, i, sb, db in reqs:
            for layer in range(3):
                for kv in range(2):
                    for t in range(TOKENS):
                        for h in range(2):
                            a = src.token_view(layer, kv, sb[t // 4], t % 4, h)
                            b = dsts[i].token_view(layer, kv, db[0], t, h)
                            assert np.array_equal(a, b), (rid, layer, kv, t, h)
        # per destination, posts went out in prefill_done order (first source unit = 4k for request k)
        for i in range(2):
            order = [u for peer, u in pt.posts if peer == f"D{i}-agent"]
            assert order == sorted(order) and len(order) == 4, pt.posts
        st = p.stats()
        assert st["inflight_bytes_max"] <= 2 * REQ_BYTES
        assert st["inflight_writes_max"] == 2  # the bound was reached, never passed
        assert st["writes"] == 8
        assert sum(d.stats()["nudges"] for d in ds) >= 1  # the decodes were told of the posts
    finally:
        hub.hold_writes = False
        hub.release_held()
        for d in ds:
            d.close()
        p.close()


def test_a_write_over_the_budget_goes_alone():
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=32, **GEO))
    dst = HostKVCache(KVLayout(block_size=8, num_blocks=16, **GEO))
    cfg = KVPushConfig.from_mapping(dict(engine_id="P", port=0, post_workers=1, max_inflight_descriptors=1))
    p = PrefillEndpoint(cfg, src.layout, transport=MemoryTransport("P-agent", hub))
    d = DecodeEndpoint(KVPushConfig(engine_id="D"), dst.layout, transport=MemoryTransport("D-agent", hub))
    try:
        p.start()
        d.start()
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        for k in range(3):
            d.expect(f"r{k}", [k], TOKENS, addr)
        time.sleep(0.05)
        for k in range(3):
            p.prefill_done(f"r{k}", [4 * k, 4 * k + 1], TOKENS)
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            got += d.finished()
            time.sleep(0.01)
        assert len(got) == 3 and all(r.ok for r in got)
        assert p.stats()["inflight_writes_max"] == 1
    finally:
        d.close()
        p.close()


def test_config_bounds_are_checked():
    with pytest.raises(ConfigError):
        KVPushConfig.from_mapping(dict(post_workers=-1))
    with pytest.raises(ConfigError):
        KVPushConfig.from_mapping(dict(max_inflight_bytes=0))
