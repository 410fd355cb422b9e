"""The streamed sender machine under random interleavings of ready ranges, registrations (new attempts
included), prefill_done, aborts from either side, the clock, and WRITE outcomes (ok, failed, abandoned).

Checked on every schedule: no WRITE reads a token-layer before kv_ready/prefill_done reported it; no
token-layer is written twice into one attempt of a decode rank (no duplicate bytes); the decode is told
once per attempt and rank, success only after every byte of it landed (nothing lost) and never while a
WRITE into it is in flight unless that WRITE carries the word; the source is released once, only after
every WRITE from it settled, and nothing is started for a request after its release; before prefill_done
a WRITE covers whole blocks only (a chunk's partial last block waits for the rest of its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.ranges import Range, StreamPolicy, pending_ranges, per_layer_ranges
from kvpush.protocol.sender import (
    Forget,
    NotifyDone,
    NotifyFailure,
    ReleaseSource,
    SenderState,
    StartWrite,
)
from kvpush.protocol.wire import Abort, Registration

LAYERS, TOKENS, ALIGN = 4, 64, 8
RID = "r"


@dataclass
class World:
    s: SenderState
    policy: StreamPolicy = field(default_factory=StreamPolicy)
    now: float = 0.0
    attempt: int = 0
    ready: list[int] = field(default_factory=lambda: [0] * LAYERS)
    done: bool = False
    inflight: list[StartWrite] = field(default_factory=list)
    written: dict[tuple[int, int], set[tuple[int, int]]] = field(default_factory=dict)  # (att, rank)
    told: dict[tuple[int, int], str] = field(default_factory=dict)  # (att, rank) -> "ok" / "failed"
    releases: int = 0
    abandoned: set[tuple[int, int]] = field(default_factory=set)  # (att, rank) with a WRITE given up
    ready_reported: bool = False
    engine_aborted: bool = False
    forgotten: bool = False  # the machine forgot the request (ended, no prefill_done within a lease)

    def apply(self, actions, ack=False):
        """ack: the actions answer a decode's message (Abort, Registration): a failure word may repeat."""
        for a in actions:
            key = (a.attempt, a.decode_rank) if not isinstance(a, ReleaseSource | Forget) else None
            if isinstance(a, StartWrite):
                assert self.releases == 0, "a WRITE started after the source was released"
                layers = range(*(a.layers or (0, LAYERS)))
                frontier = [TOKENS] * LAYERS if self.done else self.ready
                cells = {(layer, t) for layer in layers for t in range(a.token_start, a.num_tokens)}
                assert all(t < frontier[layer] for layer, t in cells), "read KV not reported ready"
                r = Range(a.token_start, a.num_tokens, *(a.layers or (0, LAYERS)))
                assert self.done or self.policy.early(r, max(self.ready)), "streamed under the threshold"
                # a chunk's last block may be partial: before prefill_done a WRITE ends on a whole block
                # (both sides' alignment), so that block's later tokens are never taken as written
                assert a.token_start % ALIGN == 0, "a WRITE starts inside a block"
                assert self.done or a.num_tokens % ALIGN == 0, "a partial block moved before prefill_done"
                seen = self.written.setdefault(key, set())
                assert not cells & seen, "a token-layer written twice into one attempt"
                seen |= cells
                assert key not in self.told, "a WRITE into a rank already told its outcome"
                if a.notify:
                    assert not [w for w in self.inflight if (w.attempt, w.decode_rank) == key]
                self.inflight.append(a)
            elif isinstance(a, NotifyDone):
                self._tell(key, "ok")
                assert self.written.get(key) == {(lay, t) for lay in range(LAYERS) for t in range(TOKENS)}
            elif isinstance(a, NotifyFailure):
                if key in self.written or key in self.told:  # a rank that saw WRITEs: word after they settled
                    assert not [w for w in self.inflight if (w.attempt, w.decode_rank) == key]
                if key in self.abandoned and key not in self.told:
                    assert a.abandoned, "a WRITE was given up: the decode must fence before it reuses blocks"
                self._tell(key, "failed", refusal=ack or key not in self.written)
            elif isinstance(a, Forget):
                assert not self.done and not self.forgotten, "forgot a request prefill_done ended, or twice"
                assert not self.inflight, "forgot a request with a WRITE from its blocks in flight"
                assert (a.ready_blocks is not None) == self.ready_reported, "kv_ready blocks not named"
                self.forgotten = True
            else:
                assert not self.inflight, "source released while a WRITE from it is in flight"
                self.releases += 1
                assert self.releases == 1, "source released twice"

    def _tell(self, key, what, refusal=False):
        if refusal and key in self.told:
            return  # a refusal repeated for a duplicate registration is an answer to that message
        assert key not in self.told, f"decode told twice: {self.told.get(key)} then {what}"
        self.told[key] = what

    def settle(self, i: int, outcome: str) -> None:
        w = self.inflight.pop(i % len(self.inflight))
        ok = outcome == "ok"
        if outcome == "abandon":
            self.abandoned.add((w.attempt, w.decode_rank))
        nbytes = (w.num_tokens - w.token_start) * len(range(*(w.layers or (0, LAYERS))))
        acts = self.s.on_write_done(
            RID, w.attempt, w.decode_rank, ok, nbytes, outcome, self.now, outcome == "abandon"
        )
        if ok and w.notify:
            self._tell((w.attempt, w.decode_rank), "ok")
            key = (w.attempt, w.decode_rank)
            assert self.written[key] == {(lay, t) for lay in range(LAYERS) for t in range(TOKENS)}
        self.apply(acts)


