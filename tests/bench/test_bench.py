"""A tiny sweep through `kvpush bench` and `kvpush plot`: result files, schema and summary.

Correctness, not timing: every request completes in every mode, the files carry the keys of
`vllm bench serve`, and summary.json carries a pull/push ratio for each point.
"""

from __future__ import annotations

import json
import os

import pytest

from kvpush.apps.bench.costmodel import CostModel
from kvpush.apps.bench.metrics import REQUIRED_KEYS, summarize
from kvpush.apps.bench.runner import arrivals

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


def test_sorted_descriptor_count_matches_the_planner() -> None:
    import numpy as np

    from kvpush.apps.blocks import BlockPool
    from kvpush.protocol.layout import blocks_for, packed_planes
    from kvpush.protocol.plan import build_plan

    cm = CostModel.load()
    lay = cm.layout("decode")
    src_l, dst_l = packed_planes(lay, 1 << 20), packed_planes(lay, 1 << 40)
    pool_s, pool_d = BlockPool(4096), BlockPool(4096)
    pool_s.age([7, 63, 20], 4, 9000)
    pool_d.age([5, 70, 31], 3, 9000)
    rng = np.random.default_rng(0)
    for n_tok in (16, 17, 1000, 1024, 3000):
        nb = blocks_for(n_tok, 16)
        s, d = pool_s.allocate(nb), pool_d.allocate(nb)
        if n_tok == 3000:
            s = [int(x) for x in rng.permutation(s)]
        plan = build_plan(src_l, dst_l, s, d, n_tok)
        assert cm.sorted_descriptors(s, d, n_tok, lay) == plan.num_descriptors
        assert cm.posted_descriptors(0, s, d, lay) >= plan.num_descriptors
        pool_s.free(s)
        pool_d.free(d)


def test_pool_aging_is_deterministic_and_keeps_every_block() -> None:
    cm = CostModel.load()
    a, b = cm.aged_pool("prefill"), cm.aged_pool("prefill")
    assert a.num_free == b.num_free == cm.layout("prefill").num_blocks
    assert a.allocate(5000) == b.allocate(5000)


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
    from importlib import resources

    from kvpush.cli import main

    # small pools (the default's real-size pools cost seconds to fill, register and age per engine)
    text = resources.files("kvpush.apps.bench").joinpath("qwen3_32b_tp8_h200.toml").read_text()
    text = text.replace("prefill_num_blocks = 217000", "prefill_num_blocks = 2048")
    text = text.replace("decode_num_blocks = 217000", "decode_num_blocks = 2048")
    assert "prefill_num_blocks = 2048" in text and "decode_num_blocks = 2048" in text
    cm_file = tmp_path / "small.toml"
    cm_file.write_text(text)
    out = tmp_path / "results"
    rc = main(
        [
            "bench",
            "--modes",
            "push,pull,pull-threaded",
            "--qps",
            "8",
            "--input-lens",
            "256,1024",
            "--output-len",
            "4",
            "--num-requests",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
            "--cost-model",
            str(cm_file),
            "--base-port",
            "27600",
            "--no-progress",
        ]
    )
    assert rc == 0
    for mode in ("push", "pull", "pull-threaded"):
        for n_in in (256, 1024):
            f = out / f"{mode}_qps8_in{n_in}_out4_iter0.json"
            res = json.loads(f.read_text())
            missing = [k for k in REQUIRED_KEYS if k not in res]
            assert not missing, f"{f.name} lacks {missing}"
            assert res["completed"] == 3 and res["failed"] == 0, res.get("errors")
            assert res["median_ttft_ms"] > 0 and res["median_tpot_ms"] > 0
            assert res["total_output_tokens"] == 3 * 4
            assert res["breakdown_ms"]["descs"] > 0 and set(res["engine_cpu_s"]) == {"prefill", "decode"}
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["points"]) == 2
    for row in summary["points"]:
        for m in ("pull", "pull-threaded"):
            for metric in ("ttft", "tpot"):
                assert row[f"{m}/push_median_{metric}"] > 0
    assert summary["cost_model"]["kv_bytes_scale"] >= 1
    assert summary["transport_impl"] == "kvpush.transport.nixl.NixlTransport"
    assert (out / "table.md").read_text().count("\n") == 2 + 2
    for metric in ("ttft", "tpot"):
        png = tmp_path / f"{metric}.png"
        assert main(["plot", "--results-dir", str(out), "--metric", metric, "--out", str(png)]) == 0
        assert png.stat().st_size > 1000
