"""Typed, versioned wire messages (msgspec/msgpack), bounded strict decoding, frames.

A message body is a fixed 4-byte envelope, then the message's fields as a msgpack map:

    b"KP" | wire version (1 byte) | kind (1 byte) | msgpack map

The envelope is why no payload can push the header out of reach: wire v2 put `kind` and `v` inside the map,
and msgspec wrote `v` last, so a registration with ~4,090 block ids (a ~65k-token prompt) outgrew the
bounded header scan and was dropped. Decoding checks, in order: size; the envelope (magic, version - a peer
on another version gets "unsupported wire version", not a field error - and kind); then the body, with the
one concrete Struct type its kind names (a typed decoder never skips unknown values, so a nesting bomb
fails at its first level instead of recursing; unknown fields are refused by name); and last, that the body
is exactly what our encoder writes for the decoded message, which refuses duplicate keys (msgspec would keep
the last one) and any other ambiguous encoding. Any failure is a WireError whose message names the
problem; nothing else escapes `Codec.decode`, whatever the bytes. The caller drops that one message and
carries on.

On the side channel and in notifications a message travels in a frame (`split_frame`): one flag byte,
then the body, and for authenticated peers a sequence number and an HMAC tag (see handshake.Session).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from typing import Annotated, Literal

import msgspec

from ..errors import WireError
from .groups import BlockIds, from_flat
from .reasons import Failure

# v3: the fixed envelope (v2 carried kind and version inside the map; see the module docstring)
# v4: layer ids, KV-cache groups, windows and PP stage in LayoutWire; per-group tables in Registration
WIRE_VERSION = 4
MAGIC = b"KP"
ENVELOPE_BYTES = 4
TAG_BYTES = 32
SEQ_BYTES = 8

MAX_REQUEST_ID = 512
MAX_TOKENS = 2**26
MAX_BLOCK_ID = 2**40
MAX_BLOCK_IDS = 1 << 20  # per registration, every group's table together
MAX_GROUPS = 16  # KV-cache groups (layout.MAX_GROUPS)
MAX_LAYER_ID = 1 << 20
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=65535)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=65536)]
Attempt = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
# -1: no block here (a sliding-window group's block outside the window; see protocol/groups.py)
BlockIdOrHole = Annotated[int, msgspec.Meta(ge=-1, le=MAX_BLOCK_ID)]
Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=2048)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class _Msg(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A message's fields; its kind and the wire version travel in the envelope, not in the map."""


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
    layer_ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_ID)]], msgspec.Meta(max_length=4096)
    ] = []
    layer_group: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]], msgspec.Meta(max_length=4096)
    ] = []
    group_window: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]], msgspec.Meta(max_length=MAX_GROUPS)
    ] = []
    pp_rank: Rank = 0
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1


Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Clock = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]


class Hello(_Msg, frozen=True):
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


class PeerMemory(_Msg, frozen=True):
    """Decode -> prefill, sealed, the first message of a keyed connection: the decode's NIXL agent metadata
    and the addresses of the regions its Hello described. A keyed Hello carries neither (regions at
    address 0), so they reach only a prefill that proved the key by answering that Hello."""

    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 19)]
    region_addrs: Annotated[list[NonNeg], msgspec.Meta(max_length=1 << 16)]


class Registration(_Msg, frozen=True):
    """Decode -> prefill: these destination blocks wait for request_id's KV (attempt `attempt`).

    `block_ids` is one table, or (with `group_sizes`) every KV-cache group's table back to back, group
    0 first: group g's table is the next group_sizes[g] ids. -1 marks a window group's block outside the
    window (the layout check refuses it anywhere else)."""

    request_id: RequestId
    attempt: Attempt
    decode_engine_id: Name
    decode_rank: Rank
    decode_tp: TpSize
    block_ids: Annotated[list[BlockIdOrHole], msgspec.Meta(min_length=1, max_length=MAX_BLOCK_IDS)]
    num_tokens: Tokens
    # The prefill's monotonic clock after which it must never post a WRITE for this registration (the
    # decode computes it conservatively from its own expiry and the prefill's clock readings).
    expires_at: Clock
    group_sizes: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_IDS)]], msgspec.Meta(max_length=MAX_GROUPS)
    ] = []

    def tables(self) -> BlockIds:
        """The block table, or one per KV-cache group."""
        return from_flat(self.block_ids, self.group_sizes)

    def __post_init__(self) -> None:
        if self.group_sizes and sum(self.group_sizes) != len(self.block_ids):
            raise ValueError(
                f"group_sizes add up to {sum(self.group_sizes)} block ids but block_ids holds {len(self.block_ids)}"
            )


