"""The held-too-long invariant of both workers: a request still held past its bound is named in the log
with its state (rate limited); requests within their bound, or settled, never are. No engine: each
worker's per-request records are driven as vLLM drives them, with an endpoint that reports nothing."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpush.endpoint import PrefillAddress, RecvResult
    from kvpush.platforms.vllm.decode_worker import DecodeWorker
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.prefill_worker import PrefillWorker
    from kvpush.platforms.vllm.scheduler import KVPushConnectorMetadata, RecvItem, SendItem

EXTRA = {"host": "127.0.0.1", "port": 7100, "idle_wait_ms": 0, "lease_s": 10.0, "ready_timeout_s": 20.0}
PREFILL = PrefillAddress("p0", "127.0.0.1", 7000, 1, 1)


class SilentEndpoint:
    """Takes every call and reports nothing unless told: a request it holds stays held."""

    def __init__(self) -> None:
        self.results: list[Any] = []

    def expect(self, *args: Any) -> None: ...
    def abort(self, *args: Any) -> None: ...
    def cancel(self, *args: Any) -> None: ...
    def prefill_done(self, *args: Any, **kw: Any) -> None: ...

    def finished(self) -> list[Any]:
        out, self.results = self.results, []
        return out

    def describe(self, key: str) -> str:
        return f"attempt 0 ending; prefill rank 0 expected (key {key})"

    def stats(self) -> dict[str, int]:
        return {}


def worker(cls: Any, role: str) -> Any:
    w = cls(ConnectorSettings.from_extra(role, f"{role}-0", EXTRA, block_size=16, tp_size=1, pp_size=1), None)
    w.endpoint = SilentEndpoint()
    w.cache = SimpleNamespace(ratio=1, kv_written_barrier=lambda: None, layout=None)
    return w


def overdue_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "held longer than their bound" in r.getMessage()]


def test_decode_names_a_stuck_request_with_its_state_and_is_quiet_otherwise(caplog):
    caplog.set_level(logging.WARNING, logger="kvpush.vllm")
    w = worker(DecodeWorker, "decode")
    assert w.overdue.bound_s == 20.0 + 10.0 + 1.0 + 2.0  # the fence (ready + WRITE bound) + slack
    meta = KVPushConnectorMetadata(
        expect=[RecvItem("req-a", "kvp-a", (1, 2), 20, PREFILL), RecvItem("req-b", "kvp-b", (3,), 5, PREFILL)]
    )
    w.start_step(meta)
    w.start_step(KVPushConnectorMetadata(abort_recv=["req-a"]))
    t0 = w.by_key["kvp-a"].expected_at
    # b settles normally; a's abort is never confirmed
    w.endpoint.results.append(RecvResult("kvp-b", True, (3,), "", 64, t0 + 1))
    w.collect(set())
    assert w.check_overdue(t0 + 5) == [] and overdue_lines(caplog) == []  # within its bound: quiet
    [held] = w.check_overdue(t0 + w.overdue.bound_s + 1)
    assert held.key == "kvp-a" and held.req_id == "req-a"
    [line] = overdue_lines(caplog)
    assert "kvpush decode: 1 request(s)" in line and "kvp-a (vLLM req-a" in line
    assert "aborted by vLLM, waiting for the prefill to confirm" in line
    assert "endpoint: attempt 0 ending; prefill rank 0 expected" in line
    # still held: named again, but not more than once per every_s
    w.check_overdue(t0 + w.overdue.bound_s + 5)
    assert len(overdue_lines(caplog)) == 1
    w.check_overdue(t0 + w.overdue.bound_s + 1 + w.overdue.every_s)
    assert len(overdue_lines(caplog)) == 2
    # once the endpoint reports it, nothing is held and nothing is logged
    w.endpoint.results.append(RecvResult("kvp-a", False, (1, 2), "aborted", 0, t0 + 100))
    w.collect(set())
    assert w.outstanding() == 0
    assert w.check_overdue(t0 + 1000) == [] and len(overdue_lines(caplog)) == 2


def test_prefill_names_a_push_the_endpoint_never_settles(caplog):
    caplog.set_level(logging.WARNING, logger="kvpush.vllm")
    w = worker(PrefillWorker, "prefill")
    assert w.overdue.bound_s == 10.0 + 10.0 + 1.0 + 2.0  # lease + WRITE bound + slack
    w.end_step(KVPushConnectorMetadata(send=[SendItem("req-p", "kvp-p", (4, 5), 20)]))
    t0 = w.by_key["kvp-p"].handed_at
    w.collect({"req-p"})  # vLLM finished it; the push thread still holds its blocks
    assert w.check_overdue(t0 + 5) == [] and overdue_lines(caplog) == []
    [held] = w.check_overdue(t0 + w.overdue.bound_s + 1)
    assert held.key == "kvp-p"
    [line] = overdue_lines(caplog)
    assert "kvpush prefill: 1 request(s)" in line and "finished in vLLM; endpoint:" in line
