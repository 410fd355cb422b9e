"""SenderState: the prefill side of the push protocol, sans-IO.

It takes events (a registration from a decode rank, prefill done, a WRITE's outcome, an abort, the clock)
and returns actions (start a WRITE, tell a decode rank we will not write, release source blocks). It
never touches a socket, a thread or NIXL, so every event order can be tested with a fake clock
(tests/protocol/test_protocol_sim.py, tests/protocol/test_transitions.py).

Each decode rank this prefill rank owes KV to, within a request's current attempt, is in one named
`DecodeRankState`; `SENDER_TRANSITIONS` is the whole table of what may happen to it. An event the table does
not list raises LocalProtocolError: a bug in the caller or here, never silently absorbed.

Invariants:
- the source blocks of every prefill_done are released exactly once, and never while a WRITE from them
  may still be in flight;
- only the newest attempt of a request is ever written; a superseded attempt's blocks are never touched;
- duplicate registrations and duplicate prefill_done are idempotent;
- a request belongs to the decode engine whose registration claimed it first, or the one `prefill_done`
  names: no other engine can register for it, supersede it or abort it (claims.py);
- no WRITE is started at or after its registration's `expires_at` (the decode frees the blocks once that
  expiry plus the WRITE bound has passed); a registration that expires unserved fails the request;
- a decode rank is told about every failure of a WRITE it may be waiting for, and whether the WRITE was
  abandoned while still in flight (its bytes may still land until the decode's fence).
"""

from __future__ import annotations

from .claims import NO_OWNER, Tombstones, claimed_by_other, foreign
from .groups import BlockIds, single_table
from .ranges import StreamPolicy
from .reasons import Failure
from .sender_actions import Arm as Arm
from .sender_actions import Disarm as Disarm
from .sender_actions import EventOrder as EventOrder
from .sender_actions import Forget as Forget
from .sender_actions import NotifyDone as NotifyDone
from .sender_actions import NotifyFailure as NotifyFailure
from .sender_actions import ReleaseSource as ReleaseSource
from .sender_actions import SenderAction as SenderAction
from .sender_actions import StartWrite as StartWrite
from .sender_arm import Arming
from .sender_arm import disarm as disarm
from .sender_end import RequestEnding
from .sender_table import SENDER_TRANSITIONS as SENDER_TRANSITIONS
from .sender_table import DecodeRankState as DecodeRankState
from .sender_table import Entry, Trouble, refusal
from .sender_table import RankEvent as RankEvent
from .sender_table import SendPhase as SendPhase
from .sender_table import sender_transition as sender_transition
from .table import IGNORE as IGNORE
from .tp import owed_heads, owes_nothing, writer_ranks
from .wire import Registration


