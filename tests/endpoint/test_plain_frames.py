"""Issue 45 finding 1: on a keyed side channel nothing unsealed decides a request's fate. A plain ErrorReply
written into the decode's connection by anyone on the path (no key needed) used to fail the request it
named at once and hand its blocks back while the prefill still held the registration (its KV then landed
in reused blocks), and a plain "hello_first" failed every request in flight. Now a plain frame on a keyed
session is a hint at most (a fresh handshake); a request ends only on a sealed message or our own clocks."""

from __future__ import annotations

import collections
import threading
import time

import zmq

from kvpush.config_groups import Limits, Liveness
from kvpush.endpoint import PrefillAddress
from kvpush.endpoint.control import ControlChannel, ControlListener, ControlPlane, MemoryControl, ZmqControl
from kvpush.endpoint.decode_conns import Hint, PrefillConnections, PrefillPeer
from kvpush.endpoint.stats import Ledger
from kvpush.protocol.handshake import Session
from kvpush.protocol.wire import PLAIN, Codec, ErrorCode, ErrorReply
from kvpush.transport.memory import MemoryHub

from .test_hardening import caches, push_ok, start_decode, start_prefill, wait

KEY = b"a-shared-secret-of-32-bytes-long"
CODEC = Codec(1 << 20)


def plain(msg: ErrorReply) -> bytes:
    return bytes([PLAIN]) + CODEC.encode(msg)


class _Channel:
    """The decode's connection, with frames an on-path writer slips in ahead of the prefill's own."""

    def __init__(self, inner: ControlChannel) -> None:
        self.inner, self.pollable = inner, inner.pollable
        self.slipped: collections.deque[bytes] = collections.deque()

    def send(self, data: bytes) -> None:
        self.inner.send(data)

    def recv(self) -> bytes | None:
        try:
            return self.slipped.popleft()
        except IndexError:
            return self.inner.recv()

    def peer_closed(self) -> bool:
        return self.inner.peer_closed()

    def close(self) -> None:
        self.inner.close()


class SlipControl:
    """ZeroMQ, plus `slip(frame)`: the frame reaches every live decode connection as if the prefill sent it."""

    def __init__(self, inner: ControlPlane) -> None:
        self.inner = inner
        self.channels: list[_Channel] = []
        self.lock = threading.Lock()

    def listen(self, host: str, port: int, max_message_bytes: int) -> ControlListener:
        return self.inner.listen(host, port, max_message_bytes)

    def connect(self, host: str, port: int, max_message_bytes: int) -> ControlChannel:
        chan = _Channel(self.inner.connect(host, port, max_message_bytes))
        with self.lock:
            self.channels.append(chan)
        return chan

    def nobody_listens(self, host: str, port: int) -> bool:
        return self.inner.nobody_listens(host, port)

    def slip(self, frame: bytes) -> None:
        with self.lock:
            for chan in self.channels[-1:]:  # the newest: the one the decode reads now
                chan.slipped.append(frame)


def keyed_pair():
    hub = MemoryHub()
    src, dst = caches()
    p = start_prefill(hub, src, hmac_key=KEY)
    slip = SlipControl(ZmqControl())
    d = start_decode(hub, dst, hmac_key=KEY, control=slip)
    addr = PrefillAddress("P", *p.address)
    d.connect(addr)
    return p, d, addr, slip, (hub, src, dst)  # the caches and the hub must outlive the endpoints


def test_a_plain_error_reply_naming_a_request_on_a_keyed_channel_fails_nothing_and_it_completes():
    p, d, addr, slip, _keep = keyed_pair()
    try:
        d.expect("victim", [1, 2], 8, addr)
        time.sleep(0.3)  # registered at the prefill, which holds it
        for attempt in range(3):  # whatever attempt number it has
            reply = ErrorReply(reason="refused", request_id="victim", attempt=attempt, code=ErrorCode.REFUSED)
            slip.slip(plain(reply))
        time.sleep(1.0)
        # before the fix: failed within ms, its blocks handed back while the prefill still held it
        assert d.finished() == [], "a plain ErrorReply ended a request on a keyed channel"
        p.prefill_done("victim", [3, 4], 8)
        got_p, got_d = wait(p)[0], wait(d)[0]
        assert got_d.ok and got_p.ok and got_d.nbytes > 0, (got_p, got_d)
        assert d.stats()["wire_errors"] >= 1, d.stats()
    finally:
        d.close()
        p.close()


def test_a_plain_hello_first_on_a_keyed_channel_at_most_rehandshakes_and_fails_nothing():
    p, d, addr, slip, _keep = keyed_pair()
    try:
        d.expect("in-flight", [1, 2], 8, addr)
        time.sleep(0.3)
        for _ in range(3):
            slip.slip(plain(ErrorReply(reason="send hello first", code=ErrorCode.HELLO_FIRST)))
        time.sleep(1.0)  # > peer_timeout_s 0.6: before the fix the request had failed (after 1 s)
        assert d.finished() == [], "a plain hello_first ended requests on a keyed channel"
        p.prefill_done("in-flight", [3, 4], 8)
        got_p, got_d = wait(p)[0], wait(d)[0]
        assert got_d.ok and got_p.ok, (got_p, got_d)
        rp, rd = push_ok(p, d, addr, "next")
        assert rp.ok and rd.ok, (rp, rd)
    finally:
        d.close()
        p.close()


def _conns(key: bytes | None) -> tuple[PrefillConnections, PrefillPeer]:
    plane = MemoryControl()
    conns = PrefillConnections(
        Limits(), Liveness(), key, CODEC, None, plane, zmq.Poller(), Ledger("decode", "D", 0), lambda: ()
    )
    peer = PrefillPeer(PrefillAddress("P", "127.0.0.1", 1), 0, plane.connect("127.0.0.1", 1, 1 << 20))
    return conns, peer


def test_what_a_plain_refusal_may_mean_keyed_and_not():
    named = plain(ErrorReply(reason="no", request_id="r", attempt=0, code=ErrorCode.REFUSED))
    unnamed = plain(ErrorReply(reason="set the same hmac_key", code=ErrorCode.AUTH_REQUIRED))
    conns, peer = _conns(KEY)
    # before a session: a refusal of the pairing may be plain (the prefill has no session to seal it
    # with); one naming a request cannot be an answer to anything sent on this connection yet
    assert conns.open(peer, named) is None
    assert isinstance(conns.open(peer, unnamed), ErrorReply)
    peer.session = Session(CODEC, KEY, b"d" * 16, b"p" * 16, "decode")
    assert conns.open(peer, named) == Hint(ErrorCode.REFUSED, "no")  # with a session: a hint, never a message
    assert isinstance(conns.open(peer, unnamed), Hint)
    # without a key the local host is trusted: a plain refusal is the message it says
    conns, peer = _conns(None)
    peer.session = Session(CODEC, None, b"d" * 16, b"p" * 16, "decode")
    assert isinstance(conns.open(peer, named), ErrorReply)
