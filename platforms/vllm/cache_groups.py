"""What vLLM's KV-cache config declares about a rank's cache: its groups, each with its layers, its kind
(full attention, sliding window, MLA latent) and its window.

Why read this and not the model config: the model config says what the model computes, the KV-cache
config what vLLM keeps. A Gemma-3-style model has one `sliding_window` in its config but several KV-cache
groups (global layers in one, local layers in others, each with its own block table); with the hybrid
manager off, the same model's window layers sit in one full-attention group that keeps every block. An
MLA model's config names several KV heads while the cache holds one latent "head" per token. So the
group's spec (`kv_cache_config.kv_cache_groups[i].kv_cache_spec`) decides, read by its class name and
attributes (vLLM versions differ in the classes they have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvpush.errors import LayoutError

GroupKind = Literal["full", "window", "mla", "other"]


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: vLLM gives every request one block table per group.

    window: tokens a window group keeps (vLLM frees the blocks before them); 0 for every other kind.
    spec: the spec's class name (names what kvpush refuses when kind is "other").
    block_size: tokens per block of this group's table (the spec's); 0 where the spec names none.
    """

    layer_names: tuple[str, ...]
    kind: GroupKind
    window: int
    num_kv_heads: int
    head_size: int
    spec: str
    block_size: int = 0

    def describe(self) -> str:
        what = {"full": "full attention", "window": f"window {self.window}", "mla": "MLA latent"}
        return what.get(self.kind, self.spec)


def _kind(spec: Any) -> tuple[GroupKind, int]:
    """(kind, window) of a KV-cache spec. A FullAttentionSpec may carry a sliding_window (window layers
    merged into a full-attention group when the hybrid manager is off): it keeps every block, so it is
    full attention as far as moving blocks goes. Only a SlidingWindowSpec frees blocks."""
    name = type(spec).__name__
    if "MLA" in name:
        if "SlidingWindow" in name:
            return "other", 0  # windowed latents (DeepSeek-V4-style): not a cache kvpush knows
        return "mla", 0
    if name == "SlidingWindowSpec":
        return "window", int(getattr(spec, "sliding_window", 0) or 0)
    if name == "FullAttentionSpec":
        return "full", 0
    return "other", 0


def cache_groups(kv_cache_config: Any) -> tuple[CacheGroup, ...]:
    """The groups of a vLLM KVCacheConfig, in vLLM's order (the order of request_finished_all_groups'
    block tables); () when there is no config (vLLM built the connector without one). An entry without
    a spec says nothing to read and is left out (the caller still counts it as a group)."""
    if kv_cache_config is None:
        return ()
    out = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = getattr(group, "kv_cache_spec", None)
        if spec is None:
            continue
        kind, window = _kind(spec)
        out.append(
            CacheGroup(
                layer_names=tuple(getattr(group, "layer_names", ()) or ()),
                kind=kind,
                window=window,
                num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
                head_size=int(getattr(spec, "head_size", 0) or 0),
                spec=type(spec).__name__,
                block_size=int(getattr(spec, "block_size", 0) or 0),
            )
        )
    return tuple(out)


def groups_block_size(groups: tuple[CacheGroup, ...], configured: int) -> int:
    """Tokens per block of the tables vLLM hands the connector: the groups' spec block size, else
    `configured` (cache_config.block_size; no groups known, or their specs name none).

    Why not always cache_config.block_size: a sliding-window spec picks its own block size. vLLM 0.29
    gives an all-window model's one group the attention kernel's smallest block (32 tokens on CPU)
    while cache_config says 128; read as 128-token blocks, its tables name the wrong tokens (the
    window's blocks look freed). Where several groups share a table geometry vLLM scales them to one
    page and one block size; kvpush's layout has one block size, so groups that differ are refused."""
    sizes = sorted({g.block_size for g in groups if g.block_size > 0})
    if not sizes:
        return configured
    if len(sizes) > 1:
        raise LayoutError(
            f"vLLM's KV-cache groups have different block sizes ({', '.join(map(str, sizes))} tokens: "
            f"{[g.describe() + ' ' + str(g.block_size) for g in groups]}); kvpush moves one block size"
        )
    return sizes[0]


def group_of_layers(groups: tuple[CacheGroup, ...], names: list[str]) -> tuple[int, ...]:
    """The group index of each layer name (in the caller's order); () when no groups are known.
    A layer no group names (vLLM shares another layer's cache with it) is an error: kvpush would move
    it with no block table."""
    if not groups:
        return ()
    where = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    missing = [n for n in names if n not in where]
    if missing:
        raise LayoutError(
            f"KV cache tensors {missing[:4]} belong to no KV-cache group of vLLM's KV cache config "
            f"(groups: {[list(g.layer_names) for g in groups]})"
        )
    return tuple(where[n] for n in names)


def kept_window(group: CacheGroup) -> int:
    """The tokens before its next position a window group's cache must hold: vLLM's sliding window
    counts the position itself, so window - 1 (what vLLM keeps when a request finishes, and what the
    decode's next position reads; scheduler.window_backoff makes that position the decode's). 0 for
    every other kind (kvpush's "full attention": every block moves)."""
    if group.kind != "window":
        return 0
    if group.window < 2:
        raise LayoutError(f"sliding window {group.window}: a window group must keep at least one token")
    return group.window - 1


def layout_groups(
    groups: tuple[CacheGroup, ...], names: list[str]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layer_group, group_window) of a KVLayout for these vLLM groups and layer names: both empty for
    one full-attention group, so such a layout (and its compatibility hash) is the one of before."""
    if not groups or (len(groups) == 1 and groups[0].kind != "window"):
        return (), ()
    return group_of_layers(groups, names), tuple(kept_window(g) for g in groups)
