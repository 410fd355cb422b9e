"""The apps' one block pool in both of its orders: vLLM's (bench) and shuffled runs freed as given (demo,
soak), with every id accounted for and a refusal that names the shortfall."""

from __future__ import annotations

import pytest

from kvpush.apps.blocks import BlockPool, OutOfBlocks, shuffled_runs
from kvpush.errors import KVPushError


def test_vllm_order_starts_in_id_order_and_frees_a_table_last_block_first():
    pool = BlockPool(8)
    a, b = pool.allocate(3), pool.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    pool.free(a)
    assert pool.free_ids() == [5, 6, 7, 2, 1, 0]
    assert pool.allocate(5) == [5, 6, 7, 2, 1]  # a descending run: vLLM's fragmentation


def test_shuffled_runs_cover_every_id_once_in_runs_and_depend_on_the_seed():
    order = shuffled_runs(18, seed=3, run=4)
    assert sorted(order) == list(range(18))
    # runs of 4 (the last of 2) stay whole: only a run's first id (a multiple of 4) follows a stranger
    assert all(b % 4 == 0 or order[i - 1] == b - 1 for i, b in enumerate(order))
    assert order != list(range(18)) and order != shuffled_runs(18, seed=4, run=4)
    assert order == shuffled_runs(18, seed=3, run=4)
    assert sorted(shuffled_runs(7, seed=1, run=1)) == list(range(7))


def test_as_given_order_frees_a_table_as_it_was_handed_out():
    pool = BlockPool(8, shuffled_runs(8, seed=1, run=4), reverse_free=False)
    first = pool.allocate(4)
    pool.free(first)
    assert pool.free_ids()[-4:] == first
    assert pool.num_free == 8 and sorted(pool.free_ids()) == list(range(8))


def test_running_out_is_refused_by_count_and_lose_leaks_one_on_purpose():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks, match="need 2 blocks, 1 free") as err:
        pool.allocate(2)
    assert isinstance(err.value, KVPushError) and isinstance(err.value, MemoryError)
    assert pool.num_free == 1  # nothing taken by the refusal
    pool.lose()
    assert pool.num_free == 0 and not pool.can_allocate(1)
