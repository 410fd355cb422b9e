"""Tombstones (protocol/claims.py) against a model of the rule, and the cost of a tick: expire() looks only
at the stones that are due (it runs every tick on the push thread, and a prefill remembers every id that
finished in the last tombstone_s: 300 s by default, tens of thousands of ids on a busy engine)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.claims import Tombstones

IDS = [f"r{i}" for i in range(12)]
ENGINES = ["a", "b"]

op = st.one_of(
    st.tuples(st.just("finished"), st.sampled_from(IDS), st.floats(0, 50)),
    st.tuples(st.just("prefill_aborted"), st.sampled_from(IDS), st.floats(0, 5)),
    st.tuples(st.just("decode_aborted"), st.sampled_from(IDS), st.sampled_from(ENGINES)),
    st.tuples(st.just("forget"), st.sampled_from(IDS), st.none()),
    st.tuples(st.just("tick"), st.none(), st.floats(0, 8)),
)


class Model:
    """The rule the slow way: id -> expiry, abort-made ids per engine in order, a scan to expire."""

    def __init__(self, ttl: float, cap: int) -> None:
        self.ttl, self.cap = ttl, cap
        self.stones: dict[str, float] = {}
        self.by_abort: dict[str, list[str]] = {}

    def forget(self, rid: str) -> None:
        self.stones.pop(rid, None)
        for ids in self.by_abort.values():
            if rid in ids:
                ids.remove(rid)

    def put(self, rid: str, expiry: float) -> None:
        self.forget(rid)
        self.stones[rid] = expiry

    def decode_aborted(self, rid: str, engine: str, now: float) -> None:
        self.put(rid, now + self.ttl)
        mine = self.by_abort.setdefault(engine, [])
        mine.append(rid)
        while len(mine) > self.cap:
            self.forget(mine[0])

    def expire(self, now: float) -> None:
        for rid in [r for r, e in self.stones.items() if now >= e]:
            self.forget(rid)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=120))
def test_tombstones_keep_exactly_what_the_rule_keeps(ops: list[tuple[str, str | None, object]]) -> None:
    ttl, cap = 10.0, 3
    stones, model, now = Tombstones(ttl, cap), Model(ttl, cap), 0.0
    for kind, rid, arg in ops:
        if kind == "tick":
            assert isinstance(arg, float)
            now += arg
            stones.expire(now)
            model.expire(now)
        elif kind == "finished":
            assert rid is not None and isinstance(arg, float)
            stones.finished(rid, 0, "a", now + arg)
            model.put(rid, now + arg)
        elif kind == "prefill_aborted":
            assert rid is not None
            if rid not in model.stones:
                model.put(rid, now + ttl)
            stones.prefill_aborted(rid, now)
        elif kind == "decode_aborted":
            assert rid is not None and isinstance(arg, str)
            stones.decode_aborted(rid, 0, arg, now)
            model.decode_aborted(rid, arg, now)
        else:
            assert rid is not None
            stones.forget(rid)
            model.forget(rid)
        assert {r: stones.get(r).expiry for r in IDS if r in stones} == model.stones  # type: ignore[union-attr]
        for e in ENGINES:
            assert stones.abort_made(e) == len(model.by_abort.get(e, []))


class NoScan(dict[str, object]):
    """The stones' dict, refusing to be walked: a tick with nothing due must not look at every stone."""

    def items(self):  # type: ignore[override]
        raise AssertionError("expire() walked every tombstone")

    def values(self):  # type: ignore[override]
        raise AssertionError("expire() walked every tombstone")


def test_a_tick_with_nothing_due_does_not_walk_the_tombstones() -> None:
    stones = Tombstones(300.0, 4)
    for i in range(5000):
        stones.finished(f"r{i}", 0, "a", 300.0 + i * 0.01)
    stones._stones = NoScan(stones._stones)  # type: ignore[assignment]
    stones.expire(10.0)  # nothing due
    assert len(stones) == 5000
    stones.expire(300.0 + 99 * 0.01)  # the first hundred are due: only they are touched
    assert len(stones) == 4900 and "r99" not in stones and "r100" in stones


def test_an_abort_flood_keeps_the_due_heap_bounded() -> None:
    """A decode may abort unseen ids at will; each is capped per engine, and the heap of expiries of stones
    forgotten by the cap is rebuilt before it outgrows the stones kept."""
    stones = Tombstones(300.0, 8)
    for i in range(20_000):
        stones.decode_aborted(f"x{i}", 0, "hostile", float(i) * 1e-3)
    assert len(stones) == 8 and stones.abort_made("hostile") == 8
    assert len(stones._due) <= 2 * len(stones) + 64
