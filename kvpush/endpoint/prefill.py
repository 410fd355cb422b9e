"""The prefill endpoint: receives registrations, pushes KV with WRITEs, tells the engine when blocks are free.

    prefill = PrefillEndpoint(config, layout)          # layout placed in registered memory
    prefill.start()                                     # transport, side channel on config.side_channel.host:port+rank
    prefill.prefill_done(req_id, block_ids, num_tokens) # returns at once
    for r in prefill.finished(): free(r.block_ids)      # WRITEs completed (or the request failed)

The push thread runs a non-reentrant action pump over three parts that return values, never call each
other: the decode connections (prefill_conns.py) yield events for the sender machine; the machine
(protocol/sender.py) returns actions; each StartWrite becomes a WriteOrder (protocol/order.py, one trip;
push_actions.py carries the actions out) queued on the WRITE scheduler (writes.py), whose settlements come back, one `Settled` per WRITE, through
`_settle`, the one place the machine hears a WRITE's outcome.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq

from ..config import KVPushConfig
from ..errors import LayoutError, TransportError
from ..protocol.groups import BlockIds, TableArg
from ..protocol.layout import KVLayout
from ..protocol.plan import build_plan
from ..protocol.prepared import Half, PairUnits
from ..protocol.reasons import Failure
from ..protocol.sender import (
    Arm,
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
from .base import (
    TIMELINE,
    Endpoint,
    EndpointThread,
    SendResult,
    TransferHooks,
    TransportSource,
    checked_blocks,
    stream_policy,
    stream_table,
)
from .conn_events import Admitted, ConnEvent, DecodeAborted
from .control import ControlPlane
from .early import HeldCalls, ReadyCall
from .kept import prefill_kept
from .prefill_conns import MAX_MESSAGES_PER_ROUND, DecodeConnections
from .push_actions import PushActions
from .stats import Count
from .writes import Settled, WriteScheduler

__all__ = ["MAX_MESSAGES_PER_ROUND", "TIMELINE", "PrefillEndpoint", "PushThread"]

log = logging.getLogger("kvpush")


class PushThread(PushActions, EndpointThread[SendResult]):
    name = "kvpush-push"
    role = "prefill"

    def init_role(self) -> None:
        config, layout = self.config, self.layout
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
        self.prefill_done_at: dict[str, float] = {}
        self.kv_written: dict[
            str, list[Callable[[], None]]
        ] = {}  # request -> the engine's barriers, until used
        self.staged: set[str] = set()  # requests whose source blocks the hooks staged already
        self.timeline: dict[str, dict[str, float]] = {}  # request -> TIMELINE marks so far
        # an abandoned WRITE may still read its source until write_linger_s after it was given up: the
        # engine gets the source blocks back only then (held: (when, release), in order of `when`)
        self.reads_until: dict[str, float] = {}
        self.held: deque[tuple[float, ReleaseSource]] = deque()
        self.closing = False
        self.bound_port = 0
        self.early = HeldCalls()
        # sides of a plan made before the other side's event (push_actions.py: the trigger plans one side)
        self.src_half: dict[str, Half] = {}
        self.dst_half: dict[str, dict[tuple[int, int], Half]] = {}  # request -> (attempt, decode rank)
        self.last_units: PairUnits | None = None

    def setup(self) -> None:
        self.config.check_listen()  # beyond loopback only with authentication (or explicitly without)
        self.transport, self.hello = self.setup_transport()
        port = self.config.side_channel.port + self.layout.rank if self.config.side_channel.port else 0
        try:
            listener = self.control.listen(
                self.config.side_channel.host, port, self.config.limits.max_message_bytes
            )
        except TransportError:
            self.transport.close()
            raise
        self.bound_port = listener.port
        self.poller.register(listener.pollable, zmq.POLLIN)
        self.conns = DecodeConnections(
            self.config, self.layout, self.mem_type, self.codec, self.hello, self.transport, listener,
            self.ledger, self.state,
        )  # fmt: skip
        warm = [[0]] * self.layout.num_groups  # warm numpy's paths off the first request
        build_plan(self.layout, self.layout, warm, warm, 1)
        self.scheduler = WriteScheduler(self.config, self.transport, self.ledger, self.doorbell.ring)
        self.armed = ArmedStore(self.transport)

    def teardown(self) -> None:
        # Shutting down (or dying) mid-transfer: cancel what is in flight, deregister our memory, then
        # report every request failed so the engine frees its source blocks; nothing is leaked.
        reason = "prefill endpoint closed" if self.fatal is None else f"prefill endpoint died: {self.fatal!r}"
        settled = self.scheduler.close(reason)
        self.armed.close()  # WRITEs made ahead and never posted: released while the transport is open
        self.conns.listener.close()
        self.transport.close()  # deregistered: no WRITE reads our memory any more, held releases go now
        self.closing = True
        while self.held:
            self._release(self.held.popleft()[1])
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

    def tracked(self) -> int:
        return len(self.state) + len(self.held)

    def kept(self) -> dict[str, int]:
        return prefill_kept(self)

    def idle_wait_ms(self) -> int:
        """A transport owed progress (progress_owed) is drained at the tick cadence even with nothing
        tracked: the longer idle block would leave a notice queued that long per round."""
        if self.transport.progress_owed(time.monotonic()):
            return max(1, int(self.config.pacing.idle_poll_s * 1000))
        return super().idle_wait_ms()

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
            if len(self.state) or self.transport.progress_owed(now):
                # prefill expects no notifications; draining keeps UCX progressing while requests are
                # live, and after a standalone notification that may not have left yet (NIXL 1.3.x: a
                # failure or done notice sent once nothing else is live; docs/backends.md)
                for peer, _msg in self.transport.drain_notifs():
                    log.debug("kvpush prefill: ignored notification from %s", peer)
            for event in self.conns.liveness(now):
                self._on_event(event)
            self._apply(self.state.on_tick(now))
            for rid, calls in self.early.overdue(now - self.config.leases.lease_s / 2).items():
                self.cmd_held(rid, calls)
            while self.held and self.held[0][0] <= now:
                self._release(self.held.popleft()[1])
            self.ledger.pending(len(self.state))
            self.ledger.in_flight_bytes(self.scheduler.inflight_bytes)
        return did

    def _on_event(self, event: ConnEvent) -> None:
        """What the decode connections tell the sender machine."""
        if isinstance(event, Admitted):
            reg = event.registration
            self.timeline.setdefault(reg.request_id, {}).setdefault("registered", event.at)
            peer = self.conns.peers.get((reg.decode_engine_id, reg.decode_rank))
            align = math.lcm(self.layout.block_size, peer.layout.block_size if peer else 1)
            self._apply(self.state.on_registration(reg, event.at, align))
            if reg.request_id not in self.state:  # refused: no release will take its marks
                self.timeline.pop(reg.request_id, None)
                return
            if reg.request_id not in self.prefill_done_at and (
                (reg.request_id, reg.attempt, reg.decode_rank) not in self.armed
            ):
                self._plan_dst_early(reg)
        elif isinstance(event, DecodeAborted):
            self._apply(self.state.on_decode_abort(event.abort, time.monotonic()))
        else:
            now = time.monotonic()
            for rid in event.request_ids:
                if rid in self.state.pending():
                    self._apply(self.state.abort(rid, event.reason, now, Failure.PEER_GONE))

    # ---- the action pump ----------------------------------------------------------------------
    def _apply(self, actions: Iterable[SenderAction]) -> None:
        """Run actions and every follow-up they produce, in order, without re-entering the machine."""
        pending = deque(actions)
        while True:
            while pending:
                act = pending.popleft()
                if isinstance(act, StartWrite):
                    pending.extend(self._start_write(act))
                elif isinstance(act, NotifyFailure):
                    self._notify_failure(act)
                elif isinstance(act, NotifyDone):
                    self._notify_done(act)
                elif isinstance(act, Arm):
                    self._arm_write(act.write)
                elif isinstance(act, Disarm):
                    self.armed.drop((act.request_id, act.attempt, act.decode_rank))
                elif isinstance(act, Forget):
                    self._forget(act)
                else:
                    self._release(act)
            if not self.scheduler.queues:
                break
            failed, posted_inline = self.scheduler.dispatch()
            pending.extend(self._settle(failed))
            if posted_inline:
                # progress at once: a loopback copy may finish inside the post, and its notification
                # should leave now rather than after the next loop round
                pending.extend(self._settle(self.scheduler.progress(time.monotonic())))
            for a in self.scheduler.take_nudges():  # tell the decodes after the first poll: Posted
                if not a.notify:
                    continue  # a range before the last: the decode has nothing to wait for yet
                posted = Posted(request_id=a.request_id, attempt=a.attempt, prefill_rank=self.layout.rank)
                if self.conns.send_to((a.decode_engine_id, a.decode_rank), posted):
                    self.ledger.add(Count.NUDGES)
            if not pending:
                break

    def _settle(self, outcomes: list[Settled]) -> list[SenderAction]:
        """The one place the sender machine hears a WRITE's outcome."""
        follow: list[SenderAction] = []
        for s in outcomes:
            a = s.action
            marks = self.timeline.setdefault(a.request_id, {})
            if s.made_at:
                marks["made"] = min(marks.get("made", s.made_at), s.made_at)
            if s.posted_at:
                marks["posted"] = min(marks.get("posted", s.posted_at), s.posted_at)
            if s.complete_at:
                marks["complete"] = s.complete_at
            if s.ok:
                self.ledger.add(Count.BYTES, s.nbytes)
            if s.abandoned:
                until = s.complete_at + self.config.leases.write_linger_s
                self.reads_until[a.request_id] = max(self.reads_until.get(a.request_id, 0.0), until)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvpush push %s: complete %.1f ms after post (ok=%s)",
                    a.request_id,
                    1e3 * (s.complete_at - (s.posted_at or s.complete_at)),
                    s.ok,
                )
            follow += self.state.on_write_done(
                a.request_id,
                a.attempt,
                a.decode_rank,
                s.ok,
                s.nbytes,
                s.reason,
                time.monotonic(),
                s.abandoned,
                s.kind,
            )
        return follow

    def _release(self, act: ReleaseSource) -> None:
        now = time.monotonic()
        until = self.reads_until.pop(act.request_id, 0.0)
        if until > now and not self.closing:
            self.held.append((until, act))  # write_linger_s is one value: `until` only grows along held
            return
        started, marks = self._drop_state(act.request_id)
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
        return 0 < armed <= self.config.posting.engine_post_max_bytes and not (
            self.hooks or self.scheduler.queues or request_id in self.early or request_id in self.kv_written
        )

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
        self.prefill_done_at[request_id] = at
        self.timeline.setdefault(request_id, {})["prefill_done"] = at
        if kv_written is not None:
            self.kv_written.setdefault(request_id, []).append(kv_written)
        now = time.monotonic()
        self._apply(self.state.on_prefill_done(request_id, block_ids, num_tokens, now, decode_engine_id))
        if request_id in self.prefill_done_at and "picked" not in self.timeline.get(request_id, ()):
            self._plan_src_early(request_id, block_ids, num_tokens)  # no WRITE yet: no registration

    def cmd_source_blocks(
        self, request_id: str, block_ids: BlockIds, num_tokens: int, decode_engine_id: str
    ) -> None:
        if self.hooks is not None or request_id in self.prefill_done_at:
            return  # staging copies the blocks only after prefill_done; or prefill_done came already
        now = time.monotonic()
        self._apply(self.state.on_source_blocks(request_id, block_ids, num_tokens, now, decode_engine_id))

    def cmd_kv_ready(self, request_id: str, c: ReadyCall) -> None:
        if c.kv_written is not None:
            self.kv_written.setdefault(request_id, []).append(c.kv_written)
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


