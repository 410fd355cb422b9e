"""The engine-agnostic API: what a serving stack calls on each side.

PrefillEndpoint (one per prefill worker / TP rank) and DecodeEndpoint (one per decode worker / TP rank)
wrap the sans-IO state machines with a background thread that owns the NIXL agent and the side channel.
Every engine-facing call only enqueues and returns: no descriptor work, no posting, no waiting.

    prefill = PrefillEndpoint(config, layout)        # layout placed in registered memory
    prefill.start()                                    # NIXL agent, side channel on config.host:port+rank
    prefill.prefill_done(req_id, block_ids, num_tokens)
    for r in prefill.finished(): free(r.block_ids)     # WRITEs completed (or the request failed)

    decode = DecodeEndpoint(config, layout)
    decode.start()
    decode.expect(req_id, block_ids, num_tokens, PrefillAddress(engine_id, host, port, tp_size))
    for r in decode.finished(): r.ok and start_decoding(r.request_id)
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import metrics
from .config import KVPushConfig
from .layout import KVLayout, LayoutError
from .plan import TransferPlan, build_plan
from .receiver import Discarded, Failed, Ready, ReceiverAction, ReceiverState, SendAbort, SendRegistration
from .runtime import Worker, check_peer_hello, make_hello
from .sender import NotifyFailure, ReleaseSource, SenderAction, SenderState, StartWrite
from .transport.base import Transport, TransportError
from .transport.nixl import NixlTransport, prepare_environment
from .wire import Abort, ErrorReply, Hello, Registration, TransferDone, TransferFailed

log = logging.getLogger("kvpush")


@dataclass(frozen=True)
class PrefillAddress:
    """Where a decode engine finds the prefill engine (as a router passes it along)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1

    def rank_endpoint(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port + rank}"


@dataclass(frozen=True)
class SendResult:
    request_id: str
    ok: bool
    block_ids: tuple[int, ...]
    reason: str = ""
    nbytes: int = 0
    done_at: float = 0.0


@dataclass(frozen=True)
class RecvResult:
    request_id: str
    ok: bool
    block_ids: tuple[int, ...]
    reason: str = ""
    nbytes: int = 0
    ready_at: float = 0.0


def _new_transport(config: KVPushConfig, role: str, rank: int) -> Transport:
    prepare_environment(config.ucx_net_devices)
    return NixlTransport(f"{config.engine_id}-{role}-{rank}-{uuid.uuid4().hex[:8]}", config.backends)


# ====================================================================================================
# prefill side
# ====================================================================================================
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


class _EndpointWorker(Worker):
    """A worker that owns one rank's NIXL agent: created and registered on its own thread at start."""

    role = ""

    def __init__(self, config: KVPushConfig, layout: KVLayout, mem_type: str,
                 transport: Transport | None) -> None:
        super().__init__(config)
        self.layout = layout
        self.mem_type = mem_type
        self.transport = transport
        self._next_tick = 0.0
        self.labels = (self.role, config.engine_id, str(layout.tp_rank))
        self.result_listener: Callable[[], None] | None = None

    def notify_result(self) -> None:
        """A result was queued: tell the engine's listener (it may be sleeping in an idle step)."""
        listener = self.result_listener
        if listener is None:
            return
        try:
            listener()
        except Exception:  # noqa: BLE001 - a broken listener must not take the transfer thread down
            log.exception("kvpush: result listener failed")

    def setup_transport(self) -> Transport:
        if self.transport is None:
            self.transport = _new_transport(self.config, self.role, self.layout.tp_rank)
        self.transport.register(self.layout.regions, self.mem_type)
        self.hello = make_hello(self.config, self.role, self.transport.name, self.transport.metadata(),
                                self.mem_type, self.layout)
        return self.transport


