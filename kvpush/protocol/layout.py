"""The KV geometry of one engine rank, and block -> byte-address arithmetic.

A rank's KV cache is a set of *planes*, one per (layer, K|V) (one per layer for MLA-style caches).
Every plane has the same shape: `num_blocks` blocks, `block_stride` bytes apart, each holding
`block_size` tokens x `num_kv_heads` heads x `head_dim` elements, arranged token-major ("NHD") or
head-major ("HND"). A plane starts at `offset` inside one registered memory region. This covers one
tensor per plane, vLLM's per-layer [2, blocks, ...] tensors and the [blocks, 2, ...] interleaved form
(there `block_stride` is twice the block's bytes and V starts one block-half in).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from ..errors import LayoutError as LayoutError  # re-exported: layouts raise it

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

TokenOrder = Literal["NHD", "HND"]
MAX_GROUPS = 16  # KV-cache groups per layout (and block tables per registration)
MAX_RANKS = 65536  # global ranks (PP x TP) the wire numbers
IntOrArray = TypeVar("IntOrArray", int, "npt.NDArray[np.int64]")


@dataclass(frozen=True)
class Region:
    """A registered memory region: where it is and on which device (0 for host DRAM)."""

    addr: int
    nbytes: int
    device_id: int = 0


@dataclass(frozen=True)
class Plane:
    """One (layer, kv) slice of the cache: `offset` bytes into region `region`."""

    layer: int
    kv: int
    region: int
    offset: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens (the one ceil-div in kvpush)."""
    return -(-num_tokens // block_size)


def inner_offset(
    token_order: str,
    token_in_block: IntOrArray,
    local_head: IntOrArray,
    block_size: int,
    num_kv_heads: int,
    unit_bytes: int,
) -> IntOrArray:
    """Byte offset of (token, head) inside a block; works on ints and on numpy arrays alike."""
    if token_order == "NHD":
        return (token_in_block * num_kv_heads + local_head) * unit_bytes
    return (local_head * block_size + token_in_block) * unit_bytes


def heads_of_rank(tp_rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """Global KV-head range [lo, hi) held by a TP rank.

    With more ranks than KV heads, heads are replicated: ranks r*rep .. r*rep+rep-1 share head r.
    """
    if tp_size <= 0 or total_kv_heads <= 0 or not (0 <= tp_rank < tp_size):
        raise LayoutError(f"bad TP rank {tp_rank} of {tp_size} with {total_kv_heads} KV heads")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise LayoutError(f"{total_kv_heads} KV heads do not divide over TP {tp_size}")
        per = total_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % total_kv_heads:
        raise LayoutError(f"TP {tp_size} is not a multiple of {total_kv_heads} KV heads")
    head = tp_rank // (tp_size // total_kv_heads)
    return head, head + 1


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one rank's KV cache. Pure data: no allocation, no I/O."""

    num_layers: int
    block_size: int
    num_blocks: int
    total_kv_heads: int
    head_dim: int
    dtype_size: int
    tp_rank: int = 0
    tp_size: int = 1
    kv_per_layer: int = 2
    token_order: TokenOrder = "NHD"
    block_stride: int = 0  # 0: blocks are packed (stride = block_bytes)
    regions: tuple[Region, ...] = ()
    planes: tuple[Plane, ...] = ()
    model_tag: str = ""  # anything else that must match across sides (model name, dtype name)
    # The block's interior is opaque (vLLM's CPU kernels pack tokens in their own order): a plan may
    # only move whole blocks, so both sides need the same block size and partial blocks move whole.
    atomic_blocks: bool = False
    # Where `packed_planes` puts the planes: layer-major (each plane a run of blocks) or block-major
    # (block-outermost: every layer's K and V of one block lie in one run, vLLM's cross-layer layouts).
    # A placed layout's kind is read from its planes (`kind`), so it survives the wire without a field.
    block_major: bool = False
    # Layers, KV-cache groups, pipeline stages (all defaulted: one full-attention group over every layer).
    # layer_ids: the model's global index of each local layer (a PP stage names its own; empty: 0..n-1).
    layer_ids: tuple[int, ...] = ()
    # layer_group: the KV-cache group of each local layer (empty: all group 0); group_window: per group,
    # its sliding window in tokens (0: full attention; empty: one full-attention group). Every group
    # shares block_size, num_blocks and the regions, as vLLM's hybrid manager lays them out.
    layer_group: tuple[int, ...] = ()
    group_window: tuple[int, ...] = ()
    # this rank's pipeline stage: its global rank is pp_rank x tp_size + tp_rank (ports, notifications)
    pp_rank: int = 0
    pp_size: int = 1
    _plane_index: dict[tuple[int, int], Plane] = field(default_factory=dict, compare=False, repr=False)
    _layer_index: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "block_size",
            "num_blocks",
            "total_kv_heads",
            "head_dim",
            "dtype_size",
            "tp_size",
            "kv_per_layer",
        ):
            if getattr(self, name) <= 0:
                raise LayoutError(f"layout {name} must be > 0, got {getattr(self, name)}")
        if self.token_order not in ("NHD", "HND"):
            raise LayoutError(f"token_order must be 'NHD' or 'HND', got {self.token_order!r}")
        heads_of_rank(self.tp_rank, self.tp_size, self.total_kv_heads)
        self._check_layers_and_groups()
        object.__setattr__(self, "_layer_index", {g: i for i, g in enumerate(self.layer_ids)})
        if self.block_stride == 0:
            per_block = self.num_layers * self.kv_per_layer if self.block_major else 1
            object.__setattr__(self, "block_stride", self.block_bytes * per_block)
        if self.block_stride < self.block_bytes:
            raise LayoutError(f"block_stride {self.block_stride} < block bytes {self.block_bytes}")
        index = {(p.layer, p.kv): p for p in self.planes}
        object.__setattr__(self, "_plane_index", index)
        if self.planes:
            want = {(lyr, kv) for lyr in range(self.num_layers) for kv in range(self.kv_per_layer)}
            if set(index) != want or len(index) != len(self.planes):
                raise LayoutError("planes must name each (layer, kv) exactly once")
            plane_span = (self.num_blocks - 1) * self.block_stride + self.block_bytes
            for p in self.planes:
                if not (0 <= p.region < len(self.regions)):
                    raise LayoutError(f"plane {p} names region {p.region}; there are {len(self.regions)}")
                if p.offset < 0 or p.offset + plane_span > self.regions[p.region].nbytes:
                    raise LayoutError(f"plane (layer {p.layer}, kv {p.kv}) overruns region {p.region}")

        if self.block_major and self.planes and self.kind != "block-major":
            raise LayoutError("block_major layout whose planes are not block-major (see packed_planes)")

    def _check_layers_and_groups(self) -> None:
        n = self.num_layers
        if self.layer_ids:
            if len(self.layer_ids) != n:
                raise LayoutError(f"layer_ids names {len(self.layer_ids)} layers; the layout has {n}")
            if min(self.layer_ids) < 0 or len(set(self.layer_ids)) != n:
                raise LayoutError(f"layer_ids must be distinct and >= 0, got {span_text(self.layer_ids)}")
        if self.layer_group and len(self.layer_group) != n:
            raise LayoutError(f"layer_group names {len(self.layer_group)} layers; the layout has {n}")
        if len(self.group_window) > MAX_GROUPS:
            raise LayoutError(f"{len(self.group_window)} KV-cache groups; kvpush moves at most {MAX_GROUPS}")
        if any(w < 0 for w in self.group_window):
            raise LayoutError(f"group_window must be >= 0 (0: full attention), got {self.group_window}")
        bad = [g for g in self.layer_group if not 0 <= g < self.num_groups]
        if bad:
            raise LayoutError(
                f"layer_group names group {bad[0]}; the layout has {self.num_groups} KV-cache groups "
                "(group_window gives one window per group)"
            )
        if not 0 <= self.pp_rank < self.pp_size:
            raise LayoutError(f"bad PP rank {self.pp_rank} of {self.pp_size}")
        if self.pp_size * self.tp_size > MAX_RANKS:
            raise LayoutError(
                f"PP {self.pp_size} x TP {self.tp_size} ranks: the wire numbers at most {MAX_RANKS}"
            )

    # ---- layers, groups, stages -------------------------------------------------------------------
    @property
    def global_layers(self) -> tuple[int, ...]:
        """The model's layer index of each local layer."""
        return self.layer_ids or tuple(range(self.num_layers))

    @property
    def num_groups(self) -> int:
        return len(self.group_window) or 1

    def group_of(self, layer: int) -> int:
        """KV-cache group of local layer `layer`."""
        return self.layer_group[layer] if self.layer_group else 0

    def window(self, group: int) -> int:
        """Sliding window of a group in tokens (0: full attention)."""
        return self.group_window[group] if self.group_window else 0

    def local_layer(self, global_layer: int) -> int:
        """The local index of a model layer this rank holds (LayoutError if it holds none)."""
        if not self.layer_ids:
            if 0 <= global_layer < self.num_layers:
                return global_layer
        elif global_layer in self._layer_index:
            return self._layer_index[global_layer]
        raise LayoutError(f"layout holds no layer {global_layer} (it holds {span_text(self.global_layers)})")

    @property
    def rank(self) -> int:
        """This rank's global rank across pipeline stages: what ports and notifications are numbered by."""
        return self.pp_rank * self.tp_size + self.tp_rank

    # ---- derived geometry -------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """ "block-major" when every block holds all planes back to back (one run per block, in one
        region), else "layer-major". Read from the planes when placed, from `block_major` otherwise."""
        if not self.planes:
            return "block-major" if self.block_major else "layer-major"
        n = len(self.planes)
        if n == 1 or len({p.region for p in self.planes}) != 1 or self.block_stride < n * self.block_bytes:
            return "layer-major"
        offs = sorted(p.offset for p in self.planes)
        dense = all(b - a == self.block_bytes for a, b in itertools.pairwise(offs))
        return "block-major" if dense else "layer-major"

    @property
    def cache_bytes(self) -> int:
        """Bytes `packed_planes` needs for this layout (one region)."""
        if self.block_major:
            return self.num_blocks * self.block_stride
        return self.num_blocks * self.block_stride * self.num_layers * self.kv_per_layer

    @property
    def kv_heads(self) -> tuple[int, int]:
        """Global head range [lo, hi) this rank holds."""
        return heads_of_rank(self.tp_rank, self.tp_size, self.total_kv_heads)

    @property
    def num_kv_heads(self) -> int:
        lo, hi = self.kv_heads
        return hi - lo

    @property
    def unit_bytes(self) -> int:
        """Bytes of one (token, head): the smallest piece that is always contiguous."""
        return self.head_dim * self.dtype_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.unit_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies on this rank, across all layers."""
        return self.num_layers * self.kv_per_layer * self.num_kv_heads * self.unit_bytes

    def tokens_to_move(self, num_tokens: int) -> int:
        """Tokens a transfer covers: the prompt, or whole blocks when the block interior is opaque."""
        if not self.atomic_blocks:
            return num_tokens
        return blocks_for(num_tokens, self.block_size) * self.block_size

    def plane(self, layer: int, kv: int) -> Plane:
        try:
            return self._plane_index[(layer, kv)]
        except KeyError:
            raise LayoutError(f"layout has no plane for layer {layer}, kv {kv}") from None

    def unit_offset(self, token_in_block: int, local_head: int) -> int:
        """Byte offset of (token, head) inside a block."""
        return inner_offset(
            self.token_order, token_in_block, local_head, self.block_size, self.num_kv_heads, self.unit_bytes
        )

    def address(self, layer: int, kv: int, block_id: int, token_in_block: int, local_head: int) -> int:
        """Absolute address of one (token, head) unit."""
        p = self.plane(layer, kv)
        return (
            self.regions[p.region].addr
            + p.offset
            + block_id * self.block_stride
            + self.unit_offset(token_in_block, local_head)
        )

    def compat_hash(self) -> str:
        """What must be equal on both sides for KV to be exchangeable (block size and TP may differ)."""
        key = (
            f"v1|layers={self.num_layers}|kv={self.kv_per_layer}|heads={self.total_kv_heads}"
            f"|dim={self.head_dim}|dtype={self.dtype_size}|order={self.token_order}|tag={self.model_tag}"
            + (f"|atomic-blocks={self.block_size}" if self.atomic_blocks else "")
            + ("|block-major" if self.kind == "block-major" else "")
            + (f"|layers={','.join(map(str, self.layer_ids))}" if self.layer_ids else "")
            + (f"|groups={','.join(map(str, self.layer_group))}" if self.layer_group else "")
            + (f"|windows={','.join(map(str, self.group_window))}" if self.group_window else "")
            + (f"|pp={self.pp_rank}/{self.pp_size}" if self.pp_size != 1 else "")
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def with_memory(self, regions: tuple[Region, ...], planes: tuple[Plane, ...]) -> KVLayout:
        """The same geometry placed in concrete memory."""
        return KVLayout(
            self.num_layers,
            self.block_size,
            self.num_blocks,
            self.total_kv_heads,
            self.head_dim,
            self.dtype_size,
            self.tp_rank,
            self.tp_size,
            self.kv_per_layer,
            self.token_order,
            self.block_stride,
            regions,
            planes,
            self.model_tag,
            atomic_blocks=self.atomic_blocks,
            block_major=self.block_major,
            layer_ids=self.layer_ids,
            layer_group=self.layer_group,
            group_window=self.group_window,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
        )


def packed_planes(layout: KVLayout, base_addr: int, device_id: int = 0) -> KVLayout:
    """Place every plane back to back in one region starting at base_addr (a host buffer, say); a
    block_major layout places the planes inside each block instead (plane i at i x block bytes)."""
    if layout.block_major:
        planes = tuple(
            Plane(layer, kv, 0, (layer * layout.kv_per_layer + kv) * layout.block_bytes)
            for layer in range(layout.num_layers)
            for kv in range(layout.kv_per_layer)
        )
        return layout.with_memory((Region(base_addr, layout.cache_bytes, device_id),), planes)
    plane_bytes = layout.num_blocks * layout.block_stride
    planes = tuple(
        Plane(layer, kv, 0, (layer * layout.kv_per_layer + kv) * plane_bytes)
        for layer in range(layout.num_layers)
        for kv in range(layout.kv_per_layer)
    )
    region = Region(base_addr, plane_bytes * layout.num_layers * layout.kv_per_layer, device_id)
    return layout.with_memory((region,), planes)


def span_text(layers: Sequence[int]) -> str:
    """Layer ids in words, ranges folded: (0, 1, 2, 3, 8) -> "0-3, 8"."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(layers)), lambda p: p[1] - p[0]):
        ids = [g for _, g in run]
        out.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ", ".join(out) if out else "none"


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutError naming the first difference that makes src -> dst impossible.

    src may be one pipeline stage: its layers must all be held by dst (which may hold more, written by the
    other stages). KV-cache groups must match by count, window and membership of every shared layer."""
    for name in (
        "kv_per_layer",
        "total_kv_heads",
        "head_dim",
        "dtype_size",
        "token_order",
        "model_tag",
        "atomic_blocks",
        "kind",
    ):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise LayoutError(f"layout mismatch: prefill {name}={a!r} but decode {name}={b!r}")
    if src.pp_size == 1 and src.num_layers != dst.num_layers:
        raise LayoutError(
            f"layout mismatch: prefill num_layers={src.num_layers!r} but decode num_layers={dst.num_layers!r}"
        )
    missing = set(src.global_layers) - set(dst.global_layers)
    if missing:
        stage = f"prefill stage {src.pp_rank} layers" if src.pp_size > 1 else "prefill layers"
        raise LayoutError(
            f"layout mismatch: {stage} {span_text(src.global_layers)} not all held by the decode "
            f"(it holds {span_text(dst.global_layers)}; missing {span_text(sorted(missing))})"
        )
    if src.num_groups != dst.num_groups:
        raise LayoutError(
            f"layout mismatch: prefill has {src.num_groups} KV-cache groups, decode {dst.num_groups}"
        )
    for g in range(src.num_groups):
        if src.window(g) != dst.window(g):
            raise LayoutError(
                f"layout mismatch: KV-cache group {g} sliding window {_window(src.window(g))} (prefill) vs "
                f"{_window(dst.window(g))} (decode)"
            )
    for i, layer in enumerate(src.global_layers):
        a, b = src.group_of(i), dst.group_of(dst.local_layer(layer))
        if a != b:
            raise LayoutError(
                f"layout mismatch: layer {layer} is in KV-cache group {a} on prefill, {b} on decode"
            )
    if src.atomic_blocks and src.block_size != dst.block_size:
        raise LayoutError(
            f"layout mismatch: blocks are opaque (moved whole) but prefill block_size="
            f"{src.block_size} and decode block_size={dst.block_size}; use the same block size"
        )
    big, small = max(src.block_size, dst.block_size), min(src.block_size, dst.block_size)
    if big % small:
        raise LayoutError(
            f"block sizes {src.block_size} (prefill) and {dst.block_size} (decode): one must divide the other"
        )


def _window(tokens: int) -> str:
    return f"window {tokens}" if tokens else "none (full attention)"
