"""Who is on the other end of the prefill's side channel: the decode identities its connections bind.

`DecodeBindings` keeps the table of side-channel connections and everything about their identity: the Hello
and its session keys (keyed: a Hello binds nothing until the first sealed message, the decode's PeerMemory,
opens), the (engine, rank) each connection binds and a reconnect or replacement of it, liveness (pings,
silent connections dropped, unused data-plane peers pruned), and sealed replies and refusals. A bound rank's
NIXL agent and prepared lists live in the data-plane table (peers.py), which this table keeps in step.
`DecodeConnections` (prefill_conns.py) reads what arrives on the connections and hands first messages here.
What the sender machine must hear comes back as events.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from ..config import Limits, Liveness, Security
from ..errors import LayoutError, TransportError, WireError
from ..protocol import handshake
from ..protocol.handshake import AuthMismatch, Session, check_peer_hello, hello_frame, open_hello
from ..protocol.layout import KVLayout
from ..protocol.tp import check_peer_tp
from ..protocol.wire import PLAIN, Codec, ErrorCode, ErrorReply, Hello, Message, Ping
from ..transport.base import Transport
from .admission import Pending, SenderView
from .conn_events import ConnEvent, PeerDropped
from .control import ControlListener
from .peers import DecodePeers, Identity
from .stats import Count, Ledger

log = logging.getLogger("kvpush")

MAX_CONNECTIONS = 4096  # side-channel connections tracked; the oldest without a handshake go first


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
    """Side-channel connections of one prefill rank and the decode ranks they bind."""

    def __init__(
        self,
        layout: KVLayout,
        security: Security,
        limits: Limits,
        liveness: Liveness,
        codec: Codec,
        hello: Hello,
        transport: Transport,
        listener: ControlListener,
        ledger: Ledger,
        peers: DecodePeers,
        sender: SenderView,
    ) -> None:
        self.layout, self.security, self.limits, self.live = layout, security, limits, liveness
        self.codec, self.hello, self.transport, self.listener = codec, hello, transport, listener
        self.ledger, self.peers, self.sender = ledger, peers, sender
        self.conns: dict[bytes, DecodeConn] = {}
        self.bound: dict[Identity, bytes] = {}  # decode (engine, rank) -> the connection it is bound to

    # ---- handshake and identity -----------------------------------------------------------------
    def on_first_message(self, conn: bytes, data: bytes | None, now: float) -> list[ConnEvent]:
        """A connection without a session may only say Hello."""
        key = self.security.hmac_key
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
        allowed = self.security.allowed_decode_ids
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
            check_peer_tp(peer_layout, self.limits.max_peer_tp)
        except LayoutError as exc:
            self.ledger.add(Count.REFUSED)
            log.warning("kvpush prefill: refused decode %s: %s", ascii(hello.engine_id), exc)
            self.refuse(conn, str(exc), ErrorCode.REFUSED)
            return []
        identity = (hello.engine_id, peer_layout.tp_rank)
        if identity not in self.bound and len(self.bound) >= self.limits.max_identities:
            self.ledger.add(Count.REFUSED)
            why = (
                f"this prefill rank has {len(self.bound)} decode identities bound "
                f"(limits.max_identities {self.limits.max_identities}): try again later"
            )
            log.warning("kvpush prefill: refused decode %s: %s", ascii(hello.engine_id), why)
            self.refuse(conn, why, ErrorCode.LIMIT)
            return []
        in_use, events = self._identity_in_use(conn, identity, now, hello.instance)
        if in_use:
            return events
        key = self.security.hmac_key
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

    def confirm(self, c: DecodeConn, msg: Message, now: float) -> list[ConnEvent]:
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
            f"that one is gone (silent for {self.live.peer_timeout_s}s, or its NIXL agent disconnected)",
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
        assert c.session is not None
        c.confirmed = True
        self.bound[c.identity] = c.conn
        self.peers.bind(c.identity, c.agent, c.peer_layout, c.session)  # prepared lists made here
        self.ledger.peers(len(self.bound))
        return events

    # ---- liveness -------------------------------------------------------------------------------
    def _provably_gone(self, c: DecodeConn, now: float) -> bool:
        """A bound identity may move to a new connection only once the old one is gone: silent past
        peer_timeout_s, or its NIXL agent refuses a notification."""
        if now - c.last_heard >= self.live.peer_timeout_s:
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
            self.peers.unbind(c.identity)
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
        """Ping bound connections; drop silent ones; prune data-plane peers nothing uses any more."""
        cfg = self.live
        events: list[ConnEvent] = []
        for c in list(self.conns.values()):
            if c.session is None:
                continue
            if now - c.last_ping >= cfg.ping_interval_s:
                c.last_ping = now
                self.send_sealed(c, Ping(clock=time.monotonic()))
            if now - c.last_heard >= cfg.peer_timeout_s:
                log.warning(
                    "kvpush prefill: decode %s silent for %.1fs: dropped",
                    ascii(str(c.identity)),
                    now - c.last_heard,
                )
                events += self._drop(c, f"silent for {now - c.last_heard:.1f}s")
        self.peers.prune(self.bound, self.sender.writing_to, {c.agent for c in self.conns.values()})
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
