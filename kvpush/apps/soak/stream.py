"""The soak prefill's streamed requests: KV computed and reported ready range by range (kv_ready) across
several loop rounds, so the driver's faults (kills, stops, aborts, lost notifications, resets) land
mid-stream, and some requests are aborted by the prefill itself after k of their ranges. An aborted
stream still gets its terminal prefill_done, one round later, as docs/contract.md asks of an engine: its
SendResult (the blocks back) comes only after it.

Each request's pattern is made in a staging copy of the cache first; a step copies one range of it (a
layer, a prefill chunk's new blocks, or both) into the real cache and then reports it, so a WRITE that
read a range before it was reported would carry the bytes of the request the blocks last held, and the
decode's byte check would count them as corrupt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpush.apps.demo.pattern import U8, copy_layer, fill
from kvpush.endpoint import PrefillEndpoint
from kvpush.protocol.layout import KVLayout

# How a request's KV is reported: one prefill_done (whole), a layer at a time, a prefill chunk at a time
# (complete blocks, all layers), or each chunk a layer at a time (chunked prefill with layer push)
SHAPES = ("whole", "layers", "chunks", "chunk_layers")
STREAMED = SHAPES[1:]
CHUNKS = 3  # at most, cut at block boundaries


@dataclass(frozen=True)
class _Step:
    """One step of a streamed prefill: write a range's KV into the cache, then report it."""

    write: Callable[[], None]
    report: Callable[[], None]  # kv_ready, or prefill_done (final)
    final: bool = False


@dataclass
class _Stream:
    rid: str
    blocks: list[int]
    n: int
    steps: list[_Step]
    abort_after: int  # steps taken before the prefill aborts it itself (-1: never)
    done: int = 0
    ranges: int = 0  # kv_ready calls made
    aborted: bool = False  # abort() was called: the next step is the terminal prefill_done
    self_aborted: bool = False
    late_write: Callable[[], None] | None = None  # self-check "early": the last range's KV, written late


@dataclass
class StreamedPrefill:
    """The prefill child's streamed requests, advanced one step per request per loop round.

    late_writes (the soak's --self-check early): each range is reported one loop round before its KV is
    written, so WRITEs read bytes that are not there yet and the decode's byte check must count them."""

    ep: PrefillEndpoint
    buffer: U8
    layout: KVLayout
    late_writes: bool = False
    stage: U8 = field(init=False)
    live: dict[str, _Stream] = field(default_factory=dict)
    ended: list[tuple[str, int, bool]] = field(default_factory=list)  # (request, ranges, self-aborted)

    def __post_init__(self) -> None:
        self.stage = np.zeros_like(self.buffer)

    def start(self, rid: str, blocks: list[int], n: int, tag: int, shape: str, abort_after: int) -> None:
        """Make the request's pattern in the staging copy and report its first range now (the endpoint holds
        the blocks from this call until the SendResult its prefill_done brings). abort_after >= 0: the
        prefill aborts it itself after that many steps, at least one and never after its last range."""
        if shape not in STREAMED:
            raise ValueError(f"soak: unknown stream shape {shape!r}, expected one of {STREAMED}")
        fill(self.stage, self.layout, blocks, n, tag)
        steps = self._steps(rid, blocks, n, shape)
        if abort_after >= 0:
            abort_after = min(max(1, abort_after), len(steps) - 1) if len(steps) > 1 else -1
        s = _Stream(rid, blocks, n, steps, abort_after)
        self.live[rid] = s
        self._advance(s)

    def take_ended(self) -> list[tuple[str, int, bool]]:
        """Requests whose last step ran since the last call: (request, kv_ready calls, self-aborted)."""
        out, self.ended = self.ended, []
        return out

    def aborted(self, rid: str) -> None:
        """The engine called abort(rid): no range after this one, and prefill_done at the next step."""
        s = self.live.get(rid)
        if s is not None:
            s.aborted = True

    def step(self) -> None:
        """One step of every live streamed request."""
        for s in list(self.live.values()):
            self._advance(s)

    def _advance(self, s: _Stream) -> None:
        if s.late_write is not None:
            s.late_write()
            s.late_write = None
        if s.aborted:  # the terminal call, after an abort too (docs/contract.md)
            self.ep.prefill_done(s.rid, s.blocks, s.n)
            self._end(s)
            return
        if s.done == s.abort_after:
            s.aborted = s.self_aborted = True
            self.ep.abort(s.rid, "soak: aborted by the prefill engine mid-stream")
            return
        step = s.steps[s.done]
        s.done += 1
        if self.late_writes and not step.final:
            step.report()
            s.late_write = step.write
        else:
            step.write()
            step.report()
        if not step.final:
            s.ranges += 1
        if s.done == len(s.steps):
            self._end(s)

    def _end(self, s: _Stream) -> None:
        del self.live[s.rid]
        self.ended.append((s.rid, s.ranges, s.self_aborted))

    def _steps(self, rid: str, blocks: list[int], n: int, shape: str) -> list[_Step]:
        bs, layers = self.layout.block_size, self.layout.num_layers
        full = n // bs
        cuts = sorted({max(1, full * k // CHUNKS) for k in range(1, CHUNKS)}) if full >= 2 else []
        # prefixes: (blocks reported, tokens); the last is the whole request
        prefixes = [(k, k * bs) for k in cuts if k < len(blocks)] + [(len(blocks), n)]
        if shape == "layers":
            prefixes = prefixes[-1:]
        steps: list[_Step] = []
        lo = 0
        for k, tokens in prefixes:
            prefix, part = blocks[:k], blocks[lo:k]
            if shape == "chunks":
                steps.append(self._chunk(rid, prefix, tokens, part, final=k == len(blocks)))
            else:
                steps += [self._layer(rid, prefix, tokens, part, layer) for layer in range(layers)]
            lo = k
        if shape != "chunks":
            steps.append(_Step(lambda: None, lambda: self.ep.prefill_done(rid, blocks, n), final=True))
        return steps

    def _layer(self, rid: str, prefix: list[int], tokens: int, part: list[int], layer: int) -> _Step:
        def write() -> None:
            copy_layer(self.buffer, self.stage, self.layout, part, layer)

        def report() -> None:
            self.ep.kv_ready(rid, prefix, tokens, layers=(layer, layer + 1))

        return _Step(write, report)

    def _chunk(self, rid: str, prefix: list[int], tokens: int, part: list[int], final: bool) -> _Step:
        def write() -> None:
            for layer in range(self.layout.num_layers):
                copy_layer(self.buffer, self.stage, self.layout, part, layer)

        def report() -> None:
            if final:
                self.ep.prefill_done(rid, prefix, tokens)
            else:
                self.ep.kv_ready(rid, prefix, tokens)

        return _Step(write, report, final)
