"""How the push thread carries out the sender machine's actions towards a decode rank: a StartWrite
becomes a planned, sealed WRITE queued on the scheduler (the per-WRITE path that kvpush's timeline
times: picked, plan_built, sealed, queued), and a decode rank is told when it will not be written or
that every range landed. A mixin of PushThread (prefill.py), which owns the state it reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import KVPushConfig
from ..errors import LayoutError, PeerGone, TransportError
from ..protocol.groups import BlockIds
from ..protocol.handshake import Session
from ..protocol.layout import KVLayout
from ..protocol.order import NOTIF, done_notice, failure_notice, sealed_done, write_plan
from ..protocol.plan import TransferPlan
from ..protocol.prepared import Half, IndexPlan, PairUnits, build_index_plan, half_plan
from ..protocol.reasons import Failure
from ..protocol.replay import REPLAY_WINDOW
from ..protocol.sender import (
    DecodeRankState,
    Forget,
    NotifyDone,
    NotifyFailure,
    SenderAction,
    SenderState,
    StartWrite,
)
from ..protocol.tp import owed_heads
from ..protocol.wire import Registration
from ..transport.base import Transport
from .armed import ArmedStore, ArmedWrite
from .posting import MadeWrite, discard, write_spec
from .prefill_bindings import DecodePeer, Prepared
from .prefill_conns import DecodeConnections
from .stats import Count, Ledger
from .writes import Settled, WriteScheduler, failure_of

if TYPE_CHECKING:
    from .base import TransferHooks

log = logging.getLogger("kvpush")

# Count(act.order) by a plain dict: an Enum call by value runs Python-level enum code on every WRITE
_ORDER_COUNT = {c.value: c for c in (Count.REGISTRATION_FIRST, Count.PREFILL_FIRST)}


class PushActions:
    """Needs the push thread's transport, connections, scheduler and per-request maps, and `_settle`."""

    config: KVPushConfig
    layout: KVLayout
    mem_type: str
    ledger: Ledger
    transport: Transport
    conns: DecodeConnections
    scheduler: WriteScheduler
    hooks: TransferHooks | None
    timeline: dict[str, dict[str, float]]
    prefill_done_at: dict[str, float]
    reads_until: dict[str, float]
    kv_written: dict[str, list[Callable[[], None]]]
    staged: set[str]
    state: SenderState
    src_half: dict[str, Half]
    dst_half: dict[str, dict[tuple[int, int], Half]]
    last_units: PairUnits | None
    armed: ArmedStore

    def _settle(self, outcomes: list[Settled]) -> list[SenderAction]:
        raise NotImplementedError

    def _start_write(self, act: StartWrite) -> list[SenderAction]:
        """A StartWrite becomes a queued WRITE: the source made ready, then one trip into protocol/
        (write_order: plan and sealed notification); a failure settles it at once. The StartWrite the
        machine armed (sender_arm.py) queues what was made ahead: only the barrier and the post remain."""
        now = time.monotonic()
        self.ledger.add(_ORDER_COUNT[act.order])
        marks = self.timeline.setdefault(act.request_id, {})
        if act.notify:
            marks.setdefault("prefill_done", self.prefill_done_at.get(act.request_id, now))
        marks.setdefault("registered", now)
        marks.setdefault("picked", now)
        made = self.armed.take(act) if self.armed else None
        if made is not None:
            return self._start_armed(act, made, marks, now)
        try:
            peer, session, prep, plan = self._order(act, True)
        except (LayoutError, TransportError) as exc:
            return self._settle([Settled(act, False, 0, str(exc), kind=failure_of(exc))])
        marks.setdefault("plan_built", time.monotonic())
        notif = sealed_done(act, self.layout.rank, plan.nbytes, session)
        lists = None if prep is None else (prep.local, prep.remote)
        spec = write_spec(plan, notif, peer.agent, self.mem_type, lists)
        marks.setdefault("sealed", time.monotonic())
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvpush push %s: queued %.1f ms, plan %.1f ms, %d descriptors, %d bytes",
                act.request_id,
                1e3 * (now - self.prefill_done_at.get(act.request_id, now)),
                1e3 * (marks["plan_built"] - now),
                plan.num_descriptors,
                plan.nbytes,
            )
        self.scheduler.queue(act, plan, spec, now)
        marks.setdefault("queued", time.monotonic())
        return []

    def _order(
        self, act: StartWrite, ready: bool
    ) -> tuple[DecodePeer, Session, Prepared | None, TransferPlan | IndexPlan]:
        """The peer, session, prepared pair and plan of act's WRITE; `ready`: run the engine's barriers
        and staging first (not when the WRITE is only made ahead). LayoutError/TransportError."""
        dest = (act.decode_engine_id, act.decode_rank)
        peer = self.conns.peers.get(dest)
        if peer is None:
            raise PeerGone(f"no handshake with decode {act.decode_engine_id!r} rank {act.decode_rank}")
        if ready:
            self._source_ready(act)
        prep = self.conns.prepared(peer, act.heads)
        session = self.conns.session(dest)
        if session is None:
            raise PeerGone(f"no live session with decode {act.decode_engine_id!r} rank {act.decode_rank}")
        halves = self._halves(act, prep.units) if prep is not None else None
        if halves is not None and prep is not None:  # a side planned before the trigger
            plan: TransferPlan | IndexPlan = build_index_plan(
                prep.units, act.src_blocks, act.dst_blocks, act.num_tokens, halves=halves
            )
        else:
            plan = write_plan(act, self.layout, peer.layout, prep.units if prep else None)
        return peer, session, prep, plan

    def _arm_write(self, act: StartWrite) -> None:
        """The machine's Arm: plan, seal and make act's WRITE now, before prefill_done, and keep it
        unposted (armed.py). Not with staging hooks (they copy the blocks only once prefill_done came)
        nor for a pair without prepared lists; any failure leaves the general path to prefill_done."""
        if self.hooks is not None:
            return
        try:
            _peer, session, prep, plan = self._order(act, False)
            if prep is None or not isinstance(plan, IndexPlan):
                return
            notif = sealed_done(act, self.layout.rank, plan.nbytes, session)
            handle = self.transport.make_write(prep.local, plan.src_idx, prep.remote, plan.dst_idx, notif)
        except (LayoutError, TransportError) as exc:
            log.debug("kvpush push %s: not made ahead: %s", act.request_id, exc)
            return
        armed = ArmedWrite(act, plan, MadeWrite(handle), session, session.sealed(NOTIF), time.monotonic())
        self.armed.put((act.request_id, act.attempt, act.decode_rank), armed)

    def _start_armed(
        self, act: StartWrite, made: ArmedWrite, marks: dict[str, float], now: float
    ) -> list[SenderAction]:
        """Queue the WRITE made ahead for act, after the engine's barriers; if its peer's session changed
        since (or the decode's replay window would refuse its notification), make it anew instead."""
        session = self.conns.session((act.decode_engine_id, act.decode_rank))
        if session is not made.session or session.sealed(NOTIF) - made.seq >= REPLAY_WINDOW // 2:
            discard(self.transport, made.spec)
            try:
                _peer, session, prep, plan = self._order(act, True)
                if prep is None or not isinstance(plan, IndexPlan):
                    raise TransportError("the decode's prepared lists are gone")
                notif = sealed_done(act, self.layout.rank, plan.nbytes, session)
                handle = self.transport.make_write(prep.local, plan.src_idx, prep.remote, plan.dst_idx, notif)
            except (LayoutError, TransportError) as exc:
                return self._settle([Settled(act, False, 0, str(exc), kind=failure_of(exc))])
            made = ArmedWrite(act, plan, MadeWrite(handle), session, session.sealed(NOTIF), now)
        elif self.kv_written:
            try:
                self._source_ready(act)
            except TransportError as exc:
                discard(self.transport, made.spec)
                return self._settle([Settled(act, False, 0, str(exc), kind=failure_of(exc))])
        marks["plan_built"] = marks["sealed"] = now
        marks["armed"] = made.at  # made ahead (not a TIMELINE stage: the demo tells armed WRITEs apart)
        self.scheduler.queue(act, made.plan, made.spec, now)
        marks["queued"] = time.monotonic()
        return []

    def _halves(self, act: StartWrite, units: PairUnits) -> tuple[Half | None, Half | None] | None:
        """The sides of this WRITE's plan made before its trigger (a whole request only), if any; the
        pair is remembered for the source half of the next prefill_done that comes before its registration."""
        self.last_units = units
        if act.token_start or act.layers is not None:
            return None
        s = self.src_half.get(act.request_id)
        d = self.dst_half.get(act.request_id, {}).get((act.attempt, act.decode_rank))
        return None if s is None and d is None else (s, d)

    def _plan_src_early(self, request_id: str, blocks: BlockIds, num_tokens: int) -> None:
        """prefill_done before any registration: plan the source side now, for the pair the last WRITE
        used (a prefill usually serves one decode layout); the registration then plans only its side."""
        try:
            half = None if self.last_units is None else half_plan(self.last_units, False, blocks, num_tokens)
        except LayoutError:  # the plan at the trigger says it again, for this request alone
            return
        if half is not None:
            if len(self.src_half) > 2 * len(self.state) + 64:  # bounded: halves of requests still live
                self.src_half = {k: v for k, v in self.src_half.items() if k in self.prefill_done_at}
            self.src_half[request_id] = half

    def _plan_dst_early(self, reg: Registration) -> None:
        """A registration waiting for prefill_done: plan its side now (the pair's prepared lists are made
        here if this is its first request); prefill_done then plans only the source side."""
        peer = self.conns.peers.get((reg.decode_engine_id, reg.decode_rank))
        rank = self.state.rank_states(reg.request_id).get(reg.decode_rank)
        if peer is None or rank is not DecodeRankState.REGISTERED:
            return
        lay = self.layout
        heads = owed_heads(lay.tp_rank, lay.tp_size, reg.decode_tp, lay.total_kv_heads).get(reg.decode_rank)
        prep = None if heads is None else self.conns.prepared(peer, heads)
        try:
            half = None if prep is None else half_plan(prep.units, True, reg.tables(), reg.num_tokens)
        except LayoutError:
            return
        if half is not None:
            if len(self.dst_half) > 2 * len(self.state) + 64:
                live = set(self.state.pending())
                self.dst_half = {k: v for k, v in self.dst_half.items() if k in live}
            self.dst_half.setdefault(reg.request_id, {})[(reg.attempt, reg.decode_rank)] = half

    def _source_ready(self, act: StartWrite) -> None:
        """Before the first WRITE from a request's blocks: wait for the engine's "KV written" barrier
        (a device event, say) and let the backend stage the blocks; both run here, on the push thread."""
        for barrier in self.kv_written.pop(act.request_id, ()):  # every range reported so far: all in order
            try:
                barrier()
            except Exception as exc:  # a failed barrier fails this request, not the thread
                raise TransportError(f"the engine's KV-written barrier failed: {exc!r}") from exc
        if self.hooks is not None and act.request_id not in self.staged:
            try:
                self.hooks.before_write(act.request_id, act.src_blocks)
            except Exception as exc:  # likewise: the request fails with the reason
                raise TransportError(f"staging the source blocks failed: {exc!r}") from exc
            self.staged.add(act.request_id)

    def _notify_done(self, act: NotifyDone) -> None:
        """Every range landed and no WRITE carried the notification: it goes alone."""
        dest = (act.decode_engine_id, act.decode_rank)
        peer, session = self.conns.peers.get(dest), self.conns.session(dest)
        try:
            if peer is None or session is None:
                raise PeerGone(f"no live session with decode {act.decode_engine_id!r} rank {act.decode_rank}")
            notice = done_notice(act.request_id, act.attempt, self.layout.rank, act.nbytes, session)
            self.transport.send_notif(peer.agent, notice)
        except TransportError as exc:  # the decode's fence or liveness check ends its wait
            log.warning("kvpush prefill: could not tell decode that %s landed: %s", act.request_id, exc)

    def _drop_state(self, request_id: str) -> tuple[float | None, dict[str, float]]:
        """What the push thread keeps of a request, dropped as it ends: its prefill_done time and
        timeline marks are returned (the SendResult reports them)."""
        started = self.prefill_done_at.pop(request_id, None)
        if self.armed:
            self.armed.drop_request(request_id)  # a Disarm came already: never more than a leftover
        self.kv_written.pop(request_id, None)
        self.staged.discard(request_id)
        self.src_half.pop(request_id, None)
        self.dst_half.pop(request_id, None)
        return started, self.timeline.pop(request_id, {})

    def _forget(self, act: Forget) -> None:
        """The machine forgot a request that never heard prefill_done: so does the push thread (a
        destination planned ahead, its marks). An engine that reported blocks with kv_ready and then
        never made the terminal call still waits for them: say so, and count it."""
        self._drop_state(act.request_id)
        if self.reads_until.get(act.request_id, 0.0) <= time.monotonic():
            self.reads_until.pop(act.request_id, None)  # a later prefill_done still honours a linger
        if act.ready_blocks is None:
            log.debug("kvpush prefill: forgot %s (%s): no prefill_done came", act.request_id, act.reason)
            return
        self.ledger.add(Count.NO_PREFILL_DONE)
        log.warning(
            "kvpush prefill: request %r ended (%s) and prefill_done never came within the lease: the "
            "engine still holds the %d blocks it reported with kv_ready, and only prefill_done returns "
            "them (a SendResult, failed); call prefill_done after abort() (docs/contract.md)",
            act.request_id,
            act.reason,
            len(act.ready_blocks),
        )

    def _notify_failure(self, act: NotifyFailure) -> None:
        dest = (act.decode_engine_id, act.decode_rank)
        peer = self.conns.peers.get(dest)
        if peer is None:
            log.warning(
                "kvpush prefill: cannot tell decode %s rank %s that %s failed: %s (no handshake)",
                act.decode_engine_id,
                act.decode_rank,
                act.request_id,
                act.reason,
            )
            return
        if act.kind is Failure.EXPIRED:
            self.ledger.add(Count.EXPIRED)
        try:
            session = self.conns.session(dest)
            if session is None:
                raise TransportError(
                    f"no live session with decode {act.decode_engine_id!r} rank {act.decode_rank}"
                )
            self.transport.send_notif(peer.agent, failure_notice(act, self.layout.rank, session))
        except TransportError as exc:
            log.warning("kvpush prefill: %s", exc)
