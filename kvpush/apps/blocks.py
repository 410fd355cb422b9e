"""The apps' one block pool: a free queue of block ids, so block tables fragment as an engine's do.

Allocation takes ids from the front, freeing appends to the back. Two orders are in use, and they are
the pool's only parameters:
- vLLM's (the bench): the queue starts in id order and a request's blocks go back in reverse
  (v1/core/block_pool.py `popleft_n`; single_type_kv_cache_manager.free: `free_blocks(reversed(blocks))`).
  After a warm-up (`age`) a request gets descending runs interleaved with other requests' leftovers: the
  descriptor count of a transfer depends on this.
- shuffled runs (the demo and the soak): the queue starts as runs of a few consecutive ids in a seeded
  random order (`shuffled_runs`) and blocks go back as given, so every table is fragmented from the
  first request, while the runs within it still merge into one descriptor.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable

from kvpush.errors import KVPushError


class OutOfBlocks(KVPushError, MemoryError):
    """The pool has fewer free blocks than a request needs."""


def shuffled_runs(num_blocks: int, seed: int, run: int) -> list[int]:
    """Every id once, as runs of `run` consecutive ids in a seeded random order (run <= 1: ids shuffled)."""
    rng = random.Random(seed)
    if run <= 1:
        order = list(range(num_blocks))
        rng.shuffle(order)
        return order
    runs = [list(range(s, min(s + run, num_blocks))) for s in range(0, num_blocks, run)]
    rng.shuffle(runs)
    return [b for r in runs for b in r]


class BlockPool:
    """`num_blocks` ids, free in `order` (default: id order); `reverse_free`: a freed table goes back
    last block first, as vLLM frees it."""

    def __init__(
        self, num_blocks: int, order: Iterable[int] | None = None, reverse_free: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.reverse_free = reverse_free
        self._free: deque[int] = deque(range(num_blocks) if order is None else order)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        """The free queue, front first (a copy)."""
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: Iterable[int]) -> None:
        self._free.extend(reversed(list(blocks)) if self.reverse_free else blocks)

    def lose(self) -> int:
        """Take the last free id out of the pool for good (a harness's self-check: a leak on purpose)."""
        return self._free.pop()

    def age(self, sizes: list[int], concurrency: int, total_blocks: int) -> None:
        """Churn the free queue as a server that has already served `total_blocks` blocks' worth of
        requests (sizes in blocks, cycled; `concurrency` live at a time, freed oldest first), then free
        everything. Deterministic, so every mode starts from the same pool state."""
        live: deque[list[int]] = deque()
        served, i = 0, 0
        while served < total_blocks:
            n = sizes[i % len(sizes)]
            i += 1
            while live and (len(live) >= concurrency or not self.can_allocate(n)):
                self.free(live.popleft())
            live.append(self.allocate(n))
            served += n
        while live:
            self.free(live.popleft())
