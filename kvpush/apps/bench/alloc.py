"""A block pool that hands out ids the way vLLM's does, so block tables fragment realistically.

vLLM (v1/core/block_pool.py) keeps free blocks in a queue: allocation pops from the front
(`popleft_n`), freeing appends to the back, and a request's blocks are freed in reverse order
(single_type_kv_cache_manager.free: `free_blocks(reversed(blocks))`). After a warm-up the ids a request
gets are descending runs interleaved with other requests' leftovers: the descriptor count of a transfer
depends on this.
"""

from __future__ import annotations

from collections import deque

from kvpush.protocol.layout import blocks_for as blocks_for  # re-exported for the bench's users


class OutOfBlocks(Exception):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def age(self, sizes: list[int], concurrency: int, total_blocks: int) -> None:
        """Churn the free queue as a server that has already served `total_blocks` blocks' worth of
        requests (sizes in blocks, cycled; `concurrency` live at a time, freed oldest first), then free
        everything. Deterministic, so every mode starts from the same pool state."""
        from collections import deque as _deque

        live: _deque[list[int]] = _deque()
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
