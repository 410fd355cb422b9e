"""A tiny sweep through `kvpush bench` and `kvpush plot`: result files, schema and summary.

Correctness, not timing: every request completes in every mode, the files carry the keys of
`vllm bench serve`, and summary.json carries a pull/push ratio for each point.
"""

from __future__ import annotations

import json
import os

import pytest

from kvpush.bench.costmodel import CostModel
from kvpush.bench.metrics import REQUIRED_KEYS, summarize
from kvpush.bench.runner import arrivals

pytestmark = pytest.mark.e2e


def test_cost_model_is_sourced_and_scaled() -> None:
    cm = CostModel.load()
    lay = cm.layout("decode")
    # real per-rank geometry: 64 layers x K,V, one KV head, block 16 -> descriptor counts are real
    assert (lay.num_layers, lay.kv_per_layer, lay.num_kv_heads, lay.block_size) == (64, 2, 1, 16)
    assert cm.real_bytes_per_token == 64 * 2 * 128 * 2
    assert lay.bytes_per_token * cm.kv_bytes_scale == cm.real_bytes_per_token
    assert 0.004 < cm.decode_step_s(1, 1000) < 0.007  # seed: light-load TPOT 5.6-5.8 ms
    assert cm.prefill_alone_s(16000) > cm.prefill_alone_s(1000)


def test_posted_descriptors_in_order_vs_sorted() -> None:
    cm = CostModel.load()
    lay = cm.layout("decode")
    planes = lay.num_layers * lay.kv_per_layer
    assert cm.posted_descriptors(0, [0, 1, 2], [5, 6, 7], lay) == planes
    assert cm.posted_descriptors(0, [2, 1, 0], [7, 6, 5], lay) == 3 * planes  # descending: no merge


def test_metrics_and_arrivals() -> None:
    a = arrivals(4.0, 100, seed=1)
    assert a[0] == 0 and (a[1:] >= a[:-1]).all() and (a == arrivals(4.0, 100, seed=1)).all()
    recs = [{"arrival": 0.0, "tokens": [0.1, 0.2, 0.3]}, {"arrival": 1.0, "tokens": [], "error": "x"}]
    res = summarize(recs, 2.0, 10)
    assert all(k in res for k in REQUIRED_KEYS)
    assert res["completed"] == 1 and res["failed"] == 1
    assert res["median_ttft_ms"] == pytest.approx(100.0) and res["median_tpot_ms"] == pytest.approx(100.0)


@pytest.mark.timeout(240)
def test_tiny_sweep_writes_results_and_summary(tmp_path) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvpush.cli import main

    out = tmp_path / "results"
    rc = main(["bench", "--modes", "push,pull,pull-threaded", "--qps", "4", "--input-lens", "256,1024",
               "--output-len", "4", "--num-requests", "3", "--warmup", "1", "--out", str(out),
               "--base-port", "27600", "--no-progress"])
    assert rc == 0
    for mode in ("push", "pull", "pull-threaded"):
        for n_in in (256, 1024):
            f = out / f"{mode}_qps4_in{n_in}_out4_iter0.json"
            res = json.loads(f.read_text())
            missing = [k for k in REQUIRED_KEYS if k not in res]
            assert not missing, f"{f.name} lacks {missing}"
            assert res["completed"] == 3 and res["failed"] == 0, res.get("errors")
            assert res["median_ttft_ms"] > 0 and res["median_tpot_ms"] > 0
            assert res["total_output_tokens"] == 3 * 4
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["points"]) == 2
    for row in summary["points"]:
        for m in ("pull", "pull-threaded"):
            for metric in ("ttft", "tpot"):
                assert row[f"{m}/push_median_{metric}"] > 0
    assert summary["cost_model"]["kv_bytes_scale"] >= 1
    for metric in ("ttft", "tpot"):
        png = tmp_path / f"{metric}.png"
        assert main(["plot", "--results-dir", str(out), "--metric", metric, "--out", str(png)]) == 0
        assert png.stat().st_size > 1000
