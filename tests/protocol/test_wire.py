"""Wire boundary: bad input is refused with a message that names the problem."""

from __future__ import annotations

import contextlib
import hashlib
import hmac

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.protocol.handshake import Session
from kvpush.protocol.reasons import Failure
from kvpush.protocol.wire import (
    ENVELOPE_BYTES,
    KIND_CODES,
    MAGIC,
    WIRE_VERSION,
    Abort,
    Codec,
    ErrorCode,
    ErrorReply,
    Mac,
    Posted,
    Registration,
    TransferDone,
    TransferFailed,
    WireError,
    hmac_tag,
)

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


def raw(version=WIRE_VERSION, code=KIND_CODES[Registration], **fields):
    """A registration body written by hand: the envelope, then the map (`...` leaves a field out)."""
    base = {
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
    body = msgspec.msgpack.encode({k: v for k, v in base.items() if v is not ...})
    return MAGIC + bytes((version, code)) + body


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
        (msgspec.msgpack.encode({"kind": "reg", "v": 2}), "no kvpush envelope"),
        (MAGIC + bytes((WIRE_VERSION,)), "no kvpush envelope"),
        (raw(version=99), "unsupported wire version 99"),
        (raw(version=2), "unsupported wire version 2"),
        (raw(code=200), "unknown message kind 200"),
        (raw(code=KIND_CODES[Posted]), "invalid Posted message"),
        (raw(v=WIRE_VERSION), "unknown field `v`"),
        (raw(kind="reg"), "unknown field `kind`"),
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


@pytest.mark.parametrize("n", [1, 4095, 4096, 100_000, 200_000])
def test_registrations_of_any_length_round_trip(n):
    """Wire v2 dropped a registration with >= ~4,090 block ids: its header scan gave up before reaching
    `v`, which msgspec wrote after the block ids (a ~65k-token prompt at block size 16 never moved)."""
    c = Codec()
    reg = Registration(
        request_id="long",
        attempt=1,
        decode_engine_id="dec",
        decode_rank=0,
        decode_tp=1,
        block_ids=list(range(n)),
        num_tokens=n * 16,
        expires_at=9.0,
    )
    assert c.decode(c.encode(reg)) == reg


def test_the_largest_registration_the_limit_admits_round_trips_and_one_more_id_is_refused_by_encode():
    c = Codec()

    def reg(n):
        return Registration(
            request_id="r",
            attempt=0,
            decode_engine_id="d",
            decode_rank=0,
            decode_tp=1,
            block_ids=[1 << 20] * n,  # 5 bytes each on the wire
            num_tokens=1,
            expires_at=1.0,
        )

    fixed = len(c.encode(reg(70_000))) - 5 * 70_000  # with a 32-bit array length, as at the limit
    most = (c.max_bytes - fixed) // 5
    assert c.decode(c.encode(reg(most))) == reg(most)
    with pytest.raises(WireError, match="limit"):
        c.encode(reg(most + 1))


def test_a_duplicated_key_is_refused_whichever_value_comes_last():
    """msgspec keeps the last of two equal keys, so a check on the first could be passed by a crafted body."""
    good = Codec().encode(REG)
    env, body = good[:4], good[4:]
    assert body[0] == 0x89  # a fixmap of nine fields
    for dup in (b"\xa7attempt\x02", b"\xa7attempt\x07"):
        crafted = env + bytes((0x8A,)) + body[1:] + dup
        with pytest.raises(WireError, match="non-canonical"):
            Codec().decode(crafted)


def test_nesting_bombs_in_any_field_are_refused_without_recursing():
    for opener in (b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"):
        bomb = opener * 100_000 + b"\xc0"
        for field in ("block_ids", "request_id", "surprise"):
            with pytest.raises(WireError):
                Codec(max_bytes=1 << 22).decode(raw(**{field: msgspec.Raw(bomb)}))


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


def _streamed_hmac(key: bytes, *parts: bytes) -> bytes:
    """The tag as the wire defines it, written out the long way: every part behind its 4-byte length."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=16, max_size=80), st.lists(st.binary(max_size=300), max_size=6))
def test_tags_made_from_a_keyed_copy_equal_the_definition(key, parts):
    """Mac keys once and copies per frame (handshake.Session): the bytes it authenticates, and so its tags,
    must be the definition's, or a peer on the previous release refuses every sealed frame."""
    want = _streamed_hmac(key, *parts)
    mac = Mac(key)
    assert mac.tag(*parts) == want
    assert mac.tag(*parts) == want  # the keyed state is copied, never consumed
    assert hmac_tag(key, *parts) == want


# ---- a failure's kind and a refusal's code on the wire (added within v4) ----------------------------
class _V4TransferFailed(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """TransferFailed as a v4 peer from before the kind defines it (what an unchanged peer decodes with)."""

    request_id: str
    attempt: int
    prefill_rank: int
    reason: str
    abandoned: bool = False


def _body(msg: object) -> bytes:
    return msgspec.msgpack.encode(msg)


@pytest.mark.parametrize("abandoned", [False, True])
def test_a_kindless_failure_notice_is_byte_for_byte_what_an_older_v4_peer_writes(abandoned):
    c = Codec()
    old = _V4TransferFailed(request_id="r", attempt=3, prefill_rank=1, reason="x", abandoned=abandoned)
    new = TransferFailed(request_id="r", attempt=3, prefill_rank=1, reason="x", abandoned=abandoned)
    body = MAGIC + bytes((WIRE_VERSION, KIND_CODES[TransferFailed])) + _body(old)
    assert c.encode(new) == body  # an older decode accepts it as before
    got = c.decode(body)  # and an older prefill's notice is accepted here, with no kind: REMOTE
    assert got == new and isinstance(got, TransferFailed) and got.kind is Failure.REMOTE


def test_a_failure_notice_carries_its_kind_and_an_older_v4_peer_refuses_it_by_name():
    c = Codec()
    msg = TransferFailed(
        request_id="r", attempt=0, prefill_rank=0, reason="lease", abandoned=False, kind=Failure.EXPIRED
    )
    assert c.decode(c.encode(msg)) == msg and msg.kind is Failure.EXPIRED
    with pytest.raises(msgspec.ValidationError, match="unknown field `kind`"):
        msgspec.msgpack.decode(c.encode(msg)[4:], type=_V4TransferFailed)


def test_a_failure_kind_outside_the_set_and_a_missing_abandoned_are_refused():
    head = MAGIC + bytes((WIRE_VERSION, KIND_CODES[TransferFailed]))
    fields = {"request_id": "r", "attempt": 0, "prefill_rank": 0, "reason": "x", "abandoned": False}
    with pytest.raises(WireError, match="invalid TransferFailed message.*kind"):
        Codec().decode(head + _body({**fields, "kind": "gremlins"}))
    with pytest.raises(WireError, match="non-canonical"):  # a default kind is never written
        Codec().decode(head + _body({**fields, "kind": "remote"}))
    with pytest.raises(WireError, match="abandoned"):
        Codec().decode(head + _body({k: v for k, v in fields.items() if k != "abandoned"}))


@pytest.mark.parametrize("code", list(ErrorCode))
def test_an_error_codes_bytes_are_the_string_it_replaced(code):
    """ErrorReply.code was a string; the enum's values are those strings, so the bytes did not change."""
    c = Codec()
    msg = ErrorReply(reason="no", request_id="r", attempt=1, code=code)
    old = {"reason": "no", "request_id": "r", "attempt": 1, "code": code.value}
    body = c.encode(msg)
    assert body[ENVELOPE_BYTES:] == _body(old)
    assert c.decode(body) == msg


def test_an_unknown_error_code_is_refused_by_name():
    head = MAGIC + bytes((WIRE_VERSION, KIND_CODES[ErrorReply]))
    with pytest.raises(WireError, match="invalid ErrorReply message.*code"):
        Codec().decode(head + _body({"reason": "no", "request_id": "", "attempt": 0, "code": "teapot"}))