class PrefillEndpoint(Endpoint[SendResult]):
    """One prefill rank: receives registrations, pushes KV, tells the engine when blocks are free."""

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str = "DRAM",
        transport: TransportSource = None,
        control: ControlPlane | None = None,
        hooks: TransferHooks | None = None,
    ) -> None:
        self._push = PushThread(config, layout, mem_type, transport, control, hooks)
        super().__init__(config, layout, self._push)
        self._streaming: set[str] = set()  # requests with a kv_ready sent to the push thread (not held)
        # source_blocks' checked table, by request: prefill_done naming the same ids skips the check
        self._sourced: dict[str, tuple[int, BlockIds]] = {}

    @property
    def address(self) -> tuple[str, int]:
        """(host, base port): decode ranks reach rank r at base port + r."""
        return self.config.side_channel.advertised, self._push.bound_port - self.layout.rank

    def prefill_done(
        self,
        request_id: str,
        block_ids: TableArg,
        num_tokens: int,
        kv_written: Callable[[], None] | None = None,
        decode_engine_id: str = "",
    ) -> None:
        """The request's prompt KV is computed into block_ids (one table, or one per KV-cache group of
        the layout; a window group's may hold -1 outside the window); push it once decode has registered.

        kv_written: optional barrier the push thread calls before reading the blocks (e.g. a CUDA event's
        synchronize, recorded by the engine on the stream that wrote the KV): the engine never waits.
        decode_engine_id: the decode engine the router sent this request to, when known: only that engine
        may then register for it or abort it (otherwise the first engine to register owns it).
        """
        at = time.monotonic()
        named = self._sourced.pop(request_id, None) if self._sourced else None
        if named is not None and named[0] == num_tokens and tuple(block_ids) == named[1]:
            blocks = named[1]  # checked at source_blocks (a flat table compares equal only to itself)
        else:
            blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens)
        self._streaming.discard(request_id)
        push = self._push

        def command() -> None:
            push.cmd_prefill_done(request_id, blocks, num_tokens, at, kv_written, decode_engine_id)

        def on_engine_thread() -> None:
            command()
            push.ledger.add(Count.ENGINE_POSTS)  # under the thread's round lock: the ledger's one writer

        if kv_written is None and push.run_inline(on_engine_thread, lambda: push.inline_ok(request_id)):
            return  # posted from this thread: the WRITE was made ahead (source_blocks) and is small
        push.submit(command)

    def source_blocks(
        self,
        request_id: str,
        block_ids: TableArg,
        num_tokens: int,
        decode_engine_id: str = "",
    ) -> None:
        """The engine is computing the prompt's KV into block_ids (as prefill_done will name them: one
        table, or one per KV-cache group) and prefill_done follows; vLLM could say so during the forward
        pass. A registered decode rank's WRITE is then planned, sealed and made now, so prefill_done with
        the same blocks and tokens only posts it. Optional and non-blocking; the blocks stay the engine's
        (nothing reads them before prefill_done), and a request that never gets its prefill_done ends
        when its lease runs out. Other blocks at prefill_done, kv_ready ranges, an abort or expiry drop
        what was made and take the general path. decode_engine_id: as in prefill_done.
        """
        blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens)
        if len(self._sourced) >= 4096:  # named and never finished (aborted, say): bounded, not exact
            self._sourced.clear()
        self._sourced[request_id] = (num_tokens, blocks)
        self._push.submit(
            lambda: self._push.cmd_source_blocks(request_id, blocks, num_tokens, decode_engine_id)
        )

    def kv_ready(
        self,
        request_id: str,
        block_ids: TableArg,
        num_tokens: int,
        layers: tuple[int, int] | None = None,
        kv_written: Callable[[], None] | None = None,
        decode_engine_id: str = "",
    ) -> None:
        """Streamed push: the first `num_tokens` tokens of layers [layers[0], layers[1]) (None: all) are
        computed into block_ids (a prefix of the table prefill_done will give). Their WRITEs may start now;
        prefill_done stays the terminal call, after abort() too: from the first kv_ready the blocks are
        the endpoint's until its SendResult, which only prefill_done brings. kv_written: this range's
        barrier, as in prefill_done; every barrier reported so far is called before a WRITE reads them. Below
        stream_min_tokens nothing can move yet: the call waits here for the request's next one (early.py).
        """
        blocks = stream_table(self.layout, request_id, block_ids, num_tokens)
        if layers is not None and not (0 <= layers[0] < layers[1] <= self.layout.num_layers):
            raise LayoutError(f"kv_ready {request_id!r}: layers {layers} outside 0..{self.layout.num_layers}")
        call, push = ReadyCall(blocks, num_tokens, layers, kv_written, decode_engine_id), self._push
        if request_id not in self._streaming and (
            num_tokens < self.config.streaming.min_tokens or push.hooks is not None
        ):
            push.alive_or_raise()
            push.early.hold(request_id, call, time.monotonic())  # nothing may move yet: early.py
            return
        push.submit(lambda: push.cmd_held(request_id, [*push.early.take(request_id), call]))
        self._streaming.add(request_id)

    def abort(self, request_id: str, reason: str = "aborted by prefill engine") -> None:
        self._streaming.discard(request_id)
        self._sourced.pop(request_id, None)
        self._push.submit(lambda: self._push.cmd_abort(request_id, reason))
