"""A step without a forward pass still ends on the worker. vLLM < 0.32 runs such a step through
kv_connector_no_forward, which calls get_finished but not wait_for_save; a prefill request aborted
mid-stream gets its terminal call in exactly such a step (nothing else to compute), so without it the push
never ended and vLLM held the request's blocks for good (tests/vllm/test_stream_vllm.py on vLLM 0.29).
The connector runs as vLLM 0.29 drives it, over a real PrefillEndpoint and DecodeEndpoint (test_layer_groups'
bed: in-memory transport, ZeroMQ side channel)."""

from __future__ import annotations

import time
import warnings

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpush.platforms.vllm.connector import KVPushConnector
    from kvpush.platforms.vllm.scheduler import KVPushConnectorMetadata, SendItem
    from tests.vllm.test_layer_groups import Bed, bed  # noqa: F401  (the fixture)


def worker_connector(b: Bed) -> KVPushConnector:
    """The worker-side connector around the bed's worker (vLLM's config is not needed past __init__)."""
    c = KVPushConnector.__new__(KVPushConnector)
    c._sched, c._worker, c._failures_by_blocks, c._ended = None, b.worker, False, None
    c._connector_metadata = None
    return c


def step_029(
    c: KVPushConnector, meta: KVPushConnectorMetadata, finished: frozenset[str] = frozenset()
) -> set[str]:
    """One step as vLLM 0.29's _get_kv_connector_output runs it; wait_for_save only with a forward pass.
    `finished`: the scheduler's finished_req_ids of that step."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    if meta.forward:
        c.wait_for_save()
    sending, _recving = c.get_finished(set(finished))
    c.clear_connector_metadata()
    return set(sending or ())


def test_a_push_aborted_mid_stream_ends_in_a_step_without_a_forward_pass(bed: Bed) -> None:
    c = worker_connector(bed)
    bed.decode.expect("kvp-1", [5, 6], 8, bed.addr)
    time.sleep(0.2)  # registered before the first chunk
    chunk = SendItem("r1", "kvp-1", (3,), 4)
    assert step_029(c, KVPushConnectorMetadata(ready=[chunk])) == set()  # the first chunk streams
    # the client went away: the scheduler's next step has nothing to compute, only the abort and the
    # terminal call on the blocks the stream read
    end = KVPushConnectorMetadata(abort_send=[("r1", "kvp-1")], stop=[chunk], forward=False)
    sent = step_029(c, end, frozenset({"r1"}))  # vLLM finished the request (it holds the blocks)
    deadline = time.monotonic() + 10.0
    while "r1" not in sent and time.monotonic() < deadline:  # idle steps until the push settles
        time.sleep(0.02)
        sent |= step_029(c, KVPushConnectorMetadata(forward=False))
    assert "r1" in sent, "the aborted push never ended: vLLM would hold its blocks"
    assert bed.endpoint.stats()["pending"] == 0


def test_a_step_with_a_forward_pass_ends_once_in_wait_for_save(bed: Bed) -> None:
    c = worker_connector(bed)
    calls: list[KVPushConnectorMetadata] = []
    real = bed.worker.end_step
    bed.worker.end_step = lambda m: (calls.append(m), real(m))[1]  # type: ignore[method-assign]
    meta = KVPushConnectorMetadata()
    c.bind_connector_metadata(meta)
    c.get_finished(set())  # defer_finalize (a draft model): results before wait_for_save
    assert calls == []  # not ended before its forward pass is
    c.wait_for_save()
    c.get_finished(set())
    assert calls == [meta]
