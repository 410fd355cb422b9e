"""The soak prefill's streamed requests (kvpush/apps/soak/stream.py), against a recording endpoint: each
shape reports the ranges it should, in order, every reported range's bytes are in the cache when it is
reported (and are not with the `early` self-check, or that check could not fail), and a mid-stream
self-abort never follows the last range."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvpush.apps.demo.pattern import copy_layer, count_wrong_bytes, fill
from kvpush.apps.soak.common import soak_geometry
from kvpush.apps.soak.stream import STREAMED, StreamedPrefill
from kvpush.backends.host import HostKVCache

TAG = 5


class Recorder:
    """Records each call with a copy of the cache as it was at the call."""

    def __init__(self, cache: HostKVCache) -> None:
        self.cache = cache
        self.calls: list[tuple[str, list[int], int, tuple[int, int] | None, np.ndarray]] = []

    def kv_ready(self, rid: str, blocks: list[int], n: int, layers: tuple[int, int] | None = None) -> None:
        self.calls.append(("kv_ready", list(blocks), n, layers, self.cache.buffer.copy()))

    def prefill_done(self, rid: str, blocks: list[int], n: int) -> None:
        self.calls.append(("prefill_done", list(blocks), n, None, self.cache.buffer.copy()))

    def abort(self, rid: str, reason: str) -> None:
        self.calls.append(("abort", [], 0, None, self.cache.buffer.copy()))


def run(shape: str, n: int, late: bool = False, abort_after: int = -1) -> tuple[Recorder, Any, list[int]]:
    cache = HostKVCache(soak_geometry(16, 64).layout(0))
    layout = cache.layout
    need = -(-n // layout.block_size)
    blocks = [int(b) for b in np.random.default_rng(n).permutation(layout.num_blocks)[:need]]
    fill(cache.buffer, layout, blocks, n, TAG + 1)  # what the blocks held before: another request's KV
    ep = Recorder(cache)
    streams = StreamedPrefill(ep, cache.buffer, layout, late_writes=late)  # type: ignore[arg-type]
    streams.start("r", blocks, n, TAG, shape, abort_after)
    rounds = 0
    while streams.live:
        streams.step()
        rounds += 1
        assert rounds < 100
    return ep, streams, blocks


def wrong_at_report(layout: Any, call: tuple[str, list[int], int, tuple[int, int] | None, np.ndarray]) -> int:
    """Bytes of the reported range that were not the request's pattern when it was reported."""
    _, prefix, tokens, layers, snapshot = call
    probe = np.zeros_like(snapshot)
    fill(probe, layout, prefix, tokens, TAG)  # right everywhere ...
    lo, hi = layers if layers is not None else (0, layout.num_layers)
    for layer in range(lo, hi):  # ... but in the reported layers, which come from the cache as it was
        copy_layer(probe, snapshot, layout, prefix, layer)
    return count_wrong_bytes(probe, layout, prefix, tokens, TAG)


@pytest.mark.parametrize("shape", STREAMED)
@pytest.mark.parametrize("n", [16, 100, 700])
def test_each_shape_reports_written_ranges_in_order_then_prefill_done(shape, n):
    ep, streams, blocks = run(shape, n)
    layout = ep.cache.layout
    kinds = [c[0] for c in ep.calls]
    assert kinds[-1] == "prefill_done" and kinds.count("prefill_done") == 1 and "abort" not in kinds
    assert ep.calls[-1][1] == blocks and ep.calls[-1][2] == n
    for call in ep.calls:
        assert wrong_at_report(layout, call) == 0, call[:4]
    ranges = [c for c in ep.calls if c[0] == "kv_ready"]
    for _, prefix, tokens, _layers, _ in ranges:
        assert prefix == blocks[: len(prefix)] and 0 < tokens <= n
        assert tokens == n or tokens % layout.block_size == 0  # a chunk ends on a block boundary
    tokens_seen = [c[2] for c in ranges]
    assert tokens_seen == sorted(tokens_seen)
    if shape == "layers":
        assert [c[3] for c in ranges] == [(i, i + 1) for i in range(layout.num_layers)]
    if shape == "chunks":
        assert all(c[3] is None for c in ranges)
        assert len(ranges) == (0 if n < 2 * layout.block_size else 2)
    if shape == "chunk_layers":
        chunks = 1 if n < 2 * layout.block_size else 3
        assert len(ranges) == chunks * layout.num_layers
    assert streams.take_ended() == [("r", len(ranges), False)]
    assert count_wrong_bytes(ep.cache.buffer, layout, blocks, n, TAG) == 0


def test_late_writes_report_ranges_before_their_bytes():
    """The `early` self-check: the harness's byte check sees ranges reported before they were written."""
    ep, _, _ = run("layers", 700, late=True)
    ranges = [c for c in ep.calls if c[0] == "kv_ready"]
    assert all(wrong_at_report(ep.cache.layout, c) > 0 for c in ranges)


@pytest.mark.parametrize("abort_after", [0, 1, 3, 4, 99])
def test_a_self_abort_comes_after_a_range_and_is_ended_by_prefill_done(abort_after):
    """Aborted mid-stream, then the terminal prefill_done a round later (docs/contract.md: only it brings
    the SendResult; a soak that skipped it stalled a 10,000-request run on blocks never given back)."""
    ep, streams, blocks = run("layers", 300, abort_after=abort_after)
    kinds = [c[0] for c in ep.calls]
    reported = min(max(1, abort_after), 4)
    assert kinds == ["kv_ready"] * reported + ["abort", "prefill_done"]
    assert ep.calls[-1][1] == blocks and ep.calls[-1][2] == 300
    assert streams.take_ended() == [("r", reported, True)]


def test_a_driver_abort_stops_the_stream_and_prefill_done_ends_it():
    cache = HostKVCache(soak_geometry(16, 64).layout(0))
    ep = Recorder(cache)
    streams = StreamedPrefill(ep, cache.buffer, cache.layout)  # type: ignore[arg-type]
    streams.start("r", [1, 2, 3], 40, TAG, "layers", -1)
    streams.aborted("r")  # the engine called ep.abort("r")
    streams.step()
    streams.step()
    assert [c[0] for c in ep.calls] == ["kv_ready", "prefill_done"] and not streams.live
    assert ep.calls[-1][1:3] == ([1, 2, 3], 40)
    assert streams.take_ended() == [("r", 1, False)]
    streams.aborted("r")  # ended already: nothing more
    streams.step()
    assert len(ep.calls) == 2


def test_an_unknown_shape_is_refused_by_name():
    cache = HostKVCache(soak_geometry(16, 64).layout(0))
    streams = StreamedPrefill(Recorder(cache), cache.buffer, cache.layout)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown stream shape 'sideways'"):
        streams.start("r", [1], 16, TAG, "sideways", -1)
