"""Block-outermost (block-major) KV caches in the vLLM integration: the connector asks vLLM for one only
when configured and never on CPU, and the probe reads vLLM's per-layer views of such a cache as a
block-major layout whose plan merges across layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvpush.errors import ConfigError  # noqa: E402
from kvpush.platforms.vllm.layout_probe import RFC_VIEW, probe_layout  # noqa: E402
from kvpush.platforms.vllm.params import required_kv_cache_layout  # noqa: E402
from kvpush.protocol.plan import build_plan  # noqa: E402


def test_layout_requirement_from_extra_config():
    assert required_kv_cache_layout({}, platform_is_cpu=False) is None
    assert required_kv_cache_layout({"kv_cache_layout": "auto"}, platform_is_cpu=True) is None
    assert required_kv_cache_layout({"kv_cache_layout": "block-major"}, platform_is_cpu=False) == "BLHNC"
    assert required_kv_cache_layout({"kv_cache_layout": "BLNHC"}, platform_is_cpu=False) == "BLNHC"
    with pytest.raises(ConfigError, match="CPU attention backend"):
        required_kv_cache_layout({"kv_cache_layout": "block-major"}, platform_is_cpu=True)
    with pytest.raises(ConfigError, match="kv_cache_layout must be one of"):
        required_kv_cache_layout({"kv_cache_layout": "blockmajor"}, platform_is_cpu=False)


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM imports torch.jit deprecations
def test_connector_class_answers_vllm_on_this_cpu_platform():
    pytest.importorskip("vllm")
    from kvpush.platforms.vllm.connector import KVPushConnector

    def cfg(extra):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    assert KVPushConnector.get_required_kvcache_layout(cfg({})) is None
    with pytest.raises(ConfigError, match="CPU"):
        KVPushConnector.get_required_kvcache_layout(cfg({"kv_cache_layout": "block-major"}))


def _blhnc_caches(layers: int, blocks: int, heads: int, tokens: int, content: int, fill: float):
    """vLLM's per-layer [B, H, N, C] views of one block-outermost [B, L, H, N, C] allocation."""
    whole = torch.arange(blocks * layers * heads * tokens * content, dtype=torch.float16).reshape(
        blocks, layers, heads, tokens, content
    )
    whole += fill
    return whole, {f"layer.{i}": whole[:, i] for i in range(layers)}


def test_probe_reads_a_block_outermost_cache_as_block_major_and_the_plan_merges_layers():
    L, B, H, N, C = 4, 32, 2, 16, 8
    _src_whole, src = _blhnc_caches(L, B, H, N, C, 0.0)
    _dst_whole, dst = _blhnc_caches(L, B, H, N, C, 0.5)
    kw = dict(block_size=N, total_kv_heads=H, tp_rank=0, tp_size=1, model_tag="m", declared=RFC_VIEW)
    p, d = probe_layout(src, **kw), probe_layout(dst, **kw)
    assert p.layout.kind == "block-major" and d.layout.kind == "block-major"
    assert p.layout.compat_hash() == d.layout.compat_hash()
    plan = build_plan(p.layout, d.layout, [3, 4, 5, 9], [10, 11, 12, 20], 4 * N)
    # two runs of consecutive blocks on both sides: one descriptor each, every layer inside it
    assert plan.num_descriptors == 2
    assert plan.nbytes == 4 * L * H * N * C * 2
