"""SenderState: the prefill side of the push protocol, sans-IO.

It takes events (a registration from a decode rank, prefill done, a WRITE's outcome, an abort, the clock)
and returns actions (start a WRITE, tell a decode rank we will not write, release source blocks). It
never touches a socket, a thread or NIXL, so every event order can be tested with a fake clock
(tests/protocol/test_protocol_sim.py, tests/protocol/test_transitions.py). SenderState keeps the table of
live requests, the tombstones of finished ones and the ownership checks that need both; each live request
is a SendRequest (sender_request.py) that takes the events for it and returns the actions.

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

from .claims import NO_OWNER, Tombstone, Tombstones, claimed_by_other, foreign
from .groups import BlockIds
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
from .sender_attempt import SendRules
from .sender_request import SendRequest
from .sender_table import SENDER_TRANSITIONS as SENDER_TRANSITIONS
from .sender_table import DecodeRankState as DecodeRankState
from .sender_table import RankEvent as RankEvent
from .sender_table import SendPhase as SendPhase
from .sender_table import late, refusal
from .sender_table import sender_transition as sender_transition
from .table import IGNORE as IGNORE
from .tp import owes_nothing, writer_ranks
from .wire import Abort, Registration


class SenderState:
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
        self.rules = SendRules(
            prefill_rank,
            prefill_tp,
            total_kv_heads,
            lease_s,
            num_layers,
            stream if stream is not None else StreamPolicy(),
        )
        self.tombstone_s = tombstone_s
        self.owes_nothing = owes_nothing(prefill_rank, prefill_tp, total_kv_heads)
        self._requests: dict[str, SendRequest] = {}
        self._tombstones = Tombstones(tombstone_s, abort_tombstones_per_engine)

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def pending(self) -> list[str]:
        return list(self._requests)

    def rank_states(self, request_id: str) -> dict[int, DecodeRankState]:
        """decode rank -> state for the request's current attempt (empty if unknown); for tests and logs."""
        req = self._requests.get(request_id)
        return {} if req is None else {d: r.state for d, r in req.current.ranks.items()}

    def writing_to(self, decode_engine_id: str, decode_rank: int) -> bool:
        """True while a WRITE towards that decode rank may be in flight, or is made ahead (its peer must
        not be pruned)."""
        return any(req.writing_to(decode_engine_id, decode_rank) for req in self._requests.values())

    # ---- events -----------------------------------------------------------------------------------
    def on_registration(self, reg: Registration, now: float, align: int = 1) -> list[SenderAction]:
        """`align`: streamed ranges into this rank start on multiples of it (the lcm of both block sizes)."""
        screened = self._screen(reg, now)
        if screened is not None:
            return screened
        req = self._requests.get(reg.request_id) or self._open(reg.request_id, now, "registration_first")
        return self._answer(req, req.on_registration(reg, now, align))

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
        if tomb is not None and request_id not in self._requests:
            if not (decode_engine_id and foreign(tomb.owner, decode_engine_id)):
                why = "request already finished or aborted on prefill"
                return [ReleaseSource(request_id, block_ids, False, 0, why, Failure.ABORTED)]
            self._tombstones.forget(request_id)  # another engine's word about a request not its own
        req = self._requests.get(request_id) or self._open(request_id, now, "prefill_first")
        return self._answer(req, req.on_prefill_done(block_ids, num_tokens, now, decode_engine_id))

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
        if self._finished(request_id):
            return []  # finished or aborted already: prefill_done (if it comes) answers
        req = self._requests.get(request_id) or self._open(request_id, now, "prefill_first")
        return self._answer(req, req.on_kv_ready(block_ids, num_tokens, layers, now, decode_engine_id))

    def on_source_blocks(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        now: float,
        decode_engine_id: str = NO_OWNER,
    ) -> list[SenderAction]:
        """The engine is computing the prompt into `block_ids` (`num_tokens` tokens), prefill_done to
        follow: a registered decode rank's WRITE may be made now. A hint, never a claim: ownership and
        the lease stay as prefill_done and the registrations set them."""
        if self._finished(request_id):
            return []  # nothing to write, or already finished: prefill_done answers
        req = self._requests.get(request_id) or self._open(request_id, now, "prefill_first", sourced=True)
        return self._answer(req, req.on_source_blocks(block_ids, num_tokens, now, decode_engine_id))

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
        req = self._requests.get(request_id)
        if req is None:
            return []
        return self._answer(
            req, req.on_write_done(attempt, decode_rank, ok, nbytes, reason, now, abandoned, kind)
        )

    def abort(
        self, request_id: str, reason: str, now: float, kind: Failure = Failure.ABORTED
    ) -> list[SenderAction]:
        req = self._requests.get(request_id)
        if req is None:
            self._tombstones.prefill_aborted(request_id, now)
            return []
        return self._answer(req, req.on_abort(reason, kind, now))

    def on_decode_abort(self, msg: Abort, now: float) -> list[SenderAction]:
        """Decode gave up: write nothing more; each registered rank not mid-WRITE gets a failure as ack."""
        req = self._requests.get(msg.request_id)
        tomb = self._tombstones.get(msg.request_id)
        gave_up = req.abandoned if req is not None else tomb.abandoned if tomb is not None else ()
        ack = NotifyFailure(  # an abandoned WRITE's bytes may still land: the decode waits for the fence
            msg.request_id,
            msg.attempt,
            msg.decode_engine_id,
            msg.decode_rank,
            f"aborted by decode rank {msg.decode_rank}: {msg.reason}",
            (msg.attempt, msg.decode_rank) in gave_up,
            Failure.ABORTED,
        )
        if foreign(_owner(req, tomb), msg.decode_engine_id):
            why = f"abort refused: {claimed_by_other(msg.request_id)}"
            return [NotifyFailure(msg.request_id, msg.attempt, msg.decode_engine_id, msg.decode_rank, why)]
        if req is None:
            if tomb is None or tomb.attempt < msg.attempt:
                self._tombstones.decode_aborted(msg.request_id, msg.attempt, msg.decode_engine_id, now)
            return [ack]
        return self._answer(req, req.on_decode_abort(msg, ack, now))

    def on_tick(self, now: float) -> list[SenderAction]:
        actions: list[SenderAction] = []
        for req in list(self._requests.values()):
            actions += self._answer(req, req.on_tick(now))
        self._tombstones.expire(now)
        return actions

    def drop_streamed(self, reason: str) -> list[SenderAction]:
        """Closing: a request that streamed ranges but never heard prefill_done gives its kv_ready blocks
        back now (the transport is closed, so no WRITE reads them, and the engine can no longer call
        prefill_done, the terminal call it would otherwise wait for)."""
        out: list[SenderAction] = []
        for req in list(self._requests.values()):
            release = req.on_close(reason)
            if release is not None:
                out += self._answer(req, [release])
        return out

    # ---- internals --------------------------------------------------------------------------------
    def _open(
        self, request_id: str, now: float, created_by: EventOrder, sourced: bool = False
    ) -> SendRequest:
        req = SendRequest(request_id, self.rules, now + self.rules.lease_s, created_by, sourced)
        self._requests[request_id] = req
        return req

    def _answer(self, req: SendRequest, actions: list[SenderAction]) -> list[SenderAction]:
        """`actions`, after dropping `req` if they finished it: a tombstone remembers it for a while."""
        if req.closed_at is not None:
            del self._requests[req.request_id]
            expiry = req.closed_at + self.tombstone_s
            self._tombstones.finished(
                req.request_id, req.current.number, req.owner, expiry, frozenset(req.abandoned)
            )
        return actions

    def _finished(self, request_id: str) -> bool:
        """Nothing to write (this rank owes nothing), or the request finished already."""
        return self.owes_nothing or (request_id not in self._requests and request_id in self._tombstones)

    def _screen(self, reg: Registration, now: float) -> list[SenderAction] | None:
        """The answer to a registration the table refuses before any request sees it (None: route it)."""
        why = self._misrouted(reg)
        if why:
            return [refusal(reg, why)]
        req = self._requests.get(reg.request_id)
        tomb = self._tombstones.get(reg.request_id)
        if foreign(_owner(req, tomb), reg.decode_engine_id):
            return [refusal(reg, claimed_by_other(reg.request_id))]
        if req is not None:
            return None
        if tomb is not None:
            if reg.attempt <= tomb.attempt:
                return []  # a late duplicate of something already finished
            return [refusal(reg, "source KV already released (request finished on prefill)")]
        return [late(reg)] if now >= reg.expires_at else None

    def _misrouted(self, reg: Registration) -> str:
        """Why this prefill rank holds nothing for the registering decode rank ("" when it does)."""
        rank, tp = self.rules.prefill_rank, self.rules.prefill_tp
        if self.owes_nothing:
            return f"prefill rank {rank} owes no decode rank KV: a lower rank writes every head it holds"
        try:
            owners = writer_ranks(reg.decode_rank, reg.decode_tp, tp, self.rules.total_kv_heads)
        except ValueError as exc:
            return f"registration does not fit prefill TP {tp}: {exc}"
        if rank not in owners:
            return (
                f"prefill rank {rank} holds no KV heads for decode rank {reg.decode_rank} "
                f"(decode TP {reg.decode_tp}, prefill TP {tp})"
            )
        return ""


def _owner(req: SendRequest | None, tomb: Tombstone | None) -> str:
    """The decode engine a live or finished request belongs to (NO_OWNER: none yet)."""
    return req.owner if req is not None else tomb.owner if tomb is not None else NO_OWNER
