"""Real vLLM (CPU) + real NIXL with streamed push: the prefill's chunked prefill splits each prompt into
several steps (--max-num-batched-tokens 128) and the connector pushes each step's complete blocks
(kv_connector_extra_config stream: true, thresholds 0). Greedy outputs equal a single engine's under
concurrency; a request aborted mid-stream leaks nothing on either side."""

from __future__ import annotations

import os
import time
import urllib.error
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client
from kvpush.platforms.vllm.tools.serve_pd import start_pd
from kvpush.platforms.vllm.tools.tiny_model import build
from tests.vllm.stats_files import read_stats, settled

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MAX_TOKENS = 16
CHUNK = 128  # tokens per prefill step: a 1,000-token prompt takes 8 steps, so 7 ranges move early
LENGTHS = [60, 200, 400, 700, 1000, 30]  # words (about 2 tokens each)
# A prefill step of the tiny model takes ~1 ms; a real model's takes tens. Without a stand-in for that time
# a prompt can be computed before the decode's registration arrives and its ranges leave as one WRITE (a CI
# run under load saw 12 WRITEs for 12 prompts): tests/vllm/slow_prefill sleeps this long per prefill step.
STEP_S = 0.02
SLOW_PREFILL = Path(__file__).with_name("slow_prefill")


@pytest.fixture(scope="module")
def model() -> str:
    return str(build("fast"))


def start_streamed_pd(model: str, logs: Path, streaming: dict):
    """A kvpush P/D pair whose prefill runs chunked prefill (CHUNK tokens a step) with `streaming` keys and
    thresholds 0, each prefill step STEP_S longer (slow_prefill/sitecustomize.py); `stats_dir` and `logs` ride
    on the deployment (shared with test_stream_layers_vllm.py)."""
    stats = logs / "stats"
    base = {"stats_dir": str(stats), "lease_s": 30.0, "ready_timeout_s": 40.0}
    prefill = {**base, **streaming, "stream_min_tokens": 0, "stream_min_bytes": 0}
    chunked = ["--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill"]
    path = os.pathsep.join(p for p in (str(SLOW_PREFILL), os.environ.get("PYTHONPATH", "")) if p)
    slow = {"PYTHONPATH": path, "KVPUSH_TEST_PREFILL_STEP_S": str(STEP_S)}
    kw = {"prefill_extra": prefill, "decode_extra": base, "prefill_args": chunked, "prefill_env": slow}
    dep = start_pd("kvpush", model, logs, **kw)
    dep.stats_dir = stats  # type: ignore[attr-defined]
    dep.logs = logs  # type: ignore[attr-defined]
    return dep


@pytest.fixture(scope="module")
def pd(model: str, tmp_path_factory: pytest.TempPathFactory):
    dep = start_streamed_pd(model, tmp_path_factory.mktemp("vllm-stream-logs"), {"stream": True})
    yield dep
    dep.stop()


def _stats(dep, role: str) -> dict:
    return read_stats(dep.stats_dir, role)


def _wait(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.25)
    return bool(pred())


def _kv_usage(url: str) -> float:
    return client.metric(client.metrics(url), "vllm:kv_cache_usage_perc")


def test_streamed_outputs_equal_single_engine_under_concurrency(pd, single, model: str) -> None:
    prompts = client.make_prompts(12, LENGTHS, seed=21)
    want = client.complete_many(single.url, model, prompts, MAX_TOKENS, concurrency=4)
    got = client.complete_many(pd.url, model, prompts, MAX_TOKENS, concurrency=4)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert len(w) == MAX_TOKENS
        assert g == w, f"prompt {i} ({len(prompts[i].split())} words): streamed P/D {g} != single {w}"
    # both sides' files once they count every push over (a file may lag the client's answers a step)
    p, d = settled(pd.stats_dir, len(prompts))
    assert p["send_bytes"] == d["recv_bytes"]
    assert p["sent_failed"] == 0 and d["recv_failed"] == 0 and p["sent_ok"] >= len(prompts)
    # the prompts moved in ranges: many more WRITEs than requests (one each without streaming)
    # (ranges ready before the decode's registration arrives go out as one WRITE, so the count depends on
    # registration timing: STEP_S per prefill step gives the registration time to arrive first)
    assert p["endpoint"]["writes"] > p["sent_ok"], p["endpoint"]


def test_a_request_aborted_mid_stream_leaks_nothing(pd, model: str) -> None:
    prefill, decode = pd.engines
    before = _stats(pd, "prefill")["endpoint"]["writes"]
    prompt = client.make_prompts(1, [1800], seed=5)[0]  # ~3,600 tokens: ~28 prefill steps
    with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
        client.complete(pd.url, model, prompt, 2000, timeout=0.4)
    assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0), (
        f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
    )
    assert _wait(
        lambda: _stats(pd, "decode")["outstanding"] == 0 and _stats(pd, "prefill")["outstanding"] == 0
    )
    assert _stats(pd, "prefill")["endpoint"]["writes"] > before  # it was streaming when it was cut off
    assert len(client.complete(pd.url, model, "import os", 4)) == 4  # and the pair still serves
