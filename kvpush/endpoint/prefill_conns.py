"""What arrives on the prefill's side channel, seen from the push thread.

`DecodeConnections` reads the connections that `DecodeBindings` (prefill_bindings.py: the Hello, session
keys, identity binding, liveness, replies) keeps: fair receive with per-connection backlogs, each frame
opened through its connection's session (a connection without one goes to the bindings' handshake), and the
registrations and aborts a bound connection may send, checked against the identity it bound, the peer's
declared TP (peers.py) and the admission limits on pending registrations. It never touches the sender
machine: what the machine must hear comes back as events (`Admitted`, `DecodeAborted`, `PeerDropped`), in
the order the frames arrived.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from ..config import Limits
from ..errors import WireError
from ..protocol.handshake import Session
from ..protocol.wire import Abort, ErrorCode, Message, Ping, Pong, Registration
from .admission import Admission, SenderView
from .conn_events import Admitted, ConnEvent, DecodeAborted
from .peers import DecodePeers, Identity
from .prefill_bindings import DecodeBindings, DecodeConn
from .stats import Count, Ledger

log = logging.getLogger("kvpush")


# At most this many side-channel messages per loop round, so one flooding peer cannot starve WRITE
# progress, completions and ticks; per connection, config.limits.max_messages_per_peer_round (the rest of a
# connection's messages wait, in order, in its backlog, so one peer cannot starve the others either).
MAX_MESSAGES_PER_ROUND = 64
MAX_BACKLOG = 1024  # messages of one connection waiting for its next rounds; beyond: refused


def _or_none(events: list[ConnEvent]) -> list[ConnEvent | None]:
    """The events of one message, or one None: each handled message yields at least once."""
    return list(events) if events else [None]


class DecodeConnections:
    """What arrives on the side channel of one prefill rank, and what its decode connections may send."""

    def __init__(
        self, bindings: DecodeBindings, peers: DecodePeers, limits: Limits, ledger: Ledger, sender: SenderView
    ) -> None:
        self.bindings, self.peers, self.limits, self.ledger = bindings, peers, limits, ledger
        self.admission = Admission(limits, sender, lambda: [c.pending for c in bindings.conns.values()])

    # ---- receive --------------------------------------------------------------------------------
    def receive(self, now: float) -> Iterator[ConnEvent | None]:
        """One round of side-channel messages, fair per connection: each gets at most its share a round
        (the rest wait in order in its backlog), and the round as a whole is capped. Yields what the
        sender machine must hear, as it happens (None: a message was handled, nothing to tell)."""
        cap = self.limits.max_messages_per_peer_round
        counts: dict[bytes, int] = {}
        for c in [c for c in self.bindings.conns.values() if c.backlog]:
            while c.backlog and counts.get(c.conn, 0) < cap:
                counts[c.conn] = counts.get(c.conn, 0) + 1
                yield from _or_none(self._on_side_message(c.conn, c.backlog.popleft(), now))
        for _ in range(MAX_MESSAGES_PER_ROUND):
            got = self.bindings.listener.recv()
            if got is None:
                break
            conn, data = got
            counts[conn] = counts.get(conn, 0) + 1
            known = self.bindings.conns.get(conn)
            if known is not None and data is not None and (known.backlog or counts[conn] > cap):
                if len(known.backlog) >= MAX_BACKLOG:
                    self.ledger.add(Count.REFUSED)
                    self.bindings.refuse(
                        conn, "too many messages queued on this connection: slow down", ErrorCode.LIMIT
                    )
                else:
                    known.backlog.append(data)
                yield None
                continue
            yield from _or_none(self._on_side_message(conn, data, now))

    def _on_side_message(self, conn: bytes, data: bytes | None, now: float) -> list[ConnEvent]:
        """One frame from one connection. Nothing a peer sends can raise out of here: bad frames are
        counted and answered; a Registration or Abort counts only on the connection whose Hello bound
        that (engine, rank), through that connection's session (authenticated, in order, no replays)."""
        c = self.bindings.conns.get(conn)
        if c is None or c.session is None:
            return self.bindings.on_first_message(conn, data, now)
        msg = self._open(data, c.identity, c.session)
        if msg is None:
            self.bindings.refuse(
                conn, "message refused: could not decode or authenticate it (see prefill log)"
            )
            return []
        c.last_heard = now
        if not c.confirmed:  # keyed: the first sealed message proves the key and carries the memory
            return self.bindings.confirm(c, msg, now)
        events: list[ConnEvent] = []
        if isinstance(msg, Registration):
            if self._admit_registration(c, msg):
                events.append(Admitted(msg, now))
        elif isinstance(msg, Abort):
            if (msg.decode_engine_id, msg.decode_rank) != c.identity:
                self.ledger.add(Count.REFUSED)
                self.bindings.refuse(
                    conn,
                    f"abort for decode {msg.decode_engine_id!r} rank {msg.decode_rank} on the "
                    f"connection of {c.identity}",
                    ErrorCode.NOT_ALLOWED,
                    msg.request_id,
                    msg.attempt,
                )
            else:
                events.append(DecodeAborted(msg))
        elif isinstance(msg, Ping):
            self.bindings.send_sealed(c, Pong(clock=time.monotonic()))
        elif not isinstance(msg, Pong):  # last_heard is all a pong is for
            self.ledger.add(Count.WIRE_ERRORS)
            self.bindings.refuse(conn, f"prefill does not accept {type(msg).__name__} messages here")
        return events

    def _open(self, data: bytes | None, identity: Identity | None, session: Session) -> Message | None:
        try:
            if data is None:
                raise WireError("malformed frame (wrong number of parts or over the size limit)")
            return session.open(data)
        except WireError as exc:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush: dropped a message from %s: %s", ascii(f"decode {identity}"), exc)
            return None

    def _admit_registration(self, c: DecodeConn, msg: Registration) -> bool:
        """Checks before any per-rank work: the identity its connection bound, the TP that identity's
        handshake declared, and the limits on pending registrations (admission.py)."""
        why, code = "", ErrorCode.REFUSED
        peer = self.peers.get(c.identity) if c.identity is not None else None
        if (msg.decode_engine_id, msg.decode_rank) != c.identity:
            why = f"registration for decode {msg.decode_engine_id!r} rank {msg.decode_rank} on "
            why, code = why + f"the connection of {c.identity}", ErrorCode.NOT_ALLOWED
        elif peer is None:
            why = "no handshake for this decode rank: send hello first"
            self.bindings.refuse(
                c.conn, why, ErrorCode.HELLO_FIRST, msg.request_id, msg.attempt
            )  # not counted: no peer yet
            return False
        elif msg.decode_tp != peer.layout.tp_size:
            why = f"registration says decode TP {msg.decode_tp}; the handshake said {peer.layout.tp_size}"
        elif msg.request_id not in c.pending.regs:
            why, code = self.admission.refusal(c.pending, msg), ErrorCode.LIMIT
        if why:
            self.ledger.add(Count.REFUSED)
            self.bindings.refuse(c.conn, why, code, msg.request_id, msg.attempt)
            return False
        self.admission.record(c.pending, msg)
        return True
