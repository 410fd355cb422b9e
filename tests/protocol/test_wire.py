"""Wire boundary: bad input is refused with a message that names the problem."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.wire import WIRE_VERSION, Abort, Codec, ErrorReply, Registration, TransferDone, WireError

REG = Registration(
    request_id="req-1",
    attempt=2,
    decode_engine_id="dec",
    decode_rank=1,
    decode_tp=2,
    block_ids=[4, 5, 9],
    num_tokens=40,
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
        (Codec().encode(REG)[:-4], "truncated"),
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
            )
        )


def test_hmac_rejects_tampering_and_wrong_keys():
    good, other = Codec(hmac_key=b"k1"), Codec(hmac_key=b"k2")
    data = good.encode(REG)
    assert good.decode(data) == REG
    with pytest.raises(WireError, match="HMAC"):
        other.decode(data)
    tampered = bytearray(data)
    tampered[10] ^= 1
    with pytest.raises(WireError, match="HMAC"):
        good.decode(bytes(tampered))
    with pytest.raises(WireError, match="truncated"):
        good.decode(b"short")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_anything_but_wireerror(data):
    with contextlib.suppress(WireError):
        Codec().decode(data)
