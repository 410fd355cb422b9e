"""prefill_done posting a WRITE made ahead from the engine's own thread (loop.run_inline), over real NIXL.

A small armed request skips the thread hop only when the push thread is between rounds; everything else
(a barrier, a larger request, engine_post_max_bytes 0, the push thread mid-round) goes to the push thread
as before. Every byte is verified and every handle NIXL made is released once (the `pair` fixture)."""

from __future__ import annotations

import threading

import pytest

from kvpush.apps.demo.pattern import count_wrong_bytes
from kvpush.endpoint.prefill import PushThread
from kvpush.errors import EndpointClosed
from kvpush.transport.nixl import NixlTransport
from tests.endpoint.test_armed_nixl import N, Pair, fill_src, pair, results, until

__all__ = ["pair"]  # the fixture, imported for these tests

pytestmark = pytest.mark.e2e


@pytest.fixture
def posters(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread names that reposted a WRITE made ahead, in order."""
    names: list[str] = []
    real = NixlTransport.repost

    def repost(self: NixlTransport, handle: object) -> None:
        names.append(threading.current_thread().name)
        real(self, handle)

    monkeypatch.setattr(NixlTransport, "repost", repost)
    return names


def armed_request(pair: Pair, rid: str, i: int, tag: int) -> list[int]:
    src, dst = [3 * i, 3 * i + 1, 3 * i + 2], [2 * i, 2 * i + 1]
    fill_src(pair, src, tag)
    pair.pe.source_blocks(rid, src, N)
    pair.de.expect(rid, dst, N, pair.addr)
    until(pair.armed)
    return dst


def landed(pair: Pair, rid: str, dst: list[int], tag: int) -> None:
    assert results(pair.pe, rid).ok and results(pair.de, rid).ok
    assert count_wrong_bytes(pair.d_cache.to_host(), pair.d_cache.layout, dst, N, tag) == 0


def test_small_armed_request_is_posted_from_the_engine_thread(pair: Pair, posters: list[str]) -> None:
    engine = threading.current_thread().name
    for i in range(4):  # the push thread may be mid-round (a tick, a ping) at one call: then it posts
        dst = armed_request(pair, f"r{i}", i + 1, 20 + i)
        pair.pe.prefill_done(f"r{i}", [3 * (i + 1), 3 * (i + 1) + 1, 3 * (i + 1) + 2], N)
        landed(pair, f"r{i}", dst, 20 + i)
    assert len(posters) == 4 and engine in posters, posters
    assert pair.counters()["armed"] == 4 and pair.armed() == 0
    assert pair.counters()["engine_posts"] == posters.count(engine)


@pytest.mark.parametrize("pair", [{"engine_post_max_bytes": 0}, {"engine_post_max_bytes": 1}], indirect=True)
def test_off_or_too_large_goes_to_the_push_thread(pair: Pair, posters: list[str]) -> None:
    for i in range(3):
        dst = armed_request(pair, f"s{i}", i + 1, 30 + i)
        pair.pe.prefill_done(f"s{i}", [3 * (i + 1), 3 * (i + 1) + 1, 3 * (i + 1) + 2], N)
        landed(pair, f"s{i}", dst, 30 + i)
    assert posters == [PushThread.name] * 3
    assert pair.counters()["engine_posts"] == 0


def test_a_barrier_keeps_the_post_and_the_barrier_on_the_push_thread(pair: Pair, posters: list[str]) -> None:
    barrier: list[str] = []
    dst = armed_request(pair, "b", 1, 41)
    pair.pe.prefill_done(
        "b", [3, 4, 5], N, kv_written=lambda: barrier.append(threading.current_thread().name)
    )
    landed(pair, "b", dst, 41)
    assert barrier == [PushThread.name] and posters == [PushThread.name]


def test_push_thread_mid_round_means_the_command_is_queued(pair: Pair, posters: list[str]) -> None:
    dst = armed_request(pair, "q", 1, 42)
    with pair.pe._loop.work:  # as if the thread were inside a round: the engine must not wait for it
        pair.pe.prefill_done("q", [3, 4, 5], N)
        assert posters == []
    landed(pair, "q", dst, 42)
    assert posters == [PushThread.name]


def test_a_command_failing_on_the_engine_thread_kills_the_endpoint_cleanly(
    pair: Pair, posters: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    armed_request(pair, "x", 1, 43)

    def broken(self: PushThread, *args: object, **kw: object) -> None:
        raise RuntimeError("state machine bug")

    monkeypatch.setattr(PushThread, "cmd_prefill_done", broken)
    until(lambda: not pair.pe._loop.work.locked())
    pair.pe.prefill_done("x", [3, 4, 5], N)  # the engine's call returns; the endpoint is dead from here
    with pytest.raises(EndpointClosed, match="state machine bug"):
        until(lambda: pair.pe.prefill_done("y", [6, 7, 8], N) and False, timeout=2.0)
    until(lambda: not pair.pe._loop._thread.is_alive())  # stopped, its teardown ran (handles released)
    with pytest.raises(EndpointClosed, match="state machine bug"):
        until(lambda: pair.pe.finished() and False, timeout=2.0)
    assert posters == [] and pair.armed() == 0
