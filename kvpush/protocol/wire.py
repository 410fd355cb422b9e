"""Typed, versioned wire messages (msgspec/msgpack), bounded strict decoding, frames.

Every message carries `v` (the wire version) and a `kind` tag. Decoding checks, in order: size; the
header (kind and version), found by a small iterative scanner that bounds nesting depth and work before
anything recursive touches the bytes (a 1 KB frame nested 1000 deep used to raise RecursionError out of
msgspec and kill the endpoint's thread); version (before the body is interpreted, so a newer peer gets a
clear "unsupported version" rather than a confusing field error); then the body's types and ranges with
msgspec into bounded Structs (whose schema depth is small and whose unknown fields are refused without
being parsed). Any failure is a WireError whose message names the problem; nothing else escapes
`Codec.decode`, whatever the bytes. The caller drops that one message and carries on.

On the side channel and in notifications a message travels in a frame (`split_frame`): one flag byte,
then the body, and for authenticated peers a sequence number and an HMAC tag (see handshake.Session).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Literal

import msgspec

from ..errors import WireError

WIRE_VERSION = 2
TAG_BYTES = 32
SEQ_BYTES = 8
# No message kvpush sends nests deeper than 4 (Hello > layout > regions > tuple); 16 leaves room for a
# newer peer's additions without letting a hostile one make any parser recurse.
MAX_DEPTH = 16
# The header scanner gives up after this many skipped items before it found `kind` and `v` (our encoder
# writes them first, so an honest message needs two).
MAX_HEADER_ITEMS = 4096

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=65535)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=65536)]
Attempt = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
Tokens = Annotated[int, msgspec.Meta(ge=1, le=2**26)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=2048)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class _Msg(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True, frozen=True, kw_only=True):
    v: int = WIRE_VERSION


class LayoutWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A rank's KVLayout as sent in the handshake (its memory included, for remote descriptors)."""

    num_layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 32)]
    total_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    dtype_size: Annotated[int, msgspec.Meta(ge=1, le=16)]
    tp_rank: Rank
    tp_size: TpSize
    kv_per_layer: Annotated[int, msgspec.Meta(ge=1, le=2)]
    token_order: Literal["NHD", "HND"]
    block_stride: NonNeg
    regions: list[tuple[NonNeg, NonNeg, NonNeg]]
    planes: list[tuple[NonNeg, NonNeg, NonNeg, NonNeg]]
    model_tag: Annotated[str, msgspec.Meta(max_length=256)] = ""
    atomic_blocks: bool = False


Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Clock = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]


class Hello(_Msg, tag="hello", frozen=True):
    """Handshake, sent by decode on first contact and answered in kind by prefill.

    `instance` is random per endpoint start: a Hello with a new instance from the same address proves
    the old process is gone. `nonce` is random per connection: both nonces key the connection's session
    (handshake.Session), so a captured message is worthless on any other connection. `clock` is the
    sender's monotonic clock when it sent the Hello (the decode converts registration expiries into the
    prefill's clock with it, conservatively). `auth` says whether the sender holds a shared key.
    """

    engine_id: Name
    role: Annotated[str, msgspec.Meta(pattern="^(prefill|decode)$")]
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 19)]
    mem_type: Annotated[str, msgspec.Meta(max_length=16)]
    compat: Annotated[str, msgspec.Meta(max_length=64)]
    layout: LayoutWire
    instance: Nonce
    nonce: Nonce
    clock: Clock
    auth: bool = False


class Registration(_Msg, tag="reg", frozen=True):
    """Decode -> prefill: these destination blocks wait for request_id's KV (attempt `attempt`)."""

    request_id: RequestId
    attempt: Attempt
    decode_engine_id: Name
    decode_rank: Rank
    decode_tp: TpSize
    block_ids: Annotated[list[BlockId], msgspec.Meta(min_length=1, max_length=1 << 20)]
    num_tokens: Tokens
    # The prefill's monotonic clock after which it must never post a WRITE for this registration (the
    # decode computes it conservatively from its own expiry and the prefill's clock readings).
    expires_at: Clock


class TransferDone(_Msg, tag="done", frozen=True):
    """Prefill -> decode, riding on the WRITE as its notification: all of this rank's bytes landed."""

    request_id: RequestId
    attempt: Attempt
    prefill_rank: Rank
    nbytes: NonNeg


class TransferFailed(_Msg, tag="fail", frozen=True):
    """Prefill -> decode: this rank will not write (lease expired, aborted, transport error)."""

    request_id: RequestId
    attempt: Attempt
    prefill_rank: Rank
    reason: Reason
    # True when a WRITE was posted and then abandoned at its timeout: its bytes may still land until the
    # registration's fence, so the decode keeps the blocks until then.
    abandoned: bool = False


