"""The head-to-head's arithmetic: load points, bootstrap ratios, the summary table, idle-thread accounting."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvpush.platforms.vllm.tools import bench_vllm


def test_points_from_loads_offer_the_requested_fraction_of_prefill_capacity() -> None:
    points = bench_vllm.points_from_loads({1024: 0.25, 4096: 1.6}, [0.3, 0.85])
    assert points == [(1024, 1.2), (1024, 3.4), (4096, 0.19), (4096, 0.53)]
    for n, q in points:
        t = {1024: 0.25, 4096: 1.6}[n]
        assert any(abs(q * t - load) / load < 0.05 for load in (0.3, 0.85))


@pytest.mark.parametrize("prefill, loads", [({1024: 0.0}, [0.5]), ({1024: 0.2}, [0.0]), ({1024: 0.2}, [2.0])])
def test_points_from_loads_rejects_nonsense(prefill: dict[int, float], loads: list[float]) -> None:
    with pytest.raises(ValueError):
        bench_vllm.points_from_loads(prefill, loads)


def test_bootstrap_ratio_brackets_the_point_estimate_and_separates_real_differences() -> None:
    a = [1.0 + 0.01 * i for i in range(40)]
    b = [2.0 + 0.02 * i for i in range(40)]
    r, lo, hi = bench_vllm.bootstrap_ratio(a, b)
    assert lo <= r <= hi
    assert hi < 1.0  # a is clearly faster than b
    same, lo2, hi2 = bench_vllm.bootstrap_ratio(a, list(reversed(a)))
    assert same == pytest.approx(1.0)
    assert lo2 <= 1.0 <= hi2


def test_summary_rows_carry_offered_load_and_ratios() -> None:
    samples = {
        ("kvpush", 2.0, 1024): {"ttft": [0.10, 0.11, 0.12], "tpot": [0.02, 0.02, 0.02]},
        ("nixl-pull", 2.0, 1024): {"ttft": [0.20, 0.22, 0.24], "tpot": [0.02, 0.03, 0.02]},
    }
    s = bench_vllm._summarize(
        ["kvpush", "nixl-pull"], [(1024, 2.0)], samples, {"kvpush": [0.4]}, {"kvpush": [0.05]}, {1024: 0.25}
    )
    (row,) = s["rows"]
    assert row["offered_prefill_load"] == pytest.approx(0.5)
    assert row["kvpush_over_nixl-pull"][0] == pytest.approx(0.5)
    assert "| 1024 | 2 | 0.50 |" in s["table_md"]


def test_idle_thread_accounting_sees_a_busy_thread_and_an_idle_one(tmp_path: Path) -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin, name="kvpush-busy")
    idle = threading.Thread(target=stop.wait, name="kvpush-idle")
    busy.start()
    idle.start()
    try:
        snap = {
            "role": "prefill",
            "pid": os.getpid(),
            "threads": {"busy": busy.native_id, "idle": idle.native_id},
        }
        (tmp_path / "p-rank0.json").write_text(json.dumps(snap))
        threads = bench_vllm.kvpush_threads(tmp_path)
        assert set(threads) == {"prefill:busy", "prefill:idle"}
        before = {k: bench_vllm._thread_ns(*v) for k, v in threads.items()}
        time.sleep(0.3)
        after = {k: bench_vllm._thread_ns(*v) for k, v in threads.items()}
    finally:
        stop.set()
        busy.join()
        idle.join()
    spent = {k: (after[k] or 0) - (before[k] or 0) for k in threads}
    assert spent["prefill:busy"] > 50_000_000  # spun for most of 0.3 s
    assert spent["prefill:idle"] < 20_000_000
