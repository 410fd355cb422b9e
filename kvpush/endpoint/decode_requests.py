"""The decode's requests: one record per request (where its KV comes from, when it was expected, whether it
waits for a re-handshake, which ranks announced a WRITE), the receiver machine, and the action pump that
turns the machine's actions into Registrations and Aborts for the prefill ranks and results for the engine.

A request is held out of the machine while a prefill rank it needs is handshaken again (its connection
closed, or it went silent): until the answer says which process is there, so a restart proven by the
answer does not fail it along with the old process's requests (issue 16). Nothing of a held request has
been registered, so it can fail at once, and whatever ends it hands its blocks straight back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from ..config_groups import Leases, Liveness
from ..errors import TransportError, WireError
from ..protocol.groups import BlockIds
from ..protocol.layout import KVLayout
from ..protocol.reasons import Failure
from ..protocol.receiver import (
    Discarded,
    Failed,
    Ready,
    ReceiverAction,
    ReceiverState,
    SendAbort,
    SendRegistration,
)
from ..protocol.tp import stage_senders
from ..protocol.wire import Abort, Registration, TransferFailed
from .base import PrefillAddress, RecvResult, TransferHooks
from .decode_conns import MAX_BACKLOG, AddressKey, PrefillConnections, PrefillPeer, address_key
from .stats import Count, Ledger

log = logging.getLogger("kvpush")


@dataclass(frozen=True)
class Held:
    """What a held request needs to enter the machine once its ranks answer."""

    blocks: BlockIds
    num_tokens: int


@dataclass
class RecvRequest:
    """Everything the receive thread keeps for one request besides the machine's attempts."""

    prefill: PrefillAddress  # where its KV comes from
    expected_at: float  # when expect() reached the thread
    held: Held | None = None  # set while it waits out a re-handshake, outside the machine
    # prefill ranks that announced a WRITE (Posted) whose notification has not come: poll fast until then
    announced: dict[int, float] = field(default_factory=dict)