class Abort(_Msg, tag="abort", frozen=True):
    """Decode -> prefill: stop; do not write this attempt's blocks."""

    request_id: RequestId
    attempt: Attempt
    decode_engine_id: Name
    decode_rank: Rank
    reason: Reason


class ErrorReply(_Msg, tag="error", frozen=True):
    """Prefill -> decode on the side channel: your last message was refused, and why."""

    reason: Reason
    request_id: Annotated[str, msgspec.Meta(max_length=512)] = ""
    attempt: Attempt = 0
    # machine-readable cause: "hello_first" (unknown connection: handshake again), "identity_in_use",
    # "auth_required", "auth_unexpected", "not_allowed", "refused", "limit", "" (anything else)
    code: Annotated[str, msgspec.Meta(max_length=32)] = ""


class Posted(_Msg, tag="posted", frozen=True):
    """Prefill -> decode on the side channel, right after a WRITE was posted: its notification is on the
    way, so poll NIXL notifications fast until it lands (with UCX it leaves only when the prefill polls,
    and is found only when the decode polls). A hint only: losing or ignoring it costs latency, never
    correctness. Added within wire v2 before any v2 release (a decode without it would count it as a
    wire error and drop it), so WIRE_VERSION stays 2."""

    request_id: RequestId
    attempt: Attempt
    prefill_rank: Rank


class Ping(_Msg, tag="ping", frozen=True):
    """Liveness, either way on the side channel; answered by Pong. Carries the sender's clock."""

    clock: Clock


class Pong(_Msg, tag="pong", frozen=True):
    clock: Clock


Message = Hello | Registration | TransferDone | TransferFailed | Abort | ErrorReply | Posted | Ping | Pong


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_KINDS = {"hello", "reg", "done", "fail", "abort", "error", "posted", "ping", "pong"}

# msgpack type bytes -> how to skip: ("fixed", n bytes after the type byte) | ("len", width of a length
# prefix, that many bytes follow) | ("arr", width) | ("map", width)
_SKIP: dict[int, tuple[str, int]] = {
    0xC0: ("fixed", 0), 0xC2: ("fixed", 0), 0xC3: ("fixed", 0),
    0xC4: ("len", 1), 0xC5: ("len", 2), 0xC6: ("len", 4),
    0xC7: ("ext", 1), 0xC8: ("ext", 2), 0xC9: ("ext", 4),
    0xCA: ("fixed", 4), 0xCB: ("fixed", 8),
    0xCC: ("fixed", 1), 0xCD: ("fixed", 2), 0xCE: ("fixed", 4), 0xCF: ("fixed", 8),
    0xD0: ("fixed", 1), 0xD1: ("fixed", 2), 0xD2: ("fixed", 4), 0xD3: ("fixed", 8),
    0xD4: ("fixed", 2), 0xD5: ("fixed", 3), 0xD6: ("fixed", 5), 0xD7: ("fixed", 9), 0xD8: ("fixed", 17),
    0xD9: ("len", 1), 0xDA: ("len", 2), 0xDB: ("len", 4),
    0xDC: ("arr", 2), 0xDD: ("arr", 4), 0xDE: ("map", 2), 0xDF: ("map", 4),
}  # fmt: skip


def _read_item(data: bytes, pos: int) -> tuple[int, int, int]:
    """One msgpack item's head at pos: (position after its head and payload, child items, kind) where
    kind is 0 scalar/string, 1 array, 2 map. Raises WireError on truncation or an unused type byte."""
    end = len(data)
    if pos >= end:
        raise WireError("malformed or truncated message: ends inside an item")
    b = data[pos]
    if b <= 0x7F or b >= 0xE0:
        return pos + 1, 0, 0
    if 0x80 <= b <= 0x8F:
        return pos + 1, b & 0x0F, 2
    if 0x90 <= b <= 0x9F:
        return pos + 1, b & 0x0F, 1
    if 0xA0 <= b <= 0xBF:
        nxt = pos + 1 + (b & 0x1F)
    else:
        how = _SKIP.get(b)
        if how is None:
            raise WireError(f"malformed message: invalid msgpack type byte 0x{b:02x} at offset {pos}")
        what, width = how
        if pos + 1 + width > end:
            raise WireError("malformed or truncated message: ends inside an item header")
        if what == "fixed":
            nxt = pos + 1 + width
        else:
            n = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            if what == "arr":
                return pos + 1 + width, n, 1
            if what == "map":
                return pos + 1 + width, n, 2
            nxt = pos + 1 + width + n + (1 if what == "ext" else 0)
    if nxt > end:
        raise WireError("malformed or truncated message: an item runs past the end")
    return nxt, 0, 0


