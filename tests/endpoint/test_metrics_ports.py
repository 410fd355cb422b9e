"""Prometheus per rank: rank r serves on metrics.port + r, and the decode exports its expect -> ready time."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.test_hardening import FAST, push_ok

GEO = dict(num_layers=2, total_kv_heads=2, head_dim=8, dtype_size=2, block_size=4, num_blocks=32)


def free_port_pair() -> int:
    """A base port whose successor is free too (two ranks of one engine)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base
    raise RuntimeError("no two adjacent free ports")


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_two_ranks_of_one_engine_in_one_process_serve_on_port_plus_rank():
    hub = MemoryHub()
    base = free_port_pair()
    eps = []
    try:
        for rank in (0, 1):
            layout = KVLayout(tp_rank=rank, tp_size=2, **GEO)
            cfg = KVPushConfig.from_mapping(dict(engine_id="P2", port=0, metrics_port=base, **FAST))
            ep = PrefillEndpoint(cfg, HostKVCache(layout).layout, transport=MemoryTransport(f"p{rank}", hub))
            ep.start()  # rank 1 used to fail here: "Address already in use" on the shared port
            eps.append(ep)
        for rank in (0, 1):
            body = scrape(base + rank)
            # prometheus_client's registry is process-wide: each port shows both ranks' series
            assert 'kvpush_pending_requests{engine_id="P2",rank="1",role="prefill"}' in body
    finally:
        for ep in eps:
            ep.close()


def test_decode_exports_its_expect_to_ready_histogram():
    hub = MemoryHub()
    src, dst = HostKVCache(KVLayout(**GEO)), HostKVCache(KVLayout(**GEO))
    src.buffer[:] = np.random.default_rng(3).integers(0, 256, src.nbytes, dtype=np.uint8)
    base = free_port_pair()
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="PH", port=0, **FAST)),
        src.layout,
        transport=MemoryTransport("ph", hub),
    )
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="DH", metrics_port=base, **FAST)),
        dst.layout,
        transport=MemoryTransport("dh", hub),
    )
    p.start()
    d.start()
    try:
        addr = PrefillAddress("PH", *p.address)
        d.connect(addr)
        for i in range(3):
            rp, rd = push_ok(p, d, addr, f"h{i}")
            assert rp.ok and rd.ok
        body = scrape(base)
        series = 'kvpush_receive_seconds_count{engine_id="DH",rank="0",role="decode"} 3.0'
        assert series in body, [ln for ln in body.splitlines() if "receive_seconds_count" in ln]
        assert 'kvpush_transfer_seconds_count{engine_id="PH",rank="0",role="prefill"} 3.0' in body
        # the decode's wait is not reported as a prefill transfer time
        assert 'kvpush_transfer_seconds_count{engine_id="DH"' not in body
    finally:
        d.close()
        p.close()
