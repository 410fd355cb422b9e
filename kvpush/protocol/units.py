"""The data of prepared-list plans (prepared.py): a (prefill rank, decode rank) pair's units, computed once
per peer, and a request's plan as index arrays into the pair's prepared lists."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .layout import KVLayout

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


@dataclass(frozen=True)
class SideUnits:
    """One side's units: the strided rows to prepare, and index = plane_base[p] + blk * blk_mult +
    slot * slot_mult for unit `slot` of block `blk` in plane p (planes in (layer, kv) order)."""

    rows: I64  # N x 5: (addr, len, device, stride, count)
    plane_base: I64
    blk_mult: int
    slot_mult: int
    dense: bool  # units adjacent in memory have adjacent indices in one row (NIXL can merge them)
    block_outer: bool  # the block index is the outermost index (block-major dense)
    slots: int  # units per block

    @property
    def num_units(self) -> int:
        return int(self.rows[:, 4].sum())


@dataclass(frozen=True)
class PairUnits:
    """Everything about a (source layout, destination layout, heads) pair that does not depend on the
    request: computed once per peer, reused by every request."""

    src: KVLayout
    dst: KVLayout
    heads: tuple[int, int]
    mode: str  # "token" (NHD head slice per token), "nhd" (chunk x all heads), "hnd" (chunk x one head)
    chunk: int  # tokens per unit
    unit_bytes: int  # bytes per unit
    s: SideUnits
    d: SideUnits  # its plane_base is indexed by src's planes: each src plane's dst plane (PP, layer ids)
    plane_layer: I64  # src's local layer of each src plane, (layer, kv) order
    plane_group: I64  # KV-cache group of each src plane

    @property
    def mergeable(self) -> bool:
        return self.s.dense and self.d.dense


@dataclass(frozen=True)
class IndexPlan:
    """A request as indices into the pair's prepared lists (int32, as make_prepped_xfer takes them)."""

    src_idx: I32
    dst_idx: I32
    unit_bytes: int
    num_descriptors: int  # after merging consecutive indices (what NIXL posts)
    num_tokens: int
    num_blocks: int  # source blocks covered
    nbytes: int  # the request's KV bytes (what build_plan moves); wire_bytes adds the last unit's rest

    @property
    def wire_bytes(self) -> int:
        return int(self.src_idx.shape[0]) * self.unit_bytes
