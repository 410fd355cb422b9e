"""The handshake, sans-IO: a rank's Hello, and the check that two ranks can exchange KV.

A Hello carries the sender's layout (its memory included, so the peer can address remote descriptors)
and a compatibility hash that must match the layout it describes. Both sides check the pairing; the
prefill side answers a refused Hello with the reason, which the decode raises as PeerRefused.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..errors import LayoutError, WireError
from .layout import KVLayout, Plane, Region, check_compatible
from .replay import ReplayWindow
from .wire import (
    HELLO_MAC,
    PLAIN,
    SEALED,
    SEQ_BYTES,
    Codec,
    Hello,
    LayoutWire,
    Mac,
    Message,
    PeerMemory,
    frame_name,
    hmac_tag,
    split_frame,
    tags_equal,
)

# A shared key shorter than this is refused at configuration (an empty or short key is no secret).
MIN_KEY_BYTES = 16


class AuthMismatch(WireError):
    """One side holds a shared key and the other does not (or the key is wrong): the text says which."""


def layout_to_wire(layout: KVLayout) -> LayoutWire:
    return LayoutWire(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        total_kv_heads=layout.total_kv_heads,
        head_dim=layout.head_dim,
        dtype_size=layout.dtype_size,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        kv_per_layer=layout.kv_per_layer,
        token_order=layout.token_order,
        block_stride=layout.block_stride,
        regions=[(r.addr, r.nbytes, r.device_id) for r in layout.regions],
        planes=[(p.layer, p.kv, p.region, p.offset) for p in layout.planes],
        model_tag=layout.model_tag,
        atomic_blocks=layout.atomic_blocks,
        layer_ids=list(layout.layer_ids),
        layer_group=list(layout.layer_group),
        group_window=list(layout.group_window),
        pp_rank=layout.pp_rank,
        pp_size=layout.pp_size,
    )


def layout_from_wire(w: LayoutWire) -> KVLayout:
    """Rebuild a peer's layout; a malformed one raises LayoutError naming the problem."""
    return KVLayout(
        w.num_layers,
        w.block_size,
        w.num_blocks,
        w.total_kv_heads,
        w.head_dim,
        w.dtype_size,
        w.tp_rank,
        w.tp_size,
        w.kv_per_layer,
        w.token_order,
        w.block_stride,
        tuple(Region(*r) for r in w.regions),
        tuple(Plane(*p) for p in w.planes),
        w.model_tag,
        atomic_blocks=w.atomic_blocks,
        layer_ids=tuple(w.layer_ids),
        layer_group=tuple(w.layer_group),
        group_window=tuple(w.group_window),
        pp_rank=w.pp_rank,
        pp_size=w.pp_size,
    )


def make_hello(
    engine_id: str,
    role: str,
    agent_name: str,
    metadata: bytes,
    mem_type: str,
    layout: KVLayout,
    *,
    instance: bytes = b"\0" * 16,
    nonce: bytes = b"\0" * 16,
    clock: float = 0.0,
    auth: bool = False,
) -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,
        agent_name=agent_name,
        agent_metadata=metadata,
        mem_type=mem_type,
        compat=layout.compat_hash(),
        layout=layout_to_wire(layout),
        instance=instance,
        nonce=nonce,
        clock=clock,
        auth=auth,
    )


def without_memory(hello: Hello) -> Hello:
    """The Hello a keyed side sends before the peer has proven the key: no NIXL agent metadata and every
    region at address 0 (sizes kept, so the layout still checks); PeerMemory carries the rest later."""
    regions = [(0, nbytes, device) for _addr, nbytes, device in hello.layout.regions]
    layout = msgspec.structs.replace(hello.layout, regions=regions)
    return msgspec.structs.replace(hello, agent_metadata=b"", layout=layout)


def memory_of(hello: Hello) -> PeerMemory:
    return PeerMemory(agent_metadata=hello.agent_metadata, region_addrs=[r[0] for r in hello.layout.regions])


def with_memory(hello: Hello, memory: Message) -> Hello:
    """The peer's full Hello: its keyed Hello completed by the PeerMemory sent once the key was proven
    (WireError if the message is anything else, or names another number of regions)."""
    if not isinstance(memory, PeerMemory):
        raise WireError(f"the first sealed message must be PeerMemory, not {type(memory).__name__}")
    regions = hello.layout.regions
    if len(memory.region_addrs) != len(regions):
        raise WireError(
            f"PeerMemory names {len(memory.region_addrs)} region addresses; the Hello described {len(regions)}"
        )
    filled = [
        (addr, nbytes, dev) for addr, (_a, nbytes, dev) in zip(memory.region_addrs, regions, strict=True)
    ]
    layout = msgspec.structs.replace(hello.layout, regions=filled)
    return msgspec.structs.replace(hello, agent_metadata=memory.agent_metadata, layout=layout)


# ---- authentication ------------------------------------------------------------------------------
def hello_frame(codec: Codec, hello: Hello, key: bytes | None, echo: bytes = b"") -> bytes:
    """A Hello as a frame: plain without a key; with one, tagged over the body and `echo` (the peer's
    nonce when answering its Hello, so the answer cannot be a replay of an older one)."""
    body = codec.encode(hello)
    if key is None:
        return bytes([PLAIN]) + body
    return bytes([HELLO_MAC]) + body + hmac_tag(key, b"kvpush-hello", body, echo)