class TransferDone(_Msg, frozen=True):
    """Prefill -> decode, riding on the WRITE as its notification: all of this rank's bytes landed."""

    request_id: RequestId
    attempt: Attempt
    prefill_rank: Rank
    nbytes: NonNeg


class TransferFailed(_Msg, frozen=True, omit_defaults=True):
    """Prefill -> decode: this rank will not write (lease expired, aborted, transport error), and why as a
    kind, so the decode's result names the prefill's kind rather than its words.

    `kind` was added within wire v4. A default kind is not sent (omit_defaults), and `abandoned` has no
    default so that it is always sent, as before: the bytes of a kindless notice are exactly the ones an
    older v4 prefill writes, so a decode on this code accepts an older prefill's notices (kind REMOTE).
    An older v4 decode refuses a notice that carries a kind ("unknown field `kind`"), drops it as a wire
    error, and ends the attempt at its ready timeout instead (version ranges: issue 43)."""

    request_id: RequestId
    attempt: Attempt
    prefill_rank: Rank
    reason: Reason
    # True when a WRITE was posted and then abandoned at its timeout: its bytes may still land until the
    # registration's fence, so the decode keeps the blocks until then.
    abandoned: bool
    kind: Failure = Failure.REMOTE


class Abort(_Msg, frozen=True):
    """Decode -> prefill: stop; do not write this attempt's blocks."""

    request_id: RequestId
    attempt: Attempt
    decode_engine_id: Name
    decode_rank: Rank
    reason: Reason


class ErrorCode(enum.Enum):
    """ErrorReply's machine-readable cause (the values are the bytes on the wire: never change one)."""

    HELLO_FIRST = "hello_first"  # unknown connection: handshake again
    IDENTITY_IN_USE = "identity_in_use"  # the (engine, rank) is bound to another live connection
    AUTH_REQUIRED = "auth_required"  # this prefill holds a key and the Hello was not keyed
    AUTH_UNEXPECTED = "auth_unexpected"  # the Hello was keyed and this prefill holds no key
    NOT_ALLOWED = "not_allowed"  # not allowed for this connection's identity (or not in the allow list)
    REFUSED = "refused"  # the pairing or the request cannot work (layout, TP, agent)
    LIMIT = "limit"  # a limit was reached (identities, pending registrations, queued messages)
    OTHER = ""  # anything else (a message that could not be opened, or of a kind not accepted here)


class ErrorReply(_Msg, frozen=True):
    """Prefill -> decode on the side channel: your last message was refused, and why."""

    reason: Reason
    request_id: Annotated[str, msgspec.Meta(max_length=512)] = ""
    attempt: Attempt = 0
    code: ErrorCode = ErrorCode.OTHER


class Posted(_Msg, frozen=True):
    """Prefill -> decode on the side channel, right after a WRITE was posted: its notification is on the
    way, so poll NIXL notifications fast until it lands (with UCX it leaves only when the prefill polls,
    and is found only when the decode polls). A hint only: losing or ignoring it costs latency, never
    correctness. (Added late in wire v2; every v3 peer knows it.)"""

    request_id: RequestId
    attempt: Attempt
    prefill_rank: Rank


class Ping(_Msg, frozen=True):
    """Liveness, either way on the side channel; answered by Pong. Carries the sender's clock."""

    clock: Clock


class Pong(_Msg, frozen=True):
    clock: Clock


Message = (
    Hello
    | Registration
    | TransferDone
    | TransferFailed
    | Abort
    | ErrorReply
    | Posted
    | Ping
    | Pong
    | PeerMemory
)