class SenderState(Arming, RequestEnding):
    """One prefill rank's view of every request it may push."""

    def __init__(
        self,
        prefill_rank: int,
        prefill_tp: int,
        total_kv_heads: int,
        lease_s: float,
        tombstone_s: float,
        abort_tombstones_per_engine: int = 4096,
        num_layers: int = 1,
        stream: StreamPolicy | None = None,
    ) -> None:
        self.rank = prefill_rank
        self.tp = prefill_tp
        self.total_kv_heads = total_kv_heads
        self.lease_s = lease_s
        self.tombstone_s = tombstone_s
        self.num_layers = num_layers
        self.stream = stream if stream is not None else StreamPolicy()
        self.owes_nothing = owes_nothing(prefill_rank, prefill_tp, total_kv_heads)
        self._entries: dict[str, Entry] = {}
        self._tombstones = Tombstones(tombstone_s, abort_tombstones_per_engine)

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def pending(self) -> list[str]:
        return list(self._entries)

    def rank_states(self, request_id: str) -> dict[int, DecodeRankState]:
        """decode rank -> state for the request's current attempt (empty if unknown); for tests and logs."""
        entry = self._entries.get(request_id)
        return {} if entry is None else {d: r.state for d, r in entry.ranks.items()}

    # ---- events -----------------------------------------------------------------------------------
    def on_registration(self, reg: Registration, now: float, align: int = 1) -> list[SenderAction]:
        """`align`: streamed ranges into this rank start on multiples of it (the lcm of both block sizes)."""
        fail = self._refuse_registration(reg)
        if fail:
            return [refusal(reg, fail)]
        # An expired registration is refused only where it would be newly accepted: a late duplicate of
        # one already accepted must not tell the decode "failed" while that rank's WRITE is in flight.
        late = "registration arrived after its expiry: not written"
        expired: list[SenderAction] = [refusal(reg, late, Failure.EXPIRED)] if now >= reg.expires_at else []
        tomb = self._tombstones.get(reg.request_id)
        entry = self._entries.get(reg.request_id)
        owner = entry.owner if entry is not None else tomb.owner if tomb is not None else NO_OWNER
        if foreign(owner, reg.decode_engine_id):
            return [refusal(reg, claimed_by_other(reg.request_id))]
        if entry is None and tomb is not None:
            if reg.attempt <= tomb.attempt:
                return []  # a late duplicate of something already finished
            return [refusal(reg, "source KV already released (request finished on prefill)")]
        if entry is None:
            if expired:
                return expired
            entry = self._entries[reg.request_id] = Entry(
                reg.request_id, now + self.lease_s, created_by="registration_first"
            )
        if entry.sourced:  # named by source_blocks only: the registration is the first real event
            entry.created_by, entry.sourced = "registration_first", False
        if entry.phase is SendPhase.OPEN:
            entry.owner = reg.decode_engine_id
        if entry.phase is SendPhase.ENDING:
            current = entry.ranks.get(reg.decode_rank) if reg.attempt == entry.attempt else None
            if current is not None and current.state in (DecodeRankState.WRITING, DecodeRankState.DONE):
                return []  # a duplicate for a rank mid-WRITE or written: the WRITE's outcome answers it
            if (reg.attempt, reg.decode_rank) in entry.stale_in_flight:
                return []
            return [refusal(reg, entry.reason, entry.kind)]
        if reg.attempt < entry.attempt:
            return []  # superseded by a newer attempt: never written
        dropped: list[SenderAction] = []  # WRITEs made ahead for the superseded attempt (sender_arm.py)
        if reg.attempt > entry.attempt:
            if expired:
                return expired  # never supersede the current attempt with one that may not be written
            dropped = self._new_attempt(
                entry,
                reg.attempt,
                reg.decode_engine_id,
                reg.decode_tp,
                owed_heads(self.rank, self.tp, reg.decode_tp, self.total_kv_heads),
            )
            entry.deadline = now + self.lease_s
        rank = entry.ranks.get(reg.decode_rank)
        if rank is None or reg.decode_tp != entry.decode_tp:
            why = f"registration for decode rank {reg.decode_rank} (decode TP {reg.decode_tp}) "
            return [
                *dropped,
                refusal(reg, why + f"does not match attempt {entry.attempt}'s decode TP {entry.decode_tp}"),
            ]
        if rank.state is DecodeRankState.OWED:
            if expired:
                return dropped + expired
            rank.reg, rank.align = reg, align
        self._move(rank, RankEvent.REGISTER)
        return dropped + self._advance(entry, now)

    def on_prefill_done(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        now: float,
        decode_engine_id: str = NO_OWNER,
    ) -> list[SenderAction]:
        """The source KV is computed. `decode_engine_id`, when the prefill engine knows it (the router told
        it where the decode runs), makes that engine the owner: an earlier claim by another engine is
        refused and dropped, and another engine's abort of the id is ignored. A rank that owes nothing
        gives the blocks back at once, ok: no decode will ever register with it."""
        if self.owes_nothing:
            return [ReleaseSource(request_id, block_ids, True, 0, owed_nothing=True)]
        tomb = self._tombstones.get(request_id)
        if tomb is not None and request_id not in self._entries:
            if not (decode_engine_id and foreign(tomb.owner, decode_engine_id)):
                why = "request already finished or aborted on prefill"
                return [ReleaseSource(request_id, block_ids, False, 0, why, Failure.ABORTED)]
            self._tombstones.forget(request_id)  # another engine's word about a request not its own
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = Entry(
                request_id, now + self.lease_s, created_by="prefill_first"
            )
        if entry.sourced:
            entry.created_by, entry.sourced = "prefill_first", False
        if entry.src_blocks is not None:
            why = "duplicate prefill_done: kept the first"
            return [ReleaseSource(request_id, block_ids, False, 0, why, Failure.REFUSED)]
        actions: list[SenderAction] = []
        if decode_engine_id and entry.phase is SendPhase.OPEN:
            if foreign(entry.owner, decode_engine_id):
                actions += self._drop_claim(entry)
            entry.owner = decode_engine_id
        entry.src_blocks, entry.num_tokens = block_ids, num_tokens
        if entry.phase is SendPhase.OPEN:
            entry.deadline = now + self.lease_s
        if entry.source is not None and entry.source[0] == block_ids:
            fast = self._post_armed(entry, now)  # only post what was made ahead (sender_arm.py)
            if fast is not None:
                return actions + fast
        flat = single_table(block_ids)
        if entry.ready_blocks is not None and (
            flat is None or flat[: len(entry.ready_blocks)] != entry.ready_blocks
        ):
            actions += self._end(
                entry, "prefill_done's block table does not extend kv_ready's", Failure.REFUSED
            )
        return actions + self._advance(entry, now)

    def on_kv_ready(
        self,
        request_id: str,
        block_ids: tuple[int, ...],
        num_tokens: int,
        layers: tuple[int, int] | None,
        now: float,
        decode_engine_id: str = NO_OWNER,
    ) -> list[SenderAction]:
        """Streamed push: the first `num_tokens` tokens of `layers` (None: all) are computed into
        `block_ids` (a prefix of prefill_done's table). Ready ranges are posted as the policy allows.
        prefill_done stays the terminal call, after an abort too: its release waits for every WRITE."""
        if self.owes_nothing or (request_id not in self._entries and request_id in self._tombstones):
            return []  # finished or aborted already: prefill_done (if it comes) answers
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = Entry(
                request_id, now + self.lease_s, created_by="prefill_first"
            )
        if entry.src_blocks is not None:
            return []  # prefill_done said it all
        if entry.sourced:
            entry.created_by, entry.sourced = "prefill_first", False
        dropped = disarm(entry)  # a streamed request moves in ranges: nothing made ahead is posted
        old = entry.ready_blocks
        if old is not None and (len(block_ids) < len(old) or block_ids[: len(old)] != old):
            why = "kv_ready's block table does not extend the one reported before"
            return dropped + self._end(entry, why, Failure.REFUSED) + self._advance(entry, now)
        entry.ready_blocks = block_ids
        ready = entry.ready = entry.ready or [0] * self.num_layers
        for layer in range(*(layers or (0, self.num_layers))):
            ready[layer] = max(ready[layer], num_tokens)
        actions = dropped
        if entry.phase is SendPhase.OPEN:
            if decode_engine_id:
                if foreign(entry.owner, decode_engine_id):
                    actions += self._drop_claim(entry)
                entry.owner = decode_engine_id
            entry.deadline = now + self.lease_s
        return actions + self._advance(entry, now)

    def on_write_done(
        self,
        request_id: str,
        attempt: int,
        decode_rank: int,
        ok: bool,
        nbytes: int,
        reason: str,
        now: float,
        abandoned: bool = False,
        kind: Failure = Failure.WRITE_FAILED,
    ) -> list[SenderAction]:
        """A WRITE settled: completed, failed (`kind` says how), or (abandoned=True) given up at its
        timeout by the edge."""
        entry = self._entries.get(request_id)
        if entry is None:
            return []
        why = f"WRITE failed: {reason}"
        if abandoned:
            entry.abandoned.add((attempt, decode_rank))
        stale = entry.stale_in_flight.get((attempt, decode_rank))
        if stale is not None:  # a superseded attempt's WRITE settled
            stale.count -= 1
            if not ok:
                stale.trouble = stale.trouble or Trouble(why, kind)
                stale.trouble.abandoned |= abandoned
            if stale.count:
                return []
            del entry.stale_in_flight[(attempt, decode_rank)]
            # the decode's superseded attempt waits for a word: its last WRITE's notification, or this
            told: list[SenderAction] = []
            if stale.trouble is not None or not stale.final:
                trouble = stale.trouble or Trouble("superseded by a newer attempt", Failure.SUPERSEDED)
                told = [self._told(request_id, attempt, stale.engine, decode_rank, trouble)]
            return told + self._advance(entry, now)
        rank = entry.ranks.get(decode_rank)
        if attempt != entry.attempt or rank is None or rank.state is not DecodeRankState.WRITING:
            return []  # not a WRITE this machine started: the edge reported something twice
        rank.inflight -= 1
        actions: list[SenderAction] = []
        if ok:
            rank.landed += nbytes
            entry.nbytes += nbytes
        else:
            rank.trouble = rank.trouble or Trouble(why, kind)
            rank.trouble.abandoned |= abandoned
        ending = f"WRITE to decode rank {decode_rank} failed: {reason}"
        if rank.inflight:
            self._move(rank, RankEvent.SETTLED)
        elif rank.trouble is not None or (entry.phase is SendPhase.ENDING and not (ok and rank.final_posted)):
            trouble = rank.trouble or Trouble(entry.reason, entry.kind)
            self._move(rank, RankEvent.WRITE_FAILED)
            actions.append(self._told(request_id, attempt, entry.decode_engine_id, decode_rank, trouble))
        elif rank.final_posted:
            self._move(rank, RankEvent.WRITE_OK)
        elif self._complete(entry, rank):
            self._move(rank, RankEvent.WRITE_OK)
            actions.append(NotifyDone(request_id, attempt, entry.decode_engine_id, decode_rank, rank.landed))
        else:
            self._move(rank, RankEvent.PART_OK)
        if not ok:
            actions += self._end(entry, ending, kind)
        return actions + self._advance(entry, now)

    def writing_to(self, decode_engine_id: str, decode_rank: int) -> bool:
        """True while a WRITE towards that decode rank may be in flight, or is made ahead (its peer must
        not be pruned)."""
        return any(
            e.decode_engine_id == decode_engine_id
            and (
                any(d == decode_rank for _a, d in e.stale_in_flight)
                or (decode_rank in e.ranks and e.ranks[decode_rank].inflight > 0)
                or (decode_rank in e.ranks and e.ranks[decode_rank].armed is not None)
            )
            for e in self._entries.values()
        )

    # ---- internals --------------------------------------------------------------------------------
    def _refuse_registration(self, reg: Registration) -> str:
        if self.owes_nothing:
            return f"prefill rank {self.rank} owes no decode rank KV: a lower rank writes every head it holds"
        try:
            owners = writer_ranks(reg.decode_rank, reg.decode_tp, self.tp, self.total_kv_heads)
        except ValueError as exc:
            return f"registration does not fit prefill TP {self.tp}: {exc}"
        if self.rank not in owners:
            return (
                f"prefill rank {self.rank} holds no KV heads for decode rank {reg.decode_rank} "
                f"(decode TP {reg.decode_tp}, prefill TP {self.tp})"
            )
        return ""

    def _advance(self, entry: Entry, now: float) -> list[SenderAction]:
        """Start what can start, then release the source once nothing can still read it.

        Recurses at most once: `_expire_registrations` ends the entry (phase ENDING) before it calls back
        here, and an ENDING entry expires nothing, so the inner call cannot recurse again."""
        actions: list[SenderAction] = []
        something = entry.src_blocks is not None or entry.ready is not None
        if entry.phase is SendPhase.OPEN and something:
            expired = self._expire_registrations(entry, now)
            if expired:
                return expired  # it ended the entry and advanced it already
        if entry.phase is SendPhase.OPEN and something:
            actions += self._post_ranges(entry, now)
        elif entry.source is not None:
            actions += self._arm(entry, now)  # registered before prefill_done: make the WRITE ahead
        if entry.writing():
            return actions
        done = all(r.state is DecodeRankState.DONE for r in entry.ranks.values())
        if entry.phase is SendPhase.OPEN and entry.ranks and done:
            assert entry.src_blocks is not None  # DONE ranks were written from it
            actions.append(ReleaseSource(entry.request_id, entry.src_blocks, True, entry.nbytes))
            self._finish(entry, None)
        elif entry.phase is SendPhase.ENDING and entry.src_blocks is not None:
            actions.append(
                ReleaseSource(
                    entry.request_id, entry.src_blocks, False, entry.nbytes, entry.reason, entry.kind
                )
            )
            self._finish(entry, None)
        return actions
