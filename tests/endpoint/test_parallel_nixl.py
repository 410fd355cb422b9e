"""Parallel posting over real NIXL (UCX loopback, host DRAM, agents in this process): posting workers
sharing the prefill's agent, several WRITEs in flight to two decode ranks (two destinations), the
in-flight budget, every byte verified, every source block released exactly once."""

from __future__ import annotations

import os
import time

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.apps.demo.procs import Geometry, make_cache
from kvpush.apps.ports import free_port_range as _free_port_range
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint

pytestmark = pytest.mark.e2e

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.mark.parametrize("workers", [2, 0])
def test_parallel_posting_over_nixl(workers):
    common = dict(layers=3, total_kv_heads=2, head_dim=64, dtype_size=2, token_order="NHD")
    pg = Geometry(block_size=16, num_blocks=256, tp_size=1, **common)
    dg = Geometry(block_size=32, num_blocks=128, tp_size=2, **common)
    pc = make_cache(pg.layout(0), "cpu")
    dcs = [make_cache(dg.layout(r), "cpu") for r in range(2)]
    n = 300
    req_bytes = n * 2 * 64 * 2 * 3 * 2  # both decode ranks' halves
    port = _free_port_range(1)
    pcfg = KVPushConfig.from_mapping(
        dict(
            engine_id="P",
            port=port,
            post_workers=workers,
            max_inflight_bytes=req_bytes,
            lease_s=20.0,
            ready_timeout_s=30.0,
        )
    )
    pe = PrefillEndpoint(pcfg, pc.layout)
    de = [
        DecodeEndpoint(
            KVPushConfig.from_mapping(dict(engine_id="D", port=0, lease_s=20.0, ready_timeout_s=30.0)),
            c.layout,
        )
        for c in dcs
    ]
    try:
        for ep in [pe, *de]:
            ep.start()
        addr = PrefillAddress("P", "127.0.0.1", port, 1)
        for ep in de:
            ep.connect(addr)
        reqs = []
        for k in range(6):  # prefill first for all: the registrations then start WRITEs back to back
            pb = list(range(20 * k + 19, 20 * k, -1))[: -(-n // 16)]  # descending tables still merge
            db = [10 * k + j for j in (3, 1, 2, 0, 4, 5, 6, 7, 8, 9)][: -(-n // 32)]
            fill(pc.to_host(), pc.layout, pb, n, 11 + k)
            pe.prefill_done(f"r{k}", pb, n)
            reqs.append((f"r{k}", pb, db, 11 + k))
        time.sleep(0.05)
        for rid, _pb, db, _tag in reqs:
            for ep in de:
                ep.expect(rid, db, n, addr)
        ready: dict[str, list] = {}
        sent: dict[str, list] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (sum(map(len, ready.values())) < 12 or len(sent) < 6):
            for ep in de:
                for r in ep.finished():
                    ready.setdefault(r.request_id, []).append(r)
            for r in pe.finished():
                sent.setdefault(r.request_id, []).append(r)
            time.sleep(0.005)
        time.sleep(0.1)
        for r in pe.finished():
            sent.setdefault(r.request_id, []).append(r)
        assert sorted(sent) == sorted(ready) == sorted(r[0] for r in reqs)
        assert all(len(v) == 2 and all(x.ok for x in v) for v in ready.values()), ready
        assert all(len(v) == 1 and v[0].ok for v in sent.values()), sent  # released exactly once
        for rid, pb, db, tag in reqs:
            assert sent[rid][0].block_ids == tuple(pb)
            for c in dcs:
                assert count_wrong_bytes(c.to_host(), c.layout, db, n, tag) == 0, rid
        st = pe.stats()
        assert st["writes"] == 12  # one per (request, decode rank)
        assert st["inflight_bytes_max"] <= req_bytes  # both halves of one request at most
        assert st["nudges"] == 12
    finally:
        for ep in [*de, pe]:
            ep.close()
