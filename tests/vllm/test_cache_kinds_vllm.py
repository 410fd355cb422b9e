"""Real vLLM (CPU) + real NIXL: the KV-cache kinds of issue 19 through kvpush's connector and proxy.

One module-scoped P/D pair (through the kvpush proxy) and one reference single engine per cache kind,
each with its tiny model built offline (tiny_model.py). Lean on purpose: CI runs this on 2 cores.

MLA (DeepSeek-V2-style, vLLM's CPU_MLA backend, block 16): every engine (pair and reference) runs with
vLLM's CPU rotary-embedding op off (MLA_ENGINE_ARGS: that op ropes MLA's strided query and key views
wrongly, so a CPU MLA engine otherwise disagrees with itself); then each prompt alone and 16 at once is
token for token the single engine's answer, and every request's latents are compared by checksum between
the two engines; all pushed, none failed, nothing held.

Window kinds (Gemma-3-style hybrid, Mistral-style all-window, gpt-oss-style): 16 prompts at once, token
for token equal to the single engine, lengths around the window and at N % block == block - 1.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
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

# the model each window kind runs on vLLM 0.29, where it differs: 0.29's CPU attention kernel takes
# attention sinks in bf16 only (the float32 gpt-oss-style model fails in cpu_attention_with_kv_cache with
# "expected scalar type BFloat16 but found Float"), so the same weights in bf16; the reference engine and
# the P/D pair run the same one (docs/vllm.md, "KV-cache kinds")
VLLM_029_VARIANT = {"gptoss": "gptoss-bf16"}
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

    def __init__(
        self,
        variant: str,
        logs: Path,
        debug: bool = False,
        engine_args: list[str] | None = None,
        reference: Callable[[], Deployment] | None = None,
    ) -> None:
        """debug: the pair logs kvpush's DEBUG lines (each request's KV checksums on both sides);
        engine_args: given to all three engines; reference: gets a shared reference engine configured
        so (called once the pair is up; not stopped here) in place of one of this kind's own."""
        self.variant = variant
        self.model = str(build(variant))
        self.logs = logs
        self.stats_dir = logs / "stats"
        extra = {"stats_dir": str(self.stats_dir), "lease_s": 30.0, "ready_timeout_s": 40.0}
        env = {"VLLM_LOGGING_CONFIG_PATH": str(_debug_logging(logs))} if debug else {}
        args = list(engine_args or ())
        self.pd: Deployment = start_pd(
            "kvpush",
            self.model,
            logs,
            max_model_len=MAX_MODEL_LEN,
            prefill_extra=extra,
            decode_extra=extra,
            prefill_env=env,
            decode_env=env,
            prefill_args=args,
            decode_args=args,
        )
        self.own_single = reference is None
        try:
            # after the pair is up, so the start-ups do not fight for the 2 cores
            if reference is not None:
                self.single = reference()
            else:
                self.single = start_single(
                    self.model, logs, cores="0", max_model_len=MAX_MODEL_LEN, engine_args=args
                )
        except BaseException:
            self.pd.stop()
            raise

    def stop(self) -> None:
        if self.own_single:
            self.single.stop()
        self.pd.stop()

    def assert_latents_landed(self, total: int) -> None:
        """Every one of the `total` requests of this pair (debug=True) logged its KV sums on both engines,
        they are equal, and none is all zeros."""
        sent = _wait(lambda: len(s := checksums(self.logs / "kvpush-prefill.log", "P")) >= total and s)
        got = _wait(lambda: len(s := checksums(self.logs / "kvpush-decode.log", "D")) >= total and s)
        assert len(sent) == len(got) == total, (len(sent), len(got))
        differ = {k: (sent.get(k), v) for k, v in got.items() if sent.get(k) != v}
        assert not differ, f"latents differ between prefill and decode: {differ}"
        assert all(any(x != 0.0 for x in v) for v in got.values())

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


