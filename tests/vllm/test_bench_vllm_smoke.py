"""`kvpush bench-vllm` end to end for a few requests: real engines, load from vLLM's own `vllm bench
serve`, and its result file plus kvpush's extras (the proxy's prefill-answered -> first-token times)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


def test_bench_vllm_runs_vllm_bench_serve_and_keeps_the_proxy_timings(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = [
        sys.executable,
        "-m",
        "kvpush.cli",
        "bench-vllm",
        "--connectors",
        "kvpush",
        "--qps",
        "4",
        "--input-lens",
        "200",
        "--output-len",
        "4",
        "--num-prompts",
        "4",
        "--reps",
        "1",
        "--variant",
        "fast",
        "--idle-seconds",
        "0.5",
        "--result-dir",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [point] = list(out.glob("kvpush_qps4_in200_out4_iter0.json"))
    res = json.loads(point.read_text())
    # vLLM's own result file ...
    assert res["completed"] == 4 and res["failed"] == 0, res.get("errors")
    assert res["num_prompts"] == 4 and res["input_lens"] == [200] * 4 and res["output_lens"] == [4] * 4
    assert len(res["ttfts"]) == 4 and res["median_ttft_ms"] > 0
    assert "vllm" in res["load_generator"]
    # ... plus the proxy-side prefill-answered -> first-token times, one per request
    assert len(res["prefill_to_first_token_s"]) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["args"]["connectors"] == "kvpush"