class DecodeRequests:
    """The engine's requests on the receive thread; `report` hands a result to the engine."""

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        leases: Leases,
        liveness: Liveness,
        conns: PrefillConnections,
        ledger: Ledger,
        hooks: TransferHooks | None,
        report: Callable[[RecvResult], None],
    ) -> None:
        self.layout, self.conns, self.ledger, self.hooks, self.report = layout, conns, ledger, hooks, report
        self.state = ReceiverState(
            engine_id,
            layout.tp_rank,
            layout.tp_size,
            layout.total_kv_heads,
            leases.ready_timeout_s,
            leases.write_bound_s,
            gone_linger_s=leases.write_linger_s,
            abort_resend_s=liveness.ping_interval_s,
        )
        self.records: dict[str, RecvRequest] = {}
        self.held = 0  # records held for a re-handshake
        self.announced = 0  # (request, rank) announcements waited for, over all records

    def __len__(self) -> int:
        return len(self.records)

    def addresses(self) -> set[AddressKey]:
        """The prefill addresses live requests name (their ranks are never pruned)."""
        return {address_key(r.prefill) for r in self.records.values()}

    def senders(self, prefill: PrefillAddress) -> dict[int, tuple[int, int]]:
        lay = self.layout
        return stage_senders(lay.tp_rank, lay.tp_size, prefill.tp_size, prefill.pp_size, lay.total_kv_heads)

    # ---- the action pump ----------------------------------------------------------------------
    def apply(self, actions: Iterable[ReceiverAction]) -> None:
        """Run actions and their follow-ups in order; executors return follow-ups, never re-enter."""
        pending = deque(actions)
        while pending:
            act = pending.popleft()
            if isinstance(act, SendRegistration | SendAbort):
                pending.extend(self._send(act))
            elif isinstance(act, Ready | Failed):
                self.finish(act)
            elif isinstance(act, Discarded):
                self.ledger.add(Count.DISCARDED)
                log.debug("kvpush decode: %s", act.reason)

    def _send(self, act: SendRegistration | SendAbort) -> list[ReceiverAction]:
        rec = self.records.get(act.message.request_id)
        if rec is None:
            return []
        peer = self.conns.peer(rec.prefill, act.prefill_rank, time.monotonic())
        if isinstance(peer, str):
            return self.failed_send(act.message, act.prefill_rank, peer, Failure.REFUSED)
        repeat = isinstance(act, SendAbort) and act.repeat
        if peer.session is None:
            if peer.error:
                return self.refused(peer, act.message)
            if repeat:
                return []  # a resend: the next one goes out once the handshake is done
            if len(peer.backlog) >= MAX_BACKLOG:
                why = "too many messages wait for its handshake"
                return self.failed_send(act.message, act.prefill_rank, why, Failure.REFUSED)
            peer.backlog.append(act.message)
            return []
        return self.send_now(peer, act.message, repeat)

    def send_now(
        self, peer: PrefillPeer, msg: Registration | Abort, repeat: bool = False
    ) -> list[ReceiverAction]:
        assert peer.session is not None
        if isinstance(msg, Registration):
            # our expiry in the prefill's clock: the offset never overstates the prefill's clock, so the
            # prefill stops posting no later than our own expiry
            msg = msgspec.structs.replace(
                msg, expires_at=max(0.0, msg.expires_at + (peer.clock_offset or 0.0))
            )
        try:
            peer.channel.send(peer.session.seal(msg))
        except (TransportError, WireError) as exc:
            if repeat:  # the first Abort went out; a failed repeat proves nothing about the WRITEs
                return []
            return self.failed_send(msg, peer.rank, f"side channel send failed: {exc}", Failure.PEER_GONE)
        return []

    def refused(self, peer: PrefillPeer, msg: Registration | Abort) -> list[ReceiverAction]:
        """The rank refused the pairing: nothing can be registered there, so the attempt fails now, by name."""
        if isinstance(msg, Abort):
            return []  # nothing was registered there to stop
        return self.failed_send(msg, peer.rank, f"{peer.origin} refused: {peer.error}", Failure.REFUSED)

    def failed_send(
        self, msg: Registration | Abort, rank: int, reason: str, kind: Failure
    ) -> list[ReceiverAction]:
        """Nothing was sent, so nothing can be written from it: the attempt fails for this rank now."""
        if isinstance(msg, Abort):
            return []  # the rank may hold the registration: only its answer or the fence settles it
        return self.state.on_failed(
            TransferFailed(
                request_id=msg.request_id,
                attempt=msg.attempt,
                prefill_rank=rank,
                reason=reason,
                abandoned=False,
            ),
            time.monotonic(),
            kind,
        )

    def finish(self, act: Ready | Failed) -> None:
        now = time.monotonic()
        rid = act.request_id
        rec = self.records.get(rid)
        expected_at = None if rec is None else rec.expected_at
        if rec is not None:
            self.announced -= len(rec.announced)
            rec.announced.clear()
            if not self.state.tracks(rid):
                self.forget(rid)
        if isinstance(act, Ready) and self.hooks is not None:
            try:
                self.hooks.after_receive(rid, act.block_ids)
            except Exception as exc:  # noqa: BLE001 - the request fails with the reason; the thread lives
                why = f"staging into the cache failed: {exc!r}"
                act = Failed(rid, act.attempt, act.block_ids, why, Failure.WRITE_FAILED)
            now = time.monotonic()
        if isinstance(act, Ready):
            self.ledger.add(Count.BYTES, act.nbytes)
            result = RecvResult(rid, True, act.block_ids, "", act.nbytes, now)
        else:
            result = RecvResult(rid, False, act.block_ids, act.reason, 0, now, act.kind)
        latency = None if expected_at is None else now - expected_at
        self.ledger.finished(result.ok, latency, result.failure)
        self.report(result)

    def forget(self, request_id: str) -> None:
        """The request left the machine: its record goes, and so do registrations of it still waiting
        for a handshake (their expiry has passed or the request ended: none may go out any more)."""
        rec = self.records.pop(request_id, None)
        if rec is None:
            return
        self.announced -= len(rec.announced)
        self.held -= rec.held is not None
        for rank in self.senders(rec.prefill):
            peer = self.conns.get(rec.prefill, rank)
            if peer is not None and peer.backlog:
                peer.backlog = [m for m in peer.backlog if isinstance(m, Abort) or m.request_id != request_id]

    # ---- announcements (Posted) -----------------------------------------------------------------
    def announce(self, request_id: str, rank: int, until: float) -> None:
        rec = self.records.get(request_id)
        if rec is not None and self.state.tracks(request_id):
            self.announced += rank not in rec.announced
            rec.announced[rank] = until

    def landed(self, request_id: str, rank: int) -> None:
        """That rank's notification came: no fast polling for it any more."""
        rec = self.records.get(request_id)
        if rec is not None and rec.announced.pop(rank, None) is not None:
            self.announced -= 1

    def expire_announced(self, now: float) -> None:
        if not self.announced:
            return
        for rec in self.records.values():
            for rank in [r for r, until in rec.announced.items() if until <= now]:
                del rec.announced[rank]
                self.announced -= 1

    # ---- held for a re-handshake ----------------------------------------------------------------
    def rehandshaking(self, prefill: PrefillAddress, now: float) -> PrefillPeer | None:
        """A rank of `prefill` this rank needs that had a session and is being handshaken again (its
        connection closed, or it went silent): the answer may come from a new process."""
        for rank in self.senders(prefill):
            peer = self.conns.get(prefill, rank)
            if peer is None:
                continue
            self.conns.verify_closed(peer, now)
            if peer.session is None and peer.instance:
                return peer
        return None

    def fail_held(self, request_id: str, reason: str, kind: Failure = Failure.PEER_SILENT) -> None:
        """Nothing was registered for a held request, so nothing can be written: it fails at once."""
        rec = self.records[request_id]
        assert rec.held is not None
        self.finish(Failed(request_id, 0, rec.held.blocks, reason, kind))
        self.forget(request_id)

    def held_ids(self) -> list[str]:
        return [rid for rid, rec in self.records.items() if rec.held is not None] if self.held else []

    def release_held(self, now: float) -> None:
        """Held requests whose every rank has a session again go into the machine now."""
        for rid in self.held_ids():
            rec = self.records[rid]
            if rec.held is not None and self.rehandshaking(rec.prefill, now) is None:
                held, rec.held = rec.held, None
                self.held -= 1
                self.expect(rid, held.blocks, held.num_tokens, rec.prefill)

    def waiting_for(self, peer: PrefillPeer, now: float) -> list[str]:
        return [rid for rid in self.held_ids() if self.rehandshaking(self.records[rid].prefill, now) is peer]

    # ---- commands -----------------------------------------------------------------------------
    def expect(self, request_id: str, blocks: BlockIds, num_tokens: int, prefill: PrefillAddress) -> None:
        now = time.monotonic()
        rec = self.records.get(request_id)
        if rec is not None and rec.held is not None:
            self.fail_held(request_id, "superseded by a newer expect()", Failure.SUPERSEDED)
            rec = None
        fresh = rec is None and not self.state.tracks(request_id)
        if fresh and self.rehandshaking(prefill, now) is not None:
            if self.held >= MAX_BACKLOG:
                why = "too many requests wait for a prefill handshake"
                self.finish(Failed(request_id, 0, blocks, why, Failure.REFUSED))
                return
            self.records[request_id] = RecvRequest(prefill, now, Held(blocks, num_tokens))
            self.held += 1
            return
        if rec is None:
            rec = self.records[request_id] = RecvRequest(prefill, now)
        rec.prefill, rec.expected_at = prefill, now
        tp, pp = prefill.tp_size, prefill.pp_size
        self.apply(self.state.expect(request_id, blocks, num_tokens, tp, now, pp))

    def abort(self, request_id: str, reason: str) -> None:
        rec = self.records.get(request_id)
        if rec is not None and rec.held is not None:
            self.fail_held(request_id, reason, Failure.ABORTED)
            return
        self.apply(self.state.abort(request_id, reason, time.monotonic()))

    def cancel(self, request_id: str, prefill: PrefillAddress, reason: str) -> None:
        rec = self.records.get(request_id)
        if rec is not None and rec.held is not None:
            self.fail_held(request_id, reason, Failure.ABORTED)
            return
        if rec is None:
            rec = self.records[request_id] = RecvRequest(prefill, time.monotonic())
        tp, pp = prefill.tp_size, prefill.pp_size
        self.apply(self.state.cancel(request_id, tp, reason, time.monotonic(), pp))
        if not self.state.tracks(request_id):
            self.forget(request_id)

    def connect(self, prefill: PrefillAddress, done: threading.Event) -> tuple[list[PrefillPeer], str]:
        """The ranks of `prefill` this rank needs, their handshakes started; `done` is set once each has
        answered. The second item names why a rank could not be added (the table is full)."""
        now = time.monotonic()
        peers: list[PrefillPeer] = []
        for rank in self.senders(prefill):
            peer = self.conns.peer(prefill, rank, now)
            if isinstance(peer, str):
                done.set()
                return peers, peer
            peers.append(peer)
        pending = [p for p in peers if p.session is None and not p.error]
        if not pending:
            done.set()
        for p in pending:
            p.waiters.append(done)
        return peers, ""

    def unwait(self, peers: list[PrefillPeer], done: threading.Event) -> None:
        """connect() gave up on `done`: the ranks no longer keep it (nor are kept for it)."""
        for p in peers:
            if done in p.waiters:
                p.waiters.remove(done)
