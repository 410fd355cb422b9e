"""Block tables per KV-cache group, and which tokens of a sliding-window group move.

An engine passes one block table (one KV-cache group, as before) or one table per group (vLLM's hybrid
manager: full-attention and sliding-window groups, each with its own table over one shared block pool).
In a window group's table an id of -1 (`HOLE`) means "no block here": the engine freed it, or never
allocated it, because no token in it is inside the window any more. A table may hold a hole only where
`window_token_range` says no token is needed; a needed block that is a hole is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

from ..errors import LayoutError
from .layout import MAX_GROUPS, KVLayout, blocks_for

HOLE = -1
Table = tuple[int, ...]
# What travels from the engine call to the plan: one table (one group), or one per KV-cache group.
BlockIds = Table | tuple[Table, ...]
# What an engine call (and a planner) accepts: any sequence of ids, or a sequence of per-group sequences.
TableArg = Sequence[int] | Sequence[Sequence[int]]


def window_token_range(num_tokens: int, window: int, block_size: int) -> tuple[int, int]:
    """The tokens [first, num_tokens) a group with this sliding window needs moved, first block-aligned
    down to `block_size` (pass 1 for the exact token range).

    The rule: the last `window` tokens before num_tokens (all of them for full attention, window 0).
    The decode's next position, num_tokens, attends to only window - 1 of them, but an engine that is
    handed the whole prompt recomputes its last token (vLLM does: position num_tokens - 1 then attends to
    tokens num_tokens - window .. num_tokens - 1), so both sides must keep and move the one more token. At
    num_tokens % block_size == block_size - 1 (window a multiple of block_size) that token is alone in the
    oldest block: an engine that frees blocks by the window - 1 rule has already dropped it (vLLM Neuron's
    fork lost it), and the request is refused by name instead of decoding from garbage.
    """
    if num_tokens <= 0 or window < 0 or block_size <= 0:
        raise LayoutError(f"bad window range: {num_tokens} tokens, window {window}, block size {block_size}")
    first = max(0, num_tokens - window) if window else 0
    return first - first % block_size, num_tokens


def needed_blocks(layout: KVLayout, group: int, num_tokens: int) -> range:
    """Indices into a group's block table of the blocks holding the tokens that group moves."""
    first, _ = window_token_range(num_tokens, layout.window(group), 1)
    return range(first // layout.block_size, blocks_for(num_tokens, layout.block_size))


def as_block_ids(block_ids: TableArg) -> BlockIds:
    """A caller's table(s) as tuples of ints: one flat table, or one per group (LayoutError if mixed)."""
    if len(block_ids) and all(isinstance(t, Sequence) for t in block_ids):
        tables = tuple(tuple(int(b) for b in t) for t in block_ids)  # type: ignore[union-attr]
        if not 1 <= len(tables) <= MAX_GROUPS:
            raise LayoutError(f"{len(tables)} block tables; kvpush moves 1..{MAX_GROUPS} KV-cache groups")
        return tables
    if any(isinstance(t, Sequence) for t in block_ids):
        raise LayoutError("block_ids mixes block ids and per-group tables: pass one or the other")
    return tuple(int(b) for b in block_ids)  # type: ignore[arg-type]


def is_flat(block_ids: BlockIds) -> TypeGuard[Table]:
    """True for one flat table (one group), False for one table per group."""
    return not block_ids or isinstance(block_ids[0], int)


def single_table(block_ids: BlockIds) -> Table | None:
    """The one table of a one-group request (flat, or a tuple holding one table); None for several."""
    if is_flat(block_ids):
        return block_ids
    return block_ids[0] if len(block_ids) == 1 else None  # type: ignore[return-value]


def group_tables(layout: KVLayout, block_ids: BlockIds) -> tuple[Table, ...]:
    """One table per KV-cache group of `layout` (a flat table is group 0 of a one-group layout)."""
    if is_flat(block_ids):
        if layout.num_groups != 1:
            raise LayoutError(
                f"one block table for a layout of {layout.num_groups} KV-cache groups: pass one table per group"
            )
        return (block_ids,)
    tables: tuple[Table, ...] = block_ids  # type: ignore[assignment]
    if len(tables) != layout.num_groups:
        raise LayoutError(f"{len(tables)} block tables for a layout of {layout.num_groups} KV-cache groups")
    return tables


def flat_ids(block_ids: BlockIds) -> tuple[Table, tuple[int, ...]]:
    """(every id in group order, each table's length; empty for a flat table): the wire's form."""
    if is_flat(block_ids):
        return block_ids, ()
    tables: tuple[Table, ...] = block_ids  # type: ignore[assignment]
    return tuple(b for t in tables for b in t), tuple(len(t) for t in tables)


def from_flat(ids: Sequence[int], sizes: Sequence[int]) -> BlockIds:
    """The inverse of `flat_ids` (LayoutError if the sizes do not add up)."""
    if not sizes:
        return tuple(ids)
    if sum(sizes) != len(ids):
        raise LayoutError(f"group table sizes {list(sizes)[:8]} do not add up to {len(ids)} block ids")
    out: list[Table] = []
    at = 0
    for n in sizes:
        out.append(tuple(ids[at : at + n]))
        at += n
    return tuple(out)


def check_group_tables(layout: KVLayout, block_ids: BlockIds, num_tokens: int, who: str) -> tuple[Table, ...]:
    """Each group's table, checked: long enough for num_tokens, every needed block inside the cache
    (a hole in a window group only where no token is needed), no needed block twice. LayoutError names
    the group and the block."""
    tables = group_tables(layout, block_ids)
    out: list[Table] = []
    total = blocks_for(num_tokens, layout.block_size)
    for g, table in enumerate(tables):
        name = who if len(tables) == 1 else f"{who}: KV-cache group {g}"
        if len(table) < total:
            raise LayoutError(
                f"{name}: {len(table)} blocks of {layout.block_size} tokens cannot hold "
                f"{num_tokens} tokens ({total} needed)"
            )
        need = needed_blocks(layout, g, num_tokens)
        holes = [i for i in need if table[i] == HOLE]
        if holes:
            window = layout.window(g)
            what = f"window {window} needs tokens" if window else "full attention needs tokens"
            raise LayoutError(
                f"{name}: block {holes[0]} of the table is -1 (no block) but the {what} "
                f"{need.start * layout.block_size}..{num_tokens - 1} of {num_tokens}"
            )
        bad = [
            b
            for i, b in enumerate(table)
            if not (0 <= b < layout.num_blocks or (b == HOLE and i < need.start))
        ]
        if bad:
            raise LayoutError(f"{name}: block ids {bad[:5]} outside 0..{layout.num_blocks - 1}")
        live = table[need.start : need.stop]
        if len(set(live)) != len(live):
            raise LayoutError(f"{name}: block table repeats a block id")
        out.append(table[: need.stop])
    return tuple(out)
