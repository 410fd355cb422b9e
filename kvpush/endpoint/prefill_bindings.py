"""Who is on the other end of the prefill's side channel: the decode identities its connections bind.

`DecodeBindings` keeps the table of connections and everything about their identity: the Hello and its
session keys (keyed: a Hello binds nothing until the first sealed message, the decode's PeerMemory, opens),
the (engine, rank) each connection binds and a reconnect or replacement of it, the NIXL peer and prepared
lists of a bound rank, liveness (pings, silent connections dropped, unused NIXL peers pruned), and sealed
replies and refusals. It is the base of `DecodeConnections` (prefill_conns.py), which adds what arrives
on a connection once it is bound (fair receive, registrations, aborts); kept apart so that how a peer
proves and keeps its identity reads in one place. What the sender machine must hear comes back as events.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from ..config import KVPushConfig
from ..errors import LayoutError, TransportError, WireError
from ..protocol import handshake
from ..protocol.handshake import AuthMismatch, Session, check_peer_hello, hello_frame, open_hello
from ..protocol.layout import KVLayout
from ..protocol.prepared import PairUnits, pair_units
from ..protocol.tp import check_peer_tp, owed_heads
from ..protocol.wire import PLAIN, Codec, ErrorCode, ErrorReply, Hello, Message, Ping
from ..transport.base import PreparedList, Transport, listed_descriptors
from .admission import Admission, Pending, SenderView
from .conn_events import ConnEvent, PeerDropped
from .control import ControlListener
from .stats import Count, Ledger

log = logging.getLogger("kvpush")

MAX_CONNECTIONS = 4096  # side-channel connections tracked; the oldest without a handshake go first

Identity = tuple[str, int]  # (decode engine id, decode rank)


@dataclass
class Prepared:
    """A pair's prepared lists: made once at handshake, indexed by every request to that decode rank."""

    units: PairUnits
    local: PreparedList
    remote: PreparedList


@dataclass
class DecodePeer:
    """A bound decode rank's NIXL agent, layout and prepared lists (per head range)."""

    agent: str
    layout: KVLayout
    prepared: dict[tuple[int, int], Prepared | None] = field(default_factory=dict)


@dataclass
class DecodeConn:
    """One side-channel connection: its session once a Hello is accepted, and what it may do."""

    conn: bytes
    seen_at: float
    session: Session | None = None
    identity: Identity | None = None  # (decode engine id, rank) its Hello bound
    instance: bytes = b""
    agent: str = ""
    last_heard: float = 0.0
    last_ping: float = 0.0
    backlog: deque[bytes] = field(default_factory=deque)
    pending: Pending = field(default_factory=Pending)  # its registrations not finished yet
    # Keyed: a Hello alone binds nothing (a captured one can be replayed on any connection); the identity
    # moves here with the first sealed message that opens, which needs the key and this session's nonces.
    confirmed: bool = True
    peer_layout: KVLayout | None = None
    hello: Hello | None = None  # keyed, until confirmed: the Hello that PeerMemory completes


