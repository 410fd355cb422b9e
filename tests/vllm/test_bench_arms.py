"""`kvpush bench-vllm`'s set-ups (arms): every connector serve-pd starts is one, kvpush runs one-piece and
streamed side by side, an arm this kvpush cannot run is refused before any engine starts, and the report
names every kvpush arm's own transfer times."""

from __future__ import annotations

import pytest

from kvpush.errors import KVPushError
from kvpush.platforms.vllm.params import ConnectorSettings
from kvpush.platforms.vllm.tools import bench_report, bench_vllm
from kvpush.platforms.vllm.tools.serve_pd import CONNECTORS


def test_every_connector_is_an_arm_and_kvpush_runs_one_piece_and_streamed() -> None:
    assert {bench_vllm.ARMS[c][0] for c in CONNECTORS} == set(CONNECTORS)
    assert bench_vllm.ARMS["kvpush"] == ("kvpush", {})
    connector, extra = bench_vllm.ARMS["kvpush-streamed"]
    assert connector == "kvpush" and extra == {"stream": True}
    connector, extra = bench_vllm.ARMS["kvpush-layers"]
    assert connector == "kvpush" and extra == {"stream_layers": 8}
    layers = ConnectorSettings.from_extra("prefill", "p", extra, block_size=16, tp_size=1, pp_size=1)
    assert layers.stream and layers.stream_layers == 8
    bench_vllm.check_arm("kvpush-layers")


def test_the_streamed_arm_turns_streaming_on_in_the_connectors_own_settings() -> None:
    _, extra = bench_vllm.ARMS["kvpush-streamed"]
    try:
        settings = ConnectorSettings.from_extra("prefill", "p", extra, block_size=16, tp_size=1, pp_size=1)
    except KVPushError as exc:  # a kvpush without vLLM progressive push: check_arm says so (below)
        with pytest.raises(SystemExit, match="kvpush-streamed: this kvpush refuses"):
            bench_vllm.check_arm("kvpush-streamed")
        pytest.skip(f"this kvpush has no vLLM streamed push yet: {exc}")
    assert getattr(settings, "stream", None) is True
    plain = ConnectorSettings.from_extra("prefill", "p", {}, block_size=16, tp_size=1, pp_size=1)
    assert getattr(plain, "stream", False) is False  # the one-piece arm really is one-piece
    bench_vllm.check_arm("kvpush-streamed")


def test_an_unknown_arm_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="unknown connector 'kvpush-fast'"):
        bench_vllm.check_arm("kvpush-fast")
    for name in CONNECTORS:
        bench_vllm.check_arm(name)


def test_the_report_names_each_kvpush_arms_transfer_times() -> None:
    samples = {
        ("kvpush", 1.0, 1024): {"ttft": [0.30, 0.32], "tpot": [0.02, 0.02], "p2d": [0.05]},
        ("kvpush-streamed", 1.0, 1024): {"ttft": [0.20, 0.22], "tpot": [0.02, 0.02], "p2d": [0.01]},
    }
    arms = ["kvpush", "kvpush-streamed"]
    ready = {"kvpush": [0.010, 0.012], "kvpush-streamed": [0.002, 0.003]}
    s = bench_report._summarize(arms, [(1024, 1.0)], samples, {"kvpush": [0.1]}, ready)
    assert "kvpush registration -> decode-ready: median 11.0 ms" in s["table_md"]
    assert "kvpush-streamed registration -> decode-ready: median 2.5 ms" in s["table_md"]
    (row,) = s["rows"]
    assert row["kvpush_over_kvpush-streamed"][0] == pytest.approx(0.31 / 0.21)
    push = {"kvpush": [0.040], "kvpush-streamed": [0.004]}
    md = bench_report._extras_md(arms, [(1024, 1.0)], samples, {}, {}, push, {}, {})
    assert "kvpush prefill hand-over -> WRITE complete (KV in decode memory): median 40.0 ms" in md
    assert "kvpush-streamed prefill hand-over -> WRITE complete (KV in decode memory): median 4.0 ms" in md
