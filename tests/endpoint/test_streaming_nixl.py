"""Streamed push over real NIXL (UCX loopback, host DRAM): ranges reported with kv_ready land before
prefill_done, the decode is told once, every byte is verified; ranges reported before the registration
coalesce; layer ranges; a request aborted mid-stream gives its blocks back (at its terminal prefill_done) only after its
WRITEs settled;
a request under the threshold moves in one piece; a request that ends with no prefill_done is forgotten
a lease later by the push thread too (named in a warning when the engine holds kv_ready blocks)."""

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


def _blocks(blocks, n, bs):
    return blocks[: -(-n // bs)]


def _until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return False


def _pair(p_bs, d_bs, p_tp=1, d_tp=1, streaming=None, layers=4, lease_s=20.0):
    common = dict(layers=layers, total_kv_heads=2, head_dim=8, dtype_size=2)
    pg = Geometry(block_size=p_bs, num_blocks=64, tp_size=p_tp, **common)
    dg = Geometry(block_size=d_bs, num_blocks=64, tp_size=d_tp, **common)
    pc = [make_cache(pg.layout(r), "cpu") for r in range(p_tp)]
    dc = [make_cache(dg.layout(r), "cpu") for r in range(d_tp)]
    port = free_port_range(p_tp)
    stream = streaming if streaming is not None else {"min_tokens": 0, "min_bytes": 0}
    pcfg = KVPushConfig.from_mapping(dict(engine_id="P", port=port, lease_s=lease_s, streaming=stream))
    dcfg = KVPushConfig.from_mapping(dict(engine_id="D", port=0, lease_s=20.0, ready_timeout_s=30.0))
    pe = [PrefillEndpoint(pcfg, c.layout) for c in pc]
    de = [DecodeEndpoint(dcfg, c.layout) for c in dc]
    for ep in pe + de:
        ep.start()
    addr = PrefillAddress("P", "127.0.0.1", port, p_tp)
    for ep in de:
        ep.connect(addr)
    return pc, dc, pe, de, addr


def _close(pe, de):
    for ep in de + pe:
        ep.close()


@pytest.mark.parametrize("p_bs, d_bs, p_tp, d_tp", [(16, 32, 1, 1), (16, 16, 2, 1), (16, 16, 1, 2)])
def test_ranges_land_before_prefill_done_and_every_byte_is_verified(p_bs, d_bs, p_tp, d_tp):
    pc, dc, pe, de, addr = _pair(p_bs, d_bs, p_tp, d_tp)
    try:
        n, tag = 300, 5
        pb = _blocks(list(range(40, 20, -1)), n, p_bs)
        db = _blocks([9, 10, 11, 3, 4, 5, 6, *range(50, 63)], n, d_bs)
        for ep in de:
            ep.expect("s", db, n, addr)
        assert _until(lambda: all(len(ep._push.state) for ep in pe))  # registered
        chunks = [64, 128, 200, 256]
        for c in chunks:  # the engine computes a chunk, then reports it
            for cache in pc:
                fill(cache.to_host(), cache.layout, pb, c, tag)
            for ep in pe:
                ep.kv_ready("s", _blocks(pb, c, p_bs), c)
        # before prefill_done: the first 256 tokens (aligned to both block sizes) landed already
        assert _until(lambda: all(count_wrong_bytes(c.to_host(), c.layout, db, 256, tag) == 0 for c in dc))
        assert not any(ep.finished() for ep in de)  # no notification before prefill_done
        for cache in pc:
            fill(cache.to_host(), cache.layout, pb, n, tag)
        for ep in pe:
            ep.prefill_done("s", pb, n)
        got = [r for ep in de for r in _wait(ep)]
        assert len(got) == d_tp and all(r.ok for r in got), got
        sent = [r for ep in pe for r in _wait(ep)]
        assert len(sent) == p_tp and all(r.ok and tuple(r.block_ids) == tuple(pb) for r in sent)
        for c in dc:
            assert count_wrong_bytes(c.to_host(), c.layout, db, n, tag) == 0
        # several WRITEs per rank pair: the request moved in ranges, and the notification was one
        assert sum(ep.stats()["writes"] for ep in pe) > p_tp
        time.sleep(0.2)
        assert not any(ep.finished() for ep in de)  # exactly one result per decode rank
        assert all(not ep.pending() for ep in pe + de)
    finally:
        _close(pe, de)


def _wait(ep, timeout=20.0):
    out = []
    assert _until(lambda: bool(out.extend(ep.finished()) or out), timeout)
    return out


def test_ranges_before_registration_coalesce_and_layer_ranges_stream():
    pc, dc, pe, de, addr = _pair(16, 16, layers=4)
    try:
        n, tag = 160, 9
        pb = _blocks(list(range(1, 30)), n, 16)
        db = _blocks(list(range(30, 60)), n, 16)
        cache = pc[0]
        fill(cache.to_host(), cache.layout, pb, n, tag)
        pe[0].kv_ready("c", pb[:4], 64)  # before the decode registered: buffered, then one range
        pe[0].kv_ready("c", pb[:8], 128, layers=(0, 2))  # layers 0-1 ahead of 2-3
        de[0].expect("c", db, n, addr)
        assert _until(lambda: count_wrong_bytes(dc[0].to_host(), dc[0].layout, db, 64, tag) == 0)
        pe[0].kv_ready("c", pb[:8], 128, layers=(2, 4))
        assert _until(lambda: count_wrong_bytes(dc[0].to_host(), dc[0].layout, db, 128, tag) == 0)
        pe[0].prefill_done("c", pb, n)
        got = _wait(de[0])
        assert len(got) == 1 and got[0].ok
        assert count_wrong_bytes(dc[0].to_host(), dc[0].layout, db, n, tag) == 0
        assert _wait(pe[0])[0].ok
    finally:
        _close(pe, de)


def test_abort_mid_stream_releases_only_after_every_write_settled():
    pc, dc, pe, de, addr = _pair(16, 16)
    try:
        n, tag = 256, 3
        pb = _blocks(list(range(1, 30)), n, 16)
        db = _blocks(list(range(30, 60)), n, 16)
        fill(pc[0].to_host(), pc[0].layout, pb, n, tag)
        de[0].expect("a", db, n, addr)
        assert _until(lambda: len(pe[0]._push.state) == 1)
        for c in (32, 64, 96):  # 3 of 8 ranges
            pe[0].kv_ready("a", _blocks(pb, c, 16), c)
        pe[0].abort("a", "client went away")
        assert _until(lambda: not pe[0]._push.scheduler.writes)  # the ranges in flight settle
        assert pe[0].finished() == []  # nothing is released before the terminal prefill_done
        pe[0].prefill_done("a", pb, n)  # prefill_done stays the terminal call, after an abort too
        sent = _wait(pe[0])
        assert len(sent) == 1 and not sent[0].ok and tuple(sent[0].block_ids) == tuple(pb)
        assert not pe[0]._push.scheduler.queues
        got = _wait(de[0])
        assert len(got) == 1 and not got[0].ok
        assert not pe[0].pending() and not de[0].pending()
        # the same endpoints still move the next request whole
        fill(pc[0].to_host(), pc[0].layout, pb, n, tag + 1)
        de[0].expect("b", db, n, addr)
        pe[0].prefill_done("b", pb, n)
        assert _wait(de[0])[0].ok and _wait(pe[0])[0].ok
        assert count_wrong_bytes(dc[0].to_host(), dc[0].layout, db, n, tag + 1) == 0
    finally:
        _close(pe, de)


def test_a_request_under_the_threshold_moves_in_one_piece():
    pc, dc, pe, de, addr = _pair(16, 16, streaming={"min_tokens": 1024, "min_bytes": 0})
    try:
        n, tag = 200, 4
        pb = _blocks(list(range(1, 30)), n, 16)
        db = _blocks(list(range(30, 60)), n, 16)
        fill(pc[0].to_host(), pc[0].layout, pb, n, tag)
        de[0].expect("t", db, n, addr)
        assert _until(lambda: len(pe[0]._push.state) == 1)
        for c in (64, 128, 192):
            pe[0].kv_ready("t", _blocks(pb, c, 16), c)
        time.sleep(0.3)
        assert pe[0].stats()["writes"] == 0  # nothing moved early
        pe[0].prefill_done("t", pb, n)
        assert _wait(de[0])[0].ok and _wait(pe[0])[0].ok
        assert pe[0].stats()["writes"] == 1
        assert count_wrong_bytes(dc[0].to_host(), dc[0].layout, db, n, tag) == 0
    finally:
        _close(pe, de)


def test_an_aborted_stream_without_prefill_done_is_said_and_forgotten(caplog):
    """docs/contract.md: prefill_done stays the terminal call after an abort. An engine that never makes
    it is told by name once the lease runs out (a warning and a counter), and the push thread keeps
    nothing of the request; a late prefill_done still gives the blocks back, failed."""
    pc, dc, pe, de, addr = _pair(16, 16, lease_s=1.0)
    try:
        n, tag = 256, 6
        pb = _blocks(list(range(1, 30)), n, 16)
        db = _blocks(list(range(30, 60)), n, 16)
        fill(pc[0].to_host(), pc[0].layout, pb, n, tag)
        de[0].expect("f", db, n, addr)
        push = pe[0]._push
        assert _until(lambda: len(push.state) == 1)
        for c in (32, 64):
            pe[0].kv_ready("f", _blocks(pb, c, 16), c)
        with caplog.at_level("WARNING", logger="kvpush"):
            pe[0].abort("f", "client went away")
            assert _until(lambda: not pe[0].pending(), timeout=10.0)
            assert _until(lambda: "f" not in push.requests, timeout=2.0)
        said = [r.getMessage() for r in caplog.records if "'f'" in r.getMessage()]
        assert any("prefill_done" in m and "never" in m for m in said), said
        assert pe[0].stats()["no_prefill_done"] == 1
        assert pe[0].finished() == []  # no SendResult: the engine still owns the terminal call
        assert "f" not in push.requests  # its record: prefill_done time, barriers, staging, halves, marks
        assert not push.armed and not push.scheduler.writes
        pe[0].prefill_done("f", pb, n)  # late: the blocks still come back, failed
        sent = _wait(pe[0])
        assert len(sent) == 1 and not sent[0].ok and tuple(sent[0].block_ids) == tuple(pb)
    finally:
        _close(pe, de)


def test_a_registration_whose_prefill_never_comes_leaves_nothing_on_the_push_thread(caplog):
    """A decode registers a request the prefill engine never hears of (its prefill request was lost on
    the way): the lease ends it, the decode is told, and once the machine forgets it the push thread
    keeps nothing either (the destination it planned at the registration included); no warning, since
    the engine named no blocks."""
    pc, dc, pe, de, addr = _pair(16, 16, lease_s=1.0)
    try:
        push = pe[0]._push
        for i in range(3):
            de[0].expect(f"lost{i}", [30 + i], 16, addr)
        assert _until(lambda: len(push.state) == 3)
        with caplog.at_level("WARNING", logger="kvpush"):
            got: list = []
            assert _until(lambda: bool(got.extend(de[0].finished())) or len(got) == 3)
            assert sorted(r.request_id for r in got) == ["lost0", "lost1", "lost2"]
            assert not any(r.ok for r in got)
            assert _until(lambda: not len(push.state), timeout=5.0)
            assert _until(lambda: not push.requests, timeout=2.0), push.requests
        assert not [r for r in caplog.records if "prefill_done never came" in r.getMessage()]
        assert pe[0].stats()["no_prefill_done"] == 0
    finally:
        _close(pe, de)


def test_at_rest_the_transfer_threads_keep_nothing_per_request():
    """After requests that completed, one aborted mid-stream (with its terminal prefill_done), one whose
    prefill never came and registrations the prefill refused, every per-request map of both threads is
    empty once the leases ran out (kept.py)."""
    pc, dc, pe, de, addr = _pair(16, 16, lease_s=1.0)
    try:
        n, tag = 256, 7
        pb = _blocks(list(range(1, 30)), n, 16)
        db = _blocks(list(range(30, 60)), n, 16)
        fill(pc[0].to_host(), pc[0].layout, pb, n, tag)
        de[0].expect("ok", db, n, addr)
        for c in (64, 128):
            pe[0].kv_ready("ok", _blocks(pb, c, 16), c)
        pe[0].prefill_done("ok", pb, n)
        assert _wait(de[0])[0].ok and _wait(pe[0])[0].ok
        de[0].expect("ok", db, n, addr)  # again: the prefill's tombstone refuses the registration
        again = _wait(de[0])
        assert not again[0].ok and "already" in again[0].reason, again
        de[0].expect("cut", db, n, addr)
        assert _until(lambda: len(pe[0]._push.state) == 1)
        pe[0].kv_ready("cut", _blocks(pb, 64, 16), 64)
        pe[0].abort("cut", "client went away")
        pe[0].prefill_done("cut", pb, n)
        assert not _wait(pe[0])[0].ok and not _wait(de[0])[0].ok
        de[0].expect("lost", [40], 16, addr)  # the prefill never hears of it
        pe[0].prefill_done("late", pb[:1], 16)  # its decode never registers
        got: list = []
        assert _until(lambda: bool(got.extend(de[0].finished() + pe[0].finished())) or len(got) == 2)
        assert _until(lambda: not pe[0].pending() and not de[0].pending(), timeout=5.0)
        assert _until(lambda: not any(pe[0].kept_state().values()), timeout=3.0), pe[0].kept_state()
        assert _until(lambda: not any(de[0].kept_state().values()), timeout=3.0), de[0].kept_state()
        assert set(pe[0].kept_state()) >= {"timeline", "dst_half", "src_half", "armed"}
    finally:
        _close(pe, de)