# The kind byte of each message type. Never renumber: a number is part of the wire format.
KIND_CODES: dict[type[_Msg], int] = {
    Hello: 1,
    Registration: 2,
    TransferDone: 3,
    TransferFailed: 4,
    Abort: 5,
    ErrorReply: 6,
    Posted: 7,
    Ping: 8,
    Pong: 9,
    PeerMemory: 10,
}
_DECODERS: dict[int, tuple[str, msgspec.msgpack.Decoder[Message]]] = {
    code: (cls.__name__, msgspec.msgpack.Decoder(cls)) for cls, code in KIND_CODES.items()
}
_encoder = msgspec.msgpack.Encoder()


def envelope(msg: Message) -> bytes:
    return MAGIC + bytes((WIRE_VERSION, KIND_CODES[type(msg)]))


class Codec:
    """Encodes and decodes message bodies under one size limit. `decode` raises only WireError."""

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes

    def encode(self, msg: Message) -> bytes:
        body = envelope(msg) + _encoder.encode(msg)
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
        if len(data) < ENVELOPE_BYTES or data[:2] != MAGIC:
            raise WireError(
                "malformed message header: no kvpush envelope (a peer older than wire "
                f"v{WIRE_VERSION}, or not kvpush)"
            )
        version, code = data[2], data[3]
        if version != WIRE_VERSION:
            raise WireError(f"unsupported wire version {version}; this peer speaks {WIRE_VERSION}")
        known = _DECODERS.get(code)
        if known is None:
            raise WireError(f"unknown message kind {code}")
        name, decoder = known
        body = data[ENVELOPE_BYTES:]
        try:
            msg = decoder.decode(body)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError: test it first)
            raise WireError(f"invalid {name} message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(f"malformed {name} message: {exc}") from None
        except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as exc:
            raise WireError(f"undecodable {name} message ({type(exc).__name__})") from None
        if _encoder.encode(msg) != body:
            raise WireError(
                f"non-canonical {name} message: duplicate, reordered or re-encoded fields are refused"
            )
        return msg


def request_problem(
    request_id: str, block_ids: list[int] | tuple[int, ...], num_tokens: int, max_bytes: int | None
) -> str:
    """What would make the wire refuse this request's registration ("" if nothing), checked where the engine
    calls in, so a request the wire cannot carry fails at once by name instead of timing out. With
    max_bytes, the registration's encoded size is bounded too (from the widest block id, without encoding)."""
    if not 1 <= len(request_id) <= MAX_REQUEST_ID:
        return f"request id is {len(request_id)} characters; the wire carries 1..{MAX_REQUEST_ID}"
    if not 1 <= num_tokens <= MAX_TOKENS:
        return f"num_tokens {num_tokens} is outside the wire's 1..{MAX_TOKENS}"
    if len(block_ids) > MAX_BLOCK_IDS:
        return f"{len(block_ids)} block ids; a registration carries at most {MAX_BLOCK_IDS}"
    if max_bytes is None or not block_ids:
        return ""
    widest = max(block_ids)
    per_id = 1 if widest < 128 else 3 if widest < 1 << 16 else 5 if widest < 1 << 32 else 9
    # fixed fields: envelope, field names, the engine id (<= 256 characters) and the numbers (~200 bytes)
    size = per_id * len(block_ids) + len(request_id.encode()) + 600
    if size > max_bytes:
        return (
            f"a registration of {len(block_ids)} block ids is about {size} bytes, over max_message_bytes "
            f"{max_bytes}: raise max_message_bytes on both sides, or use larger blocks"
        )
    return ""


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


def _framed(parts: tuple[bytes, ...]) -> bytes:
    """Each part behind its 4-byte length, so no two different part lists authenticate the same bytes."""
    return b"".join([len(part).to_bytes(4, "big") + part for part in parts])


def hmac_tag(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the length-framed parts under `key` (a one-off: a Hello, a key derivation)."""
    return hmac.digest(key, _framed(parts), "sha256")


class Mac:
    """hmac_tag under one key that tags many messages (a session): the key is hashed in once and each tag
    starts from a copy of that keyed state (a tag in ~60% of the time of keying afresh)."""

    def __init__(self, key: bytes) -> None:
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)

    def tag(self, *parts: bytes) -> bytes:
        mac = self._keyed.copy()
        mac.update(_framed(parts))
        return mac.digest()


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
