"""The prefill endpoint: receives registrations, pushes KV with WRITEs, tells the engine when blocks are free.

    prefill = PrefillEndpoint(config, layout)          # layout placed in registered memory
    prefill.start()                                     # transport, side channel on side_channel.host:port+rank
    prefill.prefill_done(req_id, block_ids, num_tokens) # returns at once
    for r in prefill.finished(): free(r.block_ids)      # WRITEs completed (or the request failed)

The push thread runs a non-reentrant action pump: the state machine returns actions; each executor
returns the follow-up actions (a WRITE that failed to post, a completion) instead of calling back into
the machine, and the pump runs them in order until none are left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from ..config import KVPushConfig
from ..errors import LayoutError, TransportError, WireError
from ..protocol.handshake import AuthMismatch, Session, check_peer_hello, hello_frame, open_hello
from ..protocol.layout import KVLayout
from ..protocol.plan import TransferPlan, build_plan
from ..protocol.prepared import IndexPlan, PairUnits, build_index_plan, pair_units
from ..protocol.sender import NotifyFailure, ReleaseSource, SenderAction, SenderState, StartWrite
from ..protocol.tp import receivers_for
from ..protocol.wire import (
    PLAIN,
    Abort,
    ErrorReply,
    Hello,
    Message,
    Ping,
    Pong,
    Posted,
    Registration,
    TransferDone,
    TransferFailed,
)
from ..transport.base import PreparedList, Transport
from ..transport.posting import PostingPool, PostJob
from .base import Endpoint, EndpointWorker, SendResult, TransferHooks, checked_blocks
from .control import ControlListener, ControlPlane

log = logging.getLogger("kvpush")

# At most this many side-channel messages per loop round, so one flooding peer cannot starve WRITE
# progress, completions and ticks; per connection, config.limits.max_messages_per_peer_round (the rest
# of a connection's messages wait, in order, in its backlog, so one peer cannot starve the others either).
MAX_MESSAGES_PER_ROUND = 64
MAX_BACKLOG = 1024  # messages of one connection waiting for its next rounds; beyond: refused
MAX_CONNECTIONS = 4096  # side-channel connections tracked; the oldest without a handshake go first


@dataclass
class _Conn:
    """One side-channel connection: its session once a Hello is accepted, and what it may do."""

    conn: bytes
    seen_at: float
    session: Session | None = None
    identity: tuple[str, int] | None = None  # (decode engine id, rank) its Hello bound
    instance: bytes = b""
    agent: str = ""
    last_heard: float = 0.0
    last_ping: float = 0.0
    backlog: deque[bytes] = field(default_factory=deque)
    regs: dict[str, int] = field(default_factory=dict)  # pending request -> bytes of its block table
    reg_bytes: int = 0
    # Keyed: a Hello alone binds nothing (a captured one can be replayed on any connection); the identity
    # moves here with the first sealed message that opens, which needs the key and this session's nonces.
    confirmed: bool = True
    peer_layout: KVLayout | None = None


Dest = tuple[str, int]  # (decode engine id, decode rank)


@dataclass(eq=False)
class _Write:
    """A WRITE from plan to settlement: queued (its destination's FIFO), then in flight (posted on the
    push thread, `handle`; or handed to a posting worker, `job`), then settled exactly once."""

    action: StartWrite
    plan: TransferPlan | IndexPlan
    dest: Dest
    queued_at: float  # write_timeout_s counts from here, so a WRITE that waited is never posted late
    post: Callable[[], Any]  # make + post; runs on the push thread or a posting worker
    handle: Any = None
    posted_at: float = 0.0
    job: PostJob | None = None
    worker: int = -1


@dataclass
class _Prepared:
    """A pair's prepared lists: made once at handshake, indexed by every request to that decode rank."""

    units: PairUnits
    local: PreparedList
    remote: PreparedList


@dataclass
class _DecodePeer:
    agent: str
    layout: KVLayout
    prepared: dict[tuple[int, int], _Prepared | None] = field(default_factory=dict)  # heads -> lists


# The per-request timeline (monotonic seconds), in SendResult.timeline and the DEBUG log: registered,
# prefill_done, plan_built, posted, complete (the poll that saw DONE; with UCX the WRITE's notification
# leaves inside that call, so it is also when the notification was sent).
# `made` (NIXL only): the transfer was made and its post began; on UCX loopback the copy runs inside the
# post, so posted - made is the copy and prefill_done -> made is the per-request cost without it.
TIMELINE = ("registered", "prefill_done", "plan_built", "made", "posted", "complete")