# vLLM's CPU rotary-embedding op (`_C.rotary_embedding`) reads MLA's strided views (the rope half of each
# query head, k_pe sliced out of the latent projection) as if contiguous: its results depend on the other
# tokens in the step, so a CPU MLA engine's tokens change with the prompt's length, the batch and prefill
# vs decode. Off, vLLM ropes in PyTorch (docs/vllm.md, "KV-cache kinds").
# The backend is named: on a host with AMX tiles vLLM (0.29 and 0.32) picks AMX_MLA, which loads only
# bf16/fp16/int8 weights ("expect weight to be bfloat16, ...": these float32 models never start); CPU_MLA
# is the backend these tests check kvpush against on every host.
MLA_ENGINE_ARGS = [
    "--compilation-config",
    json.dumps({"custom_ops": ["-rotary_embedding"]}),
    "--attention-backend",
    "CPU_MLA",
]


@pytest.fixture
def mla(tmp_path_factory: pytest.TempPathFactory, mla_reference: Callable[[], Deployment]):
    # function scope: one test each, so no two kinds' engines are ever up at once; the reference is the
    # session's shared MLA engine (conftest.py; test_mla_tp_vllm.py compares with it too)
    logs = tmp_path_factory.mktemp("vllm-mla")
    kind = Kind("mla", logs, debug=True, engine_args=MLA_ENGINE_ARGS, reference=mla_reference)
    yield kind
    kind.stop()


@pytest.fixture
def mla_amx(tmp_path_factory: pytest.TempPathFactory):
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM picks AMX_MLA only on a CPU with AMX tiles; this one has none")
    # vLLM's own choice of backend (AMX_MLA here), so bf16 weights: AMX_MLA loads no float32 ones
    args = MLA_ENGINE_ARGS[:2]
    kind = Kind("mla-bf16", tmp_path_factory.mktemp("vllm-mla-amx"), debug=True, engine_args=args)
    yield kind
    kind.stop()


@pytest.fixture(params=["hybrid", "window", "gptoss"])
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import vllm

    variant = request.param
    if vllm.__version__.startswith("0.29."):
        variant = VLLM_029_VARIANT.get(variant, variant)
    kind = Kind(variant, tmp_path_factory.mktemp(f"vllm-{request.param}"))
    yield kind
    kind.stop()


def mla_lengths(block: int) -> list[int]:
    """16 prompt lengths in tokens: inside one block, one short of, at and one past block boundaries
    (1, 2 and 6 blocks), and across many blocks."""
    edges = [n for k in (1, 2, 6) for n in (k * block - 1, k * block, k * block + 1)]
    return sorted({3, 7, *edges, 47, 150, 450, 900, 1000})[:CONCURRENCY]


def test_mla_equals_the_single_engine_alone_and_16_way_latents_byte_exact_nothing_leaks(mla: Kind) -> None:
    """16 prompts (3 to 1,000 tokens: inside a block, one short of, at and one past block boundaries,
    across many) each sent alone, then all 16 at once, through the proxy: token for token the single
    engine's answer to it alone; every request's latents on the decode, when they landed, sum (first and
    last layer, over the request's tokens) to what the prefill's were at hand-over; every request pushed,
    none failed or recomputed, no block held afterwards.

    A P/D decode computes the prompt's last position with vLLM's MLA decode kernel (one query over the
    pushed latents), the single engine with its prefill path; with the rotary op off (MLA_ENGINE_ARGS)
    the two agree. With it on, no CPU MLA engine agrees with itself (a prompt alone, in a batch, or
    extended by its own first token gives other tokens), and kvpush P/D was checked against vLLM's own
    NixlConnector P/D instead (equal for every prompt alone; docs/vllm.md)."""
    block = int(mla.counters()[1]["vllm_block_size"])
    assert block == 16
    lengths = mla_lengths(block)
    prompts, want = prompts_and_answers(mla.single.url, mla.model, lengths, words=6000, seed=19)

    before = mla.counters()
    decode = mla.pd.engines[1]
    metrics_before = client.metrics(decode.url)
    for n, p, w in zip(lengths, prompts, want, strict=True):
        got = _complete_ids(mla.pd.url, mla.model, p, MAX_TOKENS)
        assert got == w, f"{n} tokens alone: P/D {got} != single {w}"
    mla.assert_all_pushed_and_released(before, len(prompts))
    after = client.metrics(decode.url)
    name = "vllm:prompt_tokens_by_source_total"
    local = client.metric(after, name, source="local_compute") - client.metric(
        metrics_before, name, source="local_compute"
    )
    assert local <= len(prompts), "the decode computed prompts itself instead of receiving their KV"

    before = mla.counters()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = list(pool.map(lambda p: _complete_ids(mla.pd.url, mla.model, p, MAX_TOKENS), prompts))
    for n, g, w in zip(lengths, got, want, strict=True):
        assert g == w, f"{n} tokens, 16 at once: P/D {g} != single {w}"
    mla.assert_all_pushed_and_released(before, CONCURRENCY)

    mla.assert_latents_landed(len(prompts) + CONCURRENCY)


