"""The two scheduler sides driven as vLLM's scheduler drives them, without an engine: each exit of
request_finished, the transfer-key claims, and what the step metadata carries to the workers."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.request import RequestStatus

    from kvpush.endpoint import PrefillAddress
    from kvpush.errors import LocalProtocolError
    from kvpush.platforms.vllm.block_table import manager_or_table
    from kvpush.platforms.vllm.decode_scheduler import DecodeScheduler
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.prefill_scheduler import PrefillScheduler, SendState
    from kvpush.platforms.vllm.scheduler import FailItem

BLOCK = 16
EXTRA = {"host": "10.0.0.5", "port": 7100, "idle_wait_ms": 0}


def settings(role: str) -> ConnectorSettings:
    return ConnectorSettings.from_extra(role, f"{role}-0", EXTRA, block_size=BLOCK, tp_size=2, pp_size=1)


def request(rid: str, params: dict[str, Any] | None, prompt: int = 40, computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        status=RequestStatus.RUNNING,
    )


def blocks(*ids: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(
    scheduled: dict[str, int],
    new: dict[str, list[int]] | None = None,
    added: dict[str, list[int] | None] | None = None,
    resumed: set[str] | frozenset[str] = frozenset(),
    snapshot: dict[str, list[int]] | None = None,
    resolved: dict[str, list[int]] | None = None,
) -> Any:
    """A SchedulerOutput as far as the connector reads it: new requests' blocks, blocks added to running
    (or resumed) ones, and on vLLM >= 0.29 the block-state snapshot (None: an older vLLM's output)."""
    added = added or {}
    out = SimpleNamespace(
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in (new or {}).items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(added),
            new_block_ids=[None if ids is None else (ids,) for ids in added.values()],
            resumed_req_ids=set(resumed),
        ),
    )
    if snapshot is not None:
        out.kv_connector_block_state = SimpleNamespace(block_ids={r: (ids,) for r, ids in snapshot.items()})
    if resolved is not None:  # vLLM >= 0.32's form: looked up per request
        out.kv_connector_block_state = SimpleNamespace(
            get_block_ids=lambda rid: (resolved[rid],) if rid in resolved else None
        )
    return out


PREFILL_AT = {"remote_engine_id": "prefill-0", "remote_host": "10.0.0.9", "remote_port": 7000, "tp_size": 2}


# ---- prefill ---------------------------------------------------------------------------------------
def prefill(table: dict[str, list[int]]) -> PrefillScheduler:
    return PrefillScheduler(settings("prefill"), lambda rid: (table[rid],))  # one KV-cache group


def test_prefill_hands_a_prompt_over_in_the_step_that_completes_it_and_holds_its_blocks():
    sched = prefill({"a-12345678": [4, 5, 6, 7]})
    req = request("a-12345678", {"do_remote_decode": True, "transfer_id": "t1"})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks(4, 5, 6, 7), 0)
    assert not sched.build_connector_meta(step({"a-12345678": 32})).send  # a chunk: 32 of 40 tokens
    req.num_computed_tokens = 32
    meta = sched.build_connector_meta(step({"a-12345678": 8}))
    assert [(s.key, s.block_ids, s.num_tokens) for s in meta.send] == [("t1", (4, 5, 6), 40)]  # 3 blocks
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, answer = sched.request_finished(req, ([4, 5, 6, 7],))
    assert hold and answer is not None
    assert (answer["remote_engine_id"], answer["remote_host"], answer["remote_port"]) == (
        "prefill-0",
        "10.0.0.5",
        7100,
    )
    assert answer["remote_request_id"] == "t1" and answer["tp_size"] == 2
    assert sched.prefills["a-12345678"].state is SendState.SENDING and not sched.meta.abort_send
    assert sched.has_pending_work()
    sched.update_connector_output(SimpleNamespace(finished_sending={"a-12345678"}, finished_recving=None))
    assert not sched.prefills and not sched.live_keys and not sched.has_pending_work()


