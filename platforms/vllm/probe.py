"""Probing an engine's KV caches into a kvpush layout: the attention backend's declaration, the model tag
both engines must agree on, and the memory backend the tensors need (kvpush.backends.select).

Also the DEBUG checksums of a request's KV, which read the same tensors by the same layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import socket
from typing import TYPE_CHECKING, Any

from kvpush.backends.neuron import check_neuron_connector
from kvpush.backends.select import CacheSetup, setup_for_tensors
from kvpush.config import LOOPBACK
from kvpush.protocol.layout import KVLayout

from .cache_groups import layout_groups
from .layout_probe import (
    CPU_VIEW,
    RFC_VIEW,
    KVCacheDeclaration,
    declaration_for_device,
    declaration_from_backend,
    features_from_vllm,
    probe_layout,
)
from .params import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpush.vllm")

CPU_BACKEND = "CPU_ATTN"


def tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


def attention_backend(vllm_config: VllmConfig, kv_caches: dict[str, Any]) -> tuple[str, Any]:
    """(name, class) of the attention backend: it decides how a block's bytes are read; ask the first
    layer. The class is None when the layer does not say (then the tensors' device decides the name)."""
    ctx = vllm_config.compilation_config.static_forward_context
    layer = ctx.get(next(iter(kv_caches)))
    try:
        cls = layer.get_attn_backend()  # type: ignore[union-attr]
        return str(cls.get_name()), cls
    except AttributeError:
        return (CPU_BACKEND if next(iter(kv_caches.values())).device.type == "cpu" else ""), None


def declared_layout(name: str, cls: Any, first_tensor: Any) -> KVCacheDeclaration | None:
    """What the backend declares about its KV tensors: its own get_kv_cache_shape where it has one
    (older vLLM), else what the tensors' device implies (Neuron: vLLM Neuron's CUSTOM backend, whose
    attention lives in its modelling code, so the layer lookup finds no class), else vLLM >= 0.32's
    per-layer [B, H, N, C] view (the CPU backend reads a head's block as [2N, C/2]); None leaves the
    probe to refuse anything ambiguous."""
    declared = declaration_from_backend(cls) if cls is not None else None
    if declared is not None:
        return declared
    declared = declaration_for_device(str(first_tensor.device.type))
    if declared is not None:
        return declared
    if name == CPU_BACKEND:
        return CPU_VIEW
    return RFC_VIEW if first_tensor.dim() == 4 else None


def model_tag(vllm_config: VllmConfig, user_tag: str, layer_names: list[str] | None = None) -> str:
    """What must match between the two engines' models beyond the KV geometry.

    A quantised KV cache (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`) adds its dtype name and its
    per-layer K/V scales: every FP8 format is one byte, so the geometry cannot tell e4m3 from e5m2,
    and the scales (constants each engine loads from the checkpoint, 1.0 without any) never travel
    with the blocks, so bytes quantised with one engine's scales are read with the other's."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [])
    tag = (
        f"{arch}|layers={getattr(hf, 'num_hidden_layers', '?')}|hidden={getattr(hf, 'hidden_size', '?')}"
        f"|vocab={getattr(hf, 'vocab_size', '?')}|dtype={mc.dtype}"
    )
    cache_config = getattr(vllm_config, "cache_config", None)  # stand-in configs (tests/backends) have none
    kv_dtype = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if kv_dtype != "auto":
        tag += f"|kv={kv_dtype}|kv-scales={kv_scales_digest(vllm_config, layer_names or [])}"
    return f"{tag}|{user_tag}" if user_tag else tag


def kv_scales_digest(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """A short digest of every layer's (k_scale, v_scale), as vLLM's attention layers hold them after
    loading ("-" for a layer that has none)."""
    ctx = vllm_config.compilation_config.static_forward_context
    parts = []
    for name in layer_names:
        layer = ctx.get(name)
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        parts.append("-" if k is None or v is None else f"{float(k)!r},{float(v)!r}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class ProbedCache:
    layout: KVLayout  # what the endpoint registers (the host bounce buffer when staged)
    ratio: int  # kernel blocks per vLLM block
    mem_type: str  # "DRAM" | "VRAM"
    rank: int
    setup: CacheSetup  # the backend: its KV-written barrier and, when staged, the staging hooks

    def kv_written_barrier(self) -> Any:
        """Called on the engine thread at hand-off; never waits (CUDA: records an event)."""
        return self.setup.cache.kv_written_barrier()


def shares_host(settings: ConnectorSettings) -> bool:
    """Whether prefill and decode run on this one host, as far as the connector's config says: a prefill
    side channel on loopback (only local decodes can reach it), or a decode whose configured prefill
    addresses are loopback or one of this host's own addresses."""
    hosts = (
        [settings.config.side_channel.host]
        if settings.is_producer
        else [a.host for a in settings.prefill_addresses]
    )
    own = set(LOOPBACK) | {"127.0.1.1"}
    try:
        name = socket.gethostname()
        own |= {name, *socket.gethostbyname_ex(name)[2]}
    except OSError:
        pass
    return any(h in own or h.startswith("127.") for h in hosts)


def probe_kv_caches(
    settings: ConnectorSettings,
    vllm_config: VllmConfig,
    kv_caches: dict[str, Any],
    kv_cache_config: Any = None,
) -> ProbedCache:
    """kv_cache_config: the connector's (vLLM passes it to connectors it constructs with one); its
    KV cache groups decide what is refused (hybrid caches, windows) and whether the cache holds MLA
    latents (then one "head" per token, whatever the model's KV head count)."""
    rank = tensor_parallel_rank()
    backend, backend_cls = attention_backend(vllm_config, kv_caches)
    first = next(iter(kv_caches.values()))
    features = features_from_vllm(vllm_config, kv_cache_config)
    # MLA: one latent per token, replicated on every TP rank (not split by the model's KV heads)
    total_kv_heads = 1 if features.mla else int(vllm_config.model_config.get_total_num_kv_heads())
    probed = probe_layout(
        kv_caches,
        block_size=settings.block_size,
        total_kv_heads=total_kv_heads,
        tp_rank=rank,
        tp_size=settings.tp_size,
        model_tag=model_tag(vllm_config, settings.model_tag, list(kv_caches)),
        declared=declared_layout(backend, backend_cls, first),
        features=features,
    )
    layout, ratio = probed.layout, probed.blocks_per_vllm_block
    layer_group, group_window = layout_groups(features.groups, list(kv_caches))
    if group_window:  # window or several groups: each layer's group, each group's kept window
        layout = dataclasses.replace(layout, layer_group=layer_group, group_window=group_window)
    if backend == CPU_BACKEND:
        # vLLM's CPU kernels keep tokens inside a block in their own packed order: a partial block
        # cannot be cut by token, so blocks move whole (the plan rounds; block sizes must match).
        layout = dataclasses.replace(layout, atomic_blocks=True)
    ktc = vllm_config.kv_transfer_config
    kv_buffer_device = str(getattr(ktc, "kv_buffer_device", None) or "cpu")
    setup = setup_for_tensors(layout, kv_caches, kv_buffer_device)
    if setup.choice.backend == "neuron" and not setup.choice.staged:
        # before the endpoint creates its NIXL agent: refused by name here, not only in kvpush doctor
        check_neuron_connector(layout.regions, single_host=shares_host(settings))
    mem_type = setup.mem_type
    log.warning(
        "kvpush: %s rank %d %s compat %s (%d layers, %d KV heads x %d, block %d tokens, %d B/block, "
        "%s, %d kernel blocks per vLLM block of %d%s; KV-cache groups: %s)",
        settings.role,
        rank,
        mem_type,
        layout.compat_hash(),
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.block_bytes,
        layout.token_order,
        ratio,
        settings.block_size,
        ", whole blocks" if layout.atomic_blocks else "",
        ", ".join(g.describe() for g in features.groups) or "one",
    )
    if setup.hooks is not None:
        log.warning("kvpush: KV staged through host memory (%s)", setup.choice.reason)
    return ProbedCache(setup.layout, ratio, mem_type, rank, setup)


def debug_checksums(
    kv_caches: dict[str, Any], blocks: list[int], num_tokens: int, block_size: int
) -> list[float]:
    """Sums of the first and last layer's KV over a request's tokens: compare prefill's with decode's
    in DEBUG logs when outputs differ. Costly; callers check log.isEnabledFor(DEBUG) first."""
    out = []
    names = list(kv_caches)
    for name in names[:1] + names[-1:]:
        t = kv_caches[name]
        total = 0.0
        for i, b in enumerate(blocks):
            k = min(block_size, num_tokens - i * block_size)
            if k <= 0:
                break
            part = t[b][:, :k] if t.dim() == 4 else t[:, b, :k]
            total += float(part.double().sum())
        out.append(round(total, 4))
    return out
