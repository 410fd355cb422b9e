"""kv_ready below stream_min_tokens is held on the engine's side (kvpush/endpoint/early.py): the push thread
hears nothing until the request's next command, then every held call in order, so the outcome is the one
it would have been; abort, close and an engine that never finishes the request still get their results."""

from __future__ import annotations

import time

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes, fill
from kvpush.errors import EndpointClosed
from kvpush.protocol.reasons import Failure
from tests.endpoint.test_streaming_nixl import _blocks, _close, _pair, _until, _wait

pytestmark = pytest.mark.e2e

THRESHOLD = {"min_tokens": 256, "min_bytes": 0}


def test_calls_under_the_threshold_wake_nothing_and_replay_in_order():
    pc, dc, pe, de, addr = _pair(16, 16, streaming=THRESHOLD)
    try:
        n, tag = 200, 4
        pb = _blocks(list(range(1, 30)), n, 16)
        db = _blocks(list(range(30, 60)), n, 16)
        fill(pc[0].to_host(), pc[0].layout, pb, n, tag)
        barriers: list[int] = []
        for layer in range(4):  # layer by layer, each with its barrier
            pe[0].kv_ready(
                "t", pb, n, layers=(layer, layer + 1), kv_written=lambda i=layer: barriers.append(i)
            )
        push = pe[0]._push
        assert len(push.early) == 1 and pe[0].pending() == 0  # held: the machine has not heard of it
        assert pe[0]._loop.commands.empty()
        de[0].expect("t", db, n, addr)
        pe[0].prefill_done("t", pb, n, kv_written=lambda: barriers.append(9))
        assert _wait(de[0])[0].ok and _wait(pe[0])[0].ok
        assert barriers == [0, 1, 2, 3, 9]  # every held barrier, in order, before the WRITE read the blocks
        assert len(push.early) == 0 and pe[0].stats()["writes"] == 1
        assert count_wrong_bytes(dc[0].to_host(), dc[0].layout, db, n, tag) == 0
    finally:
        _close(pe, de)


def test_a_request_over_the_threshold_keeps_streaming():
    pc, dc, pe, de, addr = _pair(16, 16, streaming=THRESHOLD)
    try:
        pb = list(range(1, 30))
        pe[0].kv_ready("s", pb[:8], 128)  # under: held
        assert len(pe[0]._push.early) == 1
        pe[0].kv_ready("s", pb[:16], 256, layers=(0, 1))  # over: the held call and this one go now
        assert _until(lambda: len(pe[0]._push.early) == 0 and pe[0].pending() == 1)
        pe[0].kv_ready("s", pb[:16], 128, layers=(1, 2))  # under again, but the request streams: sent
        assert len(pe[0]._push.early) == 0
        pe[0].abort("s")
        pe[0].prefill_done("s", pb[:16], 256)  # the terminal call, after an abort too (contract.md)
        (res,) = _wait(pe[0])
        assert not res.ok and res.failure is Failure.ABORTED
    finally:
        _close(pe, de)


def test_abort_of_a_held_request_gives_its_blocks_back():
    pc, dc, pe, de, addr = _pair(16, 16, streaming=THRESHOLD)
    try:
        pb = list(range(1, 9))
        pe[0].kv_ready("a", pb, 128)
        pe[0].abort("a", "engine gave up")
        pe[0].prefill_done("a", pb, 128)  # the terminal call, after an abort too (contract.md)
        (res,) = _wait(pe[0])
        assert not res.ok and res.failure is Failure.ABORTED and res.block_ids == tuple(pb)
        assert len(pe[0]._push.early) == 0
    finally:
        _close(pe, de)


def test_close_reports_held_requests_and_refuses_later_calls():
    pc, dc, pe, de, addr = _pair(16, 16, streaming=THRESHOLD)
    try:
        pb = list(range(1, 9))
        pe[0].kv_ready("c", pb, 128)
        pe[0].close()
        got = pe[0].finished()
        assert [(r.request_id, r.ok, r.failure) for r in got] == [("c", False, Failure.CLOSED)]
        with pytest.raises(EndpointClosed):
            pe[0].kv_ready("d", pb, 128)
    finally:
        _close(pe, de)


def test_a_request_held_past_half_a_lease_is_taken_over():
    """The sender machine then runs the lease as if it had heard every call: the entry expires, and the
    engine's late prefill_done gets a failure with its blocks back."""
    pc, dc, pe, de, addr = _pair(16, 16, streaming=THRESHOLD, lease_s=1.0)
    try:
        pb = list(range(1, 9))
        pe[0].kv_ready("x", pb, 128)
        time.sleep(0.2)
        assert len(pe[0]._push.early) == 1  # not yet half a lease
        assert _until(lambda: len(pe[0]._push.early) == 0 and pe[0].pending() == 1, timeout=5)
        time.sleep(1.2)  # past the lease
        pe[0].prefill_done("x", pb, 128)
        (res,) = _wait(pe[0])
        assert not res.ok and res.block_ids == tuple(pb)
    finally:
        _close(pe, de)


def test_a_prompt_no_decode_registers_ends_by_its_lease_and_is_counted_expired():
    """What a prefill sees when a client leaves before the decode's API server passed the request to its
    engine: no registration, no abort. The blocks come back at the lease, the failure is EXPIRED, and
    stats()["failed_expired"] counts it (the disconnect waves tell this hold apart from a leak by it)."""
    pc, dc, pe, de, addr = _pair(16, 16, lease_s=0.5)
    try:
        pb = list(range(1, 9))
        pe[0].prefill_done("never-registered", pb, 128)
        (res,) = _wait(pe[0])
        assert (res.ok, res.failure, res.block_ids) == (False, Failure.EXPIRED, tuple(pb))
        assert "no registration from decode" in res.reason
        assert (pe[0].stats()["failed_expired"], pe[0].stats()["failed"]) == (1, 1)
    finally:
        _close(pe, de)