def test_prefill_request_aborted_after_hand_over_aborts_its_push_but_keeps_its_blocks():
    sched = prefill({"a": [1, 2, 3]})
    req = request("a", {"do_remote_decode": True}, computed=0)
    sched.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    sched.build_connector_meta(step({"a": 40}))
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, ([1, 2, 3],))[0]
    assert sched.meta.abort_send == [("a", "a")]


def test_prefill_request_aborted_before_hand_over_frees_its_blocks_and_tells_the_decode():
    sched = prefill({})
    req = request("a", {"do_remote_decode": True})
    sched.update_state_after_alloc(req, blocks(1), 0)
    assert sched.request_finished(req, ([1],)) == (False, None)
    assert sched.meta.abort_send == [("a", "a")] and not sched.prefills and not sched.live_keys


def test_prefill_refuses_a_taken_transfer_key_and_never_aborts_the_live_owner():
    sched = prefill({"first": [1, 2, 3]})
    first = request("first", {"do_remote_decode": True, "transfer_id": "same"})
    second = request("second", {"do_remote_decode": True, "transfer_id": "same"})
    sched.update_state_after_alloc(first, blocks(1, 2, 3), 0)
    sched.update_state_after_alloc(second, blocks(8, 9, 10), 0)
    assert sched.prefills["second"].state is SendState.REFUSED
    assert "already used by live request 'first'" in sched.prefills["second"].reason
    assert [s.req_id for s in sched.build_connector_meta(step({"first": 40, "second": 40})).send] == ["first"]
    assert sched.request_finished(second, ([8, 9, 10],)) == (False, None)
    # dropped before allocation under the live key: no abort either
    assert sched.request_finished(
        request("third", {"do_remote_decode": True, "transfer_id": "same"}), ([],)
    ) == (
        False,
        None,
    )
    assert not sched.meta.abort_send and sched.live_keys == {"same": "first"}


def test_prefill_request_dropped_before_allocation_tells_the_decode():
    sched = prefill({})
    assert sched.request_finished(request("x-abcdefgh", {"do_remote_decode": True}), ([],)) == (False, None)
    assert sched.meta.abort_send == [("x-abcdefgh", "x")]
    assert sched.request_finished(request("y", None), ([],)) == (False, None)  # not a P/D request
    assert len(sched.meta.abort_send) == 1


def test_manager_or_table_reads_the_bound_manager_and_else_the_table():
    table = {"r": [7, 8]}
    bound: list[Any] = [None]
    source = manager_or_table(lambda: bound[0], lambda rid: (table[rid],))
    assert [list(g) for g in source("r")] == [[7, 8]]  # vLLM < 0.32: no manager bound
    bound[0] = SimpleNamespace(get_block_ids=lambda rid: ([3, 4], [5, 6]))
    assert [list(g) for g in source("r")] == [[3, 4], [5, 6]]  # vLLM >= 0.32, every group


def test_prefill_without_a_manager_reads_blocks_from_the_scheduler_outputs():
    """vLLM < 0.32 (0.29: vLLM Neuron's base) binds no KV cache manager: the blocks of a chunked prompt
    come from the steps' outputs, new blocks appended, a resumed request's table replaced."""
    sched = PrefillScheduler(settings("prefill"))
    req = request("a", {"do_remote_decode": True}, prompt=60)
    other = request("b", None)
    sched.update_state_after_alloc(req, blocks(1, 2), 0)
    sched.update_state_after_alloc(other, blocks(9), 0)
    meta = sched.build_connector_meta(step({"a": 16, "b": 4}, new={"a": [1, 2], "b": [9]}))
    assert not meta.send and sched.table.ids == {"a": [[1, 2]]}  # only requests it pushes are kept
    req.num_computed_tokens = 16
    sched.build_connector_meta(step({"a": 16}, added={"a": [3], "b": None}))
    assert sched.table.ids["a"] == [[1, 2, 3]]
    # preempted and resumed with new blocks: the table is replaced, not appended to
    req.num_computed_tokens = 0
    sched.build_connector_meta(step({"a": 32}, added={"a": [5, 6, 7]}, resumed={"a"}))
    req.num_computed_tokens = 32
    meta = sched.build_connector_meta(step({"a": 28}, added={"a": [8]}))
    assert [(s.block_ids, s.num_tokens) for s in meta.send] == [((5, 6, 7, 8), 60)]
    assert not sched.table.ids  # handed over: the blocks travel in the metadata


