"""The prefill endpoint: receives registrations, pushes KV with WRITEs, tells the engine when blocks are free.

    prefill = PrefillEndpoint(config, layout)          # layout placed in registered memory
    prefill.start()                                     # transport, side channel on config.host:port+rank
    prefill.prefill_done(req_id, block_ids, num_tokens) # returns at once
    for r in prefill.finished(): free(r.block_ids)      # WRITEs completed (or the request failed)

The push thread runs a non-reentrant action pump: the state machine returns actions; each executor
returns the follow-up actions (a WRITE that failed to post, a completion) instead of calling back into
the machine, and the pump runs them in order until none are left.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from ..config import KVPushConfig
from ..errors import LayoutError, TransportError
from ..protocol.handshake import check_peer_hello
from ..protocol.layout import KVLayout
from ..protocol.plan import TransferPlan, build_plan
from ..protocol.sender import NotifyFailure, ReleaseSource, SenderAction, SenderState, StartWrite
from ..protocol.wire import Abort, ErrorReply, Hello, Registration, TransferDone, TransferFailed
from ..transport.base import Transport
from .base import Endpoint, EndpointWorker, SendResult, TransferHooks, checked_blocks
from .control import ControlListener, ControlPlane

log = logging.getLogger("kvpush")

# At most this many side-channel messages per loop round, so one flooding peer cannot starve WRITE
# progress, completions and ticks.
MAX_MESSAGES_PER_ROUND = 64


@dataclass
class _Write:
    action: StartWrite
    handle: Any
    plan: TransferPlan
    posted_at: float


@dataclass
class _DecodePeer:
    agent: str
    layout: KVLayout


class PushWorker(EndpointWorker[SendResult]):
    name = "kvpush-push"
    role = "prefill"

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str,
        transport: Transport | Callable[[], Transport] | None,
        control: ControlPlane | None,
        hooks: TransferHooks | None = None,
    ) -> None:
        super().__init__(config, layout, mem_type, transport, control, hooks)
        self.state = SenderState(
            layout.tp_rank, layout.tp_size, layout.total_kv_heads, config.lease_s, config.tombstone_s
        )
        self.peers: dict[tuple[str, int], _DecodePeer] = {}
        self.writes: list[_Write] = []
        self.prefill_done_at: dict[str, float] = {}
        self.kv_written: dict[str, Callable[[], None]] = {}  # request -> the engine's barrier, until used
        self.staged: set[str] = set()  # requests whose source blocks the hooks staged already
        self.bound_port = 0

    def setup(self) -> None:
        self.transport, self.hello = self.setup_transport()
        port = self.config.port + self.layout.tp_rank if self.config.port else 0
        try:
            self.listener: ControlListener = self.control.listen(
                self.config.host, port, self.config.max_message_bytes
            )
        except TransportError:
            self.transport.close()
            raise
        self.bound_port = self.listener.port
        self.poller.register(self.listener.pollable, zmq.POLLIN)
        build_plan(self.layout, self.layout, [0], [0], 1)  # warm numpy's paths off the first request

    def teardown(self) -> None:
        # Shutting down (or dying) mid-transfer: cancel what is in flight, deregister our memory, then
        # report every request failed so the engine frees its source blocks; nothing is leaked.
        reason = "prefill endpoint closed" if self.fatal is None else f"prefill endpoint died: {self.fatal!r}"
        writes, self.writes = self.writes, []
        for w in writes:
            with contextlib.suppress(TransportError):
                self.transport.release(w.handle)
        self.listener.close()
        self.transport.close()
        now = time.monotonic()
        actions: list[SenderAction] = []
        for w in writes:
            actions += self.state.on_write_done(
                w.action.request_id, w.action.attempt, w.action.decode_rank, False, 0, reason, now
            )
        for rid in self.state.pending():
            actions += self.state.abort(rid, reason, now)
        for act in actions:  # the transport is closed: only the releases matter now
            if isinstance(act, ReleaseSource):
                self._release(act)

    def busy(self) -> bool:
        return bool(self.writes)

    def tracked(self) -> int:
        return len(self.state)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self, now: float) -> bool:
        did = False
        for _ in range(MAX_MESSAGES_PER_ROUND):
            got = self.listener.recv()
            if got is None:
                break
            did = True
            self._on_side_message(got[0], got[1], now)
        if self.writes:
            before = len(self.writes)
            self._apply(self._progress_writes(now))
            did = did or len(self.writes) < before
        if self.tick_due(now):
            if len(self.state):
                # prefill expects no notifications; draining keeps UCX progressing while requests are live
                for peer, _msg in self.transport.drain_notifs():
                    log.debug("kvpush prefill: ignored notification from %s", peer)
            self._apply(self.state.on_tick(now))
            self.ledger.pending(len(self.state))
        return did

    def _on_side_message(self, conn: bytes, data: bytes | None, now: float) -> None:
        msg = self.decode_or_count(data, "side channel")
        if msg is None:
            self._reply(conn, ErrorReply(reason="message refused: could not decode (see prefill log)"))
            return
        if isinstance(msg, Hello):
            self._on_hello(conn, msg)
        elif isinstance(msg, Registration):
            if (msg.decode_engine_id, msg.decode_rank) not in self.peers:
                self._reply(
                    conn,
                    ErrorReply(
                        reason=f"registration from unknown decode {msg.decode_engine_id!r} rank "
                        f"{msg.decode_rank}: send hello first",
                        request_id=msg.request_id,
                        attempt=msg.attempt,
                    ),
                )
                return
            self._apply(self.state.on_registration(msg, now))
        elif isinstance(msg, Abort):
            self._apply(self.state.on_decode_abort(msg, now))
        else:
            self.ledger.add("wire_errors")
            self._reply(conn, ErrorReply(reason=f"prefill does not accept {type(msg).__name__} messages"))

    def _on_hello(self, conn: bytes, hello: Hello) -> None:
        try:
            peer_layout = check_peer_hello(self.layout, hello, prefill_side=True)
            agent = self.transport.add_peer(hello.agent_metadata)
            self.transport.connect(agent)  # at handshake, not on the first request's critical path
        except (LayoutError, TransportError) as exc:
            self._reply(conn, ErrorReply(reason=str(exc)))
            return
        self.peers[(hello.engine_id, peer_layout.tp_rank)] = _DecodePeer(agent, peer_layout)
        self._reply(conn, self.hello)

    def _reply(self, conn: bytes, msg: Hello | ErrorReply) -> None:
        try:
            self.listener.send(conn, self.codec.encode(msg))
        except TransportError as exc:
            log.warning("kvpush prefill: could not reply on side channel: %s", exc)

    # ---- the action pump ----------------------------------------------------------------------
    def _apply(self, actions: Iterable[SenderAction]) -> None:
        """Run actions and every follow-up they produce, in order, without re-entering the machine."""
        pending = deque(actions)
        posted = False
        while pending:
            while pending:
                act = pending.popleft()
                if isinstance(act, StartWrite):
                    pending.extend(self._start_write(act))
                    posted = True
                elif isinstance(act, NotifyFailure):
                    self._notify_failure(act)
                else:
                    self._release(act)
            if posted:
                # progress at once: a loopback copy may finish inside the post, and its notification
                # should leave now rather than after the next loop round
                posted = False
                pending.extend(self._progress_writes(time.monotonic()))

    def _start_write(self, act: StartWrite) -> list[SenderAction]:
        now = time.monotonic()
        self.ledger.add(act.order)
        peer = self.peers.get((act.decode_engine_id, act.decode_rank))
        try:
            if peer is None:
                raise TransportError(
                    f"no handshake with decode {act.decode_engine_id!r} rank {act.decode_rank}"
                )
            self._source_ready(act)
            plan = build_plan(
                self.layout, peer.layout, act.src_blocks, act.dst_blocks, act.num_tokens, heads=act.heads
            )
            local, remote = plan.nixl_descs()
            notif = self.codec.encode(
                TransferDone(
                    request_id=act.request_id,
                    attempt=act.attempt,
                    prefill_rank=self.layout.tp_rank,
                    nbytes=plan.nbytes,
                )
            )
            t_plan = time.monotonic()
            handle = self.transport.post_write(peer.agent, local, remote, notif, self.mem_type)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvpush push %s: queued %.1f ms, plan %.1f ms, post %.1f ms, %d descriptors, %d bytes",
                    act.request_id,
                    1e3 * (now - self.prefill_done_at.get(act.request_id, now)),
                    1e3 * (t_plan - now),
                    1e3 * (time.monotonic() - t_plan),
                    plan.num_descriptors,
                    plan.nbytes,
                )
        except (LayoutError, TransportError) as exc:
            return self.state.on_write_done(
                act.request_id, act.attempt, act.decode_rank, False, 0, str(exc), now
            )
        self.ledger.add("writes")
        self.ledger.add("descriptors", plan.num_descriptors)
        self.ledger.add("blocks", plan.num_blocks)
        self.writes.append(_Write(act, handle, plan, now))
        return []

    def _source_ready(self, act: StartWrite) -> None:
        """Before the first WRITE from a request's blocks: wait for the engine's "KV written" barrier
        (a device event, say) and let the backend stage the blocks; both run here, on the push thread."""
        barrier = self.kv_written.pop(act.request_id, None)
        if barrier is not None:
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

    def _progress_writes(self, now: float) -> list[SenderAction]:
        """Poll every WRITE in flight once; the machine's answers to the finished ones are returned."""
        follow: list[SenderAction] = []
        still: list[_Write] = []
        for w in self.writes:
            try:
                if self.transport.poll(w.handle) == "PROC":
                    still.append(w)
                    continue
                ok, reason = True, ""
            except TransportError as exc:
                ok, reason = False, str(exc)
            try:
                self.transport.release(w.handle)
            except TransportError as exc:
                log.warning("kvpush prefill: %s", exc)
            nbytes = w.plan.nbytes if ok else 0
            if ok:
                self.ledger.add("bytes", nbytes)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvpush push %s: complete %.1f ms after post (ok=%s)",
                    w.action.request_id,
                    1e3 * (now - w.posted_at),
                    ok,
                )
            follow += self.state.on_write_done(
                w.action.request_id,
                w.action.attempt,
                w.action.decode_rank,
                ok,
                nbytes,
                reason,
                time.monotonic(),
            )
        self.writes = still
        return follow

    def _notify_failure(self, act: NotifyFailure) -> None:
        peer = self.peers.get((act.decode_engine_id, act.decode_rank))
        if peer is None:
            log.warning(
                "kvpush prefill: cannot tell decode %s rank %s that %s failed: %s (no handshake)",
                act.decode_engine_id,
                act.decode_rank,
                act.request_id,
                act.reason,
            )
            return
        msg = TransferFailed(
            request_id=act.request_id,
            attempt=act.attempt,
            prefill_rank=self.layout.tp_rank,
            reason=act.reason[:2000],
        )
        try:
            self.transport.send_notif(peer.agent, self.codec.encode(msg))
        except TransportError as exc:
            log.warning("kvpush prefill: %s", exc)

    def _release(self, act: ReleaseSource) -> None:
        now = time.monotonic()
        started = self.prefill_done_at.pop(act.request_id, None)
        self.kv_written.pop(act.request_id, None)
        self.staged.discard(act.request_id)
        self.ledger.finished(act.ok, None if started is None else now - started)
        self.put_result(SendResult(act.request_id, act.ok, act.block_ids, act.reason, act.nbytes, now))

    # ---- commands (run on this thread) --------------------------------------------------------
    def cmd_prefill_done(
        self,
        request_id: str,
        block_ids: tuple[int, ...],
        num_tokens: int,
        at: float,
        kv_written: Callable[[], None] | None,
    ) -> None:
        self.prefill_done_at[request_id] = at
        if kv_written is not None:
            self.kv_written[request_id] = kv_written
        self._apply(self.state.on_prefill_done(request_id, block_ids, num_tokens, time.monotonic()))

    def cmd_abort(self, request_id: str, reason: str) -> None:
        self._apply(self.state.abort(request_id, reason, time.monotonic()))


