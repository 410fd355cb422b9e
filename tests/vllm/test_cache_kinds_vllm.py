"""Real vLLM (CPU) + real NIXL: the KV-cache kinds of issue 19 through kvpush's connector and proxy.

One module-scoped P/D pair (through the kvpush proxy) and one reference single engine per cache kind,
each with its tiny model built offline (tiny_model.py). Lean on purpose: CI runs this on 2 cores.

MLA (DeepSeek-V2-style, vLLM's CPU_MLA backend, block 16): vLLM's CPU MLA engine is no token oracle (its
prefill and decode paths disagree; the test says how), so every request's latents are compared by
checksum between the two engines, sent alone and 16 at once; all pushed, none failed, nothing held.

Window kinds (Gemma-3-style hybrid, Mistral-style all-window, gpt-oss-style): 16 prompts at once, token
for token equal to the single engine, lengths around the window and at N % block == block - 1.
"""

from __future__ import annotations

import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client
from kvpush.platforms.vllm.tools.serve_pd import Deployment, start_pd, start_single
from kvpush.platforms.vllm.tools.tiny_model import build

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

# what vLLM 0.29 itself cannot do with these tiny models (docs/vllm.md, "KV-cache kinds")
VLLM_029_CANNOT = {
    "gptoss": "vLLM 0.29 cannot run the float32 gpt-oss-style model (a bf16-only kernel)",
    "window": "vLLM 0.29's decode allocates all-window tables without a block the window needs "
    "(kvpush refuses those requests by name)",
}
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