def registration(attempt: int, rank: int, expires: float) -> Registration:
    return Registration(
        request_id=RID,
        attempt=attempt,
        decode_engine_id="D",
        decode_rank=rank,
        decode_tp=2,
        block_ids=list(range(TOKENS // 8)),
        num_tokens=TOKENS,
        expires_at=expires,
    )


op = st.one_of(
    st.tuples(st.just("ready"), st.integers(1, TOKENS), st.just(0), st.just(LAYERS)),  # a prefill chunk
    st.tuples(st.just("ready"), st.integers(1, TOKENS), st.integers(0, LAYERS - 1), st.integers(1, LAYERS)),
    st.tuples(st.just("register"), st.integers(0, 1), st.booleans()),
    st.tuples(st.just("done")),
    st.tuples(st.just("settle"), st.integers(0, 20), st.sampled_from(["ok", "ok", "ok", "fail", "abandon"])),
    st.tuples(st.just("abort")),
    st.tuples(st.just("decode_abort"), st.integers(0, 1)),
    st.tuples(st.just("tick"), st.floats(0.0, 8.0)),
)


@settings(max_examples=600, deadline=None)
@given(st.lists(op, max_size=40), st.integers(0, 2))
def test_streamed_schedules_keep_every_invariant(ops, policy):
    stream = [
        StreamPolicy(),
        StreamPolicy(min_tokens=32),
        StreamPolicy(min_bytes=4 * 16, token_layer_bytes=1),
    ][policy]
    # one prefill rank (TP 1) owing two decode ranks (TP 2); token-layer bytes = 1 for the policy
    w = World(SenderState(0, 1, 2, lease_s=20.0, tombstone_s=60.0, num_layers=LAYERS, stream=stream), stream)
    for o in ops:
        kind = o[0]
        if kind == "ready" and not w.done:
            n, lo, hi = o[1], o[2], max(o[2] + 1, o[3])
            for layer in range(lo, hi):
                w.ready[layer] = max(w.ready[layer], n)
            blocks = tuple(range(100, 100 + -(-max(w.ready) // 8)))
            w.ready_reported = True
            w.apply(w.s.on_kv_ready(RID, blocks, n, (lo, hi), w.now))
        elif kind == "register":
            old = w.attempt
            if o[2]:
                w.attempt += 1  # the decode resends with a new attempt
            reg = registration(w.attempt, o[1], w.now + 30.0)
            w.apply(w.s.on_registration(reg, w.now, ALIGN), ack=True)  # a refusal answers that message
            if o[2]:  # as the receiver does: the new registration first, then the old attempt's Abort
                for rank in (0, 1):
                    abort = Abort(RID, old, "D", rank, "superseded")
                    w.apply(w.s.on_decode_abort(abort, w.now), ack=True)
        elif kind == "done" and not w.done:
            w.done = True
            w.apply(w.s.on_prefill_done(RID, tuple(range(100, 108)), TOKENS, w.now))
        elif kind == "settle" and w.inflight:
            w.settle(o[1], o[2])
        elif kind == "abort" and not w.engine_aborted:
            w.engine_aborted = True
            w.apply(w.s.abort(RID, "engine abort", w.now))
        elif kind == "decode_abort":
            w.apply(w.s.on_decode_abort(Abort(RID, w.attempt, "D", o[1], "gone"), w.now), ack=True)
        elif kind == "tick":
            w.now += o[1]
            w.apply(w.s.on_tick(w.now))
    # drain: every WRITE settles, prefill finishes, time passes
    while w.inflight:
        w.settle(0, "ok")
    if not w.done:  # prefill_done is the terminal call, after an abort too
        w.done = True
        w.apply(w.s.on_prefill_done(RID, tuple(range(100, 108)), TOKENS, w.now))
    while w.inflight:
        w.settle(0, "ok")
    for _ in range(3):
        w.now += 100.0
        w.apply(w.s.on_tick(w.now))
        while w.inflight:
            w.settle(0, "ok")
    assert not w.inflight and len(w.s) == 0, "request still tracked after everything settled"
    assert w.releases == 1, "the source was never released"
    # every attempt-rank that received bytes got exactly one word
    for key in w.written:
        assert key in w.told, f"decode rank {key} received WRITEs and was never told the outcome"


def test_pending_ranges_coalesce_layers_and_respect_alignment():
    assert pending_ranges([40, 40, 17, 17], [0, 0, 0, 0], 64, 8) == [Range(0, 40, 0, 2), Range(0, 16, 2, 4)]
    assert pending_ranges([64, 64], [40, 40], 64, 16) == [Range(40, 64, 0, 2)]  # the last range: no rounding
    assert pending_ranges([20, 20], [16, 16], 64, 16) == []  # not a whole aligned step yet
    assert StreamPolicy(min_tokens=100).early(Range(0, 16, 0, 1), 99) is False
    assert StreamPolicy(min_bytes=64, token_layer_bytes=2).early(Range(0, 16, 0, 2), 16) is True


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.integers(0, 80), min_size=1, max_size=6),
    st.lists(st.integers(0, 80), min_size=1, max_size=6),
    st.integers(1, 80),
    st.sampled_from([1, 8, 16, 32]),
    st.booleans(),
)
def test_pending_ranges_uniform_fast_path_equals_per_layer(layers, ready, sent, target, align, uniform):
    """One frontier for every layer (a one-piece request) is answered without the per-layer walk: the same
    ranges as the walk, for uniform and mixed frontiers alike."""
    ready = [ready[0]] * layers if uniform else (ready * layers)[:layers]
    sent = [min(sent[0], target)] * layers if uniform else [min(x, target) for x in (sent * layers)[:layers]]
    assert pending_ranges(ready, sent, target, align) == per_layer_ranges(ready, sent, target, align)


def _streamed(policy: StreamPolicy | None = None) -> World:
    w = World(SenderState(0, 1, 2, lease_s=20.0, tombstone_s=60.0, num_layers=LAYERS, stream=policy))
    w.apply(w.s.on_registration(registration(0, 0, 30.0), 0.0, ALIGN))
    return w


def _ready(w: World, n: int) -> None:
    w.ready = [max(r, n) for r in w.ready]
    w.apply(w.s.on_kv_ready(RID, tuple(range(100, 100 + -(-n // 8))), n, None, w.now))


def test_the_last_range_posted_beside_one_in_flight_leaves_the_notification_to_go_alone():
    w = _streamed()
    _ready(w, 16)
    assert [(a.token_start, a.num_tokens, a.notify) for a in w.inflight] == [(0, 16, False)]
    w.done = True
    w.apply(w.s.on_prefill_done(RID, tuple(range(100, 108)), TOKENS, 0.0))
    assert [(a.token_start, a.num_tokens, a.notify) for a in w.inflight] == [(0, 16, False), (16, 64, False)]
    acts = w.s.on_write_done(RID, 0, 0, True, 64, "", 0.0)
    w.inflight.pop(0)
    assert acts == []  # one still in flight: no word yet
    acts = w.s.on_write_done(RID, 0, 0, True, 192, "", 0.0)
    w.inflight.pop(0)
    assert [type(a) for a in acts] == [NotifyDone] and acts[0].nbytes == 256


def test_an_abort_after_3_of_8_ranges_releases_only_after_every_write_settled():
    w = _streamed()
    for c in (8, 16, 24):
        _ready(w, c)
    assert len(w.inflight) == 3
    w.apply(w.s.abort(RID, "client gone", 0.0))
    w.done = True
    w.apply(w.s.on_prefill_done(RID, tuple(range(100, 108)), TOKENS, 0.0))  # the terminal call
    assert w.releases == 0 and len(w.inflight) == 3
    w.settle(0, "ok")
    w.settle(0, "ok")
    assert w.releases == 0 and w.told == {}
    w.settle(0, "ok")
    assert w.releases == 1 and w.told == {(0, 0): "failed"}


def test_ranges_ready_before_the_registration_coalesce_into_one_write():
    w = World(SenderState(0, 1, 2, lease_s=20.0, tombstone_s=60.0, num_layers=LAYERS))
    for c in (8, 16, 40):
        _ready(w, c)
    w.apply(w.s.on_registration(registration(0, 0, 30.0), 0.0, ALIGN))
    assert [(a.token_start, a.num_tokens, a.layers) for a in w.inflight] == [(0, 40, None)]


def test_an_aborted_stream_with_no_prefill_done_is_forgotten_by_name_after_a_lease():
    """The engine aborted after 2 ranges and never made the terminal prefill_done: a lease later the
    machine forgets the request and names the kv_ready blocks the engine still holds; a late
    prefill_done still gets them back, failed."""
    w = _streamed()
    for c in (8, 16):
        _ready(w, c)
    w.apply(w.s.abort(RID, "client gone", 0.0))
    while w.inflight:
        w.settle(0, "ok")
    w.now = 19.0
    w.apply(w.s.on_tick(w.now))
    assert not w.forgotten and len(w.s) == 1  # within the lease: still waiting for prefill_done
    w.now = 21.0
    forgot = [a for a in w.s.on_tick(w.now) if isinstance(a, Forget)]
    assert len(forgot) == 1 and forgot[0].ready_blocks == (100, 101) and len(w.s) == 0
    assert "client gone" in forgot[0].reason and w.releases == 0
    late = w.s.on_prefill_done(RID, tuple(range(100, 108)), TOKENS, w.now)
    assert [(type(a), a.ok) for a in late] == [(ReleaseSource, False)]
