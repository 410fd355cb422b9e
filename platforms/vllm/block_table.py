"""A prefill request's block ids, read from the scheduler output vLLM hands the connector every step.

vLLM >= 0.32 binds its KV cache manager to the connector (`bind_kv_cache_manager`), which answers for any
request; older vLLM (0.29, the base of vLLM Neuron 0.29.0.1.2.0) does not, so the prefill scheduler keeps
its own table from what every SchedulerOutput already carries for the workers (0.29 through 0.33 alike):
  * `scheduled_new_reqs[i].block_ids`: a request's first blocks (set);
  * `scheduled_cached_reqs.new_block_ids`: blocks added this step (appended; a request in
    `resumed_req_ids` came back from preemption with a new table, which replaces the old one);
  * `kv_connector_block_state` (vLLM >= 0.29): vLLM's own snapshot of the requests that got blocks this
    step (0.29: a `block_ids` dict; 0.32+: `get_block_ids(req_id)`, resolved on access); it wins over
    what the table pieced together.
Every KV-cache group's table is kept (vLLM's hybrid manager gives each group its own); `group_ids` turns
them into what kvpush's endpoints take: one flat table for one group (as before groups existed), else one
table per group, with vLLM's null block (a window group's block freed outside the window) as -1.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvpush.errors import LocalProtocolError

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

# request id -> its blocks in each KV-cache group, as vLLM holds them when its prompt completes
BlockIdSource = Callable[[str], Sequence[Sequence[int]]]
# one flat table (one KV-cache group) or one table per group: what the endpoints' calls take
GroupIds = tuple[int, ...] | tuple[tuple[int, ...], ...]

NULL_BLOCK = 0  # vLLM's null block: the block pool's first block, never a request's own
HOLE = -1  # kvpush's "no block here" in a window group's table


def group_ids(groups: Sequence[Sequence[int]], num_blocks: int) -> GroupIds:
    """The first num_blocks of each group's table; one group -> one flat table. vLLM's null block
    (what a window group holds where it freed blocks before the window) becomes -1: kvpush moves only
    in-window blocks and refuses a needed block that is -1 by name."""
    tables = tuple(tuple(HOLE if b == NULL_BLOCK else int(b) for b in g[:num_blocks]) for g in groups)
    if len(tables) == 1:
        return tables[0]
    return tables


def real_ids(ids: GroupIds) -> set[int]:
    """Every block id the tables name, holes left out (vLLM's invalid-block set of a failed load)."""
    flat = [b for t in ids for b in (t if isinstance(t, tuple) else (t,))]
    return {b for b in flat if b != HOLE}


def first_table(ids: GroupIds) -> list[int]:
    """The first group's table (the DEBUG checksums read one group)."""
    first = ids[0] if ids and isinstance(ids[0], tuple) else ids
    return [b for b in first if isinstance(b, int)]


def expand_group_ids(ids: GroupIds, ratio: int) -> GroupIds:
    """vLLM block ids -> kernel block ids (`ratio` kernel blocks per vLLM block), per table; a hole
    stays a hole for each of its kernel blocks."""
    if ratio == 1:
        return ids

    def one(table: Sequence[int]) -> tuple[int, ...]:
        return tuple(HOLE if b == HOLE else b * ratio + i for b in table for i in range(ratio))

    if ids and isinstance(ids[0], tuple):
        return tuple(one(t) for t in ids)  # type: ignore[arg-type]
    return one(ids)  # type: ignore[arg-type]


class BlockTable:
    """Block ids of the requests the prefill scheduler still has to hand over."""

    def __init__(self) -> None:
        self.ids: dict[str, list[list[int]]] = {}  # per KV-cache group

    def update(self, out: SchedulerOutput, wanted: Collection[str]) -> None:
        """Take this step's blocks of the `wanted` requests (call before reading them in the same step)."""
        for new in out.scheduled_new_reqs:
            if new.req_id in wanted:
                self.ids[new.req_id] = [list(g) for g in new.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, added in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if added is None or rid not in wanted:
                continue
            if rid in cached.resumed_req_ids or rid not in self.ids:
                self.ids[rid] = [list(g) for g in added]
            else:
                for table, more in zip(self.ids[rid], added, strict=True):
                    table.extend(more)
        snapshot = getattr(out, "kv_connector_block_state", None)  # vLLM >= 0.29
        if snapshot is None:
            return
        resolve = getattr(snapshot, "get_block_ids", None)  # vLLM >= 0.32: resolved on access
        if resolve is not None:
            for rid in wanted:
                groups = resolve(rid)
                if groups is not None:
                    self.ids[rid] = [list(g) for g in groups]
            return
        for rid, groups in snapshot.block_ids.items():  # vLLM 0.29: a dict of copies
            if rid in wanted:
                self.ids[rid] = [list(g) for g in groups]

    def block_ids(self, request_id: str) -> Sequence[Sequence[int]]:
        ids = self.ids.get(request_id)
        if ids is None:
            raise LocalProtocolError(
                f"KVPushConnector: no block ids for prefill request {request_id!r}: no scheduler output "
                "listed its blocks (and vLLM bound no KV cache manager)"
            )
        return ids

    def drop(self, request_id: str) -> None:
        self.ids.pop(request_id, None)


def manager_or_table(manager: Callable[[], Any], table: BlockIdSource) -> BlockIdSource:
    """The KV cache manager vLLM >= 0.32 binds to the connector where it is bound (`manager` returns it
    or None), else `table`: the one source that every vLLM version fills."""

    def block_ids(request_id: str) -> Sequence[Sequence[int]]:
        mgr = manager()
        if mgr is None:
            return table(request_id)
        ids: Sequence[Sequence[int]] = mgr.get_block_ids(request_id)
        return ids

    return block_ids
