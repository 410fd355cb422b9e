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
Only the first KV-cache group is kept (kvpush refuses hybrid groups).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvpush.errors import LocalProtocolError

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

# request id -> its blocks in the first KV-cache group, as vLLM holds them when its prompt completes
BlockIdSource = Callable[[str], Sequence[int]]


class BlockTable:
    """Block ids of the requests the prefill scheduler still has to hand over."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}

    def update(self, out: SchedulerOutput, wanted: Collection[str]) -> None:
        """Take this step's blocks of the `wanted` requests (call before reading them in the same step)."""
        for new in out.scheduled_new_reqs:
            if new.req_id in wanted:
                self.ids[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, added in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if added is None or rid not in wanted:
                continue
            if rid in cached.resumed_req_ids:
                self.ids[rid] = list(added[0])
            else:
                self.ids.setdefault(rid, []).extend(added[0])
        snapshot = getattr(out, "kv_connector_block_state", None)  # vLLM >= 0.29
        if snapshot is None:
            return
        resolve = getattr(snapshot, "get_block_ids", None)  # vLLM >= 0.32: resolved on access
        if resolve is not None:
            for rid in wanted:
                groups = resolve(rid)
                if groups is not None:
                    self.ids[rid] = list(groups[0])
            return
        for rid, groups in snapshot.block_ids.items():  # vLLM 0.29: a dict of copies
            if rid in wanted:
                self.ids[rid] = list(groups[0])

    def block_ids(self, request_id: str) -> Sequence[int]:
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

    def block_ids(request_id: str) -> Sequence[int]:
        mgr = manager()
        if mgr is None:
            return table(request_id)
        ids: Sequence[int] = mgr.get_block_ids(request_id)[0]
        return ids

    return block_ids
