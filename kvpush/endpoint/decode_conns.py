"""The decode's table of prefill connections: the mirror of prefill_conns.py, seen from the receive thread.

One side-channel connection per prefill rank this rank needs, each with its own Hello, session and clock
offset (keyed: the Hello leaves out the NIXL agent metadata and region addresses, sent sealed as the
first message once the prefill's answer proved the key); a fresh connection and Hello when a rank must be found again; frames opened (a Hello's answer, a
sealed message, or a plain refusal from a prefill that does not know the connection). What the frames
mean for requests is the receive thread's business (decode.py): this table never touches ReceiverState.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from ..config import KVPushConfig
from ..errors import TransportError, WireError
from ..protocol.handshake import AuthMismatch, Session, hello_frame, memory_of, open_hello, without_memory
from ..protocol.layout import KVLayout
from ..protocol.tp import check_stage, check_stage_coverage
from ..protocol.wire import PLAIN, Abort, Codec, ErrorReply, Hello, Message, Ping, Registration, split_frame
from .base import PrefillAddress
from .control import ControlChannel, ControlPlane
from .stats import Count, Ledger

log = logging.getLogger("kvpush")

MAX_BACKLOG = 4096  # messages waiting for one prefill rank's handshake answer


@dataclass
class PrefillPeer:
    """One prefill rank's connection: its Hello and session once answered, and what waits for them."""

    address: PrefillAddress
    rank: int
    channel: ControlChannel
    nonce: bytes = b""  # ours, for this connection's Hello
    hello: Hello | None = None
    session: Session | None = None
    # the session before a re-handshake: notifications of WRITEs sealed under it still open (a reset
    # side channel must not turn a WRITE that landed into a timeout)
    last_session: Session | None = None
    error: str = ""
    waiters: list[threading.Event] = field(default_factory=list)
    backlog: list[Registration | Abort] = field(default_factory=list)  # waiting for the Hello's answer
    clock_offset: float | None = None  # max(prefill clock - our clock at receipt)
    last_heard: float = 0.0
    last_ping: float = 0.0
    connected_at: float = 0.0
    instance: bytes = b""  # the prefill process we last completed a Hello with
    closed_hint: bool = False  # a connection of ours was closed since the last session: verify, never trust

    @property
    def origin(self) -> str:
        return f"prefill {self.address.engine_id} rank {self.rank}"


