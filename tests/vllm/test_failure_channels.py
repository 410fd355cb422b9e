"""How a failed receive reaches vLLM, driven as each vLLM version's worker drives the connector, without
an engine: vLLM < 0.32 (0.29 is vLLM Neuron 2.33's base) calls get_finished and then
get_block_ids_with_load_errors, its only failure channel; vLLM >= 0.32 calls get_transfer_results
(failed_recving) and must not also see the blocks. Every failure kind is covered: one the decode
scheduler decided (no prefill address), one the worker refused (a key in use), one the endpoint reported."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpush.endpoint import PrefillAddress
    from kvpush.errors import LayoutError
    from kvpush.platforms.vllm import connector as connector_module
    from kvpush.platforms.vllm.connector import KVPushConnector
    from kvpush.platforms.vllm.decode_worker import DecodeWorker
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.scheduler import FailItem, KVPushConnectorMetadata, RecvItem

PREFILL = PrefillAddress("prefill-0", "10.0.0.9", 7000, 1, 1)


class Endpoint:
    """The DecodeEndpoint calls the worker makes; results are queued by the test."""

    def __init__(self) -> None:
        self.expected: list[str] = []
        self.results: list[Any] = []

    def expect(self, key: str, blocks: Any, num_tokens: int, prefill: PrefillAddress) -> None:
        if key == "refused":
            raise LayoutError(f"{key}: block 5 of the table is -1 (no block) but the window needs it")
        self.expected.append(key)

    def finished(self) -> list[Any]:
        out, self.results = self.results, []
        return out


def connector() -> tuple[KVPushConnector, Endpoint]:
    """A decode worker's connector, its vLLM config and KV cache probing left out."""
    settings = ConnectorSettings.from_extra(
        "decode", "decode-0", {"idle_wait_ms": 0}, block_size=16, tp_size=1, pp_size=1
    )
    worker = DecodeWorker(settings, vllm_config=None)  # type: ignore[arg-type]
    endpoint = Endpoint()
    worker.endpoint = endpoint  # type: ignore[assignment]
    worker.cache = SimpleNamespace(ratio=1, layout=SimpleNamespace(block_size=16))  # type: ignore[assignment]
    conn = KVPushConnector.__new__(KVPushConnector)
    conn._sched, conn._worker, conn._failures_by_blocks = None, worker, False
    conn._connector_metadata, conn._ended = None, None  # what vLLM's base and our __init__ set
    return conn, endpoint


def step_with_three_failures(conn: KVPushConnector, endpoint: Endpoint) -> None:
    meta = KVPushConnectorMetadata(
        expect=[RecvItem("ok", "k1", (1, 2), 20, PREFILL), RecvItem("twin", "k1", (3, 4), 20, PREFILL)],
        fail_recv=[FailItem("noaddr", "kv_transfer_params lack remote_host", (5, 6, 7))],
    )
    meta2 = KVPushConnectorMetadata(expect=[RecvItem("lost", "k2", (8,), 10, PREFILL)])
    assert conn._worker is not None
    conn._worker.start_step(meta)
    conn._worker.start_step(meta2)
    endpoint.results = [
        SimpleNamespace(request_id="k1", ok=True, nbytes=64, reason="", ready_at=0.0),
        SimpleNamespace(request_id="k2", ok=False, nbytes=0, reason="lease expired", ready_at=0.0),
    ]


def test_before_vllm_0_32_failures_reach_vllm_as_invalid_blocks():
    conn, endpoint = connector()
    step_with_three_failures(conn, endpoint)
    sending, recving = conn.get_finished(set())
    assert sending is None and recving == {"ok", "twin", "noaddr", "lost"}
    # every block of each failed request, none of the one that arrived
    assert conn.get_block_ids_with_load_errors() == {3, 4, 5, 6, 7, 8}
    assert conn.get_block_ids_with_load_errors() == set()  # reported once


@pytest.mark.skipif(
    connector_module.KVConnectorTransferResults is None, reason="vLLM < 0.32 has no get_transfer_results"
)
def test_from_vllm_0_32_failures_go_in_failed_recving_and_no_block_is_invalidated():
    conn, endpoint = connector()
    step_with_three_failures(conn, endpoint)
    results = conn.get_transfer_results(set())
    assert results.finished_recving == {"ok", "twin", "noaddr", "lost"}
    assert results.failed_recving == {"twin", "noaddr", "lost"}
    assert conn.get_block_ids_with_load_errors() == set()


def test_a_table_the_endpoint_refuses_fails_that_request_and_not_the_engine():
    """A window-group table without a block the window needs (what kvpush saw on vLLM 0.29 while it
    counted an all-window group's 32-token blocks as 128): expect() raises LayoutError on the engine
    thread. That request fails (its real blocks invalid), the others go on."""
    conn, endpoint = connector()
    assert conn._worker is not None
    table = ((1, 2, 3), (-1, -1, 4))
    conn._worker.start_step(
        KVPushConnectorMetadata(
            expect=[
                RecvItem("refused-1", "refused", table, 40, PREFILL),
                RecvItem("ok", "k1", (5,), 10, PREFILL),
            ]
        )
    )
    assert endpoint.expected == ["k1"]
    endpoint.results = [SimpleNamespace(request_id="k1", ok=True, nbytes=64, reason="", ready_at=0.0)]
    sending, recving = conn.get_finished(set())
    assert recving == {"refused-1", "ok"}
    assert conn.get_block_ids_with_load_errors() == {1, 2, 3, 4}
