"""Real vLLM (CPU) + real NIXL: an FP8 KV cache (`--kv-cache-dtype fp8`) through kvpush (issue 19).

vLLM's CPU attention backend stores FP8 KV as one byte per element (uint8 tensors) with per-layer K/V
scales that each engine loads from the checkpoint (1.0 for the tiny model: none are stored), so the
blocks move as they are and the scales never travel; kvpush's model tag carries the KV dtype and a
digest of the scales, so engines that disagree on either refuse to pair. The CPU backend refuses FP8 KV
without AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py, `_get_attn_isa`): the test skips there.

One P/D pair (through the kvpush proxy) and one reference single engine, all three with FP8 KV: a few
prompts alone, then 16 at once, token for token the reference's answer to each alone; every request
pushed, none failed, no block held afterwards.
"""

from __future__ import annotations

import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools.tiny_model import VARIANTS
from tests.vllm.test_cache_kinds_vllm import CONCURRENCY, MAX_TOKENS, Kind, _complete_ids, prompts_and_answers

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

KV_DTYPE = "fp8"
VARIANT = "fast"  # head size 64: the CPU backend's FP8 path needs a multiple of 32


def fp8_kv_unsupported() -> str | None:
    """Why this CPU or this vLLM cannot run an FP8 KV cache, or None when it can."""
    import torch
    import vllm

    with warnings.catch_warnings():  # vLLM's import chain warns of deprecated torch APIs
        warnings.simplefilter("ignore")
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    kinds = list(getattr(CPUAttentionBackend, "supported_kv_cache_dtypes", None) or [])
    if kinds and KV_DTYPE not in kinds:
        return (
            f"vLLM {vllm.__version__}'s CPU attention backend takes KV cache dtypes {kinds}, not {KV_DTYPE}"
        )
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        return "FP8 KV cache on vLLM's CPU backend needs x86 AVX-512 or AMX; this CPU has neither"
    return None


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory):
    reason = fp8_kv_unsupported()
    if reason:
        pytest.skip(reason)
    kind = Kind(VARIANT, tmp_path_factory.mktemp("vllm-fp8"), engine_args=["--kv-cache-dtype", KV_DTYPE])
    yield kind
    kind.stop()


def test_fp8_kv_pd_equals_the_single_fp8_engine_alone_and_16_way_nothing_leaks(fp8: Kind) -> None:
    """The pair moves 1-byte KV (bytes per token: layers x K,V x heads x head size x 1), and 4 prompts
    alone and 16 at once (3 tokens to past several blocks) are each the FP8 single engine's answer."""
    spec = VARIANTS[VARIANT]
    prefill_stats, decode_stats = fp8.counters()
    want_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 1
    assert prefill_stats["bytes_per_token"] == decode_stats["bytes_per_token"] == want_bytes
    assert prefill_stats["compat"] == decode_stats["compat"]
    block = int(decode_stats["vllm_block_size"])
    lengths = sorted({3, 17, block - 1, block, block + 1, 2 * block - 1, 2 * block + 5, 3 * block + 40})
    k = 1
    while len(lengths) < CONCURRENCY:
        lengths = sorted({*lengths, 5 + 29 * k})
        k += 1
    prompts, want = prompts_and_answers(fp8.single.url, fp8.model, lengths, words=6000, seed=8)

    alone = [0, 3, 7, len(prompts) - 1]
    before = fp8.counters()
    for i in alone:
        got = _complete_ids(fp8.pd.url, fp8.model, prompts[i], MAX_TOKENS)
        assert got == want[i], f"{lengths[i]} tokens alone: P/D {got} != single {want[i]}"
    fp8.assert_all_pushed_and_released(before, len(alone))

    before = fp8.counters()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        got_all = list(pool.map(lambda p: _complete_ids(fp8.pd.url, fp8.model, p, MAX_TOKENS), prompts))
    for n, g, w in zip(lengths, got_all, want, strict=True):
        assert g == w, f"{n} tokens, 16 at once: P/D {g} != single {w}"
    fp8.assert_all_pushed_and_released(before, len(prompts))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
