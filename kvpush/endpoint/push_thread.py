"""The push thread of a prefill rank: the sender machine's events in, its actions carried out.

A non-reentrant action pump over parts that return values and never call each other: the decode connections
(prefill_conns.py, prefill_bindings.py) yield events for the sender machine (protocol/sender.py), which
returns actions; each StartWrite goes to the WriteMaker (write_maker.py), which routes it to its decode peer
(peers.py) and returns a WRITE ready to post (planned, sealed, or made ahead); the WRITE scheduler
(writes.py) queues and posts it, and its settlements come back, one `Settled` per WRITE, through `_settle`,
the one place the machine hears a WRITE's outcome. What the thread keeps of a request is one `PushRequest`
(push_request.py) in `requests` (PushRequests: the records, held releases and the drop rules).

It is a role its endpoint's TransferLoop (loop.py) drives, not a thread class: the loop owns the thread,
doorbell, command queue and sticky death; what the endpoint shares (transport set-up, ledger, results) is
its EndpointCore (base.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq

from ..errors import LayoutError, TransportError
from ..protocol.groups import BlockIds
from ..protocol.plan import build_plan
from ..protocol.reasons import Failure
from ..protocol.sender import (
    Arm,
    DecodeRankState,
    Disarm,
    Forget,
    NotifyDone,
    NotifyFailure,
    ReleaseSource,
    SenderAction,
    SenderState,
    StartWrite,
)
from ..protocol.wire import Posted
from .armed import ArmedStore
from .base import TIMELINE, EndpointCore, SendResult, TransferHooks, stream_policy
from .conn_events import Admitted, ConnEvent, DecodeAborted
from .early import HeldCalls, ReadyCall
from .kept import prefill_kept
from .loop import LoopRole, TransferLoop, idle_wait_ms
from .peers import DecodePeers
from .posting import WriteSpec
from .prefill_bindings import DecodeBindings
from .prefill_conns import DecodeConnections
from .push_request import EngineSide, PushRequests
from .stats import Count
from .write_maker import WriteMaker
from .writes import Settled, WriteScheduler, failure_of

log = logging.getLogger("kvpush")

# Count(act.order) by a plain dict: an Enum call by value runs Python-level enum code on every WRITE
_ORDER_COUNT = {c.value: c for c in (Count.REGISTRATION_FIRST, Count.PREFILL_FIRST)}


class PushThread:
    """The prefill rank's role on its TransferLoop: setup/teardown, the round's step, the action pump and
    the engine's commands."""

    name = "kvpush-push"

    def __init__(
        self, core: EndpointCore[SendResult], loop: TransferLoop[LoopRole], hooks: TransferHooks | None
    ) -> None:
        self.core, self.loop, self.hooks = core, loop, hooks
        self.config = config = core.config
        self.layout = layout = core.layout
        self.ledger = core.ledger
        self.put_result = core.put_result
        self.tick_due = core.tick_due
        self.state = SenderState(
            layout.tp_rank,
            layout.tp_size,
            layout.total_kv_heads,
            config.leases.lease_s,
            config.leases.tombstone_s,
            config.limits.max_pending_per_peer,  # also caps the tombstones one engine's aborts leave
            layout.num_layers,
            stream_policy(config, layout),
        )
        self.bound_port = 0
        self.early = HeldCalls()  # kv_ready calls held on the engine's side (early.py)
        self.engine = EngineSide()  # what engine calls keep per request for later engine calls
        self.requests = PushRequests(self.engine, self.ledger, config.leases.write_linger_s)

    def setup(self) -> None:
        cfg, layout = self.config, self.layout
        cfg.check_listen()  # beyond loopback only with authentication (or explicitly without)
        self.transport, self.hello = self.core.setup_transport()
        port = cfg.side_channel.port + layout.rank if cfg.side_channel.port else 0
        try:
            listener = self.core.control.listen(cfg.side_channel.host, port, cfg.limits.max_message_bytes)
        except TransportError:
            self.transport.close()
            raise
        self.bound_port = listener.port
        self.loop.poller.register(listener.pollable, zmq.POLLIN)
        mem_type = self.core.mem_type
        self.peers = DecodePeers(layout, mem_type, self.transport, self.ledger)
        self.bindings = DecodeBindings(
            layout, cfg.security, cfg.limits, cfg.liveness, self.core.codec, self.hello, self.transport, listener,
            self.ledger, self.peers, self.state,
        )  # fmt: skip
        self.conns = DecodeConnections(self.bindings, self.peers, cfg.limits, self.ledger, self.state)
        warm = [[0]] * layout.num_groups  # warm numpy's paths off the first request
        build_plan(layout, layout, warm, warm, 1)
        self.scheduler = WriteScheduler(
            cfg.posting, cfg.leases.write_timeout_s, cfg.pacing.busy_poll_s, self.transport, self.ledger,
            self.loop.doorbell.ring,
        )  # fmt: skip
        self.armed = ArmedStore(self.transport)
        self.maker = WriteMaker(layout, mem_type, self.transport, self.peers, self.armed, self.hooks)
        self.requests.made_in(self.armed)

    def teardown(self) -> None:
        # Shutting down (or dying) mid-transfer: cancel what is in flight, deregister our memory, then
        # report every request failed so the engine frees its source blocks; nothing is leaked.
        fatal = self.loop.fatal
        reason = "prefill endpoint closed" if fatal is None else f"prefill endpoint died: {fatal!r}"
        settled = self.scheduler.close(reason)
        self.armed.close()  # WRITEs made ahead and never posted: released while the transport is open
        self.peers.close()  # and the prepared lists nothing indexes any more
        self.bindings.listener.close()
        self.transport.close()  # deregistered: no WRITE reads our memory any more, held releases go now
        for release in self.requests.close():
            self._release(release)
        actions = self._settle(settled)
        now = time.monotonic()
        for rid, calls in self.early.close().items():  # held kv_ready calls (early.py), heard now
            for c in [] if self.hooks else calls:
                actions += self.state.on_kv_ready(
                    rid, c.block_ids, c.num_tokens, c.layers, now, c.decode_engine_id
                )
        for rid in self.state.pending():
            actions += self.state.abort(rid, reason, now, Failure.CLOSED)
        actions += self.state.drop_streamed(reason)  # no prefill_done can come for them any more
        for act in actions:  # the transport is closed: only the releases matter now
            if isinstance(act, ReleaseSource):
                self._release(act)

    def busy(self) -> bool:
        # WRITEs a posting thread polls need no fast loop here: it rings the doorbell when one settles
        # (and write timeouts are checked at least every tick)
        return self.scheduler.busy()

    def in_flight(self) -> bool:
        return self.scheduler.busy()

    def wound_down(self) -> None:
        self.core.wound_down()

    def tracked(self) -> int:
        return len(self.state) + len(self.requests.held)

    def kept(self) -> dict[str, int]:
        return prefill_kept(self)

    def idle_wait_ms(self) -> int:
        """A transport owed progress (progress_owed) is drained at the tick cadence even with nothing
        tracked: the longer idle block would leave a notice queued that long per round."""
        if self.transport.progress_owed(time.monotonic()):
            return max(1, int(self.config.pacing.idle_poll_s * 1000))
        return idle_wait_ms(self.config.pacing, self.tracked())

    def describe(self, request_id: str) -> str:
        try:
            ranks = self.state.rank_states(request_id)
        except RuntimeError:  # the transfer thread replaced the table mid-read: say so, never raise
            return "the endpoint is changing its state"
        if not ranks:
            if request_id in self.state.pending():
                return "no registration from the decode yet"
            return "the endpoint no longer tracks it"
        return ", ".join(f"decode rank {d} {s.value}" for d, s in sorted(ranks.items()))

    # ---- the loop -----------------------------------------------------------------------------
    def step(self, now: float) -> bool:
        did = False
        for event in self.conns.receive(now):
            did = True
            if event is not None:
                self._on_event(event)
        if self.scheduler.writes:
            before = len(self.scheduler.writes)
            self._apply(self._settle(self.scheduler.progress(now)))
            did = did or len(self.scheduler.writes) < before
        if self.scheduler.queues:
            self._apply(())  # the budget may have room again
        if self.tick_due(now):
            self._tick(now)
        return did

    def _tick(self, now: float) -> None:
        if len(self.state) or self.transport.progress_owed(now):
            # prefill expects no notifications; draining keeps UCX progressing while requests are live,
            # and after a standalone notification that may not have left yet (NIXL 1.3.x: a failure or
            # done notice sent once nothing else is live; docs/backends.md)
            for peer, _msg in self.transport.drain_notifs():
                log.debug("kvpush prefill: ignored notification from %s", peer)
        for event in self.bindings.liveness(now):
            self._on_event(event)
        self._apply(self.state.on_tick(now))
        for rid, calls in self.early.overdue(now - self.config.leases.lease_s / 2).items():
            self.cmd_held(rid, calls)
        for release in self.requests.due(now):
            self._release(release)
        self.ledger.pending(len(self.state))
        self.ledger.in_flight_bytes(self.scheduler.inflight_bytes)

    def _on_event(self, event: ConnEvent) -> None:
        """What the decode connections tell the sender machine."""
        if isinstance(event, Admitted):
            self._on_registration(event)
        elif isinstance(event, DecodeAborted):
            self._apply(self.state.on_decode_abort(event.abort, time.monotonic()))
        else:
            now = time.monotonic()
            for rid in event.request_ids:
                if rid in self.state.pending():
                    self._apply(self.state.abort(rid, event.reason, now, Failure.PEER_GONE))

    def _on_registration(self, event: Admitted) -> None:
        reg = event.registration
        rid = reg.request_id
        fresh = rid not in self.requests
        req = self.requests.of(rid)
        had = "registered" in req.marks
        req.marks.setdefault("registered", event.at)
        peer = self.peers.get((reg.decode_engine_id, reg.decode_rank))
        align = math.lcm(self.layout.block_size, peer.layout.block_size if peer else 1)
        self._apply(self.state.on_registration(reg, event.at, align))
        if rid not in self.state:  # refused (or done already): no release will take its marks
            self.requests.unregister(rid, req, fresh, had)
            return
        if (
            req.prefill_done_at is None
            and (rid, reg.attempt, reg.decode_rank) not in self.armed
            and self.state.rank_states(rid).get(reg.decode_rank) is DecodeRankState.REGISTERED
        ):
            self.maker.plan_destination(req, reg)

    # ---- the action pump ----------------------------------------------------------------------
    def _apply(self, actions: Iterable[SenderAction]) -> None:
        """Run actions and every follow-up they produce, in order, without re-entering the machine."""
        pending = deque(actions)
        while True:
            while pending:
                act = pending.popleft()
                if isinstance(act, StartWrite):
                    pending.extend(self._start_write(act))
                else:
                    self._carry_out(act)
            if not self.scheduler.queues:
                break
            pending.extend(self._dispatch())
            if not pending:
                break

    def _carry_out(self, act: SenderAction) -> None:
        """Every action but StartWrite: none of them has follow-ups."""
        if isinstance(act, NotifyFailure):
            self.peers.notify_failure(act)
        elif isinstance(act, NotifyDone):
            self.peers.notify_done(act)
        elif isinstance(act, Arm):
            self.maker.arm(act.write, self.requests.get(act.write.request_id))
        elif isinstance(act, Disarm):
            self.armed.drop((act.request_id, act.attempt, act.decode_rank))
        elif isinstance(act, Forget):
            self.requests.forget(act)
        elif isinstance(act, ReleaseSource):
            self._release(act)

    def _dispatch(self) -> list[SenderAction]:
        """Post what the budget allows; the settlements of WRITEs that failed to post (or finished inside
        their post) come back as the machine's follow-ups."""
        failed, posted_inline = self.scheduler.dispatch()
        follow = self._settle(failed)
        if posted_inline:
            # progress at once: a loopback copy may finish inside the post, and its notification should
            # leave now rather than after the next loop round
            follow += self._settle(self.scheduler.progress(time.monotonic()))
        for a in self.scheduler.take_nudges():  # tell the decodes after the first poll: Posted
            if not a.notify:
                continue  # a range before the last: the decode has nothing to wait for yet
            posted = Posted(request_id=a.request_id, attempt=a.attempt, prefill_rank=self.layout.rank)
            if self.bindings.send_to((a.decode_engine_id, a.decode_rank), posted):
                self.ledger.add(Count.NUDGES)
        return follow

    def _start_write(self, act: StartWrite) -> list[SenderAction]:
        """A StartWrite becomes a queued WRITE (write_maker.py); a failure settles it at once. The
        StartWrite the machine armed queues what was made ahead: only the barrier and the post remain."""
        now = time.monotonic()
        self.ledger.add(_ORDER_COUNT[act.order])
        req = self.requests.of(act.request_id)
        marks = req.marks
        if act.notify:
            marks.setdefault("prefill_done", req.prefill_done_at or now)
        marks.setdefault("registered", now)
        marks.setdefault("picked", now)
        spec: WriteSpec
        try:
            made = self.maker.take_made(act, req, now)
            if made is not None:
                marks["plan_built"] = marks["sealed"] = now
                marks["armed"] = made.at  # made ahead (not a TIMELINE stage: the demo tells them apart)
                plan, spec = made.plan, made.spec
            else:
                plan, spec = self.maker.make(act, req)
        except (LayoutError, TransportError) as exc:
            return self._settle([Settled(act, False, 0, str(exc), kind=failure_of(exc))])
        if made is None and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvpush push %s: queued %.1f ms, plan %.1f ms, %d descriptors, %d bytes",
                act.request_id,
                1e3 * (now - (req.prefill_done_at or now)),
                1e3 * (marks["plan_built"] - now),
                plan.num_descriptors,
                plan.nbytes,
            )
        self.scheduler.queue(act, plan, spec, now)
        if made is not None:
            marks["queued"] = time.monotonic()
        else:
            marks.setdefault("queued", time.monotonic())
        return []

    def _settle(self, outcomes: list[Settled]) -> list[SenderAction]:
        """The one place the sender machine hears a WRITE's outcome."""
        follow: list[SenderAction] = []
        settled = self.requests.settled
        for s in outcomes:
            a = s.action
            settled(s)
            if s.ok:
                self.ledger.add(Count.BYTES, s.nbytes)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvpush push %s: complete %.1f ms after post (ok=%s)",
                    a.request_id,
                    1e3 * (s.complete_at - (s.posted_at or s.complete_at)),
                    s.ok,
                )
            follow += self.state.on_write_done(
                a.request_id, a.attempt, a.decode_rank, s.ok, s.nbytes, s.reason, time.monotonic(),
                s.abandoned, s.kind,
            )  # fmt: skip
        return follow

    def _release(self, act: ReleaseSource) -> None:
        now = time.monotonic()
        held, req = self.requests.release(act, now)
        if held:
            return
        marks = {} if req is None else req.marks
        started = None if req is None else req.prefill_done_at
        self.ledger.finished(act.ok, None if started is None else now - started, act.kind, act.owed_nothing)
        if log.isEnabledFor(logging.DEBUG) and marks:
            t0 = min(marks.values())
            log.debug(
                "kvpush push %s timeline (us from first mark): %s",
                act.request_id,
                ", ".join(f"{k} {1e6 * (marks[k] - t0):.0f}" for k in TIMELINE if k in marks),
            )
        result = SendResult(
            act.request_id, act.ok, act.block_ids, act.reason, act.nbytes, now, marks, act.kind
        )
        self.put_result(result)

    def inline_ok(self, request_id: str) -> bool:
        """prefill_done may run on the engine's thread (loop.run_inline): only to post WRITEs made ahead
        and small (engine_post_max_bytes), with nothing waiting for the post budget and no staging."""
        armed = self.armed.bytes_for(request_id)
        if not 0 < armed <= self.config.posting.engine_post_max_bytes:
            return False
        req = self.requests.get(request_id)
        barriers = req is not None and bool(req.barriers)
        return not (self.hooks or self.scheduler.queues or request_id in self.early or barriers)

    # ---- commands (run on this thread; prefill_done may run on the engine's, run_inline) ------
    def cmd_prefill_done(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        at: float,
        kv_written: Callable[[], None] | None,
        decode_engine_id: str = "",
    ) -> None:
        self.cmd_held(request_id, self.early.take(request_id))
        req = self.requests.of(request_id)
        req.prefill_done_at = req.marks["prefill_done"] = at
        if kv_written is not None:
            req.add_barrier(kv_written)
        now = time.monotonic()
        self._apply(self.state.on_prefill_done(request_id, block_ids, num_tokens, now, decode_engine_id))
        if self.requests.get(request_id) is req and "picked" not in req.marks:
            self.maker.plan_source(req, block_ids, num_tokens)  # no WRITE yet: no registration

    def cmd_source_blocks(
        self, request_id: str, block_ids: BlockIds, num_tokens: int, decode_engine_id: str
    ) -> None:
        req = self.requests.get(request_id)
        if self.hooks is not None or (req is not None and req.prefill_done_at is not None):
            self.engine.sourced.pop(request_id, None)  # no prefill_done will read it (or it came already)
            return  # staging copies the blocks only after prefill_done; or prefill_done came already
        now = time.monotonic()
        self._apply(self.state.on_source_blocks(request_id, block_ids, num_tokens, now, decode_engine_id))
        if request_id not in self.state:  # nothing to make ahead, or finished already: prefill_done answers
            self.engine.sourced.pop(request_id, None)

    def cmd_kv_ready(self, request_id: str, c: ReadyCall) -> None:
        if c.kv_written is not None:
            self.requests.of(request_id).add_barrier(c.kv_written)
        if self.hooks is not None:
            return  # staging copies a request's blocks once, before its first WRITE: it moves in one piece
        now = time.monotonic()
        self._apply(
            self.state.on_kv_ready(request_id, c.block_ids, c.num_tokens, c.layers, now, c.decode_engine_id)
        )

    def cmd_held(self, request_id: str, calls: list[ReadyCall]) -> None:
        """kv_ready calls in order: those the endpoint held for request_id (early.py), then the new one."""
        for c in calls:
            self.cmd_kv_ready(request_id, c)

    def cmd_abort(self, request_id: str, reason: str) -> None:
        self.cmd_held(request_id, self.early.take(request_id))
        self._apply(self.state.abort(request_id, reason, time.monotonic()))
