"""Strided descriptor lists where the data plane has them (NIXL >= 1.5) and their expansion where it does
not (NIXL 1.3.x): the feature probe, the expansion's index order, and the endpoint's descriptor counts."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.protocol.layout import KVLayout, packed_planes
from kvpush.protocol.prepared import pair_units
from kvpush.transport.base import expand_rows, listed_descriptors
from kvpush.transport.memory import MemoryHub, MemoryTransport
from kvpush.transport.nixl import strided_lists_supported
from tests.endpoint.util import until

GEO = dict(num_layers=3, total_kv_heads=2, head_dim=8, dtype_size=2)


class _Agent:
    """The four NIXL agent calls the probe makes; `prep` decides what prep_xfer_dlist does with N x 5."""

    def __init__(self, prep: type[BaseException] | None, register: bool = True) -> None:
        self.prep, self.register = prep, register
        self.calls: list[str] = []

    def register_memory(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> str:
        self.calls.append(f"register {mem_type}")
        if not self.register:
            raise RuntimeError("NIXL_ERR_NOT_SUPPORTED")
        return "reg"

    def prep_xfer_dlist(self, agent: str, rows: Any, mem_type: str) -> str:
        self.calls.append(f"prep {np.asarray(rows).shape}")
        if self.prep is not None:
            raise self.prep("prepXferDlist(): incompatible function arguments")
        return "dlist"

    def release_dlist_handle(self, handle: str) -> None:
        self.calls.append("release")

    def deregister_memory(self, reg: str) -> None:
        self.calls.append("deregister")


def test_the_probe_tries_one_strided_row_and_cleans_up() -> None:
    ok = _Agent(None)
    assert strided_lists_supported(ok)
    assert ok.calls == ["register DRAM", "prep (1, 5)", "release", "deregister"]
    old = _Agent(TypeError)  # NIXL 1.3.x: get_xfer_descs returns None, the binding raises TypeError
    assert not strided_lists_supported(old)
    assert old.calls == ["register DRAM", "prep (1, 5)", "deregister"]
    assert not strided_lists_supported(_Agent(None, register=False))


def test_expanded_rows_keep_the_index_order_of_strided_rows() -> None:
    src = KVLayout(block_size=16, num_blocks=8, token_order="HND", **GEO)
    dst = KVLayout(block_size=32, num_blocks=4, token_order="HND", **GEO)
    pair = pair_units(packed_planes(src, 0x10000), packed_planes(dst, 0x90000))
    for side in (pair.s, pair.d):
        rows = side.rows
        flat = expand_rows(rows)
        assert flat.shape == (side.num_units, 3)
        assert listed_descriptors(rows, strided=True) == rows.shape[0]
        assert listed_descriptors(rows, strided=False) == side.num_units
        assert listed_descriptors(flat, strided=False) == side.num_units
        # descriptor i of the strided list is row i of the expanded one
        i = 0
        for addr, ln, dev, stride, count in rows.tolist():
            for k in range(count):
                assert flat[i].tolist() == [addr + k * stride, ln, dev]
                i += 1


@pytest.mark.parametrize("strided", [True, False])
def test_the_endpoint_reports_the_descriptors_its_prepared_lists_hold(strided: bool) -> None:
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=32, **GEO))
    dst = HostKVCache(KVLayout(block_size=8, num_blocks=16, **GEO))
    src.buffer[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, lease_s=2.0, ready_timeout_s=3.0)),
        src.layout,
        transport=MemoryTransport("P-agent", hub, strided_lists=strided),
    )
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", lease_s=2.0, ready_timeout_s=3.0)),
        dst.layout,
        transport=MemoryTransport("D-agent", hub, strided_lists=strided),
    )
    try:
        p.start()
        d.start()
        addr = PrefillAddress("P", *p.address)
        d.connect(addr)
        d.expect("r", [3, 1, 7], 21, addr)
        time.sleep(0.05)
        p.prefill_done("r", [5, 6, 2, 9, 10, 11], 21)
        [got] = until(d.finished)
        assert got.ok
        pair = pair_units(src.layout, dst.layout)
        want = listed_descriptors(pair.s.rows, strided) + listed_descriptors(pair.d.rows, strided)
        stats = p.stats()
        assert stats["prepared_lists"] == 2
        assert stats["prepared_descriptors"] == want
        rows, units = pair.s.rows.shape[0] + pair.d.rows.shape[0], pair.s.num_units + pair.d.num_units
        assert rows < units  # the two forms differ here, so the count tells which one was prepared
        assert want == (rows if strided else units)
    finally:
        d.close()
        p.close()
