"""Wire boundary: bad input is refused with a message that names the problem."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.handshake import Session
from kvpush.protocol.wire import WIRE_VERSION, Abort, Codec, ErrorReply, Registration, TransferDone, WireError

REG = Registration(
    request_id="req-1",
    attempt=2,
    decode_engine_id="dec",
    decode_rank=1,
    decode_tp=2,
    block_ids=[4, 5, 9],
    num_tokens=40,
    expires_at=100.0,
)


def raw(**fields):
    base = {
        "kind": "reg",
        "v": WIRE_VERSION,
        "request_id": "r",
        "attempt": 0,
        "decode_engine_id": "d",
        "decode_rank": 0,
        "decode_tp": 1,
        "block_ids": [1],
        "num_tokens": 3,
        "expires_at": 9.0,
    }
    base.update(fields)
    return msgspec.msgpack.encode({k: v for k, v in base.items() if v is not ...})


def test_round_trip_every_kind():
    c = Codec()
    for msg in (
        REG,
        TransferDone(request_id="a", attempt=0, prefill_rank=3, nbytes=10),
        Abort(request_id="a", attempt=1, decode_engine_id="d", decode_rank=0, reason="client left"),
        ErrorReply(reason="nope", request_id="a", attempt=1),
    ):
        assert c.decode(c.encode(msg)) == msg


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"", "empty"),
        (Codec().encode(REG)[:-4], "malformed"),
        (b"\xc1\xc1\xc1", "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "header"),
        (raw(v=99), "unsupported wire version 99"),
        (raw(v=...), "unsupported wire version -1"),
        (raw(kind="teleport"), "unknown message kind 'teleport'"),
        (raw(attempt=-1), "attempt"),
        (raw(block_ids=[-5]), "block_ids"),
        (raw(block_ids=[]), "block_ids"),
        (raw(num_tokens=0), "num_tokens"),
        (raw(request_id=""), "request_id"),
        (raw(decode_rank="zero"), "decode_rank"),
        (raw(surprise=1), "surprise"),
        (raw(num_tokens=...), "num_tokens"),
    ],
)
def test_bad_messages_name_the_problem(data, needle):
    with pytest.raises(WireError, match=needle):
        Codec().decode(data)


def test_oversized_is_refused_before_parsing():
    c = Codec(max_bytes=64)
    with pytest.raises(WireError, match="oversized"):
        c.decode(b"\x00" * 65)
    with pytest.raises(WireError, match="limit"):
        c.encode(
            Registration(
                request_id="r",
                attempt=0,
                decode_engine_id="d",
                decode_rank=0,
                decode_tp=1,
                block_ids=list(range(100)),
                num_tokens=5,
                expires_at=1.0,
            )
        )


def test_sessions_reject_tampering_wrong_keys_other_connections_and_replays():
    key = b"0123456789abcdef-key"
    c = Codec()
    dec = Session(c, key, b"d" * 16, b"p" * 16, "decode")
    pre = Session(c, key, b"d" * 16, b"p" * 16, "prefill")
    frame = dec.seal(REG)
    assert pre.open(frame) == REG
    with pytest.raises(WireError, match="replayed"):
        pre.open(frame)  # the same frame again on the same connection
    other_conn = Session(c, key, b"d" * 16, b"q" * 16, "prefill")
    with pytest.raises(WireError, match="HMAC"):
        other_conn.open(dec.seal(REG))  # captured here, replayed on a connection with other nonces
    wrong_key = Session(c, b"another-key-of-16+", b"d" * 16, b"p" * 16, "prefill")
    with pytest.raises(WireError, match="HMAC"):
        wrong_key.open(dec.seal(REG))
    tampered = bytearray(dec.seal(REG))
    tampered[10] ^= 1
    with pytest.raises(WireError, match="HMAC"):
        pre.open(bytes(tampered))
    with pytest.raises(WireError, match="HMAC"):
        dec.open(dec.seal(REG))  # reflected back at its sender: the direction is in the tag
    with pytest.raises(WireError, match="truncated"):
        pre.open(b"\x02short")
    with pytest.raises(WireError, match="unauthenticated"):
        pre.open(Session(c, None, b"d" * 16, b"p" * 16, "decode").seal(REG))
    with pytest.raises(WireError, match="no shared key"):
        Session(c, None, b"d" * 16, b"p" * 16, "prefill").open(dec.seal(REG))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_anything_but_wireerror(data):
    with contextlib.suppress(WireError):
        Codec().decode(data)
