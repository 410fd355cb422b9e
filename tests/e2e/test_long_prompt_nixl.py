"""A 128k-token prompt moves over real NIXL (UCX loopback, host DRAM, agents in this process).

Wire v2 dropped every registration with ~4,090 or more block ids (its header scan gave up before reaching
the version field, which msgspec wrote after the block ids): at block size 16, any prompt above ~65k tokens
hung until the decode's ready timeout. Every byte is checked against the demo's per-token pattern."""

from __future__ import annotations

import os
import time

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.apps.demo.procs import Geometry, make_cache
from kvpush.apps.ports import free_port_range
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint

pytestmark = pytest.mark.e2e

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

TOKENS = 128 * 1024
BLOCK = 16


def _first(ep, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ep.finished()
        if got:
            return got[0]
        time.sleep(0.01)
    raise AssertionError(f"no result within {timeout} s")


def test_a_128k_token_prompt_transfers_over_nixl():
    blocks = TOKENS // BLOCK  # 8,192 block ids in one registration
    geo = Geometry(
        block_size=BLOCK,
        num_blocks=blocks + 8,
        tp_size=1,
        layers=2,
        total_kv_heads=2,
        head_dim=8,
        dtype_size=2,
        token_order="NHD",
    )
    p_cache = make_cache(geo.layout(0), "cpu")
    d_cache = make_cache(geo.layout(0), "cpu")
    port = free_port_range(1)
    pe = PrefillEndpoint(
        KVPushConfig(engine_id="P", port=port, lease_s=60.0, ready_timeout_s=90.0), p_cache.layout
    )
    de = DecodeEndpoint(
        KVPushConfig(engine_id="D", port=0, lease_s=60.0, ready_timeout_s=90.0), d_cache.layout
    )
    try:
        pe.start()
        de.start()
        addr = PrefillAddress("P", "127.0.0.1", port, 1)
        de.connect(addr)
        src = list(range(blocks - 1, -1, -1))  # descending: no run to merge on the source side
        dst = list(range(8, blocks + 8))
        fill(p_cache.to_host(), p_cache.layout, src, TOKENS, 11)
        de.expect("long", dst, TOKENS, addr)
        pe.prefill_done("long", src, TOKENS)
        got = _first(de, 60.0)
        assert got.ok, got
        sent = _first(pe, 30.0)
        assert sent.ok, sent
        assert count_wrong_bytes(d_cache.to_host(), d_cache.layout, dst, TOKENS, 11) == 0
    finally:
        de.close()
        pe.close()
