"""Real vLLM (CPU) + real NIXL: a TP 2 MLA prefill feeding a TP 1 decode through kvpush (issue 19).

MLA's latent is replicated on every TP rank, so the plan takes one source rank per decode rank: prefill
rank 0 writes the whole latent, rank 1 owes the decode nothing. The prefill's two ranks run on cores 0|1
(VLLM_CPU_OMP_THREADS_BIND), the decode on core 1, the reference single TP 1 engine on core 0, all with
vLLM's CPU rotary op off (MLA_ENGINE_ARGS). Lean: a handful of prompts each alone, then 8 at once.

Both engines run with idle_wait_ms 3000 (kvpush's default: decode 20, prefill 2). After every step a vLLM
worker spins up to 1 s in sched_yield waiting for the next (shm_broadcast's busy_loop_s), and an engine
that only waits for a transfer steps every idle_wait_ms, so at the defaults the decode's worker and
prefill rank 1, both pinned to core 1, spin without pause. On this box (2 cores, Linux 6.18's EEVDF
scheduler) one of two such spinners on a core got no CPU at all for 30-90 s: the decode's kvpush thread
answered no ping for 30 s (the prefill dropped it), or prefill rank 1 stalled the TP 2 forward past the
120 s lease; 4 of 4 runs failed on the first request. Stepping every 3 s leaves each worker idle 2 s in
3: no stall over 2 s, and a finished transfer still wakes its engine at once (wake.py).

The prefill runs with TORCHDYNAMO_DISABLE=1: at TP > 1 vLLM's VocabParallelEmbedding calls a
torch.compile'd helper (get_masked_input_and_mask) on the first request, and on this loaded 2-core box
rank 1's inductor compile took over 200 s (rank 0 spinning in the shared-memory all-reduce meanwhile),
so the decode's lease expired; eager, the first request takes seconds and gives the same tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools.serve_pd import Deployment, start_pd
from kvpush.platforms.vllm.tools.tiny_model import build

from .test_cache_kinds_vllm import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    MLA_ENGINE_ARGS,
    _complete_ids,
    _kv_usage,
    _wait,
    prompts_and_answers,
)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

CONCURRENT = 8
IDLE_WAIT_MS = 3000.0


class TP2Pair:
    """A TP 2 prefill (ranks on cores 0|1) and TP 1 decode (core 1) of the tiny MLA model behind the proxy,
    then a TP 1 reference engine (core 0; `reference` gets the session's shared one, conftest.py): the pair
    first, so the start-ups do not fight for 2 cores."""

    def __init__(self, logs: Path, reference: Callable[[], Deployment]) -> None:
        self.model = str(build("mla"))
        self.stats_dir = logs / "stats"
        # idle_wait_ms: see the module docstring (vLLM's workers spin 1 s after each step; two of them on
        # one core starve each other here, so an engine that only waits for a transfer steps every 3 s)
        extra = {"stats_dir": str(self.stats_dir), "idle_wait_ms": IDLE_WAIT_MS}
        self.pd: Deployment = start_pd(
            "kvpush",
            self.model,
            logs,
            prefill_cores="0|1",
            decode_cores="1",
            max_model_len=MAX_MODEL_LEN,
            prefill_extra=extra,
            decode_extra=extra,
            prefill_env={"TORCHDYNAMO_DISABLE": "1"},
            prefill_args=[*MLA_ENGINE_ARGS, "--tensor-parallel-size", "2"],
            decode_args=list(MLA_ENGINE_ARGS),
        )
        try:
            self.single = reference()  # shared: stopped after its last user (conftest.py)
        except BaseException:
            self.pd.stop()
            raise

    def stop(self) -> None:
        self.pd.stop()

    def stats(self, role: str, rank: int) -> dict[str, Any]:
        path = self.stats_dir / f"kvpush-{role}-rank{rank}.json"
        _wait(path.exists, timeout=10)
        return dict(json.loads(path.read_text()))

    def counters(self) -> list[dict[str, Any]]:
        """prefill rank 0, prefill rank 1, decode rank 0."""
        return [self.stats("prefill", 0), self.stats("prefill", 1), self.stats("decode", 0)]

    def assert_all_pushed_and_released(self, before: list[dict[str, Any]], n: int) -> None:
        """n more requests: rank 0 pushed each latent, rank 1 finished each owing nothing, the decode
        received each; none failed, and no block is held on either engine afterwards."""

        def delta(now: list[dict[str, Any]], i: int, key: str) -> int:
            return int(now[i][key]) - int(before[i][key])

        def settled() -> bool:
            now = self.counters()
            return (
                delta(now, 0, "sent_ok") >= n
                and delta(now, 1, "sent_ok") >= n
                and delta(now, 2, "recv_ok") >= n
                and all(c["outstanding"] == 0 for c in now)
            )

        assert _wait(settled, timeout=60), f"not settled: {self.counters()}"
        now = self.counters()
        assert [delta(now, 0, "sent_ok"), delta(now, 1, "sent_ok"), delta(now, 2, "recv_ok")] == [n, n, n]
        assert (
            delta(now, 0, "sent_failed") == delta(now, 1, "sent_failed") == delta(now, 2, "recv_failed") == 0
        )
        assert delta(now, 1, "send_bytes") == 0, "prefill rank 1 wrote a latent rank 0 already writes"
        assert delta(now, 0, "send_bytes") == delta(now, 2, "recv_bytes") > 0
        prefill, decode = self.pd.engines
        assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0), (
            f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
        )


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory, mla_reference: Callable[[], Deployment]):
    p = TP2Pair(tmp_path_factory.mktemp("vllm-mla-tp2"), mla_reference)
    yield p
    p.stop()


def test_mla_tp2_prefill_to_tp1_decode_equals_the_single_engine(pair: TP2Pair) -> None:
    """8 prompts (3 to 450 tokens, at and around block boundaries) each alone, then all 8 at once, through
    the proxy: token for token the TP 1 single engine's answer to each alone; every request pushed by
    prefill rank 0 alone, none failed, nothing held."""
    block = int(pair.stats("decode", 0)["vllm_block_size"])
    assert block == 16
    lengths = [3, block - 1, block, block + 1, 2 * block + 1, 47, 150, 450]
    prompts, want = prompts_and_answers(pair.single.url, pair.model, lengths, words=3000, seed=23)

    before = pair.counters()
    for n, p, w in zip(lengths, prompts, want, strict=True):
        got = _complete_ids(pair.pd.url, pair.model, p, MAX_TOKENS)
        assert got == w, f"{n} tokens alone: TP 2 -> 1 P/D {got} != single {w}"
    pair.assert_all_pushed_and_released(before, len(prompts))

    before = pair.counters()
    start = time.monotonic()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        got_all = list(pool.map(lambda p: _complete_ids(pair.pd.url, pair.model, p, MAX_TOKENS), prompts))
    for n, g, w in zip(lengths, got_all, want, strict=True):
        assert g == w, f"{n} tokens, {CONCURRENT} at once: TP 2 -> 1 P/D {g} != single {w}"
    pair.assert_all_pushed_and_released(before, CONCURRENT)
    assert time.monotonic() - start < 300