def _debug_logging(logs: Path) -> Path:
    """A vLLM logging config that turns on kvpush's DEBUG lines (each request's KV checksums on both
    sides: the prefill's at hand-over, the decode's when its KV landed) and keeps vLLM's at WARNING."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(name)s %(levelname)s %(message)s"}},
        "handlers": {"out": handler},
        "loggers": {
            "kvpush.vllm": {"level": "DEBUG", "handlers": ["out"], "propagate": False},
            "vllm": {"level": "WARNING", "handlers": ["out"], "propagate": False},
        },
    }
    path = logs / "debug-logging.json"
    path.write_text(json.dumps(config))
    return path


_SUMS = re.compile(r"kvpush (P|D) (\S+) (?:ok=(\w+) )?blocks .* sums (\[[^\]]*\])")


def checksums(log_path: Path, side: str) -> dict[str, list[float]]:
    """transfer key -> [first layer, last layer] KV sums over the request's tokens, from an engine's
    DEBUG log (the decode's only for requests whose KV arrived)."""
    out = {}
    for m in _SUMS.finditer(log_path.read_text(errors="replace")):
        if m.group(1) == side and m.group(3) in (None, "True"):
            out[m.group(2)] = json.loads(m.group(4))
    return out


class Kind:
    """A started P/D pair and reference engine for one tiny model; stopped by the fixture."""

    def __init__(self, variant: str, logs: Path, reference: bool = True) -> None:
        self.model = str(build(variant))
        self.logs = logs
        self.stats_dir = logs / "stats"
        extra = {"stats_dir": str(self.stats_dir), "lease_s": 30.0, "ready_timeout_s": 40.0}
        env = {} if reference else {"VLLM_LOGGING_CONFIG_PATH": str(_debug_logging(logs))}
        self.pd: Deployment = start_pd(
            "kvpush",
            self.model,
            logs,
            max_model_len=MAX_MODEL_LEN,
            prefill_extra=extra,
            decode_extra=extra,
            prefill_env=env,
            decode_env=env,
        )
        self.single: Deployment | None = None
        if not reference:
            return
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


@pytest.fixture
def mla(tmp_path_factory: pytest.TempPathFactory):
    # function scope: one test each, so no two kinds' engines are ever up at once
    kind = Kind("mla", tmp_path_factory.mktemp("vllm-mla"), reference=False)
    yield kind
    kind.stop()


@pytest.fixture(params=["hybrid", "window", "gptoss"])
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import vllm

    if request.param in VLLM_029_CANNOT and vllm.__version__.startswith("0.29."):
        pytest.skip(VLLM_029_CANNOT[request.param])
    kind = Kind(request.param, tmp_path_factory.mktemp(f"vllm-{request.param}"))
    yield kind
    kind.stop()


def test_mla_latents_arrive_byte_exact_alone_and_16_way_and_nothing_leaks(mla: Kind) -> None:
    """Every request's latents on the decode, when they landed, sum (first and last layer, over the
    request's tokens) to what the prefill's were at hand-over: sent one at a time (3 to 900 tokens,
    inside a block, at its edges, across many) and 16 at once; every request pushed, none failed or
    recomputed, no block held afterwards.

    Why not greedy tokens against a single engine: vLLM's CPU MLA engine disagrees with itself. A
    P/D decode computes the prompt's last position with the decode kernel, a single engine with its
    prefill path (SDPA), and the first tokens differ; pinning that token and comparing the rest still
    parts at some lengths (prompt + 1 = 16 or 32 tokens), the same inputs giving the same wrong answer
    each time, while 47 or 95 match: the kernel's answer depends on more than the request's KV. The
    checksums compare the bytes kvpush moves, which is what it owes."""
    # 3 to 900 tokens: inside one 16-token block, at its edges, across many blocks
    prompts = client.make_prompts(7, [2, 8, 9, 10, 50, 150, 450], seed=19)
    before = mla.counters()
    decode = mla.pd.engines[1]
    metrics_before = client.metrics(decode.url)
    outs = [client.complete(mla.pd.url, mla.model, p, MAX_TOKENS) for p in prompts]
    assert [len(o) for o in outs] == [MAX_TOKENS] * len(prompts)
    mla.assert_all_pushed_and_released(before, len(prompts))
    after = client.metrics(decode.url)
    name = "vllm:prompt_tokens_by_source_total"
    local = client.metric(after, name, source="local_compute") - client.metric(
        metrics_before, name, source="local_compute"
    )
    assert local <= len(prompts), "the decode computed prompts itself instead of receiving their KV"

    before = mla.counters()
    many = client.make_prompts(CONCURRENCY, [5, 40, 120, 300], seed=20)
    outs = client.complete_many(mla.pd.url, mla.model, many, MAX_TOKENS, concurrency=CONCURRENCY)
    assert [len(o) for o in outs] == [MAX_TOKENS] * CONCURRENCY
    mla.assert_all_pushed_and_released(before, CONCURRENCY)

    sent = _wait(lambda: len(s := checksums(mla.logs / "kvpush-prefill.log", "P")) >= 23 and s)
    got = _wait(lambda: len(s := checksums(mla.logs / "kvpush-decode.log", "D")) >= 23 and s)
    assert len(sent) == len(got) == len(prompts) + CONCURRENCY, (len(sent), len(got))
    differ = {k: (sent.get(k), v) for k, v in got.items() if sent.get(k) != v}
    assert not differ, f"latents differ between prefill and decode: {differ}"
    assert all(any(x != 0.0 for x in v) for v in got.values())


def _complete_ids(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    return list(client.post_json(url + "/v1/completions", body, 300)["choices"][0]["token_ids"])


def window_lengths(window: int, block: int) -> list[int]:
    """16 prompt lengths in tokens: inside the window, at it, just past it, and far past it, each long
    one at N % block == block - 1 (the boundary case of issue 19) or next to it."""
    out = {3, 17, window - 1, window, window + 1, 2 * block, 2 * block + 1, 3 * block - 2, 4 * block + window}
    k = 1
    while len(out) < CONCURRENCY:
        out.add(k * block + block - 1)  # the boundary case, at 1, 2, 3, ... blocks
        k += 1
    return sorted(out)


def test_window_and_hybrid_kinds_equal_the_single_engine_under_16_way_concurrency(windowed: Kind) -> None:
    """Gemma-3-style hybrid (full + window groups), all-window (Mistral-style) and gpt-oss-style (window
    and full layers, sinks, MoE): 16 prompts at once through the proxy, from a few tokens to far past the
    window and at the block boundary, each equal to the single engine's answer; every one pushed, none
    failed, nothing held afterwards."""
    assert windowed.single is not None
    prefill_stats, decode_stats = windowed.counters()
    groups = decode_stats["kv_cache_groups"]
    windows = [int(g.split()[1]) for g in groups if g.startswith("window")]
    assert windows, f"no window group in {groups}"
    block = int(decode_stats["vllm_block_size"])
    lengths = window_lengths(max(windows), block)
    text = " ".join(client.make_prompts(1, [6000], seed=41))
    tokenized = client.post_json(
        windowed.single.url + "/tokenize", {"model": windowed.model, "prompt": text}, 60
    )["tokens"]
    assert len(tokenized) > 2 * max(lengths)
    prompts = [tokenized[i * 37 : i * 37 + n] for i, n in enumerate(lengths)]
    with ThreadPoolExecutor(4) as pool:
        want = list(
            pool.map(lambda p: _complete_ids(windowed.single.url, windowed.model, p, MAX_TOKENS), prompts)
        )
    before = (prefill_stats, decode_stats)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = list(pool.map(lambda p: _complete_ids(windowed.pd.url, windowed.model, p, MAX_TOKENS), prompts))
    for n, w, g in zip(lengths, want, got, strict=True):
        assert len(w) == MAX_TOKENS
        assert g == w, f"{n} tokens (block {block}, windows {windows}): P/D {g} != single {w}"
    windowed.assert_all_pushed_and_released(before, len(prompts))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
