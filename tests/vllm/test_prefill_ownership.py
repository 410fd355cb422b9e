"""Ownership on the prefill in vLLM: the decode the router dispatched to (kv_transfer_params
decode_engine_id on the prefill leg, which `kvpush proxy` sets) reaches PrefillEndpoint.prefill_done, so a
registration for that request from any other decode engine is refused, whether it came before the
prompt finished or after. The prefill scheduler and worker run as vLLM drives them; the endpoints are the
real engine API (in-memory transport, ZeroMQ side channel), and every byte the named decode gets is
checked."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.v1.request import RequestStatus

    from kvpush.backends.host import HostKVCache
    from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint, RecvResult
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.prefill_scheduler import PrefillScheduler
    from kvpush.platforms.vllm.prefill_worker import PrefillWorker
    from kvpush.transport.memory import MemoryHub
    from tests.endpoint.test_hardening import caches, start_decode, start_prefill
    from tests.endpoint.util import until

BLOCK = 4  # tests.endpoint.test_hardening.caches()
PROMPT = 8  # two blocks


class Bed:
    """A vLLM prefill side (scheduler + worker) over a real PrefillEndpoint, and two decode engines:
    "dec-a", the one the router names, and "dec-b", another engine holding the same key."""

    def __init__(self) -> None:
        self.hub = MemoryHub()
        self.src, self.dst_a = caches()
        _, self.dst_b = caches()
        self.endpoint: PrefillEndpoint = start_prefill(self.hub, self.src)
        self.a: DecodeEndpoint = start_decode(self.hub, self.dst_a, name="A-agent", engine="dec-a")
        self.b: DecodeEndpoint = start_decode(self.hub, self.dst_b, name="B-agent", engine="dec-b")
        self.addr = PrefillAddress("P", *self.endpoint.address)
        self.a.connect(self.addr)
        self.b.connect(self.addr)
        settings = ConnectorSettings.from_extra(
            "prefill", "P", {"idle_wait_ms": 0}, block_size=BLOCK, tp_size=1, pp_size=1
        )
        self.table: dict[str, list[int]] = {}
        self.sched = PrefillScheduler(settings, lambda rid: (self.table[rid],))  # one KV-cache group
        self.worker = PrefillWorker(settings, None)  # type: ignore[arg-type]  # no vLLM config needed
        self.worker.endpoint = self.endpoint
        self.worker.cache = SimpleNamespace(  # type: ignore[assignment]
            ratio=1, kv_written_barrier=lambda: None, layout=self.src.layout
        )

    def prefill(self, rid: str, blocks: list[int], params: dict[str, Any]) -> None:
        """One prompt through the scheduler to the worker's hand-over (end of the forward pass)."""
        req = SimpleNamespace(
            request_id=rid,
            kv_transfer_params=params,
            num_prompt_tokens=PROMPT,
            num_computed_tokens=0,
            status=RequestStatus.RUNNING,
        )
        self.table[rid] = blocks
        self.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
        out = SimpleNamespace(
            num_scheduled_tokens={rid: PROMPT},
            total_num_scheduled_tokens=PROMPT,
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        )
        meta = self.sched.build_connector_meta(out)
        self.worker.end_step(meta)  # type: ignore[arg-type]

    def close(self) -> None:
        for ep in (self.a, self.b, self.endpoint):
            ep.close()


@pytest.fixture
def bed() -> Iterator[Bed]:
    b = Bed()
    try:
        yield b
    finally:
        b.close()


def _result(ep: DecodeEndpoint, key: str) -> RecvResult:
    [r] = [r for r in until(ep.finished, 10.0) if r.request_id == key]
    return r


def _same_kv(src: HostKVCache, src_blocks: list[int], dst: HostKVCache, dst_blocks: list[int]) -> bool:
    layout = src.layout
    return all(
        np.array_equal(src.block_view(layer, kv, s), dst.block_view(layer, kv, d))
        for layer in range(layout.num_layers)
        for kv in range(2)
        for s, d in zip(src_blocks, dst_blocks, strict=True)
    )


def test_a_registration_from_another_decode_before_the_prompt_ends_is_dropped(bed: Bed) -> None:
    bed.b.expect("kvp-1", [1, 2], PROMPT, bed.addr)  # registers first: it would own the request
    time.sleep(0.2)
    bed.prefill(
        "r1-abcdefgh", [3, 4], {"do_remote_decode": True, "transfer_id": "kvp-1", "decode_engine_id": "dec-a"}
    )
    refused = _result(bed.b, "kvp-1")
    assert not refused.ok and "claimed by another" in refused.reason, refused
    bed.a.expect("kvp-1", [5, 6], PROMPT, bed.addr)
    got = _result(bed.a, "kvp-1")
    assert got.ok, got
    assert _same_kv(bed.src, [3, 4], bed.dst_a, [5, 6])
    assert not _same_kv(bed.src, [3, 4], bed.dst_b, [1, 2])


def test_a_registration_from_another_decode_after_the_prompt_ends_is_refused(bed: Bed) -> None:
    bed.prefill(
        "r2-abcdefgh", [7, 8], {"do_remote_decode": True, "transfer_id": "kvp-2", "decode_engine_id": "dec-a"}
    )
    time.sleep(0.2)
    bed.b.expect("kvp-2", [1, 2], PROMPT, bed.addr)
    refused = _result(bed.b, "kvp-2")
    assert not refused.ok and "claimed by another" in refused.reason, refused
    bed.a.expect("kvp-2", [9, 10], PROMPT, bed.addr)
    assert _result(bed.a, "kvp-2").ok
    assert _same_kv(bed.src, [7, 8], bed.dst_a, [9, 10])


def test_without_a_named_decode_the_first_registration_owns_the_request(bed: Bed) -> None:
    """What the named decode changes: with no decode_engine_id (vllm-router sends none), whoever
    registers first gets the KV and the router's real decode is refused."""
    bed.b.expect("kvp-3", [1, 2], PROMPT, bed.addr)
    time.sleep(0.2)
    bed.prefill("r3-abcdefgh", [11, 12], {"do_remote_decode": True, "transfer_id": "kvp-3"})
    assert _result(bed.b, "kvp-3").ok
    assert _same_kv(bed.src, [11, 12], bed.dst_b, [1, 2])
    bed.a.expect("kvp-3", [5, 6], PROMPT, bed.addr)
    late = _result(bed.a, "kvp-3")
    assert not late.ok
