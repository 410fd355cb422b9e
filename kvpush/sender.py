"""SenderState: the prefill side of the push protocol, sans-IO.

It takes events (a registration from a decode rank, prefill done, a WRITE's outcome, an abort, the clock)
and returns actions (start a WRITE, tell a decode rank we will not write, release source blocks). It
never touches a socket, a thread or NIXL, so every event order can be tested with a fake clock.

Invariants (checked by tests/core/test_sender.py):
- the source blocks of every prefill_done are released exactly once, and never while a WRITE from them
  may still be in flight;
- only the newest attempt of a request is ever written; a superseded attempt's blocks are never touched;
- duplicate registrations and duplicate prefill_done are idempotent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .tp import HeadRange, receivers_for, senders_for
from .wire import Abort, Registration


@dataclass(frozen=True)
class StartWrite:
    request_id: str
    attempt: int
    decode_engine_id: str
    decode_rank: int
    decode_tp: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    num_tokens: int
    heads: HeadRange


@dataclass(frozen=True)
class NotifyFailure:
    request_id: str
    attempt: int
    decode_engine_id: str
    decode_rank: int
    reason: str


@dataclass(frozen=True)
class ReleaseSource:
    request_id: str
    block_ids: tuple[int, ...]
    ok: bool
    nbytes: int
    reason: str = ""


SenderAction = StartWrite | NotifyFailure | ReleaseSource


class Phase(enum.Enum):
    OPEN = "open"      # collecting registrations / prefill done, writing
    ENDING = "ending"  # failed or aborted: waits for in-flight WRITEs, then releases


@dataclass
class _Entry:
    request_id: str
    deadline: float
    phase: Phase = Phase.OPEN
    reason: str = ""
    src_blocks: tuple[int, ...] | None = None
    num_tokens: int = 0
    attempt: int = -1
    decode_engine_id: str = ""
    decode_tp: int = 0
    owed: dict[int, HeadRange] = field(default_factory=dict)  # decode rank -> heads, current attempt
    regs: dict[int, Registration] = field(default_factory=dict)  # current attempt, not yet started
    started: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    in_flight: set[tuple[int, int]] = field(default_factory=set)  # (attempt, decode rank)
    nbytes: int = 0
    first: str = ""  # which event created the entry: "registration_first" or "prefill_first"
    counted: bool = False


class SenderState:
    """One prefill rank's view of every request it may push."""

    def __init__(self, prefill_rank: int, prefill_tp: int, total_kv_heads: int, lease_s: float,
                 tombstone_s: float) -> None:
        self.rank = prefill_rank
        self.tp = prefill_tp
        self.total_kv_heads = total_kv_heads
        self.lease_s = lease_s
        self.tombstone_s = tombstone_s
        self._entries: dict[str, _Entry] = {}
        self._tombstones: dict[str, tuple[int, float]] = {}  # request -> (last attempt, expiry)
        # how often each event order led to a WRITE (both orders must work; tests check both occur)
        self.order_counts = {"registration_first": 0, "prefill_first": 0}

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def pending(self) -> list[str]:
        return list(self._entries)

    def in_flight(self) -> int:
        return sum(len(e.in_flight) for e in self._entries.values())

    # ---- events -----------------------------------------------------------------------------------
    def on_registration(self, reg: Registration, now: float) -> list[SenderAction]:
        fail = self._refuse_registration(reg)
        if fail:
            return [NotifyFailure(reg.request_id, reg.attempt, reg.decode_engine_id, reg.decode_rank, fail)]
        tomb = self._tombstones.get(reg.request_id)
        entry = self._entries.get(reg.request_id)
        if entry is None and tomb is not None:
            if reg.attempt <= tomb[0]:
                return []  # a late duplicate of something already finished
            return [NotifyFailure(reg.request_id, reg.attempt, reg.decode_engine_id, reg.decode_rank,
                                  "source KV already released (request finished on prefill)")]
        if entry is None:
            entry = self._entries[reg.request_id] = _Entry(reg.request_id, now + self.lease_s,
                                                           first="registration_first")
        if entry.phase is Phase.ENDING:
            return [NotifyFailure(reg.request_id, reg.attempt, reg.decode_engine_id, reg.decode_rank,
                                  entry.reason)]
        if reg.attempt < entry.attempt:
            return []  # superseded by a newer attempt: never written
        if reg.attempt > entry.attempt:
            entry.attempt = reg.attempt
            entry.decode_engine_id = reg.decode_engine_id
            entry.decode_tp = reg.decode_tp
            entry.owed = receivers_for(self.rank, self.tp, reg.decode_tp, self.total_kv_heads)
            entry.regs, entry.started, entry.done, entry.nbytes = {}, set(), set(), 0
            entry.deadline = now + self.lease_s
        if reg.decode_rank in entry.regs or reg.decode_rank in entry.started:
            return []  # duplicate registration: idempotent
        entry.regs[reg.decode_rank] = reg
        return self._advance(entry)

    def on_prefill_done(self, request_id: str, block_ids: tuple[int, ...], num_tokens: int,
                        now: float) -> list[SenderAction]:
        if request_id in self._tombstones and request_id not in self._entries:
            return [ReleaseSource(request_id, block_ids, False, 0,
                                  "request already finished or aborted on prefill")]
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = _Entry(request_id, now + self.lease_s, first="prefill_first")
        if entry.src_blocks is not None:
            return [ReleaseSource(request_id, block_ids, False, 0, "duplicate prefill_done: kept the first")]
        if entry.phase is Phase.ENDING:
            entry.src_blocks, entry.num_tokens = block_ids, num_tokens
            return self._advance(entry)
        entry.src_blocks, entry.num_tokens = block_ids, num_tokens
        entry.deadline = now + self.lease_s
        return self._advance(entry)

    def on_write_done(self, request_id: str, attempt: int, decode_rank: int, ok: bool, nbytes: int,
                      reason: str, now: float) -> list[SenderAction]:
        entry = self._entries.get(request_id)
        if entry is None or (attempt, decode_rank) not in entry.in_flight:
            return []
        entry.in_flight.discard((attempt, decode_rank))
        actions: list[SenderAction] = []
        if attempt == entry.attempt:
            if ok:
                entry.done.add(decode_rank)
                entry.nbytes += nbytes
            else:
                actions.append(NotifyFailure(request_id, attempt, entry.decode_engine_id, decode_rank,
                                             f"WRITE failed: {reason}"))
                actions += self._end(entry, f"WRITE to decode rank {decode_rank} failed: {reason}")
        return actions + self._advance(entry)

    def abort(self, request_id: str, reason: str, now: float) -> list[SenderAction]:
        entry = self._entries.get(request_id)
        if entry is None:
            self._tombstones.setdefault(request_id, (-1, now + self.tombstone_s))
            return []
        return self._end(entry, reason) + self._advance(entry)

    def on_decode_abort(self, msg: Abort, now: float) -> list[SenderAction]:
        """Decode gave up: write nothing more; each registered rank not mid-WRITE gets a failure as ack."""
        reason = f"aborted by decode rank {msg.decode_rank}: {msg.reason}"
        entry = self._entries.get(msg.request_id)
        if entry is None:
            tomb = self._tombstones.get(msg.request_id)
            if tomb is None or tomb[0] < msg.attempt:
                self._tombstones[msg.request_id] = (msg.attempt, now + self.tombstone_s)
            return [NotifyFailure(msg.request_id, msg.attempt, msg.decode_engine_id, msg.decode_rank, reason)]
        if msg.attempt < entry.attempt:
            return []
        if msg.attempt > entry.attempt:  # abort of an attempt whose registration has not arrived yet
            entry.attempt, entry.regs, entry.started, entry.done = msg.attempt, {}, set(), set()
            entry.owed = {}
            return ([NotifyFailure(msg.request_id, msg.attempt, msg.decode_engine_id, msg.decode_rank, reason)]
                    + self._end(entry, reason) + self._advance(entry))
        actions = self._end(entry, reason) + self._advance(entry)
        if not any(isinstance(a, NotifyFailure) and a.decode_rank == msg.decode_rank for a in actions) and \
                (msg.attempt, msg.decode_rank) not in entry.in_flight and msg.decode_rank not in entry.done:
            actions.insert(0, NotifyFailure(msg.request_id, msg.attempt, msg.decode_engine_id,
                                            msg.decode_rank, reason))
        return actions

    def on_tick(self, now: float) -> list[SenderAction]:
        actions: list[SenderAction] = []
        for entry in list(self._entries.values()):
            if entry.phase is Phase.OPEN and now >= entry.deadline and not entry.in_flight:
                if entry.src_blocks is None:
                    why = f"lease expired: prefill of this request did not finish within {self.lease_s}s"
                else:
                    why = f"lease expired: no registration from decode within {self.lease_s}s"
                actions += self._end(entry, why) + self._advance(entry)
            elif entry.phase is Phase.ENDING and entry.src_blocks is None and now >= entry.deadline:
                self._finish(entry, now)  # waited long enough for a prefill_done that never came
        for rid, (_attempt, expiry) in list(self._tombstones.items()):
            if now >= expiry:
                del self._tombstones[rid]
        return actions

    # ---- internals --------------------------------------------------------------------------------
    def _refuse_registration(self, reg: Registration) -> str:
        try:
            owners = senders_for(reg.decode_rank, reg.decode_tp, self.tp, self.total_kv_heads)
        except ValueError as exc:
            return f"registration does not fit prefill TP {self.tp}: {exc}"
        if self.rank not in owners:
            return (f"prefill rank {self.rank} holds no KV heads for decode rank {reg.decode_rank} "
                    f"(decode TP {reg.decode_tp}, prefill TP {self.tp})")
        return ""

    def _end(self, entry: _Entry, reason: str, notify: bool = True) -> list[SenderAction]:
        if entry.phase is Phase.ENDING:
            return []
        entry.phase, entry.reason = Phase.ENDING, reason
        actions: list[SenderAction] = []
        if notify:
            for rank in sorted(set(entry.owed) - entry.done - {r for _a, r in entry.in_flight}):
                if rank in entry.regs or rank in entry.started:
                    actions.append(NotifyFailure(entry.request_id, entry.attempt, entry.decode_engine_id,
                                                 rank, reason))
        entry.regs.clear()
        return actions

    def _advance(self, entry: _Entry) -> list[SenderAction]:
        actions: list[SenderAction] = []
        if entry.phase is Phase.OPEN and entry.src_blocks is not None:
            for rank, reg in sorted(entry.regs.items()):
                if reg.num_tokens > entry.num_tokens:
                    actions.append(NotifyFailure(
                        entry.request_id, reg.attempt, reg.decode_engine_id, rank,
                        f"decode expects {reg.num_tokens} tokens but prefill computed {entry.num_tokens}"))
                    return actions + self._end(entry, "token count mismatch") + self._advance(entry)
                entry.started.add(rank)
                entry.in_flight.add((reg.attempt, rank))
                if not entry.counted:
                    entry.counted = True
                    self.order_counts[entry.first] += 1
                actions.append(StartWrite(entry.request_id, reg.attempt, reg.decode_engine_id, rank,
                                          reg.decode_tp, entry.src_blocks, tuple(reg.block_ids),
                                          reg.num_tokens, entry.owed[rank]))
            entry.regs.clear()
        if entry.in_flight:
            return actions
        if entry.phase is Phase.OPEN and entry.owed and entry.done == set(entry.owed):
            assert entry.src_blocks is not None
            actions.append(ReleaseSource(entry.request_id, entry.src_blocks, True, entry.nbytes))
            self._finish(entry, None)
        elif entry.phase is Phase.ENDING and entry.src_blocks is not None:
            actions.append(ReleaseSource(entry.request_id, entry.src_blocks, False, entry.nbytes, entry.reason))
            self._finish(entry, None)
        return actions

    def _finish(self, entry: _Entry, now: float | None) -> None:
        del self._entries[entry.request_id]
        expiry = (now if now is not None else entry.deadline) + self.tombstone_s
        self._tombstones[entry.request_id] = (entry.attempt, expiry)