def test_prefill_block_table_takes_vllms_snapshot_over_what_it_pieced_together():
    sched = PrefillScheduler(settings("prefill"))
    req = request("a", {"do_remote_decode": True}, prompt=40)
    sched.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    meta = sched.build_connector_meta(step({"a": 40}, new={"a": [1, 2, 9]}, snapshot={"a": [1, 2, 3]}))
    assert [s.block_ids for s in meta.send] == [(1, 2, 3)]
    req = request("b", {"do_remote_decode": True}, prompt=40)
    sched.update_state_after_alloc(req, blocks(4, 5, 6), 0)
    meta = sched.build_connector_meta(step({"b": 40}, new={"b": [4, 5, 9]}, resolved={"b": [4, 5, 6]}))
    assert [s.block_ids for s in meta.send] == [(4, 5, 6)]


def test_prefill_block_table_names_a_request_it_never_saw():
    sched = PrefillScheduler(settings("prefill"))
    req = request("a", {"do_remote_decode": True}, prompt=40)
    sched.update_state_after_alloc(req, blocks(1, 2, 3), 0)
    with pytest.raises(LocalProtocolError, match="no block ids for prefill request 'a'"):
        sched.build_connector_meta(step({"a": 40}))


def test_prefill_request_aborted_while_computing_leaves_no_table_entry():
    sched = PrefillScheduler(settings("prefill"))
    req = request("a", {"do_remote_decode": True}, prompt=60)
    sched.update_state_after_alloc(req, blocks(1, 2), 0)
    sched.build_connector_meta(step({"a": 16}, new={"a": [1, 2]}))
    assert sched.request_finished(req, ([1, 2],)) == (False, None)
    assert not sched.table.ids and not sched.prefills


def streaming_prefill(table: dict[str, list[int]]) -> PrefillScheduler:
    s = ConnectorSettings.from_extra(
        "prefill", "prefill-0", {**EXTRA, "stream": True}, block_size=BLOCK, tp_size=2, pp_size=1
    )
    return PrefillScheduler(s, lambda rid: (table[rid],))  # one KV-cache group


def test_streaming_prefill_reports_each_chunk_then_hands_the_prompt_over():
    sched = streaming_prefill({"a": [4, 5, 6, 7, 8]})
    req = request("a", {"do_remote_decode": True}, prompt=70)
    sched.update_state_after_alloc(req, blocks(4, 5, 6, 7, 8), 0)
    meta = sched.build_connector_meta(step({"a": 24}))
    assert [(r.key, r.block_ids, r.num_tokens) for r in meta.ready] == [("a", (4, 5), 24)] and not meta.send
    req.num_computed_tokens = 24
    meta = sched.build_connector_meta(step({"a": 24}))
    assert [(r.block_ids, r.num_tokens) for r in meta.ready] == [((4, 5, 6), 48)]
    req.num_computed_tokens = 48
    meta = sched.build_connector_meta(step({"a": 22}))
    assert not meta.ready and [(s.block_ids, s.num_tokens) for s in meta.send] == [((4, 5, 6, 7, 8), 70)]
    assert not settings("prefill").stream  # off unless asked for


