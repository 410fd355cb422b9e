"""Who may act on a request id, and which finished ids the prefill still remembers.

A request belongs to the decode engine whose registration first claimed it (or, when the prefill engine
names it in `prefill_done`, to that engine): only that engine may supersede, re-register or abort it. A
finished request leaves a tombstone for `tombstone_s`, so a late duplicate is recognised instead of being
taken for a new request. A decode's abort of an id the prefill has not seen also leaves one (the prefill's
later `prefill_done` then releases at once instead of waiting out its lease); those are the only tombstones
a peer can create at will, so they are capped per decode engine, the oldest forgotten first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

NO_OWNER = ""


def claimed_by_other(request_id: str) -> str:
    """The refusal a decode engine gets for a request another engine owns (the owner is not named)."""
    return (
        f"request {request_id!r} is claimed by another decode engine: only the engine whose registration "
        "claimed it first (or the one the prefill engine named) may register, supersede or abort it"
    )


def foreign(owner: str, engine_id: str) -> bool:
    """True when `engine_id` may not act on a request owned by `owner` (an unowned request is anyone's)."""
    return owner != NO_OWNER and owner != engine_id


@dataclass(frozen=True)
class Tombstone:
    attempt: int  # the last attempt the request had (-1: none known)
    expiry: float
    owner: str  # the decode engine it belonged to (NO_OWNER: none)
    by_abort: bool  # left by a decode's abort of an id the prefill had not seen
    # (attempt, decode rank) pairs whose WRITE was abandoned: an abort that arrives late must still be
    # answered "abandoned" (its bytes may land until the fence), never as a plain ack that frees blocks
    abandoned: frozenset[tuple[int, int]] = frozenset()


class Tombstones:
    """Remembered request ids; those left by aborts of unseen ids are capped per decode engine."""

    def __init__(self, ttl_s: float, per_engine_cap: int) -> None:
        self.ttl_s = ttl_s
        self.per_engine_cap = per_engine_cap
        self._stones: dict[str, Tombstone] = {}
        self._by_abort: dict[str, dict[str, None]] = {}  # engine -> its abort-made ids, oldest first
        # (expiry, id) of every stone put, soonest first: expire() looks only at the ones due. An entry
        # whose stone was replaced or forgotten since stays until it surfaces (or the heap is rebuilt).
        self._due: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._stones)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._stones

    def get(self, request_id: str) -> Tombstone | None:
        return self._stones.get(request_id)

    def finished(
        self,
        request_id: str,
        attempt: int,
        owner: str,
        expiry: float,
        abandoned: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        """A request the prefill tracked has ended."""
        self._put(request_id, Tombstone(attempt, expiry, owner, by_abort=False, abandoned=abandoned))

    def prefill_aborted(self, request_id: str, now: float) -> None:
        """The prefill engine aborted an id it had not seen yet (kept if one is already there)."""
        if request_id not in self._stones:
            self._put(request_id, Tombstone(-1, now + self.ttl_s, NO_OWNER, by_abort=False))

    def decode_aborted(self, request_id: str, attempt: int, engine_id: str, now: float) -> None:
        """A decode engine aborted an id the prefill has not seen; the engine's oldest such id is forgotten
        once it holds `per_engine_cap` of them."""
        self._put(request_id, Tombstone(attempt, now + self.ttl_s, engine_id, by_abort=True))
        mine = self._by_abort.setdefault(engine_id, {})
        mine[request_id] = None
        while len(mine) > self.per_engine_cap:
            oldest = next(iter(mine))
            self.forget(oldest)

    def forget(self, request_id: str) -> None:
        stone = self._stones.pop(request_id, None)
        if stone is not None and stone.by_abort:
            mine = self._by_abort.get(stone.owner)
            if mine is not None:
                mine.pop(request_id, None)
                if not mine:
                    del self._by_abort[stone.owner]

    def expire(self, now: float) -> None:
        """Forget every id whose tombstone expired. Runs on every tick: it touches only the stones due
        (a scan of all of them cost O(ids finished in the last tombstone_s) per tick on the push thread)."""
        due, stones = self._due, self._stones
        while due and due[0][0] <= now:
            expiry, request_id = heapq.heappop(due)
            stone = stones.get(request_id)
            if stone is not None and stone.expiry == expiry:
                self.forget(request_id)

    def abort_made(self, engine_id: str) -> int:
        """How many abort-made tombstones an engine holds (for tests and stats)."""
        return len(self._by_abort.get(engine_id, ()))

    def _put(self, request_id: str, stone: Tombstone) -> None:
        self.forget(request_id)
        self._stones[request_id] = stone
        heapq.heappush(self._due, (stone.expiry, request_id))
        if len(self._due) > 2 * len(self._stones) + 64:  # mostly entries of stones gone (capped aborts)
            self._due = [(s.expiry, r) for r, s in self._stones.items()]
            heapq.heapify(self._due)