def _skip(data: bytes, pos: int, depth: int, budget: list[int]) -> int:
    """Skip one item iteratively (never recursing), refusing nesting deeper than MAX_DEPTH."""
    stack: list[int] = []  # items still to read at each open level
    while True:
        budget[0] -= 1
        if budget[0] < 0:
            raise WireError(f"message header not found within {MAX_HEADER_ITEMS} items")
        pos, children, kind = _read_item(data, pos)
        if kind:
            if depth + len(stack) + 1 > MAX_DEPTH:
                raise WireError(f"message nested deeper than {MAX_DEPTH} levels")
            stack.append(children * (2 if kind == 2 else 1))
        while stack and stack[-1] == 0:
            stack.pop()
        if not stack:
            return pos
        stack[-1] -= 1


def _header(data: bytes) -> tuple[str, int]:
    """(kind, v) of a message, read without recursion: the top level must be a map; values before the
    two keys are skipped with depth and work bounded."""
    pos, pairs, kind = _read_item(data, 0)
    if kind != 2:
        raise WireError("malformed message header (want a map with 'kind' and 'v')")
    found_kind: str | None = None
    found_v: int | None = None
    budget = [MAX_HEADER_ITEMS]
    for _ in range(pairs):
        if found_kind is not None and found_v is not None:
            break
        key_end = _skip(data, pos, 1, budget)
        key = data[pos:key_end]
        val_end = _skip(data, key_end, 1, budget)
        if key in (b"\xa4kind", b"\xa1v"):
            try:
                got = msgspec.msgpack.decode(data[key_end:val_end])
            except msgspec.DecodeError:
                got = None
            if key == b"\xa4kind":
                found_kind = got if isinstance(got, str) else ""
            else:
                found_v = got if isinstance(got, int) and not isinstance(got, bool) else -1
        pos = val_end
    return (found_kind or ""), (-1 if found_v is None else found_v)


class Codec:
    """Encodes and decodes message bodies under one size limit. `decode` raises only WireError."""

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes

    def encode(self, msg: Message) -> bytes:
        body = _encoder.encode(msg)
        if len(body) > self.max_bytes:
            raise WireError(
                f"{type(msg).__name__} is {len(body)} bytes, over the {self.max_bytes}-byte limit"
            )
        return body

    def decode(self, data: bytes) -> Message:
        if len(data) > self.max_bytes:
            raise WireError(f"oversized message: {len(data)} bytes, limit {self.max_bytes}")
        if not data:
            raise WireError("empty message")
        try:
            kind, version = _header(data)
        except WireError:
            raise
        except Exception as exc:  # noqa: BLE001 - the scanner is ours; any slip is still a refusal
            raise WireError(f"malformed message header ({type(exc).__name__})") from None
        if version != WIRE_VERSION:
            raise WireError(f"unsupported wire version {version}; this peer speaks {WIRE_VERSION}")
        if kind not in _KINDS:
            raise WireError(f"unknown message kind {kind!r}")
        try:
            msg: Message = _decoder.decode(data)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError: test it first)
            raise WireError(f"invalid {kind} message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(f"malformed {kind} message: {exc}") from None
        except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as exc:
            raise WireError(f"undecodable {kind} message ({type(exc).__name__})") from None
        return msg


# ---- frames --------------------------------------------------------------------------------------
PLAIN = 0  # body only (no key configured)
HELLO_MAC = 1  # body + HMAC(long-term key) tag: a Hello from a peer that holds a key
SEALED = 2  # body + sequence number + HMAC(session key) tag
_FRAME_NAMES = {PLAIN: "plain", HELLO_MAC: "keyed hello", SEALED: "sealed"}


def split_frame(data: bytes, max_bytes: int) -> tuple[int, bytes, int, bytes]:
    """(flag, body, seq, tag) of a frame; WireError if it is too short, too long or of unknown type."""
    if len(data) > max_bytes + 1 + SEQ_BYTES + TAG_BYTES:
        raise WireError(f"oversized frame: {len(data)} bytes, limit {max_bytes}")
    if not data:
        raise WireError("empty frame")
    flag = data[0]
    if flag == PLAIN:
        return flag, data[1:], 0, b""
    if flag == HELLO_MAC:
        if len(data) < 1 + TAG_BYTES:
            raise WireError("truncated frame: shorter than its HMAC tag")
        return flag, data[1:-TAG_BYTES], 0, data[-TAG_BYTES:]
    if flag == SEALED:
        if len(data) < 1 + SEQ_BYTES + TAG_BYTES:
            raise WireError("truncated frame: shorter than its sequence number and HMAC tag")
        tail = data[-(SEQ_BYTES + TAG_BYTES) :]
        return (
            flag,
            data[1 : -(SEQ_BYTES + TAG_BYTES)],
            int.from_bytes(tail[:SEQ_BYTES], "big"),
            tail[SEQ_BYTES:],
        )
    raise WireError(f"unknown frame type {flag}")


def frame_name(flag: int) -> str:
    return _FRAME_NAMES.get(flag, f"type {flag}")


def hmac_tag(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