class DecodeBindings:
    """Side-channel connections of one prefill rank, the decode ranks they bind, and those ranks' peers."""

    def __init__(
        self,
        config: KVPushConfig,
        layout: KVLayout,
        mem_type: str,
        codec: Codec,
        hello: Hello,
        transport: Transport,
        listener: ControlListener,
        ledger: Ledger,
        sender: SenderView,
    ) -> None:
        self.config, self.layout, self.mem_type, self.codec = config, layout, mem_type, codec
        self.hello, self.transport, self.listener, self.ledger = hello, transport, listener, ledger
        self.sender = sender
        self.conns: dict[bytes, DecodeConn] = {}
        self.bound: dict[Identity, bytes] = {}  # decode (engine, rank) -> the connection it is bound to
        self.peers: dict[Identity, DecodePeer] = {}
        self.admission = Admission(config.limits, sender, lambda: [c.pending for c in self.conns.values()])

    def session(self, identity: Identity) -> Session | None:
        """The live session of the connection that decode rank is bound to."""
        conn = self.bound.get(identity)
        c = self.conns.get(conn) if conn is not None else None
        return None if c is None else c.session

    # ---- handshake and identity -----------------------------------------------------------------
    def _on_first_message(self, conn: bytes, data: bytes | None, now: float) -> list[ConnEvent]:
        """A connection without a session may only say Hello."""
        key = self.config.security.hmac_key
        try:
            if data is None:
                raise WireError("malformed frame (wrong number of parts or over the size limit)")
            hello = open_hello(self.codec, data, key)
        except AuthMismatch as exc:
            self.ledger.add(Count.REFUSED)
            log.warning("kvpush prefill: refused a handshake: %s", exc)
            self.refuse(
                conn, str(exc), ErrorCode.AUTH_REQUIRED if key is not None else ErrorCode.AUTH_UNEXPECTED
            )
            return []
        except WireError as exc:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush prefill: dropped a message from an unknown connection: %s", exc)
            self.refuse(conn, f"message refused: send hello first ({exc})", ErrorCode.HELLO_FIRST)
            return []
        return self._on_hello(conn, hello, now)

    def _on_hello(self, conn: bytes, hello: Hello, now: float) -> list[ConnEvent]:
        allowed = self.config.security.allowed_decode_ids
        if allowed and hello.engine_id not in allowed:
            self.ledger.add(Count.REFUSED)
            log.warning(
                "kvpush prefill: refused decode %s: not in allowed_decode_ids", ascii(hello.engine_id)
            )
            self.refuse(
                conn,
                f"decode engine {hello.engine_id!r} is not in this prefill's allowed_decode_ids",
                ErrorCode.NOT_ALLOWED,
            )
            return []
        try:
            peer_layout = check_peer_hello(self.layout, hello, prefill_side=True)
            check_peer_tp(peer_layout, self.config.limits.max_peer_tp)
        except LayoutError as exc:
            self.ledger.add(Count.REFUSED)
            log.warning("kvpush prefill: refused decode %s: %s", ascii(hello.engine_id), exc)
            self.refuse(conn, str(exc), ErrorCode.REFUSED)
            return []
        identity = (hello.engine_id, peer_layout.tp_rank)
        if identity not in self.bound and len(self.bound) >= self.config.limits.max_identities:
            self.ledger.add(Count.REFUSED)
            why = (
                f"this prefill rank has {len(self.bound)} decode identities bound "
                f"(limits.max_identities {self.config.limits.max_identities}): try again later"
            )
            log.warning("kvpush prefill: refused decode %s: %s", ascii(hello.engine_id), why)
            self.refuse(conn, why, ErrorCode.LIMIT)
            return []
        in_use, events = self._identity_in_use(conn, identity, now, hello.instance)
        if in_use:
            return events
        key = self.config.security.hmac_key
        agent = "" if key is not None else self._add_agent(conn, hello)  # keyed: at PeerMemory
        if agent is None:
            return events
        nonce = os.urandom(16)
        c = DecodeConn(
            conn,
            now,
            Session(self.codec, key, hello.nonce, nonce, "prefill"),
            identity,
            hello.instance,
            agent,
            now,
            now,
            confirmed=key is None,
            peer_layout=peer_layout,
            hello=None if key is None else hello,
        )
        self._track(c)
        if c.confirmed:
            events += self._bind(c, now)
        reply = msgspec.structs.replace(self.hello, nonce=nonce, clock=time.monotonic())
        if key is not None:  # a decode never needs the prefill's memory; a replayed Hello gets none
            reply = handshake.without_memory(reply)
        self._send_raw(conn, hello_frame(self.codec, reply, key, echo=hello.nonce))
        return events

    def _add_agent(self, conn: bytes, hello: Hello) -> str | None:
        """The decode's NIXL agent, added and connected (at handshake, not on a request's path)."""
        try:
            agent = self.transport.add_peer(hello.agent_metadata)
            self.transport.connect(agent)
        except TransportError as exc:
            self.refuse(conn, str(exc), ErrorCode.REFUSED)
            return None
        return agent

    def _confirm(self, c: DecodeConn, msg: Message, now: float) -> list[ConnEvent]:
        """Keyed: the connection's first sealed message must be its decode's PeerMemory; with it the
        Hello is complete, rechecked, its NIXL agent added and the identity bound."""
        agent = None
        try:
            assert c.hello is not None
            hello = handshake.with_memory(c.hello, msg)
            c.peer_layout = check_peer_hello(self.layout, hello, prefill_side=True)
            agent = self._add_agent(c.conn, hello)
        except (WireError, LayoutError) as exc:
            self.ledger.add(Count.REFUSED)
            self.refuse(c.conn, str(exc), ErrorCode.REFUSED)
        if agent is None:
            self.conns.pop(c.conn, None)
            return []
        c.agent, c.hello = agent, None
        return self._bind(c, now)

    def _identity_in_use(
        self, conn: bytes, identity: Identity, now: float, instance: bytes, new: DecodeConn | None = None
    ) -> tuple[bool, list[ConnEvent]]:
        """Refuse (and say so) when the identity is bound to another live connection; an old one that is
        provably gone is dropped (its requests end: the events say which). The same decode process
        (instance) on a new connection replaced its old one (a reset closed it, it handshook again): once
        the new connection is proven (`new`: unkeyed at its Hello, keyed at its first sealed message) it
        takes over the old one's registrations, so a reset ends no request on this side."""
        old_conn = self.bound.get(identity)
        old = self.conns.get(old_conn) if old_conn is not None else None
        if old is None or old.conn == conn:
            return False, []
        if instance and old.instance == instance:
            if new is not None:
                self.conns.pop(old.conn, None)
                new.pending = old.pending
                log.info(
                    "kvpush prefill: decode %s reconnected: its registrations carry over",
                    ascii(str(identity)),
                )
            return False, []
        if self._provably_gone(old, now):
            return False, self._drop(old, "a new handshake replaced it")
        engine, rank = identity
        self.ledger.add(Count.REFUSED)
        log.warning(
            "kvpush prefill: decode %s rank %s is bound to a live connection; refused a new hello for it",
            ascii(engine),
            rank,
        )
        self.refuse(
            conn,
            f"decode {engine!r} rank {rank} is bound to a live connection; a new hello is accepted once "
            f"that one is gone (silent for {self.config.liveness.peer_timeout_s}s, or its NIXL agent disconnected)",
            ErrorCode.IDENTITY_IN_USE,
        )
        return True, []

    def _bind(self, c: DecodeConn, now: float) -> list[ConnEvent]:
        """The connection's identity is proven (unkeyed: at its Hello; keyed: at its first sealed message):
        it is bound here, its NIXL peer and prepared lists set up, and an old connection replaced."""
        assert c.identity is not None and c.peer_layout is not None
        in_use, events = self._identity_in_use(c.conn, c.identity, now, c.instance, c)
        if in_use:
            self.conns.pop(c.conn, None)
            return events
        c.confirmed = True
        self.bound[c.identity] = c.conn
        peer = self.peers[c.identity] = DecodePeer(c.agent, c.peer_layout)
        owed = owed_heads(
            self.layout.tp_rank, self.layout.tp_size, c.peer_layout.tp_size, self.layout.total_kv_heads
        ).get(c.peer_layout.tp_rank)
        if owed is not None:
            self.prepared(peer, owed)  # at handshake: the first request only computes indices
        self.ledger.peers(len(self.bound))
        return events

    def prepared(self, peer: DecodePeer, heads: tuple[int, int]) -> Prepared | None:
        """Prepare (once) the local and remote descriptor lists of this pair; None: this pair posts
        fresh descriptor lists (build_plan) instead, e.g. when its units overflow NIXL's int32 indices."""
        if heads in peer.prepared:
            return peer.prepared[heads]
        prepared: Prepared | None = None
        try:
            units = pair_units(self.layout, peer.layout, heads)
            local = self.transport.prepare(None, units.s.rows, self.mem_type)
            remote = self.transport.prepare(peer.agent, units.d.rows, self.mem_type)
            prepared = Prepared(units, local, remote)
            strided = self.transport.strided_lists
            self.ledger.add(Count.PREPARED_LISTS, 2)
            self.ledger.add(
                Count.PREPARED_DESCRIPTORS,
                listed_descriptors(units.s.rows, strided) + listed_descriptors(units.d.rows, strided),
            )
        except (LayoutError, TransportError) as exc:
            log.warning(
                "kvpush prefill: no prepared lists for %s (%s); posting descriptor lists", peer.agent, exc
            )
        peer.prepared[heads] = prepared
        return prepared

    # ---- liveness -------------------------------------------------------------------------------
    def _provably_gone(self, c: DecodeConn, now: float) -> bool:
        """A bound identity may move to a new connection only once the old one is gone: silent past
        peer_timeout_s, or its NIXL agent refuses a notification."""
        if now - c.last_heard >= self.config.liveness.peer_timeout_s:
            return True
        try:
            self.transport.send_notif(c.agent, b"")
        except TransportError:
            return True
        return False

    def _drop(self, c: DecodeConn, reason: str) -> list[ConnEvent]:
        """Forget a connection; the requests its decode registered fail (the decode is gone or replaced)."""
        self.conns.pop(c.conn, None)
        events: list[ConnEvent] = []
        if c.identity is not None and self.bound.get(c.identity) == c.conn:
            del self.bound[c.identity]
            self.ledger.add(Count.PEERS_GONE)
            engine, rank = c.identity
            events.append(PeerDropped(tuple(c.pending.regs), f"decode {engine!r} rank {rank}: {reason}"))
        self.ledger.peers(len(self.bound))
        return events

    def _track(self, c: DecodeConn) -> None:
        self.conns[c.conn] = c
        if len(self.conns) > MAX_CONNECTIONS:
            for old in sorted(self.conns.values(), key=lambda x: x.seen_at)[: len(self.conns) // 4]:
                if old.identity is None or self.bound.get(old.identity) != old.conn:
                    self.conns.pop(old.conn, None)

    def liveness(self, now: float) -> list[ConnEvent]:
        """Ping bound connections; drop silent ones; prune NIXL peers nothing uses any more."""
        cfg = self.config
        events: list[ConnEvent] = []
        for c in list(self.conns.values()):
            if c.session is None:
                continue
            if now - c.last_ping >= cfg.liveness.ping_interval_s:
                c.last_ping = now
                self.send_sealed(c, Ping(clock=time.monotonic()))
            if now - c.last_heard >= cfg.liveness.peer_timeout_s:
                log.warning(
                    "kvpush prefill: decode %s silent for %.1fs: dropped",
                    ascii(str(c.identity)),
                    now - c.last_heard,
                )
                events += self._drop(c, f"silent for {now - c.last_heard:.1f}s")
        in_use = {c.agent for c in self.conns.values()}
        for identity, peer in list(self.peers.items()):
            if identity in self.bound or self.sender.writing_to(*identity):
                continue
            del self.peers[identity]
            if peer.agent not in in_use:
                with contextlib.suppress(TransportError):
                    self.transport.remove_peer(peer.agent)
        return events

    # ---- sending --------------------------------------------------------------------------------
    def send_to(self, identity: Identity, msg: Message) -> bool:
        """Send msg sealed to the connection that decode rank is bound to; False if it has none."""
        conn = self.bound.get(identity)
        c = self.conns.get(conn) if conn is not None else None
        if c is None or c.session is None:
            return False
        self.send_sealed(c, msg)
        return True

    def send_sealed(self, c: DecodeConn, msg: Message) -> None:
        assert c.session is not None
        self._send_raw(c.conn, c.session.seal(msg))

    def refuse(
        self,
        conn: bytes,
        reason: str,
        code: ErrorCode = ErrorCode.OTHER,
        request_id: str = "",
        attempt: int = 0,
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
