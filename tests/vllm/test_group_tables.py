"""KV-cache groups on the scheduler side, without an engine: every group's block table travels (vLLM's
null block as -1), and with a sliding-window group the prefill stops one token short of the prompt so
that what it keeps is exactly what the decode's next position reads (scheduler.window_backoff)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpush.platforms.vllm.block_table import BlockTable, expand_group_ids, group_ids, real_ids
    from kvpush.platforms.vllm.cache_groups import CacheGroup
    from kvpush.platforms.vllm.decode_scheduler import DecodeScheduler
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.prefill_scheduler import PrefillScheduler
    from kvpush.platforms.vllm.scheduler import pushed_tokens, window_backoff

BLOCK = 16
PREFILL_AT = {"remote_engine_id": "prefill-0", "remote_host": "10.0.0.9", "remote_port": 7000, "tp_size": 1}


def settings(role: str) -> ConnectorSettings:
    extra = {"host": "10.0.0.5", "port": 7100, "idle_wait_ms": 0}
    return ConnectorSettings.from_extra(role, f"{role}-0", extra, block_size=BLOCK, tp_size=1, pp_size=1)


def group(kind: str, window: int = 0) -> CacheGroup:
    return CacheGroup(("l0",), kind, window, 2, 64, "SlidingWindowSpec" if window else "FullAttentionSpec")  # type: ignore[arg-type]


def vllm_request(rid: str, params: dict[str, Any], prompt: int) -> Any:
    tokens = list(range(100, 100 + prompt))
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=tokens,
        _all_token_ids=list(tokens),
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        max_tokens=16,
    )


def test_group_ids_one_group_flat_several_per_group_and_null_blocks_are_holes() -> None:
    assert group_ids(([4, 5, 6, 7],), 3) == (4, 5, 6)  # one group: the flat table of before
    # vLLM's null block (id 0) where a window group freed blocks before the window -> -1
    assert group_ids(([4, 5, 6], [0, 0, 9], [0, 8, 3]), 3) == ((4, 5, 6), (-1, -1, 9), (-1, 8, 3))
    assert real_ids(((4, 5), (-1, 9))) == {4, 5, 9} and real_ids((1, 2)) == {1, 2}
    assert expand_group_ids(((1, 2), (-1, 3)), 2) == ((2, 3, 4, 5), (-1, -1, 6, 7))
    assert expand_group_ids((1, 2), 2) == (2, 3, 4, 5) and expand_group_ids((1, 2), 1) == (1, 2)


def test_block_table_keeps_every_group_from_the_scheduler_outputs() -> None:
    table = BlockTable()
    new = SimpleNamespace(req_id="a", block_ids=([1, 2], [3, 4]))
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    table.update(SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached), {"a"})
    more = SimpleNamespace(req_ids=["a"], new_block_ids=[([5], [6])], resumed_req_ids=set())
    table.update(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=more), {"a"})
    assert table.block_ids("a") == [[1, 2, 5], [3, 4, 6]]


def test_window_backoff_prefill_cuts_the_last_prompt_token_and_the_decode_expects_one_less() -> None:
    """Window 64, block 16, a 79-token prompt (79 % 16 == 15, the boundary case): the prefill computes
    78 tokens and keeps tokens 15..77 (vLLM's rule for the next position 78); the decode, handed 78,
    computes position 78, which reads tokens 15..77: the same tokens, whatever N % block_size is."""
    groups = (group("full"), group("window", 64))
    assert window_backoff(groups) == 1 and window_backoff((group("full"),)) == 0
    assert window_backoff(()) == 0  # no KV-cache config: nothing changes
    assert (pushed_tokens(79, 1), pushed_tokens(1, 1), pushed_tokens(79, 0)) == (78, 1, 79)

    prefill = PrefillScheduler(
        settings("prefill"), lambda rid: ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), backoff=1
    )
    req = vllm_request("p", {"do_remote_decode": True, "transfer_id": "t"}, 79)
    prefill.on_new_request(req)
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids)) == (78, 78, 78)
    assert req.prompt_token_ids[-1] == 177 and req.max_tokens == 1
    plain = vllm_request("q", {}, 79)  # not a P/D request: untouched
    prefill.on_new_request(plain)
    assert plain.num_prompt_tokens == 79
    prefill.update_state_after_alloc(req, SimpleNamespace(), 0)
    out = SimpleNamespace(
        num_scheduled_tokens={"p": 78},
        total_num_scheduled_tokens=78,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
    )
    (send,) = prefill.build_connector_meta(out).send
    assert (send.num_tokens, send.block_ids) == (78, ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10)))

    decode = DecodeScheduler(settings("decode"), backoff=1)
    dreq = vllm_request("d", {"do_remote_prefill": True, "transfer_id": "t", **PREFILL_AT}, 79)
    assert decode.get_num_new_matched_tokens(dreq, 0) == (78, True)
    # vLLM allocated every block of both groups for the 79 tokens (5 blocks); 78 tokens need 5 as well
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14, 15], [16, 17, 18, 19, 20]))
    decode.update_state_after_alloc(dreq, blocks, 78)
    (item,) = decode.meta.expect
    assert (item.num_tokens, item.block_ids) == (78, ((11, 12, 13, 14, 15), (16, 17, 18, 19, 20)))


def _spec(name: str, block_size: int, window: int = 0) -> Any:
    """A KV-cache spec as cache_groups reads it: by class name and attributes."""
    cls = type(name, (), {})
    spec = cls()
    spec.block_size, spec.sliding_window, spec.num_kv_heads, spec.head_size = block_size, window, 2, 64
    return spec


def _vllm_config(block_size: int) -> Any:
    ktc = SimpleNamespace(
        is_kv_producer=False,
        is_kv_consumer=True,
        engine_id="decode-0",
        kv_connector_extra_config={"host": "10.0.0.5", "port": 7100},
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
    )


def test_the_tables_block_size_is_the_groups_spec_not_cache_config() -> None:
    """vLLM 0.29 gives an all-window model's one group the kernel's 32-token blocks while cache_config
    says 128: the connector counts blocks in the group's 32 (read as 128, the table's first entries,
    freed before the window, stood for the window's tokens). Groups that agree give their size; no
    groups (or specs without one) leave cache_config's; groups that differ are refused by name."""
    from kvpush.errors import LayoutError
    from kvpush.platforms.vllm.cache_groups import cache_groups, groups_block_size
    from kvpush.platforms.vllm.connector import settings_from_vllm

    window_only = cache_groups(
        SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=_spec("SlidingWindowSpec", 32, 64))
            ]
        )
    )
    assert [(g.kind, g.window, g.block_size) for g in window_only] == [("window", 64, 32)]
    assert settings_from_vllm(_vllm_config(128), window_only).block_size == 32
    assert settings_from_vllm(_vllm_config(128)).block_size == 128  # no KV-cache config: cache_config's
    hybrid = cache_groups(
        SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(layer_names=["l0"], kv_cache_spec=_spec("FullAttentionSpec", 128)),
                SimpleNamespace(layer_names=["l1"], kv_cache_spec=_spec("SlidingWindowSpec", 128, 64)),
            ]
        )
    )
    assert groups_block_size(hybrid, 16) == 128
    assert groups_block_size((group("full"),), 16) == 16  # a spec without a block size
    mixed = (window_only[0], hybrid[0])
    with pytest.raises(LayoutError, match=r"different block sizes \(32, 128 tokens"):
        groups_block_size(mixed, 128)