class PrefillConnections:
    """Connections to prefill ranks, keyed by (engine id, rank), and the NIXL agents their Hellos named."""

    def __init__(
        self,
        config: KVPushConfig,
        codec: Codec,
        hello: Hello,
        control: ControlPlane,
        poller: zmq.Poller,
        ledger: Ledger,
    ) -> None:
        self.config, self.codec, self.hello, self.control = config, codec, hello, control
        self.poller, self.ledger = poller, ledger
        self.prefills: dict[tuple[str, int], PrefillPeer] = {}
        self.by_agent: dict[str, PrefillPeer] = {}  # NIXL agent name -> the prefill rank its Hello named

    def peer(self, address: PrefillAddress, rank: int, now: float) -> PrefillPeer:
        """That rank's connection; a new one sends its Hello at once."""
        key = (address.engine_id, rank)
        peer = self.prefills.get(key)
        if peer is None:
            channel = self.control.connect(
                address.host, address.rank_port(rank), self.config.limits.max_message_bytes
            )
            self.poller.register(channel.pollable, zmq.POLLIN)
            peer = self.prefills[key] = PrefillPeer(address, rank, channel)
            self._send_hello(peer, now)
        return peer

    def live(self) -> int:
        return sum(1 for p in self.prefills.values() if p.session is not None)

    def close(self) -> None:
        for peer in self.prefills.values():
            peer.channel.close()
            for ev in peer.waiters:
                ev.set()

    def gone_for_sure(self, peer: PrefillPeer) -> bool:
        """Proof that the rank's process is gone, for a rank we already suspect: a connection of ours was
        closed and a fresh one to its address is refused (nothing listens). A closed connection alone is
        a hint (a reset relay, conntrack or a partition close it too, while the prefill lives and writes)."""
        return peer.closed_hint and self.control.nobody_listens(
            peer.address.host, peer.address.rank_port(peer.rank)
        )

    def verify_closed(self, peer: PrefillPeer, now: float) -> None:
        """A closed connection is a hint to verify: reconnect with a fresh Hello at once (a new instance
        answering proves a restart; the same instance answering proves the prefill alive)."""
        if not peer.closed_hint and peer.channel.peer_closed():
            peer.closed_hint = True
            log.info("kvpush decode: side channel to %s closed: handshaking again", ascii(peer.origin))
            self.reconnect(peer, now)

    def reconnect(self, peer: PrefillPeer, now: float) -> None:
        """A fresh connection and Hello: finds a restarted prefill (a new instance) or a resumed one."""
        with contextlib.suppress(KeyError):
            self.poller.unregister(peer.channel.pollable)
        peer.channel.close()
        peer.channel = self.control.connect(
            peer.address.host, peer.address.rank_port(peer.rank), self.config.limits.max_message_bytes
        )
        self.poller.register(peer.channel.pollable, zmq.POLLIN)
        self._send_hello(peer, now)

    def _send_hello(self, peer: PrefillPeer, now: float) -> None:
        peer.nonce = os.urandom(16)
        if peer.session is not None:
            peer.last_session = peer.session
        peer.session = None
        peer.connected_at = now
        hello = msgspec.structs.replace(self.hello, nonce=peer.nonce, clock=now)
        key = self.config.security.hmac_key
        if key is not None:
            hello = without_memory(hello)  # metadata and addresses only once the prefill proved the key
        try:
            peer.channel.send(hello_frame(self.codec, hello, key))
        except TransportError as exc:
            log.warning("kvpush decode: hello to prefill %s failed: %s", ascii(peer.address.engine_id), exc)

    def send_sealed(self, peer: PrefillPeer, msg: Message) -> None:
        assert peer.session is not None
        try:
            peer.channel.send(peer.session.seal(msg))
        except TransportError as exc:
            log.warning("kvpush decode: side channel to prefill rank %s: %s", peer.rank, exc)

    def ping(self, peer: PrefillPeer, now: float) -> None:
        """Ping a rank with a session every ping_interval_s (its Pong keeps last_heard fresh)."""
        if peer.session is not None and now - peer.last_ping >= self.config.liveness.ping_interval_s:
            peer.last_ping = now
            self.send_sealed(peer, Ping(clock=now))

    def open(self, peer: PrefillPeer, data: bytes) -> Message | None:
        """The message in one frame from that rank (counted and logged when it cannot be opened)."""
        if peer.session is None:
            return self._open_hello_reply(peer, data)
        try:
            return peer.session.open(data)
        except WireError as exc:
            self.ledger.add(Count.WIRE_ERRORS)
            log.warning("kvpush: dropped a message from %s: %s", ascii(peer.origin), exc)
        return self._plain_refusal(data)  # a restarted prefill answers an unknown connection plainly

    def _open_hello_reply(self, peer: PrefillPeer, data: bytes) -> Message | None:
        try:
            return open_hello(self.codec, data, self.config.security.hmac_key, echo=peer.nonce)
        except AuthMismatch as exc:
            peer.error = str(exc)
            self.ledger.add(Count.REFUSED)
            log.error("kvpush decode: %s: %s", ascii(peer.origin), exc)
            return None
        except WireError:
            refusal = self._plain_refusal(data)
            if refusal is None:
                self.ledger.add(Count.WIRE_ERRORS)
            return refusal

    def _plain_refusal(self, data: bytes) -> ErrorReply | None:
        """A plain ErrorReply (refusals before or outside a session) on our own connection."""
        try:
            flag, body, _seq, _tag = split_frame(data, self.codec.max_bytes)
            msg = self.codec.decode(body) if flag == PLAIN else None
        except WireError:
            return None
        return msg if isinstance(msg, ErrorReply) else None

    def check_stages(self, peer: PrefillPeer, layout: KVLayout, decode_layers: Sequence[int]) -> None:
        """LayoutError unless the answering rank is the stage and TP rank its address names and, once a
        rank of every stage in its TP column has answered, the stages together hold every decode layer
        once: each stage alone passes check_compatible, yet a gap would leave a layer unwritten."""
        tp, pp = peer.address.tp_size, peer.address.pp_size
        check_stage(layout, peer.rank, tp, pp)
        stages = {peer.rank // tp: layout.global_layers}
        for stage in range(pp):
            other = self.prefills.get((peer.address.engine_id, stage * tp + peer.rank % tp))
            if stage not in stages and other is not None and other.hello is not None and other.session:
                stages[stage] = tuple(other.hello.layout.layer_ids) or tuple(
                    range(other.hello.layout.num_layers)
                )
        if len(stages) == pp:
            check_stage_coverage(decode_layers, stages)

    def heard(self, peer: PrefillPeer, clock: float, now: float) -> None:
        peer.last_heard = now
        off = clock - now
        peer.clock_offset = off if peer.clock_offset is None else max(peer.clock_offset, off)

    def start_session(self, peer: PrefillPeer, msg: Hello, now: float) -> None:
        """The rank answered our Hello with its own (already checked): the session starts, and that rank
        now speaks for the NIXL agent its Hello named."""
        if peer.hello is not None:
            self.by_agent.pop(peer.hello.agent_name, None)
        if peer.instance != msg.instance:
            peer.last_session = None  # another process: its predecessor's WRITEs are settled as gone
        peer.hello, peer.error, peer.instance = msg, "", msg.instance
        peer.closed_hint = False
        peer.session = Session(self.codec, self.config.security.hmac_key, peer.nonce, msg.nonce, "decode")
        if self.config.security.hmac_key is not None:
            # Its answer's HMAC covered our nonce: the prefill holds the key. Our memory goes first, sealed.
            self.send_sealed(peer, memory_of(self.hello))
        self.by_agent[msg.agent_name] = peer
        peer.clock_offset = None
        self.heard(peer, msg.clock, now)
