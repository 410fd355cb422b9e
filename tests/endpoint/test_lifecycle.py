"""Endpoint lifecycle over the in-memory transport and control plane: death is sticky and loud, closing
reports every live request, and the engine's barrier and the backend hooks run on the transfer threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpush.backends.host import HostKVCache
from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, MemoryControl, PrefillAddress, PrefillEndpoint
from kvpush.errors import EndpointClosed
from kvpush.protocol.layout import KVLayout
from kvpush.transport.memory import MemoryHub, MemoryTransport
from tests.endpoint.util import until

GEO = dict(num_layers=2, total_kv_heads=2, head_dim=8, dtype_size=2)


def make_pair(hooks_p=None, hooks_d=None):
    hub, control = MemoryHub(), MemoryControl()
    src = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    dst = HostKVCache(KVLayout(block_size=4, num_blocks=16, **GEO))
    src.buffer[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    cfg = dict(lease_s=5.0, ready_timeout_s=8.0)
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, **cfg)),
        src.layout,
        transport=MemoryTransport("P-agent", hub),
        control=control,
        hooks=hooks_p,
    )
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", **cfg)),
        dst.layout,
        transport=MemoryTransport("D-agent", hub),
        control=control,
        hooks=hooks_d,
    )
    p.start()
    d.start()
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    return hub, src, dst, p, d, addr


@pytest.fixture
def pair():
    hub, src, dst, p, d, addr = make_pair()
    yield hub, src, dst, p, d, addr
    d.close()
    p.close()


def test_in_memory_control_plane_carries_a_whole_request(pair):
    hub, src, dst, p, d, addr = pair
    d.expect("r", [3, 4], 8, addr)
    p.prefill_done("r", [9, 10], 8)
    [got] = until(d.finished)
    [sent] = until(p.finished)
    assert got.ok and sent.ok and got.nbytes == 8 * 2 * 2 * 2 * 16
    assert np.array_equal(src.block_view(1, 1, 10), dst.block_view(1, 1, 4))


@pytest.mark.parametrize("teardown_delay", [0.0, 0.3])
def test_a_dead_decode_thread_fails_its_live_requests_then_every_call_raises(pair, teardown_delay):
    """teardown_delay: the dying thread is slow to report (a loaded box): finished() must neither raise
    before the results it reports on the way down were handed out, nor return them twice. It used to
    raise as soon as the thread was marked dead, before its teardown had queued anything."""
    hub, src, dst, p, d, addr = pair
    d.expect("live", [1, 2], 8, addr)
    until(lambda: [1] if d.stats()["pending"] else [])

    def boom():
        raise RuntimeError("injected crash in the receive loop")

    teardown = d._recv.teardown

    def slow_teardown():
        time.sleep(teardown_delay)
        teardown()

    d._recv.teardown = slow_teardown
    d._recv.transport.drain_notifs = boom  # the next loop round raises on the transfer thread
    [failed] = until(d.finished)  # reported once, on the way down: blocks 1, 2 can be reused
    assert not failed.ok and failed.block_ids == (1, 2) and "died" in failed.reason
    with pytest.raises(EndpointClosed, match="died") as info:
        d.finished()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EndpointClosed):
        d.expect("later", [3], 4, addr)
    with pytest.raises(EndpointClosed):
        d.wait_any(0.01)


def test_a_dead_prefill_thread_releases_its_source_blocks_then_every_call_raises(pair):
    hub, src, dst, p, d, addr = pair
    hub.hold_writes = True
    d.expect("w", [0, 1], 8, addr)
    p.prefill_done("w", [5, 6], 8)
    until(lambda: [1] if hub.held else [])

    def boom(handle):
        raise RuntimeError("injected crash while polling")

    p._push.transport.poll = boom
    [sent] = until(p.finished)
    assert not sent.ok and sent.block_ids == (5, 6) and "died" in sent.reason
    with pytest.raises(EndpointClosed, match="died"):
        p.finished()
    with pytest.raises(EndpointClosed):
        p.prefill_done("x", [1], 4)


def test_closing_the_decode_reports_every_live_request_failed():
    hub, src, dst, p, d, addr = make_pair()
    d.expect("a", [0, 1], 8, addr)
    d.expect("b", [2], 4, addr)
    until(lambda: [1] if d.stats()["pending"] == 2 else [])
    d.close()
    got = {r.request_id: r for r in d.finished()}
    assert set(got) == {"a", "b"} and not any(r.ok for r in got.values())
    assert got["a"].block_ids == (0, 1) and "closed" in got["a"].reason
    with pytest.raises(EndpointClosed, match="closed"):
        d.finished()
    assert not d._loop._thread.is_alive()
    p.close()


def test_closing_the_prefill_mid_write_releases_the_source_blocks():
    hub, src, dst, p, d, addr = make_pair()
    hub.hold_writes = True
    d.expect("m", [0, 1], 8, addr)
    p.prefill_done("m", [7, 8], 8)
    until(lambda: [1] if hub.held else [])
    p.close()
    [sent] = p.finished()
    assert not sent.ok and sent.block_ids == (7, 8) and "closed" in sent.reason
    with pytest.raises(EndpointClosed):
        p.finished()
    d.close()


def test_kv_written_barrier_runs_on_the_push_thread_before_the_bytes_move(pair):
    hub, src, dst, p, d, addr = pair
    seen: list[tuple[str, bool]] = []

    def barrier():
        seen.append((threading.current_thread().name, bool(dst.block_view(0, 0, 5).any())))

    d.expect("b", [5], 4, addr)
    p.prefill_done("b", [2], 4, kv_written=barrier)
    [got] = until(d.finished)
    assert got.ok and seen == [("kvpush-push", False)]  # once, on the push thread, before any byte landed

    def broken():
        raise RuntimeError("device fault")

    assert [r.request_id for r in until(p.finished)] == ["b"]
    d.expect("c", [6], 4, addr)
    p.prefill_done("c", [3], 4, kv_written=broken)
    [sent] = until(p.finished)
    assert sent.request_id == "c" and not sent.ok and "barrier failed" in sent.reason
    [failed] = until(d.finished)
    assert not failed.ok  # the decode was told, and the push thread lives on
    d.expect("d", [7], 4, addr)
    p.prefill_done("d", [4], 4)
    assert until(d.finished)[0].ok


class RecordingHooks:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[int, ...], str]] = []

    def before_write(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self.calls.append(("before_write", request_id, block_ids, threading.current_thread().name))

    def after_receive(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self.calls.append(("after_receive", request_id, block_ids, threading.current_thread().name))


def test_staging_hooks_run_on_the_transfer_threads_before_write_and_before_ready():
    hp, hd = RecordingHooks(), RecordingHooks()
    hub, src, dst, p, d, addr = make_pair(hp, hd)
    try:
        d.expect("h", [1, 2], 8, addr)
        p.prefill_done("h", [3, 4], 8)
        [got] = until(d.finished)
        assert got.ok
        assert hp.calls == [("before_write", "h", (3, 4), "kvpush-push")]
        assert hd.calls == [("after_receive", "h", (1, 2), "kvpush-recv")]  # before finished() saw it
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_start_that_fails_after_the_thread_started_leaves_no_thread_and_no_agent(role):
    """Issue 21: the metrics port was taken, start() raised, and the transfer thread and its NIXL agent
    stayed behind (and `with Endpoint(...)` could not clean up: __exit__ never runs when __enter__
    raises)."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    hub = MemoryHub()
    cache = HostKVCache(
        KVLayout(num_layers=1, block_size=4, num_blocks=8, total_kv_heads=1, head_dim=8, dtype_size=2)
    )
    config = KVPushConfig(engine_id="E", port=0, metrics_port=busy.getsockname()[1])
    kind = PrefillEndpoint if role == "prefill" else DecodeEndpoint
    before = {t.name for t in threading.enumerate()}
    try:
        with pytest.raises(Exception, match="cannot serve Prometheus metrics"):  # noqa: SIM117
            with kind(config, cache.layout, transport=MemoryTransport("E-agent", hub)):
                pytest.fail("the with-block must not run")
        assert "E-agent" not in hub.agents  # the transport was closed
        leaked = {t.name for t in threading.enumerate() if t.name.startswith("kvpush")} - before
        assert not leaked, leaked
    finally:
        busy.close()


def test_finished_hands_out_what_a_dying_thread_reports_before_it_raises(pair):
    """Between the thread's death and the end of its teardown, finished() answers [] (not EndpointClosed):
    an engine polling it must still get the failed results that free its blocks."""
    hub, src, dst, p, d, addr = pair
    hub.hold_writes = True
    d.expect("w", [0, 1], 8, addr)
    p.prefill_done("w", [5, 6], 8)
    until(lambda: [1] if hub.held else [])
    reached, go_on = threading.Event(), threading.Event()
    teardown = p._push.teardown

    def slow_teardown() -> None:
        reached.set()
        go_on.wait(5)
        teardown()

    def boom(handle):
        raise RuntimeError("injected crash while polling")

    p._push.teardown = slow_teardown
    p._push.transport.poll = boom
    assert reached.wait(5) and p._loop.fatal is not None
    assert p.finished() == []  # dead, still reporting: no EndpointClosed yet
    go_on.set()
    [sent] = until(p.finished)
    assert not sent.ok and sent.block_ids == (5, 6) and "died" in sent.reason
    with pytest.raises(EndpointClosed, match="died"):
        p.finished()
