"""Typed, versioned wire messages (msgspec/msgpack), strict decoding, optional HMAC.

Every message carries `v` (the wire version) and a `kind` tag. Decoding checks, in order: size, HMAC
(when a key is configured), version (before the body is interpreted, so a newer peer gets a clear
"unsupported version" rather than a confusing field error), then the body's types and ranges. Any failure
is a WireError whose message names the problem; the caller drops that one message and carries on.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Literal

import msgspec

from ..errors import WireError

WIRE_VERSION = 1
_TAG_BYTES = 32

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


class Hello(_Msg, tag="hello", frozen=True):
    """Handshake, sent by decode on first contact and answered in kind by prefill."""

    engine_id: Name
    role: Annotated[str, msgspec.Meta(pattern="^(prefill|decode)$")]
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 19)]
    mem_type: Annotated[str, msgspec.Meta(max_length=16)]
    compat: Annotated[str, msgspec.Meta(max_length=64)]
    layout: LayoutWire


class Registration(_Msg, tag="reg", frozen=True):
    """Decode -> prefill: these destination blocks wait for request_id's KV (attempt `attempt`)."""

    request_id: RequestId
    attempt: Attempt
    decode_engine_id: Name
    decode_rank: Rank
    decode_tp: TpSize
    block_ids: Annotated[list[BlockId], msgspec.Meta(min_length=1, max_length=1 << 20)]
    num_tokens: Tokens


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


Message = Hello | Registration | TransferDone | TransferFailed | Abort | ErrorReply


class _Header(msgspec.Struct):
    kind: str = ""
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
_KINDS = {"hello", "reg", "done", "fail", "abort", "error"}


class Codec:
    """Encodes and decodes messages under one size limit and optional HMAC key."""

    def __init__(self, max_bytes: int = 1 << 20, hmac_key: bytes | None = None) -> None:
        self.max_bytes = max_bytes
        self.hmac_key = hmac_key

    def encode(self, msg: Message) -> bytes:
        body = _encoder.encode(msg)
        if self.hmac_key is not None:
            body += hmac.new(self.hmac_key, body, hashlib.sha256).digest()
        if len(body) > self.max_bytes:
            raise WireError(
                f"{type(msg).__name__} is {len(body)} bytes, over the {self.max_bytes}-byte limit"
            )
        return body

    def decode(self, data: bytes) -> Message:
        if len(data) > self.max_bytes:
            raise WireError(f"oversized message: {len(data)} bytes, limit {self.max_bytes}")
        if self.hmac_key is not None:
            if len(data) < _TAG_BYTES:
                raise WireError("truncated message: shorter than its HMAC tag")
            data, tag = data[:-_TAG_BYTES], data[-_TAG_BYTES:]
            if not hmac.compare_digest(tag, hmac.new(self.hmac_key, data, hashlib.sha256).digest()):
                raise WireError("message HMAC does not match: wrong key or tampered message")
        if not data:
            raise WireError("empty message")
        try:
            header = _header_decoder.decode(data)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError: test it first)
            raise WireError(f"malformed message header (want a map with 'kind' and 'v'): {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(f"malformed or truncated message: {exc}") from None
        if header.v != WIRE_VERSION:
            raise WireError(f"unsupported wire version {header.v}; this peer speaks {WIRE_VERSION}")
        if header.kind not in _KINDS:
            raise WireError(f"unknown message kind {header.kind!r}")
        try:
            msg: Message = _decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise WireError(f"invalid {header.kind} message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(f"malformed {header.kind} message: {exc}") from None
        return msg