class _PushWorker(_EndpointWorker):
    name = "kvpush-push"
    role = "prefill"

    def __init__(self, config: KVPushConfig, layout: KVLayout, mem_type: str,
                 transport: Transport | None) -> None:
        super().__init__(config, layout, mem_type, transport)
        self.state = SenderState(layout.tp_rank, layout.tp_size, layout.total_kv_heads, config.lease_s,
                                 config.tombstone_s)
        self.results: queue.SimpleQueue[SendResult] = queue.SimpleQueue()
        self.peers: dict[tuple[str, int], _DecodePeer] = {}
        self.writes: list[_Write] = []
        self.prefill_done_at: dict[str, float] = {}
        self.bound_port = 0

    def setup(self) -> None:
        self.setup_transport()
        self.sock = self.zmq.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        port = self.config.port + self.layout.tp_rank if self.config.port else 0
        if port:
            self.sock.bind(f"tcp://{self.config.host}:{port}")
            self.bound_port = port
        else:
            self.bound_port = self.sock.bind_to_random_port(f"tcp://{self.config.host}")
        self.poller.register(self.sock, zmq.POLLIN)
        build_plan(self.layout, self.layout, [0], [0], 1)  # warm numpy's paths off the first request

    def teardown(self) -> None:
        assert self.transport is not None
        for w in self.writes:  # shutting down mid-transfer: report, never leak the source blocks
            try:
                self.transport.release(w.handle)
            except TransportError:
                pass
        self.writes.clear()
        for rid in self.state.pending():
            self._apply(self.state.abort(rid, "prefill endpoint closed", time.monotonic()))
        self.sock.close()
        self.transport.close()

    def busy(self) -> bool:
        return bool(self.writes)

    def tracked(self) -> int:
        return len(self.state)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self, now: float) -> bool:
        did = False
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            did = True
            if len(frames) != 2:
                self.counters.wire_errors += 1
                continue
            self._on_side_message(frames[0], frames[1], now)
        if self.writes:
            did = self._progress_writes(now) or did
        assert self.transport is not None
        if now >= self._next_tick:
            self._next_tick = now + 0.01
            if len(self.state):
                # prefill expects no notifications; draining keeps UCX progressing while requests are live
                for peer, _msg in self.transport.drain_notifs():
                    log.debug("kvpush prefill: ignored notification from %s", peer)
            self._apply(self.state.on_tick(now))
        return did

    def _on_side_message(self, ident: bytes, data: bytes, now: float) -> None:
        msg = self.decode_or_count(data, "side channel")
        if msg is None:
            self._reply(ident, ErrorReply(reason="message refused: could not decode (see prefill log)"))
            return
        if isinstance(msg, Hello):
            self._on_hello(ident, msg)
        elif isinstance(msg, Registration):
            if (msg.decode_engine_id, msg.decode_rank) not in self.peers:
                self._reply(ident, ErrorReply(
                    reason=f"registration from unknown decode {msg.decode_engine_id!r} rank "
                           f"{msg.decode_rank}: send hello first", request_id=msg.request_id,
                    attempt=msg.attempt))
                return
            self._apply(self.state.on_registration(msg, now))
        elif isinstance(msg, Abort):
            self._apply(self.state.on_decode_abort(msg, now))
        else:
            self._reply(ident, ErrorReply(reason=f"prefill does not accept {type(msg).__name__} messages"))

    def _on_hello(self, ident: bytes, hello: Hello) -> None:
        assert self.transport is not None
        try:
            if hello.role != "decode":
                raise LayoutError(f"hello from a {hello.role} engine; prefill talks to decode engines")
            peer_layout = check_peer_hello(self.layout, hello, prefill_side=True)
            agent = self.transport.add_peer(hello.agent_metadata)
            self.transport.connect(agent)  # at handshake, not on the first request's critical path
        except (LayoutError, TransportError) as exc:
            self._reply(ident, ErrorReply(reason=str(exc)))
            return
        self.peers[(hello.engine_id, peer_layout.tp_rank)] = _DecodePeer(agent, peer_layout)
        self._reply(ident, self.hello)

    def _reply(self, ident: bytes, msg: Hello | ErrorReply) -> None:
        try:
            self.sock.send_multipart([ident, self.codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("kvpush prefill: could not reply on side channel: %s", exc)

    # ---- actions ------------------------------------------------------------------------------
    def _apply(self, actions: list[SenderAction]) -> None:
        for act in actions:
            if isinstance(act, StartWrite):
                self._start_write(act)
            elif isinstance(act, NotifyFailure):
                self._notify_failure(act)
            elif isinstance(act, ReleaseSource):
                self._release(act)

    def _start_write(self, act: StartWrite) -> None:
        assert self.transport is not None
        now = time.monotonic()
        peer = self.peers.get((act.decode_engine_id, act.decode_rank))
        try:
            if peer is None:
                raise TransportError(f"no handshake with decode {act.decode_engine_id!r} rank {act.decode_rank}")
            plan = build_plan(self.layout, peer.layout, act.src_blocks, act.dst_blocks, act.num_tokens,
                              heads=act.heads)
            local, remote = plan.nixl_descs()
            notif = self.codec.encode(TransferDone(request_id=act.request_id, attempt=act.attempt,
                                                   prefill_rank=self.layout.tp_rank, nbytes=plan.nbytes))
            t_plan = time.monotonic()
            handle = self.transport.post_write(peer.agent, local, remote, notif, self.mem_type)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("kvpush push %s: queued %.1f ms, plan %.1f ms, post %.1f ms, %d descriptors, %d bytes",
                          act.request_id, 1e3 * (now - self.prefill_done_at.get(act.request_id, now)),
                          1e3 * (t_plan - now), 1e3 * (time.monotonic() - t_plan), plan.num_descriptors,
                          plan.nbytes)
        except (LayoutError, TransportError) as exc:
            self._apply(self.state.on_write_done(act.request_id, act.attempt, act.decode_rank, False, 0,
                                                 str(exc), now))
            return
        self.counters.writes += 1
        self.counters.descriptors += plan.num_descriptors
        self.counters.blocks += plan.num_blocks
        metrics.DESCRIPTORS.labels(*self.labels).inc(plan.num_descriptors)
        metrics.BLOCKS.labels(*self.labels).inc(plan.num_blocks)
        self.writes.append(_Write(act, handle, plan, now))
        # progress at once: a loopback copy may finish inside the post, and its notification should
        # leave now rather than after whatever else this round still has to post
        self._progress_writes(time.monotonic())

    def _progress_writes(self, now: float) -> bool:
        assert self.transport is not None
        did = False
        for w in list(self.writes):
            if w not in self.writes:  # finished by a nested round (a write started from a completion)
                continue
            try:
                state = self.transport.poll(w.handle)
                if state == "PROC":
                    continue
                ok, reason = True, ""
            except TransportError as exc:
                ok, reason = False, str(exc)
            did = True
            self.writes.remove(w)
            try:
                self.transport.release(w.handle)
            except TransportError as exc:
                log.warning("kvpush prefill: %s", exc)
            nbytes = w.plan.nbytes if ok else 0
            if ok:
                self.counters.bytes += nbytes
                metrics.BYTES.labels(*self.labels).inc(nbytes)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("kvpush push %s: complete %.1f ms after post (ok=%s)", w.action.request_id,
                          1e3 * (now - w.posted_at), ok)
            self._apply(self.state.on_write_done(w.action.request_id, w.action.attempt, w.action.decode_rank,
                                                 ok, nbytes, reason, time.monotonic()))
        return did

    def _notify_failure(self, act: NotifyFailure) -> None:
        assert self.transport is not None
        peer = self.peers.get((act.decode_engine_id, act.decode_rank))
        if peer is None:
            log.warning("kvpush prefill: cannot tell decode %s rank %s that %s failed: %s (no handshake)",
                        act.decode_engine_id, act.decode_rank, act.request_id, act.reason)
            return
        msg = TransferFailed(request_id=act.request_id, attempt=act.attempt, prefill_rank=self.layout.tp_rank,
                             reason=act.reason[:2000])
        try:
            self.transport.send_notif(peer.agent, self.codec.encode(msg))
        except TransportError as exc:
            log.warning("kvpush prefill: %s", exc)

    def _release(self, act: ReleaseSource) -> None:
        now = time.monotonic()
        started = self.prefill_done_at.pop(act.request_id, None)
        if act.ok:
            self.counters.ok += 1
            if started is not None:
                metrics.READY_LATENCY.labels(*self.labels).observe(now - started)
        else:
            self.counters.failed += 1
        metrics.REQUESTS.labels(*self.labels, "ok" if act.ok else "failed").inc()
        self.results.put(SendResult(act.request_id, act.ok, act.block_ids, act.reason, act.nbytes, now))
        self.notify_result()

    # ---- commands (run on this thread) --------------------------------------------------------
    def cmd_prefill_done(self, request_id: str, block_ids: tuple[int, ...], num_tokens: int, at: float) -> None:
        self.prefill_done_at[request_id] = at
        self._apply(self.state.on_prefill_done(request_id, block_ids, num_tokens, time.monotonic()))

    def cmd_abort(self, request_id: str, reason: str) -> None:
        self._apply(self.state.abort(request_id, reason, time.monotonic()))


class _Endpoint:
    """What both endpoints share: the worker thread's lifecycle, stats and pending count."""

    def __init__(self, config: KVPushConfig, layout: KVLayout, worker: _PushWorker | _ReceiveWorker) -> None:
        if not layout.regions:
            raise LayoutError(f"{type(self).__name__} needs a layout placed in memory (regions and planes)")
        self.config = config
        self.layout = layout
        self._worker = worker

    def start(self) -> None:
        self._worker.start()

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._worker.stop()

    def set_result_listener(self, listener: Callable[[], None] | None) -> None:
        """Call `listener()` (on the transfer thread, so it must be quick and must not block) whenever a
        result becomes available to `finished()`. An engine that sleeps while it has nothing to compute
        uses it to wake up as soon as a transfer settles instead of polling."""
        self._worker.result_listener = listener

    def stats(self) -> dict[str, int]:
        c = self._worker.counters
        out = {k: getattr(c, k) for k in c.__dataclass_fields__}
        if isinstance(self._worker, _PushWorker):
            out.update(self._worker.state.order_counts)
        out["pending"] = self._worker.tracked()  # a racy read is fine for a gauge
        return out

    def pending(self) -> int:
        """Requests the state machine still tracks (asked on the worker thread)."""
        return int(self._worker.call(self._worker.tracked, self.config.handshake_timeout_s))


class PrefillEndpoint(_Endpoint):
    """One prefill rank: receives registrations, pushes KV, tells the engine when blocks are free."""

    def __init__(self, config: KVPushConfig, layout: KVLayout, mem_type: str = "DRAM",
                 transport: Transport | None = None) -> None:
        self._push = _PushWorker(config, layout, mem_type, transport)
        super().__init__(config, layout, self._push)

    @property
    def address(self) -> tuple[str, int]:
        """(host, base port): decode ranks reach rank r at base port + r."""
        return self.config.host, self._push.bound_port - self.layout.tp_rank

    def prefill_done(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        at = time.monotonic()
        blocks = _checked_blocks(self.layout, request_id, block_ids, num_tokens)
        self._push.submit(lambda: self._push.cmd_prefill_done(request_id, blocks, num_tokens, at))

    def abort(self, request_id: str, reason: str = "aborted by prefill engine") -> None:
        self._push.submit(lambda: self._push.cmd_abort(request_id, reason))

    def finished(self) -> list[SendResult]:
        return _drain(self._push.results)


# ====================================================================================================
# decode side
# ====================================================================================================
@dataclass
class _PrefillPeer:
    address: PrefillAddress
    rank: int
    sock: zmq.Socket[Any]
    hello: Hello | None = None
    error: str = ""
    waiters: list[threading.Event] = field(default_factory=list)


class _ReceiveWorker(_EndpointWorker):
    name = "kvpush-recv"
    role = "decode"

    def __init__(self, config: KVPushConfig, layout: KVLayout, mem_type: str,
                 transport: Transport | None) -> None:
        super().__init__(config, layout, mem_type, transport)
        self.state = ReceiverState(config.engine_id, layout.tp_rank, layout.tp_size, layout.total_kv_heads,
                                   config.ready_timeout_s)
        self.results: queue.SimpleQueue[RecvResult] = queue.SimpleQueue()
        self.ready_event = threading.Event()
        self.prefills: dict[tuple[str, int], _PrefillPeer] = {}
        self.route: dict[str, PrefillAddress] = {}  # request -> its prefill engine

    def setup(self) -> None:
        self.setup_transport()

    def teardown(self) -> None:
        assert self.transport is not None
        for peer in self.prefills.values():
            peer.sock.close()
        self.transport.close()

    def busy(self) -> bool:
        return self.state.waiting() > 0

    def tracked(self) -> int:
        return len(self.state)

    def step(self, now: float) -> bool:
        assert self.transport is not None
        did = False
        for peer_name, data in self.transport.drain_notifs():
            did = True
            msg = self.decode_or_count(data, f"NIXL peer {peer_name}")
            if isinstance(msg, TransferDone):
                self._apply(self.state.on_done(msg, now))
            elif isinstance(msg, TransferFailed):
                self._apply(self.state.on_failed(msg, now))
            elif msg is not None:
                self.counters.wire_errors += 1
                log.warning("kvpush decode: unexpected %s notification from %s", type(msg).__name__, peer_name)
        for peer in self.prefills.values():
            while True:
                try:
                    data = peer.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                did = True
                self._on_reply(peer, data, now)
        if now >= self._next_tick:
            self._next_tick = now + 0.01
            self._apply(self.state.on_tick(now))
        return did

    def _peer(self, address: PrefillAddress, rank: int) -> _PrefillPeer:
        key = (address.engine_id, rank)
        peer = self.prefills.get(key)
        if peer is None:
            sock = self.zmq.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
            sock.connect(address.rank_endpoint(rank))
            self.poller.register(sock, zmq.POLLIN)
            peer = self.prefills[key] = _PrefillPeer(address, rank, sock)
            # messages on one DEALER arrive in order: the hello is processed before any registration
            sock.send(self.codec.encode(self.hello), zmq.NOBLOCK)
        return peer

    def _on_reply(self, peer: _PrefillPeer, data: bytes, now: float) -> None:
        msg = self.decode_or_count(data, f"prefill {peer.address.engine_id} rank {peer.rank}")
        if isinstance(msg, Hello):
            try:
                check_peer_hello(self.layout, msg, prefill_side=False)
                peer.hello, peer.error = msg, ""
            except LayoutError as exc:
                peer.error = str(exc)
        elif isinstance(msg, ErrorReply):
            if msg.request_id:
                self._apply(self.state.on_failed(TransferFailed(
                    request_id=msg.request_id, attempt=msg.attempt, prefill_rank=peer.rank,
                    reason=msg.reason), now))
            else:
                peer.error = msg.reason
                log.error("kvpush decode: prefill %s rank %s refused us: %s", peer.address.engine_id,
                          peer.rank, msg.reason)
        for ev in peer.waiters:
            ev.set()
        peer.waiters.clear()

    def _apply(self, actions: list[ReceiverAction]) -> None:
        for act in actions:
            if isinstance(act, SendRegistration | SendAbort):
                address = self.route.get(act.message.request_id)
                if address is None:
                    continue
                peer = self._peer(address, act.prefill_rank)
                try:
                    peer.sock.send(self.codec.encode(act.message), zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    self._apply(self.state.on_failed(TransferFailed(
                        request_id=act.message.request_id, attempt=act.message.attempt,
                        prefill_rank=act.prefill_rank, reason=f"side channel send failed: {exc}"),
                        time.monotonic()))
            elif isinstance(act, Ready | Failed):
                self._finish(act)
            elif isinstance(act, Discarded):
                self.counters.discarded += 1
                log.debug("kvpush decode: %s", act.reason)

    def _finish(self, act: Ready | Failed) -> None:
        now = time.monotonic()
        if not self.state.tracks(act.request_id):
            self.route.pop(act.request_id, None)
        ok = isinstance(act, Ready)
        if isinstance(act, Ready):
            self.counters.ok += 1
            self.counters.bytes += act.nbytes
            metrics.BYTES.labels(*self.labels).inc(act.nbytes)
            result = RecvResult(act.request_id, True, act.block_ids, "", act.nbytes, now)
        else:
            self.counters.failed += 1
            result = RecvResult(act.request_id, False, act.block_ids, act.reason, 0, now)
        metrics.REQUESTS.labels(*self.labels, "ok" if ok else "failed").inc()
        self.results.put(result)
        self.ready_event.set()
        self.notify_result()

    # ---- commands -----------------------------------------------------------------------------
    def cmd_expect(self, request_id: str, blocks: tuple[int, ...], num_tokens: int,
                   prefill: PrefillAddress) -> None:
        self.route[request_id] = prefill
        self._apply(self.state.expect(request_id, blocks, num_tokens, prefill.tp_size, time.monotonic()))

    def cmd_abort(self, request_id: str, reason: str) -> None:
        self._apply(self.state.abort(request_id, reason, time.monotonic()))

    def cmd_cancel(self, request_id: str, prefill: PrefillAddress, reason: str) -> None:
        self.route.setdefault(request_id, prefill)
        self._apply(self.state.cancel(request_id, prefill.tp_size, reason, time.monotonic()))
        if not self.state.tracks(request_id):
            self.route.pop(request_id, None)

    def cmd_connect(self, prefill: PrefillAddress, done: threading.Event) -> list[_PrefillPeer]:
        from .tp import senders_for
        ranks = senders_for(self.layout.tp_rank, self.layout.tp_size, prefill.tp_size, self.layout.total_kv_heads)
        peers = [self._peer(prefill, r) for r in ranks]
        pending = [p for p in peers if p.hello is None and not p.error]
        if not pending:
            done.set()
        for p in pending:
            p.waiters.append(done)
        return peers


class DecodeEndpoint(_Endpoint):
    """One decode rank: registers destination blocks with prefill and reports when their KV is ready."""

    def __init__(self, config: KVPushConfig, layout: KVLayout, mem_type: str = "DRAM",
                 transport: Transport | None = None) -> None:
        self._recv = _ReceiveWorker(config, layout, mem_type, transport)
        super().__init__(config, layout, self._recv)

    def connect(self, prefill: PrefillAddress, timeout: float | None = None) -> None:
        """Handshake with every prefill rank this rank needs, now; raise LayoutError on a mismatch.

        Optional: expect() connects lazily. Call it at start-up to refuse an incompatible pair early.
        """
        timeout = self.config.handshake_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            done = threading.Event()
            peers = self._recv.call(functools.partial(self._recv.cmd_connect, prefill, done), timeout)
            if not done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no handshake answer from prefill {prefill.engine_id!r} at "
                                   f"{prefill.host}:{prefill.port} within {timeout}s")
            errors = [p.error for p in peers if p.error]
            if errors:
                raise LayoutError(f"prefill {prefill.engine_id!r} refused the pairing: {errors[0]}")
            if all(p.hello is not None for p in peers):
                return

    def expect(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
               prefill: PrefillAddress) -> None:
        blocks = _checked_blocks(self.layout, request_id, block_ids, num_tokens)
        self._recv.submit(lambda: self._recv.cmd_expect(request_id, blocks, num_tokens, prefill))

    def abort(self, request_id: str, reason: str = "aborted by decode engine") -> None:
        self._recv.submit(lambda: self._recv.cmd_abort(request_id, reason))

    def cancel(self, request_id: str, prefill: PrefillAddress, reason: str = "cancelled by decode engine") -> None:
        """Like abort(), but also for a request expect() never saw (dropped before allocation): the
        prefill ranks that would have written it are told, and free its blocks at once."""
        self._recv.submit(lambda: self._recv.cmd_cancel(request_id, prefill, reason))

    def finished(self) -> list[RecvResult]:
        self._recv.ready_event.clear()
        return _drain(self._recv.results)

    def wait_any(self, timeout: float) -> list[RecvResult]:
        got = self.finished()
        if got:
            return got
        self._recv.ready_event.wait(timeout)
        return self.finished()


def _checked_blocks(layout: KVLayout, request_id: str, block_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
    """The caller's block table, or LayoutError naming what is wrong (caught here, not on the wire)."""
    if not request_id:
        raise ValueError("request_id must be a non-empty string")
    if num_tokens <= 0:
        raise ValueError(f"{request_id}: num_tokens must be > 0, got {num_tokens}")
    blocks = tuple(int(b) for b in block_ids)
    needed = -(-num_tokens // layout.block_size)
    if len(blocks) < needed:
        raise LayoutError(f"{request_id}: {len(blocks)} blocks of {layout.block_size} tokens cannot hold "
                          f"{num_tokens} tokens ({needed} needed)")
    bad = [b for b in blocks if not 0 <= b < layout.num_blocks]
    if bad:
        raise LayoutError(f"{request_id}: block ids {bad[:5]} outside 0..{layout.num_blocks - 1}")
    return blocks


def _drain(q: queue.SimpleQueue[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