def open_hello(codec: Codec, data: bytes, key: bytes | None, echo: bytes = b"") -> Hello:
    """The Hello in a frame, its key use checked against ours. AuthMismatch names a one-sided key or a
    wrong key; WireError anything else."""
    flag, body, _seq, tag = split_frame(data, codec.max_bytes)
    msg = codec.decode(body)
    if not isinstance(msg, Hello):
        raise WireError(f"expected a Hello, got {type(msg).__name__}")
    if key is None and flag == HELLO_MAC:
        raise AuthMismatch(
            f"{msg.role} {msg.engine_id!r} authenticates with a shared key but this side has none: "
            "set the same hmac_key on both sides"
        )
    if key is not None and flag == PLAIN:
        raise AuthMismatch(
            f"this side requires a shared key and {msg.role} {msg.engine_id!r} sent none: "
            "set the same hmac_key on both sides"
        )
    if flag == SEALED:
        raise WireError("a Hello must not be sealed")
    if key is not None and not tags_equal(tag, hmac_tag(key, b"kvpush-hello", body, echo)):
        raise AuthMismatch(f"Hello from {msg.role} {msg.engine_id!r} has a wrong HMAC: the keys differ")
    return msg


class Session:
    """One side-channel connection's authenticated session, sans-IO.

    With a shared key, the session key is HMAC(key, decode nonce, prefill nonce): both nonces are fresh
    per connection, so a message captured on one connection fails on every other. Each direction and
    channel ("side": the ZeroMQ connection; "notif": NIXL notifications) numbers its messages; a number
    seen before (or older than the window) is a replay and refused. Without a key, frames are plain and
    the endpoints bind messages to connections (and notifications to NIXL agents) themselves.
    """

    def __init__(
        self,
        codec: Codec,
        key: bytes | None,
        decode_nonce: bytes,
        prefill_nonce: bytes,
        local_role: Literal["prefill", "decode"],
    ) -> None:
        self.codec = codec
        self.key = None if key is None else hmac_tag(key, b"kvpush-session", decode_nonce, prefill_nonce)
        self._mac = None if self.key is None else Mac(self.key)
        self.send_dir = b"p2d" if local_role == "prefill" else b"d2p"
        self.recv_dir = b"d2p" if local_role == "prefill" else b"p2d"
        self._next: dict[bytes, int] = {}
        self._seen: dict[bytes, ReplayWindow] = {}  # channel -> the sequence numbers it accepted

    def seal(self, msg: Message, channel: bytes = b"side") -> bytes:
        body = self.codec.encode(msg)
        if self._mac is None:
            return bytes([PLAIN]) + body
        seq = self._next.get(channel, 1)
        self._next[channel] = seq + 1
        raw_seq = seq.to_bytes(SEQ_BYTES, "big")
        return bytes([SEALED]) + body + raw_seq + self._mac.tag(self.send_dir, channel, raw_seq, body)

    def sealed(self, channel: bytes = b"side") -> int:
        """How many frames this side has sealed on `channel` (a frame sealed ahead, then held, is refused
        as a replay once REPLAY_WINDOW later ones were opened before it)."""
        return self._next.get(channel, 1) - 1

    def open(self, data: bytes, channel: bytes = b"side") -> Message:
        """The message in a frame, authenticated and fresh; WireError (AuthMismatch) otherwise."""
        flag, body, seq, tag = split_frame(data, self.codec.max_bytes)
        if self._mac is None:
            if flag != PLAIN:
                raise AuthMismatch(f"peer sent a {frame_name(flag)} frame but this side has no shared key")
            return self.codec.decode(body)
        if flag != SEALED:
            raise AuthMismatch(f"unauthenticated {frame_name(flag)} frame on an authenticated connection")
        raw_seq = seq.to_bytes(SEQ_BYTES, "big")
        if not tags_equal(tag, self._mac.tag(self.recv_dir, channel, raw_seq, body)):
            raise AuthMismatch("message HMAC does not match this connection's session: forged or misrouted")
        window = self._seen.get(channel)
        if window is None:
            window = self._seen[channel] = ReplayWindow()
        if not window.accept(seq):
            raise WireError(f"replayed message (sequence {seq} already seen on this connection)")
        return self.codec.decode(body)


def check_peer_hello(mine: KVLayout, hello: Hello, prefill_side: bool) -> KVLayout:
    """The peer's layout, or LayoutError if KV cannot move between the two."""
    want = "decode" if prefill_side else "prefill"
    if hello.role != want:
        raise LayoutError(
            f"hello from a {hello.role} engine {hello.engine_id!r}; "
            f"{'prefill' if prefill_side else 'decode'} talks to {want} engines"
        )
    peer = layout_from_wire(hello.layout)
    if hello.compat != peer.compat_hash():
        raise LayoutError(
            f"peer {hello.engine_id!r} sent compat hash {hello.compat} that does not match its own layout"
        )
    src, dst = (mine, peer) if prefill_side else (peer, mine)
    check_compatible(src, dst)
    return peer
