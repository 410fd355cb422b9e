"""The endpoints' threads, side channel and state machines together, over the in-memory transport
(real byte copies, injected faults) and a real ZeroMQ side channel on 127.0.0.1."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint, RecvResult, SendResult
from kvpush.protocol.layout import KVLayout, LayoutError
from kvpush.protocol.reasons import Failure
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.util import until

GEO = dict(num_layers=3, total_kv_heads=2, head_dim=8, dtype_size=2)


@pytest.fixture
def pair():
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=32, **GEO))
    dst = HostKVCache(KVLayout(block_size=8, num_blocks=16, **GEO))
    src.buffer[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, lease_s=2.0, ready_timeout_s=3.0)),
        src.layout,
        transport=MemoryTransport("P-agent", hub),
    )
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", lease_s=2.0, ready_timeout_s=3.0)),
        dst.layout,
        transport=MemoryTransport("D-agent", hub),
    )
    p.start()
    d.start()
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    yield hub, src, dst, p, d, addr
    d.close()
    p.close()


def same_bytes(src, dst, s_blocks, d_blocks, n):
    for layer in range(GEO["num_layers"]):
        for kv in range(2):
            for t in range(n):
                for h in range(GEO["total_kv_heads"]):
                    a = src.token_view(layer, kv, s_blocks[t // 4], t % 4, h)
                    b = dst.token_view(layer, kv, d_blocks[t // 8], t % 8, h)
                    if not np.array_equal(a, b):
                        return False
    return True


@pytest.mark.parametrize("reg_first", [True, False])
def test_push_lands_every_byte_in_either_order(pair, reg_first):
    hub, src, dst, p, d, addr = pair
    s_blocks, d_blocks, n = [5, 6, 2, 9, 10, 11], [3, 1, 7], 21
    if reg_first:
        d.expect("r", d_blocks, n, addr)
        time.sleep(0.05)
        p.prefill_done("r", s_blocks, n)
    else:
        p.prefill_done("r", s_blocks, n)
        time.sleep(0.05)
        d.expect("r", d_blocks, n, addr)
    [got] = until(d.finished)
    assert got.ok and got.nbytes == n * 3 * 2 * 2 * 16
    [sent] = until(p.finished)
    assert sent == SendResult("r", True, tuple(s_blocks), "", got.nbytes, sent.done_at)
    assert same_bytes(src, dst, s_blocks, d_blocks, n)
    assert p.stats()["registration_first" if reg_first else "prefill_first"] == 1
    assert p.pending() == 0 and d.pending() == 0


def test_garbage_on_the_side_channel_is_answered_and_loses_nothing(pair):
    hub, src, dst, p, d, addr = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{addr.host}:{addr.port}")
    d.expect("keep", [0, 1], 16, addr)
    for junk in (b"", b"\xc1garbage", b"\x93\x01\x02\x03"):
        sock.send(junk)
    reply = sock.recv() if sock.poll(5000) else b""
    assert b"refused" in reply
    p.prefill_done("keep", [0, 1, 2, 3], 16)
    [got] = until(d.finished)
    assert got.ok
    assert p.stats()["wire_errors"] >= 2
    sock.close()


def test_failed_write_tells_decode_and_frees_both_sides(pair):
    hub, src, dst, p, d, addr = pair
    hub.fail_next_writes["D-agent"] = 1
    d.expect("bad", [0], 8, addr)
    time.sleep(0.05)
    p.prefill_done("bad", [0, 1], 8)
    [sent] = until(p.finished)
    assert not sent.ok and sent.block_ids == (0, 1) and "failed" in sent.reason
    [got] = until(d.finished)
    assert not got.ok and got.block_ids == (0,) and "WRITE failed" in got.reason


def test_dead_decode_mid_write_releases_prefill_blocks(pair):
    hub, src, dst, p, d, addr = pair
    hub.hold_writes = True
    d.expect("dies", [0, 1], 16, addr)
    time.sleep(0.05)
    p.prefill_done("dies", [4, 5, 6, 7], 16)
    time.sleep(0.1)
    hub.kill("D-agent")
    hub.release_held()
    [sent] = until(p.finished)
    assert not sent.ok and sent.block_ids == (4, 5, 6, 7)
    assert p.pending() == 0


def test_decode_abort_mid_flight_waits_for_the_write_then_frees(pair):
    hub, src, dst, p, d, addr = pair
    hub.hold_writes = True
    d.expect("ab", [2, 3], 16, addr)
    time.sleep(0.05)
    p.prefill_done("ab", [8, 9, 10, 11], 16)
    until(lambda: [1] if hub.held else [])
    d.abort("ab", "client went away")
    time.sleep(0.2)
    assert d.finished() == []  # a WRITE may still land in blocks 2, 3: not handed back yet
    hub.release_held()
    [got] = until(d.finished)
    assert not got.ok and got.block_ids == (2, 3) and "client went away" in got.reason
    assert got.failure is Failure.ABORTED
    [sent] = until(p.finished)
    assert sent.block_ids == (8, 9, 10, 11)
    assert p.pending() == 0 and d.pending() == 0


def test_prefill_abort_before_registration_fails_decode_fast(pair):
    hub, src, dst, p, d, addr = pair
    p.prefill_done("gone", [1], 4)
    p.abort("gone")
    [sent] = until(p.finished)
    assert not sent.ok and sent.failure is Failure.ABORTED
    d.expect("gone", [1], 4, addr)
    [got] = until(d.finished, timeout=2.0)  # well before the 3 s ready timeout
    assert not got.ok and "released" in got.reason
    assert got.failure is Failure.REFUSED  # the prefill's kind, from the wire: nothing left to serve it


def test_lease_expiry_without_registration_frees_source(pair):
    hub, src, dst, p, d, addr = pair
    p.prefill_done("orphan", [3, 4], 8)
    [sent] = until(p.finished, timeout=5.0)
    assert not sent.ok and "lease expired" in sent.reason and sent.block_ids == (3, 4)
    assert sent.failure is Failure.EXPIRED


def test_decode_times_out_when_prefill_never_runs(pair):
    hub, src, dst, p, d, addr = pair
    d.expect("never", [1], 8, addr)
    [got] = until(d.finished, timeout=6.0)
    assert isinstance(got, RecvResult) and not got.ok and "lease expired" in got.reason


def test_layout_mismatch_is_refused_at_connect():
    hub = MemoryHub()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=8, **GEO))
    other = dict(GEO, num_layers=4)
    dst = HostKVCache(KVLayout(block_size=4, num_blocks=8, **other))
    with (
        PrefillEndpoint(
            KVPushConfig.from_mapping(dict(engine_id="P", port=0)),
            src.layout,
            transport=MemoryTransport("P", hub),
        ) as p,
        DecodeEndpoint(KVPushConfig(engine_id="D"), dst.layout, transport=MemoryTransport("D", hub)) as d,
        pytest.raises(LayoutError, match="num_layers"),
    ):
        d.connect(PrefillAddress("P", *p.address))


def test_config_refuses_bad_values():
    from kvpush.config import ConfigError

    with pytest.raises(ConfigError, match="ready_timeout_s"):
        KVPushConfig.from_mapping(dict(lease_s=10, ready_timeout_s=5))
    with pytest.raises(ConfigError, match="unknown field `prot`"):
        KVPushConfig.from_mapping({"prot": 1})
    with pytest.raises(ConfigError, match="port"):
        KVPushConfig.from_mapping(dict(port=70000))


def test_engine_calls_refuse_bad_tables_at_once(pair):
    hub, src, dst, p, d, addr = pair
    with pytest.raises(LayoutError, match="cannot hold 40 tokens"):
        d.expect("short", [0, 1], 40, addr)
    with pytest.raises(LayoutError, match="outside"):
        p.prefill_done("oob", [999], 4)
    with pytest.raises(ValueError, match="num_tokens"):
        p.prefill_done("zero", [1], 0)
    assert p.pending() == 0 and d.pending() == 0


def test_cancel_before_expect_frees_prefill_blocks_at_once(pair):
    hub, src, dst, p, d, addr = pair
    p.prefill_done("dropped", [6, 7], 8)
    time.sleep(0.05)
    d.cancel("dropped", addr, "client disconnected before decode scheduled it")
    [sent] = until(p.finished, timeout=1.5)  # the lease is 2 s: this must come from the cancel
    assert not sent.ok and sent.block_ids == (6, 7) and "client disconnected" in sent.reason
    assert p.pending() == 0 and d.pending() == 0


def test_result_listeners_fire_once_a_result_is_ready_and_a_broken_one_harms_nothing(pair):
    hub, src, dst, p, d, addr = pair
    seen: dict[str, list[int]] = {"decode": [], "prefill": []}

    def listener(side):
        def call():
            # a result is already available when the listener runs
            seen[side].append(1)

        return call

    d.set_result_listener(listener("decode"))
    p.set_result_listener(listener("prefill"))
    d.expect("a", [3, 1], 12, addr)
    p.prefill_done("a", [5, 6, 2], 12)
    [got] = until(d.finished)
    [sent] = until(p.finished)
    assert got.ok and sent.ok
    assert seen == {"decode": [1], "prefill": [1]}

    def broken():
        raise RuntimeError("listener bug")

    d.set_result_listener(broken)
    p.set_result_listener(broken)
    d.expect("b", [4, 2], 12, addr)
    p.prefill_done("b", [7, 8, 9], 12)
    [got] = until(d.finished)
    [sent] = until(p.finished)
    assert got.ok and sent.ok  # the transfer threads survived the listener's exception
    assert same_bytes(src, dst, [7, 8, 9], [4, 2], 12)
