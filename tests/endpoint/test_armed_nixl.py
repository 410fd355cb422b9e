"""Armed WRITEs over real NIXL (UCX loopback, host DRAM, agents in this process): source_blocks before
prefill_done makes the WRITE ahead and prefill_done only posts it; every other path releases what was made.
Every byte is verified with the demo's per-token pattern, and every handle NIXL made is released once."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.apps.demo.procs import Geometry, make_cache
from kvpush.apps.ports import free_port_range
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.transport.nixl import NixlTransport

pytestmark = pytest.mark.e2e

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

N = 40  # tokens: 3 prefill blocks of 16, 2 decode blocks of 32


@dataclass
class Pair:
    pe: PrefillEndpoint
    de: DecodeEndpoint
    p_cache: object
    d_cache: object
    addr: PrefillAddress
    made: list[object]
    released: Counter[int]

    def armed(self) -> int:
        return len(self.pe._push.armed)

    def counters(self) -> dict[str, int]:
        return self.pe.stats()


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A prefill and a decode endpoint over NIXL; `request.param` (indirect): extra prefill config."""
    made: list[object] = []
    released: Counter[int] = Counter()
    real_make, real_release = NixlTransport.make_write, NixlTransport.release

    def make(self, *args, **kw):
        h = real_make(self, *args, **kw)
        made.append(h)  # kept alive: ids stay unique
        return h

    def release(self, handle):
        released[id(handle)] += 1
        return real_release(self, handle)

    monkeypatch.setattr(NixlTransport, "make_write", make)
    monkeypatch.setattr(NixlTransport, "release", release)
    common = dict(layers=2, total_kv_heads=1, head_dim=8, dtype_size=2, token_order="NHD")
    pg = Geometry(block_size=16, num_blocks=64, tp_size=1, **common)
    dg = Geometry(block_size=32, num_blocks=64, tp_size=1, **common)
    pc, dc = make_cache(pg.layout(0), "cpu"), make_cache(dg.layout(0), "cpu")
    port = free_port_range(1)
    extra = getattr(request, "param", {})
    pcfg = KVPushConfig.from_mapping(
        dict(engine_id="P", port=port, lease_s=3.0, ready_timeout_s=30.0, **extra)
    )
    dcfg = KVPushConfig.from_mapping(dict(engine_id="D", port=0, lease_s=3.0, ready_timeout_s=30.0))
    pe, de = PrefillEndpoint(pcfg, pc.layout), DecodeEndpoint(dcfg, dc.layout)
    pe.start()
    de.start()
    addr = PrefillAddress("P", "127.0.0.1", port, 1)
    de.connect(addr)
    p = Pair(pe, de, pc, dc, addr, made, released)
    try:
        yield p
    finally:
        de.close()
        pe.close()
    # nothing leaks: every handle made (ahead or per WRITE) was released exactly once
    assert made and all(released[id(h)] == 1 for h in made), (len(made), released)


def until(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.002)
    raise AssertionError("timed out")


def results(ep, rid: str, timeout: float = 10.0):
    box: list = []
    return until(lambda: [r for r in (box.extend(ep.finished()) or box) if r.request_id == rid], timeout)[0]


def fill_src(p: Pair, blocks: list[int], tag: int) -> None:
    host = p.p_cache.to_host()
    fill(host, p.p_cache.layout, blocks, N, tag)
    p.p_cache.from_host(host)


