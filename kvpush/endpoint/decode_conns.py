"""The decode's table of prefill connections: the mirror of prefill_conns.py, seen from the receive thread.

One side-channel connection per prefill rank this rank needs, keyed by (engine id, host, port, rank): an
address a router names reaches that address, whatever another pairing named first for the same engine id.
Each connection has its own Hello, session and clock offset (keyed: the Hello leaves out the NIXL agent
metadata and region addresses, sent sealed as the first message once the prefill's answer proved the key);
a fresh connection and Hello when a rank must be found again. The table is bounded (`max_prefill_peers`):
when full, ranks that never answered and that nothing uses make room, else the new one is refused by name.

Frames are opened here, and what an unauthenticated one may mean is decided here too: on a keyed
connection with a session, a plain frame is never a message (a `Hint` at most: a restarted prefill that
lost our session can say nothing else), and before a session a plain refusal may refuse the pairing but
never names a request. What frames mean for requests is the receive thread's business (decode_replies.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from ..config_groups import Limits, Liveness
from ..errors import TransportError, WireError
from ..protocol.handshake import AuthMismatch, Session, hello_frame, memory_of, open_hello, without_memory
from ..protocol.layout import KVLayout
from ..protocol.tp import check_stage, check_stage_coverage
from ..protocol.wire import (
    PLAIN,
    Abort,
    Codec,
    ErrorCode,
    ErrorReply,
    Hello,
    Message,
    Ping,
    Registration,
    split_frame,
)
from .base import PrefillAddress
from .control import ControlChannel, ControlPlane
from .stats import Count, Ledger

log = logging.getLogger("kvpush")

MAX_BACKLOG = 4096  # messages waiting for one prefill rank's handshake answer
# what a channel's creation or use may raise besides TransportError (ZeroMQ out of sockets, fds)
CHANNEL_ERRORS = (TransportError, zmq.ZMQError, OSError)

AddressKey = tuple[str, str, int]  # (engine id, host, base port): one prefill engine as a router names it


def address_key(address: PrefillAddress) -> AddressKey:
    return (address.engine_id, address.host, address.port)


@dataclass(frozen=True)
class Hint:
    """An unauthenticated refusal on a keyed connection that has a session: it decides nothing. A prefill
    that restarted or dropped us can only answer plainly, so the most it may cause is a fresh handshake."""

    code: ErrorCode
    reason: str


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
    starved_at: float = 0.0  # when our pings to it last had a gap longer than peer_timeout_s (our stall)
    last_hint: float = 0.0  # when a Hint last made us handshake again (at most one per peer_timeout_s)
    connected_at: float = 0.0
    instance: bytes = b""  # the prefill process we last completed a Hello with
    closed_hint: bool = False  # a connection of ours was closed since the last session: verify, never trust

    @property
    def key(self) -> AddressKey:
        return address_key(self.address)

    @property
    def origin(self) -> str:
        return f"prefill {self.address.engine_id} at {self.address.host}:{self.address.port} rank {self.rank}"


class PrefillConnections:
    """Connections to prefill ranks, keyed by (engine id, host, port, rank), and the NIXL agents their
    Hellos named. `in_use()` says which prefill addresses requests still need (those are never pruned)."""

    def __init__(
        self,
        limits: Limits,
        liveness: Liveness,
        hmac_key: bytes | None,
        codec: Codec,
        hello: Hello,
        control: ControlPlane,
        poller: zmq.Poller,
        ledger: Ledger,
        in_use: Callable[[], Collection[AddressKey]],
    ) -> None:
        self.limits, self.liveness, self.hmac_key = limits, liveness, hmac_key
        self.codec, self.hello, self.control = codec, hello, control
        self.poller, self.ledger, self.in_use = poller, ledger, in_use
        self.prefills: dict[tuple[AddressKey, int], PrefillPeer] = {}
        self.by_agent: dict[str, PrefillPeer] = {}  # NIXL agent name -> the prefill rank its Hello named

    def get(self, address: PrefillAddress, rank: int) -> PrefillPeer | None:
        return self.prefills.get((address_key(address), rank))

    def peer(self, address: PrefillAddress, rank: int, now: float) -> PrefillPeer | str:
        """That rank's connection (a new one sends its Hello at once), or why there can be none: the table
        is full of ranks in use, or no connection could be made (ZeroMQ out of sockets)."""
        key = (address_key(address), rank)
        peer = self.prefills.get(key)
        if peer is not None:
            return peer
        if len(self.prefills) >= self.limits.max_prefill_peers:
            self.prune(now, force=True)
        if len(self.prefills) >= self.limits.max_prefill_peers:
            self.ledger.add(Count.REFUSED)
            return (
                f"the decode already talks to max_prefill_peers {self.limits.max_prefill_peers} prefill ranks"
            )
        try:
            channel = self._connect(address, rank)
        except CHANNEL_ERRORS as exc:
            return f"cannot open a side channel to prefill {address.engine_id!r} rank {rank}: {exc}"
        peer = self.prefills[key] = PrefillPeer(address, rank, channel)
        self._send_hello(peer, now)
        return peer

    def _connect(self, address: PrefillAddress, rank: int) -> ControlChannel:
        channel = self.control.connect(address.host, address.rank_port(rank), self.limits.max_message_bytes)
        try:
            self.poller.register(channel.pollable, zmq.POLLIN)
        except BaseException:
            channel.close()
            raise
        return channel

    def live(self) -> int:
        return sum(1 for p in self.prefills.values() if p.session is not None)

    def close(self) -> None:
        for peer in self.prefills.values():
            with contextlib.suppress(*CHANNEL_ERRORS):
                peer.channel.close()
            for ev in peer.waiters:
                ev.set()

    # ---- pruning --------------------------------------------------------------------------------
    def prunable(self, peer: PrefillPeer, used: Collection[AddressKey]) -> bool:
        """Nothing needs it: no session (it never answered, or is being found again), nobody waits on it
        and no live request names its address (what its backlog still holds is then an Abort of a request
        never expected here, or of one that ended: nothing a prefill holds for us)."""
        return peer.session is None and not peer.waiters and peer.key not in used

    def prune(self, now: float, force: bool = False) -> int:
        """Drop unused ranks that never answered and were silent past peer_timeout_s (force: any unused
        rank without a session, to make room). Returns how many went."""
        timeout = self.liveness.peer_timeout_s
        candidates = [
            p
            for p in self.prefills.values()
            if p.session is None and (force or (not p.instance and now - p.connected_at >= timeout))
        ]
        if not candidates:
            return 0
        used = self.in_use()  # a walk over the requests: only when some rank may go
        gone = [p for p in candidates if self.prunable(p, used)]
        for peer in gone:
            self.drop(peer)
        return len(gone)

    def drop(self, peer: PrefillPeer) -> None:
        """Forget a rank: its connection closed, its NIXL agent no longer speaks for anything."""
        self.prefills.pop((peer.key, peer.rank), None)
        if peer.hello is not None and self.by_agent.get(peer.hello.agent_name) is peer:
            del self.by_agent[peer.hello.agent_name]
        self._close_channel(peer)
        for ev in peer.waiters:
            ev.set()

    def _close_channel(self, peer: PrefillPeer) -> None:
        with contextlib.suppress(KeyError, *CHANNEL_ERRORS):
            self.poller.unregister(peer.channel.pollable)
        with contextlib.suppress(*CHANNEL_ERRORS):
            peer.channel.close()

    # ---- liveness -------------------------------------------------------------------------------
    def gone_for_sure(self, peer: PrefillPeer) -> bool:
        """Proof that the rank's process is gone, for a rank we already suspect: a connection of ours was
        closed and a fresh one to its address is refused (nothing listens). A closed connection alone is
        a hint (a reset relay, conntrack or a partition close it too, while the prefill lives and writes)."""
        return peer.closed_hint and self.control.nobody_listens(
            peer.address.host, peer.address.rank_port(peer.rank)
        )

    def verify_closed(self, peer: PrefillPeer, now: float) -> str:
        """A closed connection is a hint to verify: reconnect with a fresh Hello at once (a new instance
        answering proves a restart; the same instance answering proves the prefill alive). Returns why a
        reconnect failed ("" when none was needed or it worked)."""
        if not peer.closed_hint and peer.channel.peer_closed():
            peer.closed_hint = True
            log.info("kvpush decode: side channel to %s closed: handshaking again", ascii(peer.origin))
            return self.reconnect(peer, now)
        return ""

    def reconnect(self, peer: PrefillPeer, now: float) -> str:
        """A fresh connection and Hello: finds a restarted prefill (a new instance) or a resumed one.
        Returns why no connection could be made ("" when it was): the rank keeps its old channel and
        is tried again at its next timeout; the caller fails what it owes (never the thread)."""
        try:
            channel = self._connect(peer.address, peer.rank)
        except CHANNEL_ERRORS as exc:
            why = f"cannot reconnect to {peer.origin}: {exc}"
            log.warning("kvpush decode: %s", ascii(why))
            peer.connected_at = now  # retried at its next timeout, not every round
            if peer.session is not None:
                peer.last_session = peer.session
            peer.session = None
            return why
        self._close_channel(peer)
        peer.channel = channel
        self._send_hello(peer, now)
        return ""

    def _send_hello(self, peer: PrefillPeer, now: float) -> None:
        peer.nonce = os.urandom(16)
        if peer.session is not None:
            peer.last_session = peer.session
        peer.session = None
        peer.connected_at = now
        hello = msgspec.structs.replace(self.hello, nonce=peer.nonce, clock=now)
        if self.hmac_key is not None:
            hello = without_memory(hello)  # metadata and addresses only once the prefill proved the key
        try:
            peer.channel.send(hello_frame(self.codec, hello, self.hmac_key))
        except TransportError as exc:
            log.warning("kvpush decode: hello to %s failed: %s", ascii(peer.origin), exc)

    def send_sealed(self, peer: PrefillPeer, msg: Message) -> None:
        assert peer.session is not None
        try:
            peer.channel.send(peer.session.seal(msg))
        except TransportError as exc:
            log.warning("kvpush decode: side channel to %s: %s", ascii(peer.origin), exc)

    def ping(self, peer: PrefillPeer, now: float) -> None:
        """Ping a rank with a session every ping_interval_s (its Pong keeps last_heard fresh). A gap past
        peer_timeout_s since the last ping is our own stall: the prefill may have dropped us meanwhile."""
        if peer.session is not None and now - peer.last_ping >= self.liveness.ping_interval_s:
            if peer.last_ping and now - peer.last_ping > self.liveness.peer_timeout_s:
                peer.starved_at = now
            peer.last_ping = now
            self.send_sealed(peer, Ping(clock=now))

    def starved(self, peer: PrefillPeer, now: float) -> bool:
        """We were silent to this rank past peer_timeout_s lately (this thread stalled): a prefill's plain
        "hello_first" is then what we expect, and our own clock, not the frame, ends what it owed."""
        timeout = self.liveness.peer_timeout_s
        recent = peer.starved_at and now - peer.starved_at < timeout
        return peer.session is not None and (now - peer.last_ping > timeout or bool(recent))

    # ---- frames ---------------------------------------------------------------------------------
    def open(self, peer: PrefillPeer, data: bytes) -> Message | Hint | None:
        """The message in one frame from that rank (counted and logged when it cannot be opened). Keyed,
        an unsealed refusal with a session is a Hint, never a message."""
        if peer.session is None:
            return self._open_hello_reply(peer, data)
        try:
            return peer.session.open(data)
        except WireError as exc:
            self.ledger.add(Count.WIRE_ERRORS)
            refusal = self._plain_refusal(data)
            if refusal is None:
                log.warning("kvpush: dropped a message from %s: %s", ascii(peer.origin), exc)
                return None
        # keyed (unkeyed, a plain frame opens above): anyone on the path can write this
        log.warning(
            "kvpush decode: unauthenticated refusal from %s (%s) ignored: %s",
            ascii(peer.origin),
            refusal.code.value,
            ascii(refusal.reason[:200]),
        )
        return Hint(refusal.code, refusal.reason)

    def _open_hello_reply(self, peer: PrefillPeer, data: bytes) -> Message | None:
        try:
            return open_hello(self.codec, data, self.hmac_key, echo=peer.nonce)
        except AuthMismatch as exc:
            peer.error = str(exc)
            self.ledger.add(Count.REFUSED)
            log.error("kvpush decode: %s: %s", ascii(peer.origin), exc)
            return None
        except WireError:
            refusal = self._plain_refusal(data)
            if refusal is None or (self.hmac_key is not None and refusal.request_id):
                # keyed, nothing we sent on this connection before its Hello's answer names a request
                self.ledger.add(Count.WIRE_ERRORS)
                return None
            return refusal

    def _plain_refusal(self, data: bytes) -> ErrorReply | None:
        """A plain ErrorReply (refusals before or outside a session) on our own connection."""
        try:
            flag, body, _seq, _tag = split_frame(data, self.codec.max_bytes)
            msg = self.codec.decode(body) if flag == PLAIN else None
        except WireError:
            return None
        return msg if isinstance(msg, ErrorReply) else None

    # ---- the answer -----------------------------------------------------------------------------
    def check_stages(self, peer: PrefillPeer, layout: KVLayout, decode_layers: Sequence[int]) -> None:
        """LayoutError unless the answering rank is the stage and TP rank its address names and, once a
        rank of every stage in its TP column has answered, the stages together hold every decode layer
        once: each stage alone passes check_compatible, yet a gap would leave a layer unwritten."""
        tp, pp = peer.address.tp_size, peer.address.pp_size
        check_stage(layout, peer.rank, tp, pp)
        stages = {peer.rank // tp: layout.global_layers}
        for stage in range(pp):
            other = self.prefills.get((peer.key, stage * tp + peer.rank % tp))
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
        if peer.hello is not None and self.by_agent.get(peer.hello.agent_name) is peer:
            del self.by_agent[peer.hello.agent_name]
        if peer.instance != msg.instance:
            peer.last_session = None  # another process: its predecessor's WRITEs are settled as gone
        peer.hello, peer.error, peer.instance = msg, "", msg.instance
        peer.closed_hint = False
        peer.session = Session(self.codec, self.hmac_key, peer.nonce, msg.nonce, "decode")
        peer.last_ping = now  # the session's first ping is due ping_interval_s from now
        if self.hmac_key is not None:
            # Its answer's HMAC covered our nonce: the prefill holds the key. Our memory goes first, sealed.
            self.send_sealed(peer, memory_of(self.hello))
        self.by_agent[msg.agent_name] = peer
        peer.clock_offset = None
        self.heard(peer, msg.clock, now)
