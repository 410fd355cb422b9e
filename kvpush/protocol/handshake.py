"""The handshake, sans-IO: a rank's Hello, and the check that two ranks can exchange KV.

A Hello carries the sender's layout (its memory included, so the peer can address remote descriptors)
and a compatibility hash that must match the layout it describes. Both sides check the pairing; the
prefill side answers a refused Hello with the reason, which the decode raises as PeerRefused.
"""

from __future__ import annotations

from ..errors import LayoutError
from .layout import KVLayout, Plane, Region, check_compatible
from .wire import Hello, LayoutWire


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
    )


def make_hello(
    engine_id: str, role: str, agent_name: str, metadata: bytes, mem_type: str, layout: KVLayout
) -> Hello:
    return Hello(
        engine_id=engine_id,
        role=role,
        agent_name=agent_name,
        agent_metadata=metadata,
        mem_type=mem_type,
        compat=layout.compat_hash(),
        layout=layout_to_wire(layout),
    )


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