class PrefillEndpoint(Endpoint[SendResult]):
    """One prefill rank: receives registrations, pushes KV, tells the engine when blocks are free."""

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str = "DRAM",
        transport: Transport | Callable[[], Transport] | None = None,
        control: ControlPlane | None = None,
        hooks: TransferHooks | None = None,
    ) -> None:
        self._push = PushWorker(config, layout, mem_type, transport, control, hooks)
        super().__init__(config, layout, self._push)

    @property
    def address(self) -> tuple[str, int]:
        """(host, base port): decode ranks reach rank r at base port + r."""
        return self.config.host, self._push.bound_port - self.layout.tp_rank

    def prefill_done(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        kv_written: Callable[[], None] | None = None,
    ) -> None:
        """The request's prompt KV is computed into block_ids; push it once decode has registered.

        kv_written: optional barrier the push thread calls before reading the blocks (e.g. a CUDA event's
        synchronize, recorded by the engine on the stream that wrote the KV): the engine never waits.
        """
        at = time.monotonic()
        blocks = checked_blocks(self.layout, request_id, block_ids, num_tokens)
        self._push.submit(lambda: self._push.cmd_prefill_done(request_id, blocks, num_tokens, at, kv_written))

    def abort(self, request_id: str, reason: str = "aborted by prefill engine") -> None:
        self._push.submit(lambda: self._push.cmd_abort(request_id, reason))
