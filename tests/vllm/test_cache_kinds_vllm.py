"""Real vLLM (CPU) + real NIXL: the KV-cache kinds of issue 19 through kvpush's connector and proxy.

One module-scoped P/D pair (through the kvpush proxy) and one reference single engine per cache kind,
each with its tiny model built offline (tiny_model.py). Lean on purpose: CI runs this on 2 cores.

MLA (DeepSeek-V2-style, vLLM's CPU_MLA backend, block 16): vLLM's CPU MLA engine itself gives different
greedy outputs when requests share a batch, so each prompt is sent alone, through the pair and to the
single engine, and must match token for token; then 16 concurrent requests must all be pushed, none
recomputed or failed, and leave no block held on either side.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client
from kvpush.platforms.vllm.tools.serve_pd import Deployment, start_pd, start_single
from kvpush.platforms.vllm.tools.tiny_model import build

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MAX_TOKENS = 12
MAX_MODEL_LEN = 4096
CONCURRENCY = 16


def _wait(pred: Any, timeout: float = 30.0, step: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    return pred()


def _stats(stats_dir: Path, role: str) -> dict[str, Any]:
    path = stats_dir / f"kvpush-{role}-rank0.json"
    _wait(path.exists, timeout=10)
    return dict(json.loads(path.read_text()))


def _kv_usage(url: str) -> float:
    return client.metric(client.metrics(url), "vllm:kv_cache_usage_perc")


class Kind:
    """A started P/D pair and reference engine for one tiny model; stopped by the fixture."""

    def __init__(self, variant: str, logs: Path) -> None:
        self.model = str(build(variant))
        self.stats_dir = logs / "stats"
        extra = {"stats_dir": str(self.stats_dir), "lease_s": 30.0, "ready_timeout_s": 40.0}
        self.pd: Deployment = start_pd(
            "kvpush",
            self.model,
            logs,
            max_model_len=MAX_MODEL_LEN,
            prefill_extra=extra,
            decode_extra=extra,
        )
        self.single: Deployment | None = None
        try:
            # after the pair is up, so the start-ups do not fight for the 2 cores
            self.single = start_single(self.model, logs, cores="0", max_model_len=MAX_MODEL_LEN)
        except BaseException:
            self.pd.stop()
            raise

    def stop(self) -> None:
        if self.single is not None:
            self.single.stop()
        self.pd.stop()

    def counters(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return _stats(self.stats_dir, "prefill"), _stats(self.stats_dir, "decode")

    def assert_all_pushed_and_released(self, before: tuple[dict[str, Any], dict[str, Any]], n: int) -> None:
        """n more requests pushed and received, none failed, and both engines back at rest."""
        prefill, decode = self.pd.engines

        def settled() -> bool:
            p, d = self.counters()
            return (
                p["sent_ok"] - before[0]["sent_ok"] >= n
                and d["recv_ok"] - before[1]["recv_ok"] >= n
                and p["outstanding"] == 0
                and d["outstanding"] == 0
            )

        assert _wait(settled), f"not settled: {self.counters()}"
        p, d = self.counters()
        assert p["sent_ok"] - before[0]["sent_ok"] == n and d["recv_ok"] - before[1]["recv_ok"] == n
        assert p["sent_failed"] == before[0]["sent_failed"] and d["recv_failed"] == before[1]["recv_failed"]
        assert p["send_bytes"] - before[0]["send_bytes"] == d["recv_bytes"] - before[1]["recv_bytes"] > 0
        assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0), (
            f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
        )


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory):
    kind = Kind("mla", tmp_path_factory.mktemp("vllm-mla"))
    yield kind
    kind.stop()


def test_mla_each_prompt_alone_equals_the_single_engine_and_16_way_leaks_nothing(mla: Kind) -> None:
    assert mla.single is not None
    # 3 to ~900 tokens: inside one 16-token block, at its edge, across many blocks
    prompts = client.make_prompts(6, [3, 7, 8, 60, 250, 450], seed=19)
    decode = mla.pd.engines[1]
    metrics_before = client.metrics(decode.url)
    before = mla.counters()
    for i, prompt in enumerate(prompts):
        want = client.complete(mla.single.url, mla.model, prompt, MAX_TOKENS)
        got = client.complete(mla.pd.url, mla.model, prompt, MAX_TOKENS)
        assert len(want) == MAX_TOKENS
        assert got == want, f"prompt {i} ({len(prompt.split())} words): P/D {got} != single {want}"
    mla.assert_all_pushed_and_released(before, len(prompts))
    after = client.metrics(decode.url)
    name = "vllm:prompt_tokens_by_source_total"
    pushed = client.metric(after, name, source="external_kv_transfer") - client.metric(
        metrics_before, name, source="external_kv_transfer"
    )
    assert pushed > 500, "the decode computed the prompts itself instead of receiving their KV"

    before = mla.counters()
    many = client.make_prompts(CONCURRENCY, [5, 40, 120, 300], seed=20)
    outs = client.complete_many(mla.pd.url, mla.model, many, MAX_TOKENS, concurrency=CONCURRENCY)
    assert [len(o) for o in outs] == [MAX_TOKENS] * CONCURRENCY
    mla.assert_all_pushed_and_released(before, CONCURRENCY)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