def test_streaming_prefill_aborted_mid_stream_holds_its_blocks_until_the_push_settled():
    sched = streaming_prefill({"a": [4, 5, 6, 7, 8]})
    req = request("a", {"do_remote_decode": True}, prompt=70)
    sched.update_state_after_alloc(req, blocks(4, 5, 6, 7, 8), 0)
    sched.build_connector_meta(step({"a": 32}))
    req.status = RequestStatus.FINISHED_ABORTED
    hold, answer = sched.request_finished(req, ([4, 5, 6, 7, 8],))
    assert hold and answer is None  # its ranges may be in flight: vLLM keeps the blocks
    assert sched.meta.abort_send == [("a", "a")]
    assert [(s.key, s.block_ids, s.num_tokens) for s in sched.meta.stop] == [("a", (4, 5), 32)]
    assert sched.prefills["a"].state is SendState.SENDING and sched.has_pending_work()
    sched.update_connector_output(SimpleNamespace(finished_sending={"a"}, finished_recving=None))
    assert not sched.prefills and not sched.live_keys


def test_streaming_prefill_aborted_mid_stream_reads_the_blocks_vllm_holds_without_a_manager():
    s = ConnectorSettings.from_extra(
        "prefill", "prefill-0", {**EXTRA, "stream": True}, block_size=BLOCK, tp_size=2, pp_size=1
    )
    sched = PrefillScheduler(s)  # vLLM < 0.32: blocks come from the scheduler outputs
    req = request("a", {"do_remote_decode": True}, prompt=60)
    sched.update_state_after_alloc(req, blocks(1, 2, 3, 4), 0)
    meta = sched.build_connector_meta(step({"a": 32}, new={"a": [1, 2, 3, 4]}))
    assert [(r.block_ids, r.num_tokens) for r in meta.ready] == [((1, 2), 32)]
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, ([1, 2, 3, 4],)) == (True, None)
    assert [(s.block_ids, s.num_tokens) for s in sched.meta.stop] == [((1, 2), 32)]
    assert not sched.table.ids
    # preempted and not rescheduled: vLLM holds nothing, so nothing is kept
    req2 = request("b", {"do_remote_decode": True}, prompt=60)
    sched.update_state_after_alloc(req2, blocks(5, 6, 7, 8), 0)
    sched.build_connector_meta(step({"b": 32}, new={"b": [5, 6, 7, 8]}))
    req2.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req2, ([],)) == (False, None)
    assert ("b", "b") in sched.meta.abort_send and "b" not in sched.prefills


def test_streaming_prefill_preempted_mid_stream_aborts_its_push_and_reports_no_more():
    sched = streaming_prefill({"a": [4, 5, 6, 7, 8]})
    req = request("a", {"do_remote_decode": True}, prompt=70)
    sched.update_state_after_alloc(req, blocks(4, 5, 6, 7, 8), 0)
    sched.build_connector_meta(step({"a": 32}))
    req.num_computed_tokens = 0  # preempted: vLLM freed its blocks and computes it again
    meta = sched.build_connector_meta(step({"a": 48}))
    assert meta.abort_send == [("a", "a")] and not meta.ready
    req.num_computed_tokens = 48
    meta = sched.build_connector_meta(step({"a": 22}))
    assert [s.num_tokens for s in meta.send] == [70]  # the terminal call still comes (its push fails)


# ---- decode ----------------------------------------------------------------------------------------
def test_decode_registers_the_prompts_blocks_with_the_prefills_address():
    sched = DecodeScheduler(settings("decode"))
    req = request("d-12345678", {"do_remote_prefill": True, "transfer_id": "t9", **PREFILL_AT})
    assert sched.get_num_new_matched_tokens(req, 0) == (40, True)
    assert sched.get_num_new_matched_tokens(req, 16) == (0, False)  # a local prefix hit
    sched.update_state_after_alloc(req, blocks(9, 8, 7, 6), 40)
    (item,) = sched.meta.expect
    assert (item.req_id, item.key, item.block_ids, item.num_tokens) == ("d-12345678", "t9", (9, 8, 7), 40)
    assert item.prefill == PrefillAddress("prefill-0", "10.0.0.9", 7000, 2, 1)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # a re-entry computes locally
    meta = sched.build_connector_meta(step({}))
    assert meta.expect == [item] and not sched.meta.expect
    sched.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"d-12345678"}))
    assert not sched.recving and not sched.live_keys