def test_armed_then_prefill_done_lands_and_posts_what_was_made(pair: Pair) -> None:
    src, dst = [3, 4, 5], [7, 8]
    pair.pe.source_blocks("a", src, N)  # before the registration: armed when it comes
    fill_src(pair, src, 11)
    pair.de.expect("a", dst, N, pair.addr)
    until(pair.armed)
    made_before = len(pair.made)
    pair.pe.prefill_done("a", src, N)
    sent = results(pair.pe, "a")
    assert sent.ok and sent.block_ids == (3, 4, 5) and "armed" in sent.timeline
    assert results(pair.de, "a").ok
    assert count_wrong_bytes(pair.d_cache.to_host(), pair.d_cache.layout, dst, N, 11) == 0
    assert len(pair.made) == made_before  # only posted: nothing made at prefill_done
    c = pair.counters()
    assert c["armed"] == 1 and c["writes"] == 1 and c["ok"] == 1
    assert pair.armed() == 0
    # registration first, then source_blocks: armed too
    src, dst = [10, 11, 12], [20, 21]
    fill_src(pair, src, 12)
    pair.de.expect("b", dst, N, pair.addr)
    until(lambda: pair.pe._push.state.rank_states("b"))
    pair.pe.source_blocks("b", src, N)
    until(pair.armed)
    pair.pe.prefill_done("b", src, N)
    assert results(pair.pe, "b").ok and results(pair.de, "b").ok
    assert count_wrong_bytes(pair.d_cache.to_host(), pair.d_cache.layout, dst, N, 12) == 0
    assert pair.counters()["armed"] == 2


def test_prefill_done_with_other_blocks_takes_the_general_path(pair: Pair) -> None:
    pair.pe.source_blocks("c", [3, 4, 5], N)
    pair.de.expect("c", [7, 8], N, pair.addr)
    until(pair.armed)
    src = [30, 31, 32]  # the engine computed elsewhere after all
    fill_src(pair, src, 13)
    pair.pe.prefill_done("c", src, N)
    sent = results(pair.pe, "c")
    assert sent.ok and sent.block_ids == (30, 31, 32) and "armed" not in sent.timeline
    assert results(pair.de, "c").ok
    assert count_wrong_bytes(pair.d_cache.to_host(), pair.d_cache.layout, [7, 8], N, 13) == 0
    c = pair.counters()
    assert c["armed"] == 0 and c["writes"] == 1 and pair.armed() == 0
    assert pair.released[id(pair.made[0])] == 1  # the one made ahead, released unposted


def test_abort_after_arming_writes_nothing_and_releases(pair: Pair) -> None:
    pair.pe.source_blocks("d", [3, 4, 5], N)
    pair.de.expect("d", [7, 8], N, pair.addr)
    until(pair.armed)
    pair.pe.abort("d", "client left")
    until(lambda: pair.armed() == 0)
    assert pair.released[id(pair.made[0])] == 1
    assert not results(pair.de, "d").ok  # the decode is told
    pair.pe.prefill_done("d", [3, 4, 5], N)  # the terminal call still gives the blocks back
    sent = results(pair.pe, "d")
    assert not sent.ok and sent.block_ids == (3, 4, 5)
    assert pair.counters()["writes"] == 0


def test_expiry_of_an_armed_request_releases(pair: Pair) -> None:
    pair.pe.source_blocks("e", [3, 4, 5], N)
    pair.de.expect("e", [7, 8], N, pair.addr)
    until(pair.armed)
    failed = results(pair.de, "e", timeout=15.0)  # the lease (3 s) runs out without prefill_done
    assert not failed.ok
    until(lambda: pair.armed() == 0)
    assert pair.released[id(pair.made[0])] == 1
    pair.pe.prefill_done("e", [3, 4, 5], N)
    sent = results(pair.pe, "e")
    assert not sent.ok and sent.block_ids == (3, 4, 5)
    assert pair.counters()["writes"] == 0


def test_close_with_armed_writes_leaks_nothing(pair: Pair) -> None:
    for i, rid in enumerate(("f", "g")):
        pair.pe.source_blocks(rid, [3 + 3 * i, 4 + 3 * i, 5 + 3 * i], N)
        pair.de.expect(rid, [7 + 2 * i, 8 + 2 * i], N, pair.addr)
    until(lambda: pair.armed() == 2)
    # the fixture closes both endpoints and checks every made handle was released exactly once
