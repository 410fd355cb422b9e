"""The soak driver's ledger: every request, both block pools, and who holds each block.

A block goes back to its pool only when the child that holds it reports the request finished, or when
that child was killed (its memory died with it). A child returning blocks it does not hold, a request
ending for the attacker's reason, and bytes that should be zero are counted here."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from kvpush.apps.blocks import BlockPool, shuffled_runs
from kvpush.apps.demo.procs import Geometry
from kvpush.apps.soak.common import CROSS_MARK, MARK
from kvpush.apps.soak.report import ATTACKER, PROCESS_KILLED, WRONG_BYTES, kind_of
from kvpush.protocol.layout import blocks_for
from kvpush.protocol.reasons import Failure


@dataclass
class Req:
    rid: str
    n: int
    tag: int
    p_gen: int = -1  # prefill incarnation holding its source blocks (-1: none, settled)
    d_held: dict[tuple[int, ...], int] = field(default_factory=dict)  # decode blocks -> incarnation
    last_blocks: tuple[int, ...] = ()
    outcome: str = ""  # "", "completed", "failed"
    reason: str = ""
    p_reason: str = ""
    failure: str = ""  # the decode's failure kind (report.py: a Failure's value, or the soak's own)
    p_failure: str = ""  # the prefill's
    attacked: bool = False
    settled: bool = False
    hijacked: bool = False
    shape: str = "whole"  # how the prefill reports its KV (stream.py SHAPES)

    @property
    def kind(self) -> str:
        """Why it failed, for the report: the endpoints' kinds (the decode's first), never their words."""
        return ATTACKER if self.hijacked else self.failure or self.p_failure or kind_of(None)


def _pool(num_blocks: int, seed: int) -> BlockPool:
    """Fragmented tables from the first request: runs of 4 ids in a seeded order, freed as given."""
    return BlockPool(num_blocks, shuffled_runs(num_blocks, seed, 4), reverse_free=False)


class Book:
    """The requests and the two pools (fragmented tables: `_pool`), and the failure tallies."""

    def __init__(self, p_geo: Geometry, d_geo: Geometry, seed: int) -> None:
        self.p_geo, self.d_geo = p_geo, d_geo
        self.p_alloc = _pool(p_geo.num_blocks, seed)
        self.d_alloc = _pool(d_geo.num_blocks, seed + 1)
        self.reqs: dict[str, Req] = {}
        self.source_blocks: dict[str, list[int]] = {}  # request -> source blocks the prefill holds
        self.reasons: Counter[str] = Counter()
        self.examples: dict[str, str] = {}  # failure kind -> one reason in full
        self.d_history: dict[int, str] = {}  # decode block -> who returned it last, how, when
        self.stale = 0
        self.corrupt = 0
        self.unauthorized = 0
        self.cross_peer = 0  # honest requests ended by another bound identity's abort
        self.double_freed = 0
        self.log: list[str] = []
        self.t0 = time.monotonic()

    def live(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.p_gen >= 0 or r.d_held]

    def open(self, rid: str, n: int, tag: int, p_gen: int) -> list[int] | None:
        """A new request and its source blocks, held by prefill incarnation `p_gen`; None, and nothing
        taken, unless both pools can hold it."""
        p_need, d_need = blocks_for(n, self.p_geo.block_size), blocks_for(n, self.d_geo.block_size)
        if not (self.p_alloc.can_allocate(p_need) and self.d_alloc.can_allocate(d_need)):
            return None
        r = Req(rid, n, tag)
        self.reqs[rid] = r
        blocks = self.p_alloc.allocate(p_need)
        self.source_blocks[rid] = blocks
        r.p_gen = p_gen
        return blocks

    def lend_decode(self, r: Req, d_gen: int) -> list[int] | None:
        """Fresh decode blocks for `r` (a first attempt or a resend), held by decode incarnation `d_gen`."""
        need = blocks_for(r.n, self.d_geo.block_size)
        if not self.d_alloc.can_allocate(need):
            return None
        blocks = self.d_alloc.allocate(need)
        r.last_blocks = tuple(blocks)
        r.d_held[r.last_blocks] = d_gen
        r.outcome = ""
        return blocks

    def reclaim(self, role: str, gen: int) -> None:
        """Incarnation `gen` of `role` was killed: every block it held is back, its requests settle."""
        for r in self.reqs.values():
            if role == "prefill" and r.p_gen == gen:
                self.p_alloc.free(self.source_blocks.pop(r.rid))
                r.p_gen, r.p_reason, r.p_failure = -1, "prefill process killed", PROCESS_KILLED
                self._settle(r)
            if role == "decode":
                for blocks, held_by in list(r.d_held.items()):
                    if held_by == gen:
                        del r.d_held[blocks]
                        self.d_alloc.free(list(blocks))
                        if blocks == r.last_blocks:
                            r.outcome, r.reason, r.failure = "failed", "decode process killed", PROCESS_KILLED
            self._settle(r)

    def on_released(
        self, gen: int, rid: str, reason: str, failure: Failure | None, blocks: list[int]
    ) -> None:
        """Prefill incarnation `gen` finished `rid` (failed: `failure` says why) and gives its source
        blocks back."""
        r = self.reqs.get(rid)
        if r is None or r.p_gen != gen or self.source_blocks.get(rid) != blocks:
            self.double_freed += len(blocks)
            self.log.append(f"prefill returned blocks it did not hold: {rid} {blocks}")
            return
        del self.source_blocks[rid]
        self.p_alloc.free(blocks)
        r.p_gen, r.p_reason = -1, reason
        r.p_failure = kind_of(failure) if failure is not None else ""
        self._hijacked(r, reason)
        self._settle(r)

    def on_result(
        self,
        gen: int,
        rid: str,
        ok: bool,
        reason: str,
        failure: Failure | None,
        blocks: list[int],
        wrong: int,
        known: bool,
    ) -> None:
        """Decode incarnation `gen` finished one attempt of `rid` (failed: `failure` says why); `wrong`
        bytes failed the pattern."""
        r = self.reqs.get(rid)
        key = tuple(blocks)
        if r is None or r.d_held.get(key) != gen or not known:
            self.double_freed += len(blocks)
            self.log.append(f"decode returned blocks it did not hold: {rid} {blocks}")
            return
        del r.d_held[key]
        self.d_alloc.free(blocks)
        for b in blocks:
            self.d_history[b] = f"{rid} {'ok' if ok else reason[:80]} at {time.monotonic() - self.t0:.2f}s"
        self.corrupt += wrong
        self._hijacked(r, reason)
        if key == r.last_blocks:
            r.outcome = "completed" if ok and wrong == 0 else "failed"
            r.reason = "" if ok and wrong == 0 else (reason or f"{wrong} wrong bytes")
            r.failure = "" if ok and wrong == 0 else WRONG_BYTES if ok else kind_of(failure)
        self._settle(r)

    def on_stale(self, rid: str, nbytes: int, where: str) -> None:
        """The decode found `nbytes` non-zero bytes in blocks it was given again (`where` names them)."""
        self.stale += nbytes
        self.log.append(f"stale bytes {nbytes} in blocks of {rid} {where}")
        for b in [int(x) for x in where.split("[")[-1].rstrip("]").split(",") if x.strip()][:4]:
            self.log.append(f"  block {b} last returned by {self.d_history.get(b, '?')}")

    def _hijacked(self, r: Req, reason: str) -> None:
        """An honest request ended for the attacker's reason: its frames had an effect."""
        if MARK in reason and not r.hijacked:
            r.hijacked = True
            self.unauthorized += 1
        elif CROSS_MARK in reason and not r.hijacked:
            r.hijacked = True
            self.cross_peer += 1

    def _settle(self, r: Req) -> None:
        if r.settled or r.p_gen >= 0 or r.d_held:
            return
        r.settled = True
        if not r.outcome:
            r.outcome = "failed"
        if r.outcome == "failed":
            kind = r.kind
            self.reasons[kind] += 1
            self.examples.setdefault(kind, (r.reason or r.p_reason)[:300])

    def leaked(self, alloc: BlockPool, total: int) -> tuple[int, int]:
        """(blocks missing from the pool, blocks in its free list twice)."""
        free = alloc.free_ids()
        return total - len(set(free)), len(free) - len(set(free))
