"""The prepared-list push path over real NIXL (UCX loopback, host DRAM, agents in this process): every byte
verified with the demo's per-token pattern, both event orders, block 16 -> 32, TP 2 -> 1 and 1 -> 2,
layer-major and block-major caches."""

from __future__ import annotations

import os
import time

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.apps.demo.procs import Geometry, make_cache
from kvpush.apps.ports import free_port_range as _free_port_range
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint, write_maker
from kvpush.endpoint.prefill import TIMELINE
from kvpush.transport.base import listed_descriptors

pytestmark = pytest.mark.e2e

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _until(pred, timeout: float = 10.0) -> bool:
    """Poll another thread's state (a read may race with its writer: try again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except RuntimeError:  # a dict changed size while read
            pass
        time.sleep(0.002)
    return False


def _wait(eps, n, timeout=30.0):
    got = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sum(len(v) for v in got.values()) < n * len(eps):
        for rank, ep in enumerate(eps):
            for r in ep.finished():
                got.setdefault(r.request_id, {})[rank] = r
        time.sleep(0.002)
    return got


def _prefill_done(ep: PrefillEndpoint, rid: str) -> bool:
    req = ep._push.requests.get(rid)
    return req is not None and req.prefill_done_at is not None


@pytest.mark.parametrize(
    "p_bs, d_bs, p_tp, d_tp, order, block_major, expand",
    [
        (16, 32, 1, 1, "NHD", False, False),
        (16, 16, 1, 1, "NHD", True, False),
        (16, 32, 1, 1, "HND", True, False),
        (32, 16, 2, 1, "HND", False, False),
        (16, 16, 1, 2, "NHD", False, False),
        (16, 16, 2, 1, "NHD", True, False),
        # NIXL 1.3.x's path on any NIXL: strided rows expanded to one descriptor per unit
        (16, 32, 2, 1, "HND", False, True),
    ],
)
def test_prepared_push_over_nixl(p_bs, d_bs, p_tp, d_tp, order, block_major, expand, monkeypatch):
    if expand:
        monkeypatch.setattr("kvpush.transport.nixl.strided_lists_supported", lambda agent: False)
    common = dict(layers=3, total_kv_heads=2, head_dim=8, dtype_size=2, token_order=order)
    pg = Geometry(block_size=p_bs, num_blocks=64, tp_size=p_tp, block_major=block_major, **common)
    dg = Geometry(block_size=d_bs, num_blocks=64, tp_size=d_tp, block_major=block_major, **common)
    p_caches = [make_cache(pg.layout(r), "cpu") for r in range(p_tp)]
    d_caches = [make_cache(dg.layout(r), "cpu") for r in range(d_tp)]
    port = _free_port_range(p_tp)
    pcfg = KVPushConfig.from_mapping(dict(engine_id="P", port=port, lease_s=20.0, ready_timeout_s=30.0))
    dcfg = KVPushConfig.from_mapping(dict(engine_id="D", port=0, lease_s=20.0, ready_timeout_s=30.0))
    pe = [PrefillEndpoint(pcfg, c.layout) for c in p_caches]
    de = [DecodeEndpoint(dcfg, c.layout) for c in d_caches]
    # per request (told apart by its token count): per plan with an early side, (source half used,
    # destination half used)
    early: dict[int, list[tuple[bool, bool]]] = {}
    real_plan = write_maker.build_index_plan

    def spy(pair, src, dst, n, layers=None, halves=(None, None)):
        plan = real_plan(pair, src, dst, n, layers, halves)
        s_half, d_half = halves
        early.setdefault(n, []).append(
            (
                s_half is not None and s_half.idx is plan.src_idx,
                d_half is not None and d_half.idx is plan.dst_idx,
            )
        )
        return plan

    monkeypatch.setattr(write_maker, "build_index_plan", spy)
    try:
        for ep in pe + de:
            ep.start()
        addr = PrefillAddress("P", "127.0.0.1", port, p_tp)
        for ep in de:
            ep.connect(addr)
        # prefill tables descend, decode tables are shuffled runs: merging must still find the runs
        reqs = [("r0", 200, list(range(40, 27, -1)), [9, 10, 11, 3, 4, 5, 6, 50, 51, 52, 53, 54, 55], True)]
        reqs.append(("r1", 77, [1, 2, 3, 4, 5, 60, 61, 62], [20, 21, 22, 23, 30], False))
        # r2: ascending tables, registered first
        reqs.append(("r2", 100, [7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46], True))
        for rid, n, pb, db, reg_first in reqs:
            pb = pb[: -(-n // p_bs)]
            db = db[: -(-n // d_bs)]
            for c in p_caches:
                fill(c.to_host(), c.layout, pb, n, 7 + len(rid))
            # the first side is in each prefill's push thread before the second is called (a fixed sleep was
            # not enough on a loaded box: both then came in one step and nothing was planned early)
            if reg_first:
                for ep in de:
                    ep.expect(rid, db, n, addr)
                assert _until(
                    lambda rid=rid: all(
                        len(ep._push.state.rank_states(rid)) == max(1, d_tp // p_tp) for ep in pe
                    )
                ), rid
                for ep in pe:
                    ep.prefill_done(rid, pb, n)
            else:
                for ep in pe:
                    ep.prefill_done(rid, pb, n)
                assert _until(lambda rid=rid: all(_prefill_done(ep, rid) for ep in pe)), rid
                for ep in de:
                    ep.expect(rid, db, n, addr)
            got = _wait(de, 1)
            assert rid in got and all(r.ok for r in got[rid].values()), got
            sent = _wait(pe, 1)
            assert all(r.ok for r in sent[rid].values())
            marks = sent[rid][0].timeline
            assert set(TIMELINE) <= set(marks), marks
            # the stages in order: the later trigger, then each mark of the WRITE's way out
            stages = [max(marks["registered"], marks["prefill_done"])] + [marks[k] for k in TIMELINE[2:]]
            assert stages == sorted(stages), marks
            for c in d_caches:
                assert count_wrong_bytes(c.to_host(), c.layout, db, n, 7 + len(rid)) == 0
        if not block_major:  # short requests: the side known first was planned before the trigger
            # r1's prefill_done came first (its source side), r2 registered first (its decode side); r0's
            # descending source is sorted at the trigger, so a side planned in table order is not used
            pairs = max(p_tp, d_tp)  # WRITEs per request: one per (prefill rank, decode rank) pair
            r0, r1, r2 = (early.get(n, []) for _rid, n, *_ in reqs)
            if d_tp > p_tp:  # a head slice of NHD blocks is a piece per token: the array path, at the trigger
                assert early == {}, early
            else:
                assert len(r0) == len(r1) == len(r2) == pairs, early
                assert all(u == (False, False) for u in r0), early
                assert all(u[0] for u in r1) and all(u == (False, True) for u in r2), early
        for ep in pe:
            assert not ep._push.requests  # dropped with the requests (their planned halves included)
        for ep in pe:  # the prepared path was taken (not the build_plan fallback)
            peers = ep._push.peers.values()
            assert peers and all(
                p.prepared and all(v is not None for v in p.prepared.values()) for p in peers
            )
            assert ep.stats()["descriptors"] > 0
            # what the prepared lists hold: strided rows on NIXL >= 1.5, one descriptor per unit on 1.3.x
            strided = ep._push.transport.strided_lists
            assert not (expand and strided)
            want = sum(
                listed_descriptors(v.units.s.rows, strided) + listed_descriptors(v.units.d.rows, strided)
                for p in peers
                for v in p.prepared.values()
            )
            assert ep.stats()["prepared_descriptors"] == want > 0
    finally:
        for ep in de + pe:
            ep.close()