def test_decode_request_finished_while_waiting_for_its_kv_keeps_its_blocks():
    sched = DecodeScheduler(settings("decode"))
    req = request("d", {"do_remote_prefill": True, **PREFILL_AT})
    sched.update_state_after_alloc(req, blocks(1, 2, 3), 40)
    assert sched.request_finished(req, ([1, 2, 3],)) == (True, None)
    assert sched.meta.abort_recv == ["d"] and sched.has_pending_work()


def test_decode_fails_a_request_without_a_prefill_address_or_with_a_taken_key():
    sched = DecodeScheduler(settings("decode"))
    sched.update_state_after_alloc(
        request("a", {"do_remote_prefill": True, "remote_port": 7000}), blocks(1), 40
    )
    first = request("b", {"do_remote_prefill": True, "transfer_id": "k", **PREFILL_AT})
    second = request("c", {"do_remote_prefill": True, "transfer_id": "k", **PREFILL_AT})
    sched.update_state_after_alloc(first, blocks(2, 3, 4), 40)
    sched.update_state_after_alloc(second, blocks(5, 6, 7), 40)
    (missing, taken) = sched.meta.fail_recv
    # the blocks travel with the failure: vLLM < 0.32 learns of a failed load only from its blocks
    assert missing == FailItem("a", "kv_transfer_params lack remote_engine_id, remote_host", (1,))
    assert taken.req_id == "c" and "already used by live request 'b'" in taken.reason
    assert taken.block_ids == (5, 6, 7)
    assert [e.req_id for e in sched.meta.expect] == ["b"]


def test_decode_request_dropped_before_allocation_cancels_the_prefills_hold_unless_the_key_is_live():
    sched = DecodeScheduler(settings("decode"))
    dropped = request("e-12345678", {"do_remote_prefill": True, **PREFILL_AT})
    assert sched.request_finished(dropped, ([],)) == (False, None)
    (cancel,) = sched.meta.cancel_recv
    assert cancel.key == "e" and cancel.prefill == PrefillAddress("prefill-0", "10.0.0.9", 7000, 2, 1)
    live = request("f", {"do_remote_prefill": True, "transfer_id": "k", **PREFILL_AT})
    sched.update_state_after_alloc(live, blocks(1, 2, 3), 40)
    twin = request("g", {"do_remote_prefill": True, "transfer_id": "k", **PREFILL_AT})
    assert sched.request_finished(twin, ([],)) == (False, None)
    incomplete = request("h", {"do_remote_prefill": True, "remote_engine_id": "prefill-0"})
    assert sched.request_finished(incomplete, ([],)) == (False, None)
    assert len(sched.meta.cancel_recv) == 1


def test_decode_takes_an_omitted_pp_size_as_one_and_serves_a_pipeline_parallel_request_locally():
    """vllm-router forwards no pp_size: the registration goes to a PP-1 prefill (the only kind kvpush runs);
    a request that names PP > 1 is refused by name and computed on the decode, never registered."""
    sched = DecodeScheduler(settings("decode"))
    req = request("d-omitted", {"do_remote_prefill": True, **PREFILL_AT})
    sched.update_state_after_alloc(req, blocks(4, 5, 6), 40)
    (item,) = sched.meta.expect
    assert item.prefill.pp_size == 1
    pp2 = request("d-pp2", {"do_remote_prefill": True, "pp_size": 2, **PREFILL_AT})
    assert sched.get_num_new_matched_tokens(pp2, 0) == (0, False)
    sched.update_state_after_alloc(pp2, blocks(7, 8, 9), 40)
    assert [e.req_id for e in sched.meta.expect] == ["d-omitted"]
