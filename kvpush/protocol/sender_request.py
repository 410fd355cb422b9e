"""One request on the sender machine: every event SenderState (sender.py) routes to it, each a method named
for the event that returns the actions it causes. The request owns its state: its phase and owner, the
source blocks, the ranges streamed so far, the blocks named ahead of prefill_done, the current attempt
(sender_attempt.py: the decode ranks owed in it) and the superseded attempts' WRITEs still in flight.
SenderState keeps the table of requests, the tombstones and the ownership checks that need them.

Streamed push: kv_ready reports ranges before prefill_done; a ready, registered range is posted as the
policy allows (ranges.py), and the decode rank is notified on its last WRITE, or alone once all landed.

Armed WRITEs: the engine may name a prompt's source blocks before prefill_done (`on_source_blocks`), so a
registered rank's whole WRITE is made ahead (`Arm`) and prefill_done with the same blocks returns that very
StartWrite. Every other way the rank or request goes (other blocks or tokens, kv_ready ranges, abort,
expiry, a new attempt, a dropped claim) returns a `Disarm` first, so each made WRITE is posted or released
exactly once. Nothing is posted and no source block is read before prefill_done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .claims import NO_OWNER, claimed_by_other, foreign
from .groups import BlockIds, single_table
from .reasons import Failure
from .sender_actions import EventOrder, Forget, NotifyFailure, ReleaseSource, SenderAction
from .sender_attempt import Attempt, Ready, SendRules
from .sender_table import DecodeRankState, RankEvent, SendPhase, Stale, Trouble, late, noted, refusal
from .wire import Abort, Registration


@dataclass(eq=False)
class SendRequest:
    """One request this prefill rank may push: its events in, actions out. `closed_at` set means it is
    finished; the table (SenderState) then drops it and keeps a tombstone."""

    request_id: str
    rules: SendRules
    deadline: float
    created_by: EventOrder
    sourced: bool = False  # created by source_blocks: created_by is set by the first real event
    phase: SendPhase = SendPhase.OPEN
    reason: str = ""
    kind: Failure = Failure.ABORTED
    src_blocks: BlockIds | None = None  # prefill_done's table (the request is complete)
    num_tokens: int = 0
    ready_blocks: tuple[int, ...] | None = None  # kv_ready's table so far (a streamed request)
    ready: list[int] | None = None  # per layer: tokens computed, as kv_ready reported them
    owner: str = NO_OWNER  # the only decode engine that may act on it (claims.py)
    current: Attempt = field(init=False)  # the attempt being served (number -1: none yet)
    stale_in_flight: dict[tuple[int, int], Stale] = field(default_factory=dict)  # (attempt, rank)
    nbytes: int = 0  # bytes landed for the current attempt
    abandoned: set[tuple[int, int]] = field(default_factory=set)  # (attempt, rank): a WRITE given up
    # source_blocks' word before prefill_done: (table, tokens, the decode engine it names or "")
    source: tuple[BlockIds, int, str] | None = None
    closed_at: float | None = None  # finished: its tombstone's life counts from here (SenderState drops it)

    def __post_init__(self) -> None:
        self.current = Attempt(self.request_id, self.rules)

    # ---- queries ----------------------------------------------------------------------------------
    def writing(self) -> bool:
        return bool(self.stale_in_flight) or self.current.writing()

    def writing_to(self, decode_engine_id: str, decode_rank: int) -> bool:
        """A WRITE towards that decode rank may be in flight, or is made ahead."""
        if self.current.engine != decode_engine_id:
            return False
        if any(d == decode_rank for _a, d in self.stale_in_flight):
            return True
        rank = self.current.ranks.get(decode_rank)
        return rank is not None and (rank.inflight > 0 or rank.armed is not None)

    # ---- events -----------------------------------------------------------------------------------
    def on_registration(self, reg: Registration, now: float, align: int) -> list[SenderAction]:
        # An expired registration is refused only where it would be newly accepted: a late duplicate of
        # one already accepted must not tell the decode "failed" while that rank's WRITE is in flight.
        expired: list[SenderAction] = [late(reg)] if now >= reg.expires_at else []
        self._first_event("registration_first")
        if self.phase is SendPhase.OPEN:
            self.owner = reg.decode_engine_id
        if self.phase is SendPhase.ENDING:
            return self._registration_while_ending(reg)
        if reg.attempt < self.current.number:
            return []  # superseded by a newer attempt: never written
        dropped: list[SenderAction] = []  # WRITEs made ahead for the superseded attempt
        if reg.attempt > self.current.number:
            if expired:
                return expired  # never supersede the current attempt with one that may not be written
            dropped = self._supersede(Attempt.registered(self.request_id, self.rules, reg))
            self.deadline = now + self.rules.lease_s
        return dropped + self._register_rank(reg, now, align, expired)

    def on_prefill_done(
        self, block_ids: BlockIds, num_tokens: int, now: float, decode_engine_id: str
    ) -> list[SenderAction]:
        self._first_event("prefill_first")
        if self.src_blocks is not None:
            why = "duplicate prefill_done: kept the first"
            return [ReleaseSource(self.request_id, block_ids, False, 0, why, Failure.REFUSED)]
        actions = self._named_owner(decode_engine_id)
        self.src_blocks, self.num_tokens = block_ids, num_tokens
        self._renew(now)
        if self.source is not None and self.source[0] == block_ids:
            fast = self._post_armed(now)  # only post what was made ahead
            if fast is not None:
                return actions + fast
        flat = single_table(block_ids)
        old = self.ready_blocks
        if old is not None and (flat is None or flat[: len(old)] != old):
            actions += self.end("prefill_done's block table does not extend kv_ready's", Failure.REFUSED)
        return actions + self.advance(now)

    def on_kv_ready(
        self,
        block_ids: tuple[int, ...],
        num_tokens: int,
        layers: tuple[int, int] | None,
        now: float,
        decode_engine_id: str,
    ) -> list[SenderAction]:
        if self.src_blocks is not None:
            return []  # prefill_done said it all
        self._first_event("prefill_first")
        actions = self.current.disarm()  # a streamed request moves in ranges: nothing made ahead is posted
        old = self.ready_blocks
        if old is not None and (len(block_ids) < len(old) or block_ids[: len(old)] != old):
            why = "kv_ready's block table does not extend the one reported before"
            return actions + self.end(why, Failure.REFUSED) + self.advance(now)
        self.ready_blocks = block_ids
        ready = self.ready = self.ready or [0] * self.rules.num_layers
        for layer in range(*(layers or (0, self.rules.num_layers))):
            ready[layer] = max(ready[layer], num_tokens)
        actions += self._named_owner(decode_engine_id)
        self._renew(now)
        return actions + self.advance(now)

    def on_source_blocks(
        self, block_ids: BlockIds, num_tokens: int, now: float, decode_engine_id: str
    ) -> list[SenderAction]:
        if self.src_blocks is not None or self.ready is not None:
            return []  # prefill_done or a streamed range came first: nothing to make ahead
        out = self.current.disarm() if self.source is not None else []  # a second word replaces the first
        self.source = (block_ids, num_tokens, decode_engine_id)
        return out + self._arm(now)

    def on_write_done(
        self,
        attempt: int,
        decode_rank: int,
        ok: bool,
        nbytes: int,
        reason: str,
        now: float,
        abandoned: bool,
        kind: Failure,
    ) -> list[SenderAction]:
        why = f"WRITE failed: {reason}"
        if abandoned:
            self.abandoned.add((attempt, decode_rank))
        stale = self.stale_in_flight.get((attempt, decode_rank))
        if stale is not None:  # a superseded attempt's WRITE settled
            if not ok:
                stale.trouble = noted(stale.trouble, why, kind, abandoned)
            return self._stale_settled(attempt, decode_rank, stale, now)
        rank = self.current.ranks.get(decode_rank)
        if attempt != self.current.number or rank is None or rank.state is not DecodeRankState.WRITING:
            return []  # not a WRITE this machine started: the edge reported something twice
        rank.settle(ok, nbytes, why, kind, abandoned)
        if ok:
            self.nbytes += nbytes
        ending = Trouble(self.reason, self.kind) if self.phase is SendPhase.ENDING else None
        actions = self.current.settled(decode_rank, rank, ok, ending, self.src_blocks is not None)
        if not ok:
            actions += self.end(f"WRITE to decode rank {decode_rank} failed: {reason}", kind)
        return actions + self.advance(now)

    def on_decode_abort(self, msg: Abort, ack: NotifyFailure, now: float) -> list[SenderAction]:
        """Decode gave up: write nothing more; each registered rank not mid-WRITE gets `ack`."""
        if self.phase is SendPhase.OPEN:
            self.owner = msg.decode_engine_id
        if msg.attempt < self.current.number:
            # a superseded attempt: nothing more is written into it; if no WRITE of it is in flight the
            # decode may have its blocks back now (else the WRITE's outcome answers)
            return [] if (msg.attempt, msg.decode_rank) in self.stale_in_flight else [ack]
        if msg.attempt > self.current.number:  # abort of an attempt whose registration has not arrived yet
            aborted = Attempt(
                self.request_id, self.rules, msg.attempt, msg.decode_engine_id, self.current.decode_tp
            )
            dropped = self._supersede(aborted)
            return [*dropped, ack, *self.end(ack.reason, Failure.ABORTED), *self.advance(now)]
        rank = self.current.ranks.get(msg.decode_rank)
        before = rank.state if rank is not None else None
        actions = self.end(ack.reason, Failure.ABORTED) + self.advance(now)
        told = any(isinstance(a, NotifyFailure) and a.decode_rank == msg.decode_rank for a in actions)
        if not told and before not in (DecodeRankState.WRITING, DecodeRankState.DONE):
            actions.insert(0, ack)  # the WRITE's own outcome answers a rank mid-WRITE or done
        return actions

    def on_abort(self, reason: str, kind: Failure, now: float) -> list[SenderAction]:
        return self.end(reason, kind) + self.advance(now)

    def on_tick(self, now: float) -> list[SenderAction]:
        if self.phase is SendPhase.OPEN:
            return self._expire_registrations(now) or self._expire_lease(now)
        if self.src_blocks is None and now >= self.deadline and not self.writing():
            # waited long enough for a prefill_done that never came
            self.closed_at = now
            return [Forget(self.request_id, self.reason, self.ready_blocks)]
        return []

    def on_close(self, reason: str) -> ReleaseSource | None:
        """Closing: a request that streamed ranges but never heard prefill_done gives its kv_ready blocks
        back now (no WRITE reads them once the transport is closed, and no prefill_done can come)."""
        if self.src_blocks is not None or self.ready_blocks is None:
            return None
        self.closed_at = self.deadline
        return ReleaseSource(self.request_id, self.ready_blocks, False, self.nbytes, reason, Failure.CLOSED)

    # ---- how a request moves on ---------------------------------------------------------------------
    def advance(self, now: float) -> list[SenderAction]:
        """Start what can start, then release the source once nothing can still read it.

        Recurses at most once: `_expire_registrations` ends the request (phase ENDING) before it calls
        back here, and an ENDING request expires nothing, so the inner call cannot recurse again."""
        actions: list[SenderAction] = []
        if self.phase is SendPhase.OPEN and (self.src_blocks is not None or self.ready is not None):
            expired = self._expire_registrations(now)
            if expired:
                return expired  # it ended the request and advanced it already
            actions = self._post_ranges(now)
        elif self.source is not None:
            actions = self._arm(now)  # registered before prefill_done: make the WRITE ahead
        if self.writing():
            return actions
        return actions + self._release()

    def end(self, reason: str, kind: Failure) -> list[SenderAction]:
        """The request will write nothing more: registered ranks are told, owed ones just close."""
        if self.phase is SendPhase.ENDING:
            return []
        self.phase, self.reason, self.kind = SendPhase.ENDING, reason, kind
        return self.current.end(reason, kind)

    def _release(self) -> list[SenderAction]:
        """Nothing is in flight: give the source back once every rank is done, or the request ended."""
        if self.phase is SendPhase.OPEN:
            if not self.current.all_done():
                return []
            assert self.src_blocks is not None  # DONE ranks were written from it
            self.closed_at = self.deadline
            return [ReleaseSource(self.request_id, self.src_blocks, True, self.nbytes)]
        if self.src_blocks is None:
            return []  # prefill_done, the terminal call, releases it
        self.closed_at = self.deadline
        return [ReleaseSource(self.request_id, self.src_blocks, False, self.nbytes, self.reason, self.kind)]

    def _first_event(self, order: EventOrder) -> None:
        if self.sourced:  # named by source_blocks only: this is the first real event
            self.created_by, self.sourced = order, False

    def _renew(self, now: float) -> None:
        if self.phase is SendPhase.OPEN:
            self.deadline = now + self.rules.lease_s

    def _named_owner(self, engine: str) -> list[SenderAction]:
        """The prefill engine named the decode engine: it owns the request, an earlier claim is dropped."""
        if not engine or self.phase is not SendPhase.OPEN:
            return []
        dropped = self._drop_claim() if foreign(self.owner, engine) else []
        self.owner = engine
        return dropped

    # ---- attempts and registrations -----------------------------------------------------------------
    def _registration_while_ending(self, reg: Registration) -> list[SenderAction]:
        current = self.current.ranks.get(reg.decode_rank) if reg.attempt == self.current.number else None
        if current is not None and current.state in (DecodeRankState.WRITING, DecodeRankState.DONE):
            return []  # a duplicate for a rank mid-WRITE or written: the WRITE's outcome answers it
        if (reg.attempt, reg.decode_rank) in self.stale_in_flight:
            return []
        return [refusal(reg, self.reason, self.kind)]

    def _register_rank(
        self, reg: Registration, now: float, align: int, expired: list[SenderAction]
    ) -> list[SenderAction]:
        att = self.current
        rank = att.ranks.get(reg.decode_rank)
        if rank is None or reg.decode_tp != att.decode_tp:
            why = f"registration for decode rank {reg.decode_rank} (decode TP {reg.decode_tp}) "
            return [refusal(reg, why + f"does not match attempt {att.number}'s decode TP {att.decode_tp}")]
        if rank.state is DecodeRankState.OWED:
            if expired:
                return expired
            rank.reg, rank.align = reg, align
        rank.move(RankEvent.REGISTER)
        return self.advance(now)

    def _supersede(self, newer: Attempt) -> list[SenderAction]:
        """A newer attempt supersedes the current one: its WRITEs in flight stay fenced, what was made
        ahead for it is dropped."""
        dropped = self.current.disarm()
        self.stale_in_flight.update(self.current.fenced(None))
        self.current, self.nbytes = newer, 0
        return dropped

    def _drop_claim(self) -> list[SenderAction]:
        """Another engine registered before the prefill engine named the owner: that engine is told and its
        claim forgotten (streamed ranges already in flight to it are told once they settled)."""
        why = claimed_by_other(self.request_id)
        told = self.current.refuse_registered(why) + self.current.disarm()
        self.stale_in_flight.update(self.current.fenced(Trouble(why, Failure.REFUSED)))
        self.current = Attempt(self.request_id, self.rules)
        return told

    # ---- the clock ----------------------------------------------------------------------------------
    def _expire_registrations(self, now: float) -> list[SenderAction]:
        """A registration whose expiry passed before its WRITE could start can never be served."""
        refused = self.current.expire(now)
        if refused is None:
            return []
        d, told = refused
        return [told, *self.end(f"decode rank {d}'s {told.reason}", Failure.EXPIRED), *self.advance(now)]

    def _expire_lease(self, now: float) -> list[SenderAction]:
        if now < self.deadline or self.writing():
            return []
        lease = self.rules.lease_s
        if self.src_blocks is None:
            why = f"lease expired: prefill of this request did not finish within {lease}s"
        else:
            why = f"lease expired: no registration from decode within {lease}s"
        return self.end(why, Failure.EXPIRED) + self.advance(now)

    # ---- WRITEs -------------------------------------------------------------------------------------
    def _stale_settled(self, attempt: int, d: int, stale: Stale, now: float) -> list[SenderAction]:
        """The decode's superseded attempt waits for a word: its last WRITE's notification, or this."""
        stale.count -= 1
        if stale.count:
            return []
        del self.stale_in_flight[(attempt, d)]
        told: list[SenderAction] = []
        if stale.trouble is not None or not stale.final:
            trouble = stale.trouble or Trouble("superseded by a newer attempt", Failure.SUPERSEDED)
            told = [trouble.notice(self.request_id, attempt, stale.engine, d)]
        return told + self.advance(now)

    def _post_ranges(self, now: float) -> list[SenderAction]:
        final = self.src_blocks is not None
        blocks = self.src_blocks if self.src_blocks is not None else self.ready_blocks
        assert blocks is not None
        frontier = [self.num_tokens] * self.rules.num_layers if final else (self.ready or [])
        ready = Ready(blocks, frontier, final, self.num_tokens, self.created_by)
        actions, stop = self.current.post(ready, now)
        return actions if stop is None else actions + self.end(stop.ending, stop.kind)

    def _arm(self, now: float) -> list[SenderAction]:
        src = self.source
        if src is None or self.phase is not SendPhase.OPEN or self.src_blocks is not None:
            return []
        if self.ready is not None:
            return []
        blocks, num_tokens, named = src
        return self.current.arm(Ready(blocks, [], False, num_tokens, self.created_by), named, now)

    def _post_armed(self, now: float) -> list[SenderAction] | None:
        """prefill_done named the blocks source_blocks did: post what was made ahead (what `advance` would
        return, found directly), or None for the general path."""
        if self.phase is not SendPhase.OPEN or self.ready is not None:
            return None
        return self.current.post_armed(self.num_tokens, now)
