"""With a shared key, a decode's NIXL agent metadata and region addresses leave it only after the prefill
proved the key (issue 17): the keyed Hello carries neither, PeerMemory (sealed) carries both once the
prefill's answer opened. A listener that never answers learns nothing of the decode's memory."""

from __future__ import annotations

import os

import msgspec
import pytest
import zmq

from kvpush.config import KVPushConfig
from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint
from kvpush.errors import HandshakeTimeout
from kvpush.protocol.handshake import hello_frame, make_hello, open_hello
from kvpush.protocol.wire import Codec
from kvpush.transport.memory import MemoryHub, MemoryTransport

from .test_hardening import FAST, caches, push_ok

KEY = os.urandom(32)
SECRET = b"NIXL-AGENT-METADATA:" + os.urandom(24).hex().encode()


class _Transport(MemoryTransport):
    """In-process transport whose metadata is long and unmistakable (the agent name alone would not be)."""

    def metadata(self) -> bytes:
        return SECRET + b"|" + self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        return super().add_peer(metadata.rpartition(b"|")[2])


def _silent_listener() -> tuple[zmq.Socket[bytes], int]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, port


def _what_a_silent_listener_receives(key: bytes | None) -> tuple[bytes, tuple[int, ...]]:
    hub = MemoryHub()
    _src, dst = caches()
    sock, port = _silent_listener()
    d = DecodeEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="D", hmac_key=key, handshake_timeout_s=0.5, **FAST)),
        dst.layout,
        transport=_Transport("D-agent", hub),
    )
    d.start()
    received = b""
    try:
        with pytest.raises(HandshakeTimeout):
            d.connect(PrefillAddress("P", "127.0.0.1", port, 1), timeout=1.0)
        while sock.poll(300):
            received += b"".join(sock.recv_multipart())
    finally:
        d.close()
        sock.close()
    assert received, "the decode sent no Hello at all"
    return received, tuple(r.addr for r in dst.layout.regions)


def _leaks(received: bytes, addrs: tuple[int, ...]) -> list[str]:
    found = ["agent metadata"] if SECRET in received else []
    for addr in addrs:
        for enc in (msgspec.msgpack.encode(addr), addr.to_bytes(8, "big"), addr.to_bytes(8, "little")):
            if enc in received:
                found.append(f"region address {addr:#x}")
    return found


def test_a_keyed_decode_sends_a_silent_listener_no_metadata_and_no_region_address():
    received, addrs = _what_a_silent_listener_receives(KEY)
    assert _leaks(received, addrs) == []


def test_without_a_key_the_hello_does_carry_them_so_the_check_above_can_fail():
    received, addrs = _what_a_silent_listener_receives(None)
    assert "agent metadata" in _leaks(received, addrs)
    assert any(x.startswith("region address") for x in _leaks(received, addrs))


def test_a_keyed_prefill_answers_a_hello_without_its_own_memory_and_pushes_after_peer_memory():
    hub = MemoryHub()
    src, dst = caches()
    p = PrefillEndpoint(
        KVPushConfig.from_mapping(dict(engine_id="P", port=0, hmac_key=KEY, **FAST)),
        src.layout,
        transport=_Transport("P-agent", hub),
    )
    p.start()
    p_port = p.address[1]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{p_port}")
    codec = Codec()
    nonce = os.urandom(16)
    hello = make_hello("X", "decode", "X-agent", b"", "DRAM", dst.layout, nonce=nonce, instance=nonce)
    try:
        sock.send(hello_frame(codec, hello, KEY))
        assert sock.poll(3000)
        reply = open_hello(codec, sock.recv(), KEY, echo=nonce)
        assert reply.role == "prefill" and reply.agent_metadata == b""
        assert all(addr == 0 for addr, _n, _d in reply.layout.regions)
        sock.send(b"\x00")  # not PeerMemory (not even sealed): refused, nothing bound
        # and a real keyed decode, which sends PeerMemory first, is bound and pushes
        d = DecodeEndpoint(
            KVPushConfig.from_mapping(dict(engine_id="D", hmac_key=KEY, **FAST)),
            dst.layout,
            transport=_Transport("D-agent", hub),
        )
        d.start()
        try:
            addr = PrefillAddress("P", *p.address)
            d.connect(addr)
            rp, rd = push_ok(p, d, addr, "r1")
            assert rp.ok and rd.ok, (rp, rd)
        finally:
            d.close()
    finally:
        sock.close()
        p.close()