class PushWorker(EndpointWorker[SendResult]):
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
        )
        self.peers: dict[tuple[str, int], _DecodePeer] = {}
        self.writes: list[_Write] = []  # in flight, in posting order
        self.queues: dict[Dest, deque[_Write]] = {}  # per destination: planned, waiting for the budget
        self.inflight_bytes = 0
        self.inflight_descs = 0
        self.pool: PostingPool | None = None
        self.pool_writes: dict[PostJob, _Write] = {}
        self.dest_worker: dict[Dest, int] = {}  # where a destination's WRITEs in flight are
        self.dest_flight: dict[Dest, int] = {}
        self.worker_load: list[int] = []
        self.nudges: list[_Write] = []  # posted this round: tell their decodes (Posted) after polling
        self._turn = 0  # which destination queue goes first in the next dispatch
        self.prefill_done_at: dict[str, float] = {}
        self.kv_written: dict[str, Callable[[], None]] = {}  # request -> the engine's barrier, until used
        self.staged: set[str] = set()  # requests whose source blocks the hooks staged already
        self.timeline: dict[str, dict[str, float]] = {}  # request -> TIMELINE marks so far
        self.bound_port = 0
        self.conns: dict[bytes, _Conn] = {}
        self.bound: dict[
            tuple[str, int], bytes
        ] = {}  # decode (engine, rank) -> the connection it is bound to

    def setup(self) -> None:
        self.config.check_listen()  # beyond loopback only with authentication (or explicitly without)
        self.transport, self.hello = self.setup_transport()
        port = self.config.side_channel.port + self.layout.tp_rank if self.config.side_channel.port else 0
        try:
            self.listener: ControlListener = self.control.listen(
                self.config.side_channel.host, port, self.config.limits.max_message_bytes
            )
        except TransportError:
            self.transport.close()
            raise
        self.bound_port = self.listener.port
        self.poller.register(self.listener.pollable, zmq.POLLIN)
        build_plan(self.layout, self.layout, [0], [0], 1)  # warm numpy's paths off the first request
        if self.config.posting.workers:
            self.pool = PostingPool(
                self.transport,
                self.config.posting.workers,
                self.doorbell.ring,
                self.config.pacing.busy_poll_s,
            )
            self.worker_load = [0] * self.config.posting.workers

    def teardown(self) -> None:
        # Shutting down (or dying) mid-transfer: cancel what is in flight, deregister our memory, then
        # report every request failed so the engine frees its source blocks; nothing is leaked.
        reason = "prefill endpoint closed" if self.fatal is None else f"prefill endpoint died: {self.fatal!r}"
        if self.pool is not None:
            self.pool.close()  # workers stop and release what they hold in flight
        writes, self.writes = self.writes, []
        writes += [w for q in self.queues.values() for w in q]
        self.queues.clear()
        for w in writes:
            if w.handle is not None:
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
        # WRITEs a posting worker polls need no fast loop here: the worker rings the doorbell when one
        # settles (and write timeouts are checked at least every tick)
        return any(w.job is None for w in self.writes)

    def in_flight(self) -> bool:
        return self.busy()

    def tracked(self) -> int:
        return len(self.state)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self, now: float) -> bool:
        did = self._receive(now)
        if self.writes:
            before = len(self.writes)
            self._apply(self._progress_writes(now))
            did = did or len(self.writes) < before
        if self.queues:
            self._apply(())  # the budget may have room again
        if self.tick_due(now):
            if len(self.state):
                # prefill expects no notifications; draining keeps UCX progressing while requests are live
                for peer, _msg in self.transport.drain_notifs():
                    log.debug("kvpush prefill: ignored notification from %s", peer)
            self._liveness(now)
            self._apply(self.state.on_tick(now))
            self.ledger.pending(len(self.state))
            self.ledger.in_flight_bytes(self.inflight_bytes)
        return did

    def _receive(self, now: float) -> bool:
        """One round of side-channel messages, fair per connection: each gets at most its share a round
        (the rest wait in order in its backlog), and the round as a whole is capped."""
        cap = self.config.limits.max_messages_per_peer_round
        did = False
        counts: dict[bytes, int] = {}
        for c in [c for c in self.conns.values() if c.backlog]:
            while c.backlog and counts.get(c.conn, 0) < cap:
                counts[c.conn] = counts.get(c.conn, 0) + 1
                did = True
                self._on_side_message(c.conn, c.backlog.popleft(), now)
        for _ in range(MAX_MESSAGES_PER_ROUND):
            got = self.listener.recv()
            if got is None:
                break
            did = True
            conn, data = got
            counts[conn] = counts.get(conn, 0) + 1
            known = self.conns.get(conn)
            if known is not None and data is not None and (known.backlog or counts[conn] > cap):
                if len(known.backlog) >= MAX_BACKLOG:
                    self.ledger.add("refused")
                    self._refuse(conn, "too many messages queued on this connection: slow down", "limit")
                else:
                    known.backlog.append(data)
                continue
            self._on_side_message(conn, data, now)
        return did

    def _on_side_message(self, conn: bytes, data: bytes | None, now: float) -> None:
        """One frame from one connection. Nothing a peer sends can raise out of here: bad frames are
        counted and answered; a Registration or Abort counts only on the connection whose Hello bound
        that (engine, rank), through that connection's session (authenticated, in order, no replays)."""
        c = self.conns.get(conn)
        if c is None or c.session is None:
            self._on_first_message(conn, data, now)
            return
        session = c.session
        msg = self.decode_or_count(data, f"decode {c.identity}", session.open)
        if msg is None:
            self._refuse(conn, "message refused: could not decode or authenticate it (see prefill log)")
            return
        c.last_heard = now
        if not c.confirmed:
            self._bind(c, now)  # the first sealed message that opens proves the key and this session
            if not c.confirmed:
                return
        if isinstance(msg, Registration):
            if self._admit_registration(c, msg):
                self.timeline.setdefault(msg.request_id, {}).setdefault("registered", now)
                self._apply(self.state.on_registration(msg, now))
        elif isinstance(msg, Abort):
            if (msg.decode_engine_id, msg.decode_rank) != c.identity:
                self.ledger.add("refused")
                self._refuse(
                    conn,
                    f"abort for decode {msg.decode_engine_id!r} rank {msg.decode_rank} on the "
                    f"connection of {c.identity}",
                    "not_allowed",
                    msg.request_id,
                    msg.attempt,
                )
                return
            self._apply(self.state.on_decode_abort(msg, now))
        elif isinstance(msg, Ping):
            self._send_sealed(c, Pong(clock=time.monotonic()))
        elif isinstance(msg, Pong):
            pass  # last_heard is all a pong is for
        else:
            self.ledger.add("wire_errors")
            self._refuse(conn, f"prefill does not accept {type(msg).__name__} messages here")

    def _on_first_message(self, conn: bytes, data: bytes | None, now: float) -> None:
        """A connection without a session may only say Hello."""
        key = self.config.security.hmac_key
        try:
            if data is None:
                raise WireError("malformed frame (wrong number of parts or over the size limit)")
            hello = open_hello(self.codec, data, key)
        except AuthMismatch as exc:
            self.ledger.add("refused")
            log.warning("kvpush prefill: refused a handshake: %s", exc)
            self._refuse(conn, str(exc), "auth_required" if key is not None else "auth_unexpected")
            return
        except WireError as exc:
            self.ledger.add("wire_errors")
            log.warning("kvpush prefill: dropped a message from an unknown connection: %s", exc)
            self._refuse(conn, f"message refused: send hello first ({exc})", "hello_first")
            return
        self._on_hello(conn, hello, now)

    def _on_hello(self, conn: bytes, hello: Hello, now: float) -> None:
        allowed = self.config.security.allowed_decode_ids
        if allowed and hello.engine_id not in allowed:
            self.ledger.add("refused")
            log.warning(
                "kvpush prefill: refused decode %s: not in allowed_decode_ids", ascii(hello.engine_id)
            )
            self._refuse(
                conn,
                f"decode engine {hello.engine_id!r} is not in this prefill's allowed_decode_ids",
                "not_allowed",
            )
            return
        try:
            peer_layout = check_peer_hello(self.layout, hello, prefill_side=True)
        except LayoutError as exc:
            self._refuse(conn, str(exc), "refused")
            return
        identity = (hello.engine_id, peer_layout.tp_rank)
        if self._identity_in_use(conn, identity, now):
            return
        try:
            agent = self.transport.add_peer(hello.agent_metadata)
            self.transport.connect(agent)  # at handshake, not on the first request's critical path
        except TransportError as exc:
            self._refuse(conn, str(exc), "refused")
            return
        nonce = os.urandom(16)
        c = _Conn(
            conn,
            now,
            Session(self.codec, self.config.security.hmac_key, hello.nonce, nonce, "prefill"),
            identity,
            hello.instance,
            agent,
            now,
            now,
            confirmed=self.config.security.hmac_key is None,
            peer_layout=peer_layout,
        )
        self._track(c)
        if c.confirmed:
            self._bind(c, now)
        reply = msgspec.structs.replace(self.hello, nonce=nonce, clock=time.monotonic())
        self._send_raw(conn, hello_frame(self.codec, reply, self.config.security.hmac_key, echo=hello.nonce))

    def _identity_in_use(self, conn: bytes, identity: tuple[str, int], now: float) -> bool:
        """Refuse (and say so) when the identity is bound to another live connection; an old one that is
        provably gone is dropped."""
        old_conn = self.bound.get(identity)
        old = self.conns.get(old_conn) if old_conn is not None else None
        if old is None or old.conn == conn:
            return False
        if self._provably_gone(old, now):
            self._drop_conn(old, "a new handshake replaced it", now)
            return False
        engine, rank = identity
        self.ledger.add("refused")
        log.warning(
            "kvpush prefill: decode %s rank %s is bound to a live connection; refused a new hello for it",
            ascii(engine),
            rank,
        )
        self._refuse(
            conn,
            f"decode {engine!r} rank {rank} is bound to a live connection; a new hello is accepted once "
            f"that one is gone (silent for {self.config.liveness.peer_timeout_s}s, or its NIXL agent disconnected)",
            "identity_in_use",
        )
        return True

    def _bind(self, c: _Conn, now: float) -> None:
        """The connection's identity is proven (unkeyed: at its Hello; keyed: at its first sealed message):
        it is bound here, its NIXL peer and prepared lists set up, and an old connection replaced."""
        assert c.identity is not None and c.peer_layout is not None
        if self._identity_in_use(c.conn, c.identity, now):
            self.conns.pop(c.conn, None)
            return
        c.confirmed = True
        self.bound[c.identity] = c.conn
        peer = self.peers[c.identity] = _DecodePeer(c.agent, c.peer_layout)
        owed = receivers_for(
            self.layout.tp_rank, self.layout.tp_size, c.peer_layout.tp_size, self.layout.total_kv_heads
        ).get(c.peer_layout.tp_rank)
        if owed is not None:
            self._prepare(peer, owed)  # at handshake: the first request only computes indices
        self.ledger.peers(len(self.bound))

    def _admit_registration(self, c: _Conn, msg: Registration) -> bool:
        """Checks before any per-rank work: the identity its connection bound, the TP that identity's
        handshake declared, and this peer's limits on pending registrations and their bytes."""
        if (msg.decode_engine_id, msg.decode_rank) != c.identity:
            self.ledger.add("refused")
            self._refuse(
                c.conn,
                f"registration for decode {msg.decode_engine_id!r} rank {msg.decode_rank} on "
                f"the connection of {c.identity}",
                "not_allowed",
                msg.request_id,
                msg.attempt,
            )
            return False
        peer = self.peers.get(c.identity)
        if peer is None:
            self._refuse(
                c.conn,
                "no handshake for this decode rank: send hello first",
                "hello_first",
                msg.request_id,
                msg.attempt,
            )
            return False
        if msg.decode_tp != peer.layout.tp_size:
            self.ledger.add("refused")
            self._refuse(
                c.conn,
                f"registration says decode TP {msg.decode_tp}; the handshake said {peer.layout.tp_size}",
                "refused",
                msg.request_id,
                msg.attempt,
            )
            return False
        size = 8 * len(msg.block_ids) + len(msg.request_id)
        if msg.request_id not in c.regs:
            cfg = self.config
            if (
                len(c.regs) >= cfg.limits.max_pending_per_peer
                or c.reg_bytes + size > cfg.limits.max_pending_bytes_per_peer
            ):
                live = set(self.state.pending())
                c.regs = {r: n for r, n in c.regs.items() if r in live}
                c.reg_bytes = sum(c.regs.values())
            if (
                len(c.regs) >= cfg.limits.max_pending_per_peer
                or c.reg_bytes + size > cfg.limits.max_pending_bytes_per_peer
            ):
                self.ledger.add("refused")
                self._refuse(
                    c.conn,
                    f"too many pending registrations from this decode rank ({len(c.regs)}, "
                    f"{c.reg_bytes} bytes; limits {cfg.limits.max_pending_per_peer}, "
                    f"{cfg.limits.max_pending_bytes_per_peer})",
                    "limit",
                    msg.request_id,
                    msg.attempt,
                )
                return False
            c.regs[msg.request_id] = size
            c.reg_bytes += size
        return True

    def _provably_gone(self, c: _Conn, now: float) -> bool:
        """A bound identity may move to a new connection only once the old one is gone: silent past
        peer_timeout_s, or its NIXL agent refuses a notification."""
        if now - c.last_heard >= self.config.liveness.peer_timeout_s:
            return True
        try:
            self.transport.send_notif(c.agent, b"")
        except TransportError:
            return True
        return False

    def _drop_conn(self, c: _Conn, reason: str, now: float) -> None:
        """Forget a connection; the requests its decode registered fail (the decode is gone or replaced)."""
        self.conns.pop(c.conn, None)
        if c.identity is not None and self.bound.get(c.identity) == c.conn:
            del self.bound[c.identity]
            self.ledger.add("peers_gone")
            engine, rank = c.identity
            for rid in c.regs:
                if rid in self.state.pending():
                    self._apply(self.state.abort(rid, f"decode {engine!r} rank {rank}: {reason}", now))
        self.ledger.peers(len(self.bound))

    def _track(self, c: _Conn) -> None:
        self.conns[c.conn] = c
        if len(self.conns) > MAX_CONNECTIONS:
            for old in sorted(self.conns.values(), key=lambda x: x.seen_at)[: len(self.conns) // 4]:
                if old.identity is None or self.bound.get(old.identity) != old.conn:
                    self.conns.pop(old.conn, None)

    def _liveness(self, now: float) -> None:
        """Ping bound connections; drop silent ones; prune NIXL peers nothing uses any more."""
        cfg = self.config
        for c in list(self.conns.values()):
            if c.session is None:
                continue
            if now - c.last_ping >= cfg.liveness.ping_interval_s:
                c.last_ping = now
                self._send_sealed(c, Ping(clock=time.monotonic()))
            if now - c.last_heard >= cfg.liveness.peer_timeout_s:
                log.warning(
                    "kvpush prefill: decode %s silent for %.1fs: dropped",
                    ascii(str(c.identity)),
                    now - c.last_heard,
                )
                self._drop_conn(c, f"silent for {now - c.last_heard:.1f}s", now)
        in_use = {c.agent for c in self.conns.values()}
        for identity, peer in list(self.peers.items()):
            if identity in self.bound or self.state.writing_to(*identity):
                continue
            del self.peers[identity]
            if peer.agent not in in_use:
                with contextlib.suppress(TransportError):
                    self.transport.remove_peer(peer.agent)

    def _seal_notif(self, engine_id: str, rank: int, msg: Message) -> bytes:
        """A notification to a decode rank, sealed with its connection's session."""
        conn = self.bound.get((engine_id, rank))
        c = self.conns.get(conn) if conn is not None else None
        if c is None or c.session is None:
            raise TransportError(f"no live session with decode {engine_id!r} rank {rank}")
        return c.session.seal(msg, b"notif")

    def _send_sealed(self, c: _Conn, msg: Message) -> None:
        assert c.session is not None
        self._send_raw(c.conn, c.session.seal(msg))

    def _refuse(
        self, conn: bytes, reason: str, code: str = "", request_id: str = "", attempt: int = 0
    ) -> None:
        """Answer a connection with an ErrorReply: sealed if it has a session, else plain."""
        msg = ErrorReply(reason=reason[:2000], request_id=request_id, attempt=attempt, code=code)
        c = self.conns.get(conn)
        if c is not None and c.session is not None:
            self._send_raw(conn, c.session.seal(msg))
        else:
            self._send_raw(conn, bytes([PLAIN]) + self.codec.encode(msg))

    def _send_raw(self, conn: bytes, frame: bytes) -> None:
        try:
            self.listener.send(conn, frame)
        except TransportError as exc:
            log.warning("kvpush prefill: could not reply on side channel: %s", exc)

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
                else:
                    self._release(act)
            if not self.queues:
                break
            posted_inline = self._dispatch(pending)
            if posted_inline:
                # progress at once: a loopback copy may finish inside the post, and its notification
                # should leave now rather than after the next loop round
                pending.extend(self._progress_writes(time.monotonic()))
            self._send_nudges()
            if not pending:
                break

    def _fits(self, w: _Write) -> bool:
        """Within the in-flight budget (or nothing in flight: a WRITE over the budget still goes alone)."""
        cfg = self.config
        return not self.writes or (
            self.inflight_bytes + w.plan.nbytes <= cfg.posting.max_inflight_bytes
            and self.inflight_descs + w.plan.num_descriptors <= cfg.posting.max_inflight_descriptors
        )

    def _dispatch(self, follow: deque[SenderAction]) -> bool:
        """Post queued WRITEs while the budget allows: each destination's queue in FIFO order (a head
        that does not fit holds back its queue, never overtaken), destinations taking turns. Failures
        go to `follow`; True if anything was posted on this thread."""
        posted_inline = False
        progress = True
        while progress and self.queues:
            progress = False
            dests = list(self.queues)
            k = self._turn % len(dests)
            self._turn += 1
            for dest in dests[k:] + dests[:k]:
                q = self.queues.get(dest)
                if not q or not self._fits(q[0]):
                    continue
                w = q.popleft()
                if not q:
                    del self.queues[dest]
                progress = True
                got = self._post(w)
                if got is None:
                    posted_inline = posted_inline or w.job is None
                else:
                    follow.extend(got)
        return posted_inline

    def _post(self, w: _Write) -> list[SenderAction] | None:
        """Put one WRITE in flight (on this thread, or on a posting worker); None on success, else the
        machine's answer to its failure."""
        now = time.monotonic()
        a = w.action
        if now - w.queued_at >= self.config.leases.write_timeout_s:
            return self.state.on_write_done(
                a.request_id,
                a.attempt,
                a.decode_rank,
                False,
                0,
                "WRITE not posted within write_timeout_s",
                now,
            )
        if self.pool is None:
            try:
                w.handle = w.post()
            except TransportError as exc:
                return self.state.on_write_done(
                    a.request_id, a.attempt, a.decode_rank, False, 0, str(exc), now
                )
            w.posted_at = time.monotonic()
            marks = self.timeline.setdefault(a.request_id, {})
            made = getattr(self.transport, "made_at", None)
            if callable(made) and made() is not None:
                marks.setdefault("made", made())
            marks.setdefault("posted", w.posted_at)
        else:
            flying = self.dest_flight.get(w.dest, 0)
            if flying and w.dest in self.dest_worker:
                worker = self.dest_worker[w.dest]  # keep the destination's posts in order on one worker
            else:
                worker = min(range(len(self.worker_load)), key=self.worker_load.__getitem__)
            self.dest_worker[w.dest] = worker
            w.worker = worker
            w.job = PostJob(w.post, w.queued_at + self.config.leases.write_timeout_s)
            self.pool_writes[w.job] = w
            self.worker_load[worker] += 1
            self.pool.submit(w.job, worker)
        self.writes.append(w)
        self.dest_flight[w.dest] = self.dest_flight.get(w.dest, 0) + 1
        self.inflight_bytes += w.plan.nbytes
        self.inflight_descs += w.plan.num_descriptors
        self.ledger.high("inflight_bytes_max", self.inflight_bytes)
        self.ledger.high("inflight_descriptors_max", self.inflight_descs)
        self.ledger.high("inflight_writes_max", len(self.writes))
        self.ledger.add("writes")
        self.ledger.add("descriptors", w.plan.num_descriptors)
        self.ledger.add("blocks", w.plan.num_blocks)
        if self.config.posting.nudge:
            self.nudges.append(w)
        return None

    def _unflight(self, w: _Write) -> None:
        """w leaves the in-flight set (settled or abandoned): its budget and worker slot come back."""
        self.writes.remove(w)
        self.inflight_bytes -= w.plan.nbytes
        self.inflight_descs -= w.plan.num_descriptors
        left = self.dest_flight[w.dest] - 1
        if left:
            self.dest_flight[w.dest] = left
        else:
            del self.dest_flight[w.dest]
            self.dest_worker.pop(w.dest, None)
        if w.job is not None:
            self.pool_writes.pop(w.job, None)
            self.worker_load[w.worker] -= 1

    def _send_nudges(self) -> None:
        """Posted, on the side channel, for each WRITE posted this round (after the first poll, so a
        notification that is ready leaves first): the decode then polls fast until it lands."""
        nudges, self.nudges = self.nudges, []
        for w in nudges:
            conn = self.bound.get(w.dest)
            c = self.conns.get(conn) if conn is not None else None
            if c is None or c.session is None:
                continue
            a = w.action
            self.ledger.add("nudges")
            self._send_sealed(
                c, Posted(request_id=a.request_id, attempt=a.attempt, prefill_rank=self.layout.tp_rank)
            )

    def _prepare(self, peer: _DecodePeer, heads: tuple[int, int]) -> _Prepared | None:
        """Prepare (once) the local and remote descriptor lists of this pair; None: this pair posts
        fresh descriptor lists (build_plan) instead, e.g. when its units overflow NIXL's int32 indices."""
        if heads in peer.prepared:
            return peer.prepared[heads]
        prepared: _Prepared | None = None
        try:
            units = pair_units(self.layout, peer.layout, heads)
            local = self.transport.prepare(None, units.s.rows, self.mem_type)
            remote = self.transport.prepare(peer.agent, units.d.rows, self.mem_type)
            prepared = _Prepared(units, local, remote)
        except (LayoutError, TransportError) as exc:
            log.warning(
                "kvpush prefill: no prepared lists for %s (%s); posting descriptor lists", peer.agent, exc
            )
        peer.prepared[heads] = prepared
        return prepared

    def _start_write(self, act: StartWrite) -> list[SenderAction]:
        now = time.monotonic()
        self.ledger.add(act.order)
        peer = self.peers.get((act.decode_engine_id, act.decode_rank))
        marks = self.timeline.setdefault(act.request_id, {})
        marks.setdefault("prefill_done", self.prefill_done_at.get(act.request_id, now))
        marks.setdefault("registered", now)
        try:
            if peer is None:
                raise TransportError(
                    f"no handshake with decode {act.decode_engine_id!r} rank {act.decode_rank}"
                )
            self._source_ready(act)
            prep = self._prepare(peer, act.heads)
            plan: TransferPlan | IndexPlan
            if prep is not None:
                plan = build_index_plan(prep.units, act.src_blocks, act.dst_blocks, act.num_tokens)
            else:
                plan = build_plan(
                    self.layout, peer.layout, act.src_blocks, act.dst_blocks, act.num_tokens, heads=act.heads
                )
            notif = self._seal_notif(
                act.decode_engine_id,
                act.decode_rank,
                TransferDone(
                    request_id=act.request_id,
                    attempt=act.attempt,
                    prefill_rank=self.layout.tp_rank,
                    nbytes=plan.nbytes,
                ),
            )
            t_plan = time.monotonic()
            marks.setdefault("plan_built", t_plan)
            post: Callable[[], Any]
            transport = self.transport
            if isinstance(plan, IndexPlan):
                assert prep is not None
                lp, rp, si, di = prep.local, prep.remote, plan.src_idx, plan.dst_idx

                def post() -> Any:
                    return transport.post_prepared(lp, si, rp, di, notif)
            else:
                local, remote = plan.nixl_descs()
                agent, mem = peer.agent, self.mem_type

                def post() -> Any:
                    return transport.post_write(agent, local, remote, notif, mem)

            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvpush push %s: queued %.1f ms, plan %.1f ms, %d descriptors, %d bytes",
                    act.request_id,
                    1e3 * (now - self.prefill_done_at.get(act.request_id, now)),
                    1e3 * (t_plan - now),
                    plan.num_descriptors,
                    plan.nbytes,
                )
        except (LayoutError, TransportError) as exc:
            return self.state.on_write_done(
                act.request_id, act.attempt, act.decode_rank, False, 0, str(exc), now
            )
        dest = (act.decode_engine_id, act.decode_rank)
        self.queues.setdefault(dest, deque()).append(_Write(act, plan, dest, now, post))
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
        """Settle what the posting workers handed back, then poll every WRITE this thread posted once;
        the machine's answers to the finished ones are returned (each WRITE settles exactly once)."""
        follow: list[SenderAction] = []
        if self.pool is not None:
            while True:
                try:
                    job = self.pool.results.get_nowait()
                except queue.Empty:
                    break
                w = self.pool_writes.get(job)
                if w is None:
                    continue  # abandoned (and settled) here before the worker handed it back
                self._unflight(w)
                marks = self.timeline.setdefault(w.action.request_id, {})
                if job.posted_at:
                    w.posted_at = job.posted_at
                    marks.setdefault("posted", job.posted_at)
                follow += self._settled(w, job.state == "done", job.error, job.complete_at or now)
        for w in list(self.writes):
            if now - w.queued_at >= self.config.leases.write_timeout_s:
                follow += self._abandon(w, now)  # checked before polling: an overdue WRITE is not advanced
                continue
            if w.job is not None:
                continue  # a posting worker polls it
            try:
                if self.transport.poll(w.handle) == "PROC":
                    continue
                ok, reason = True, ""
            except TransportError as exc:
                ok, reason = False, str(exc)
            try:
                self.transport.release(w.handle)
            except TransportError as exc:
                log.warning("kvpush prefill: %s", exc)
            self._unflight(w)
            follow += self._settled(w, ok, reason, time.monotonic())
        return follow

    def _settled(self, w: _Write, ok: bool, reason: str, at: float) -> list[SenderAction]:
        nbytes = w.plan.nbytes if ok else 0
        self.timeline.setdefault(w.action.request_id, {})["complete"] = at
        if ok:
            self.ledger.add("bytes", nbytes)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvpush push %s: complete %.1f ms after post (ok=%s)",
                w.action.request_id,
                1e3 * (at - (w.posted_at or w.queued_at)),
                ok,
            )
        a = w.action
        return self.state.on_write_done(
            a.request_id, a.attempt, a.decode_rank, ok, nbytes, reason, time.monotonic()
        )

    def _abandon(self, w: _Write, now: float) -> list[SenderAction]:
        """A WRITE past write_timeout_s: release its handle (or tell its worker to) and tell the machine
        (and so the decode) that it was abandoned; the decode keeps the blocks until its fence."""
        self._unflight(w)
        if w.job is not None:
            w.job.abandoned = True
        else:
            with contextlib.suppress(TransportError):
                self.transport.release(w.handle)
        self.ledger.add("write_timeouts")
        a = w.action
        reason = f"WRITE not complete after {self.config.leases.write_timeout_s}s: abandoned"
        return self.state.on_write_done(
            a.request_id, a.attempt, a.decode_rank, False, 0, reason, time.monotonic(), abandoned=True
        )

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
            abandoned=act.abandoned,
        )
        if "expir" in act.reason:
            self.ledger.add("expired")
        try:
            self.transport.send_notif(
                peer.agent, self._seal_notif(act.decode_engine_id, act.decode_rank, msg)
            )
        except TransportError as exc:
            log.warning("kvpush prefill: %s", exc)

    def _release(self, act: ReleaseSource) -> None:
        now = time.monotonic()
        started = self.prefill_done_at.pop(act.request_id, None)
        self.kv_written.pop(act.request_id, None)
        self.staged.discard(act.request_id)
        self.ledger.finished(act.ok, None if started is None else now - started, act.reason)
        marks = self.timeline.pop(act.request_id, {})
        if len(self.timeline) > 2 * len(self.state) + 64:  # marks of registrations the machine refused
            live = set(self.state.pending())
            self.timeline = {k: v for k, v in self.timeline.items() if k in live}
        if log.isEnabledFor(logging.DEBUG) and marks:
            t0 = min(marks.values())
            log.debug(
                "kvpush push %s timeline (us from first mark): %s",
                act.request_id,
                ", ".join(f"{k} {1e6 * (marks[k] - t0):.0f}" for k in TIMELINE if k in marks),
            )
        self.put_result(SendResult(act.request_id, act.ok, act.block_ids, act.reason, act.nbytes, now, marks))

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
        return self.config.side_channel.host, self._push.bound_port - self.layout.tp_rank

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