def test_mla_on_amx_equals_the_single_engine_and_its_latents_land_byte_exact(mla_amx: Kind) -> None:
    """What an MLA model served on a recent Xeon gets by default: vLLM's AMX_MLA backend (block 128, bf16).
    Prompts around its block boundaries and past several blocks, each alone, then all at once: token for
    token the single engine's answer alone (a bf16 prompt whose concurrent answer differs, a batch effect
    vLLM has without kvpush too, must equal it when sent alone through P/D); every request's latents sum to
    the same on both engines; every request pushed, none failed, no block held afterwards."""
    kind = mla_amx
    assert kind.counters()[1]["kv_cache_groups"] == ["MLA latent"]
    block = int(kind.counters()[1]["vllm_block_size"])
    lengths = sorted({3, block - 1, block, block + 1, 2 * block + 1, 900})
    prompts, want = prompts_and_answers(kind.single.url, kind.model, lengths, words=6000, seed=23)
    before = kind.counters()
    for n, p, w in zip(lengths, prompts, want, strict=True):
        got = _complete_ids(kind.pd.url, kind.model, p, MAX_TOKENS)
        assert got == w, f"{n} tokens alone (AMX_MLA, block {block}): P/D {got} != single {w}"
    sent = len(prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        got_all = list(pool.map(lambda p: _complete_ids(kind.pd.url, kind.model, p, MAX_TOKENS), prompts))
    for n, p, g, w in zip(lengths, prompts, got_all, want, strict=True):
        if g != w:
            g, sent = _complete_ids(kind.pd.url, kind.model, p, MAX_TOKENS), sent + 1
        assert g == w, f"{n} tokens (AMX_MLA, block {block}): P/D {g} != single {w}"
    kind.assert_all_pushed_and_released(before, sent + len(prompts))
    kind.assert_latents_landed(sent + len(prompts))


def prompts_and_answers(
    single_url: str, model: str, lengths: list[int], words: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token-id prompts of the given lengths (each from its own offset of one text) and the single
    engine's greedy answer to each, sent alone."""
    text = " ".join(client.make_prompts(1, [words], seed=seed))
    tokens = client.post_json(single_url + "/tokenize", {"model": model, "prompt": text}, 60)["tokens"]
    assert len(tokens) > max(lengths) + 37 * len(lengths)
    prompts = [tokens[i * 37 : i * 37 + n] for i, n in enumerate(lengths)]
    want = [_complete_ids(single_url, model, p, MAX_TOKENS) for p in prompts]
    assert [len(w) for w in want] == [MAX_TOKENS] * len(prompts)
    return prompts, want


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
    window and at the block boundary, each equal to the single engine's answer to it alone; every one
    pushed, none failed, nothing held afterwards. A bf16 model's tokens depend on its batch in vLLM itself
    (the single engine's too), so there a prompt whose concurrent P/D answer differs must equal the single
    engine when sent through P/D alone."""
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
    # the reference one request at a time: a bf16 single engine's greedy tokens depend on what else is in
    # its batch (0.29's gptoss-bf16 gave another answer to the 1023-token prompt 4 at a time than alone)
    want = [_complete_ids(windowed.single.url, windowed.model, p, MAX_TOKENS) for p in prompts]
    before = (prefill_stats, decode_stats)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got = list(pool.map(lambda p: _complete_ids(windowed.pd.url, windowed.model, p, MAX_TOKENS), prompts))
    sent = len(prompts)
    for prompt, n, w, g in zip(prompts, lengths, want, got, strict=True):
        assert len(w) == MAX_TOKENS
        if g != w and windowed.variant.endswith("-bf16"):
            # the same batch effect on the decode: that prompt alone through P/D must be the single answer
            g, sent = _complete_ids(windowed.pd.url, windowed.model, prompt, MAX_TOKENS), sent + 1
        assert g == w, f"{n} tokens (block {block}, windows {windows}): P/D {g} != single {w}"
    windowed.assert_all_pushed_and_released(before, sent)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
