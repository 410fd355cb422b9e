"""Layer-group push on the prefill (extra config `stream_layers`): the worker's save_kv_layer hook reports
each completed group of layers with kv_ready, so those layers' WRITEs land while the rest of the forward
pass computes. The worker runs as vLLM drives it (start_load_kv -> save_kv_layer per layer ->
wait_for_save) over a real PrefillEndpoint and DecodeEndpoint (in-memory transport, ZeroMQ side channel),
and every byte is checked. tests/vllm/test_stream_vllm.py runs it on real vLLM."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpush.endpoint import DecodeEndpoint, PrefillAddress, PrefillEndpoint, RecvResult
    from kvpush.errors import ConfigError
    from kvpush.platforms.vllm.layer_groups import LayerGroups
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.prefill_worker import PrefillWorker
    from kvpush.platforms.vllm.scheduler import KVPushConnectorMetadata, SendItem
    from kvpush.transport.memory import MemoryHub
    from tests.endpoint.test_hardening import caches, start_decode, start_prefill
    from tests.endpoint.util import until

NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]  # GEO: 2 layers
PROMPT = 8  # two blocks of 4


def test_a_group_completes_when_all_its_layers_are_saved_in_any_order() -> None:
    names = [f"l{i}" for i in range(7)]
    g = LayerGroups(names, 3)
    assert g.bounds == [(0, 3), (3, 6), (6, 7)]
    assert g.saved("l2") is None and g.saved("l0") is None
    assert g.saved("l2") is None  # a repeat completes nothing
    assert g.saved("shared-kv-layer") is None  # not in the cache
    assert g.saved("l1") == (0, 3)
    assert g.saved("l6") == (6, 7)  # the short last group
    assert g.saved("l4") is None and g.saved("l3") is None and g.saved("l5") == (3, 6)
    g.reset()
    assert g.saved("l1") is None and g.saved("l0") is None and g.saved("l2") == (0, 3)


def test_stream_layers_turns_streaming_on_and_refuses_what_is_not_a_layer_count() -> None:
    s = ConnectorSettings.from_extra(
        "prefill", "P", {"stream_layers": 4}, block_size=16, tp_size=1, pp_size=1
    )
    assert s.stream and s.stream_layers == 4
    off = ConnectorSettings.from_extra("prefill", "P", {}, block_size=16, tp_size=1, pp_size=1)
    assert not off.stream and off.stream_layers == 0
    for bad in (-1, "4", True, 1.5):
        with pytest.raises(ConfigError, match="stream_layers"):
            ConnectorSettings.from_extra(
                "prefill", "P", {"stream_layers": bad}, block_size=16, tp_size=1, pp_size=1
            )


class Bed:
    def __init__(self) -> None:
        self.hub = MemoryHub()
        self.src, self.dst = caches()
        self.endpoint: PrefillEndpoint = start_prefill(
            self.hub, self.src, stream_min_tokens=0, stream_min_bytes=0
        )
        self.decode: DecodeEndpoint = start_decode(self.hub, self.dst)
        self.addr = PrefillAddress("P", *self.endpoint.address)
        self.decode.connect(self.addr)
        settings = ConnectorSettings.from_extra(
            "prefill", "P", {"idle_wait_ms": 0, "stream_layers": 1}, block_size=4, tp_size=1, pp_size=1
        )
        self.worker = PrefillWorker(settings, None)  # type: ignore[arg-type]  # no vLLM config needed
        self.worker.endpoint = self.endpoint
        self.worker.cache = SimpleNamespace(  # type: ignore[assignment]
            ratio=1, kv_written_barrier=self.barrier, layout=self.src.layout
        )
        self.worker.groups = LayerGroups(NAMES, settings.stream_layers)
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1

    def landed(self, layer: int, src: list[int], dst: list[int]) -> bool:
        return all(
            np.array_equal(self.src.block_view(layer, kv, s), self.dst.block_view(layer, kv, d))
            for kv in range(2)
            for s, d in zip(src, dst, strict=True)
        )

    def close(self) -> None:
        self.decode.close()
        self.endpoint.close()


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


def _wait(pred, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def test_each_layer_group_lands_during_the_forward_pass_and_the_decode_is_told_once(bed: Bed) -> None:
    bed.decode.expect("kvp-1", [5, 6], PROMPT, bed.addr)
    time.sleep(0.2)  # the registration is there before the prefill computes
    meta = KVPushConnectorMetadata(send=[SendItem("r1", "kvp-1", (3, 4), PROMPT)])
    bed.worker.save_kv_layer(meta, NAMES[0])  # the forward pass runs before start_load_kv (vLLM 0.32)
    assert _wait(lambda: bed.landed(0, [3, 4], [5, 6])), "layer 0 did not move before the step ended"
    assert not bed.landed(1, [3, 4], [5, 6])  # layer 1 is still "computing": nothing of it was read
    assert not bed.decode.finished()  # one notification, after everything landed
    bed.worker.save_kv_layer(meta, NAMES[1])
    bed.worker.end_step(meta)
    got = _result(bed.decode, "kvp-1")
    assert got.ok, got
    assert bed.landed(0, [3, 4], [5, 6]) and bed.landed(1, [3, 4], [5, 6])
    assert bed.worker.layer_ranges == 2 and bed.barriers >= 2  # one barrier per group (and the hand-off)
    assert bed.endpoint.stats()["writes"] >= 2  # the groups moved as separate WRITEs


def test_a_prompt_aborted_in_its_step_gets_no_layer_range(bed: Bed) -> None:
    """Preempted mid-stream: vLLM freed its blocks and may have handed them to this very step, so
    nothing may be read from them for the old request; its abort comes first in wait_for_save."""
    bed.decode.expect("kvp-2", [7, 8], PROMPT, bed.addr)
    time.sleep(0.2)
    meta = KVPushConnectorMetadata(
        send=[SendItem("r2", "kvp-2", (9, 10), PROMPT)], abort_send=[("r2", "kvp-2")]
    )
    for name in NAMES:
        bed.worker.save_kv_layer(meta, name)
    assert bed.worker.layer_ranges == 0
    bed.worker.end_step(meta)
    got = _result(bed.decode, "kvp-2")
    assert not got.ok, got
    assert not bed.landed(0, [9, 10], [7, 8])
