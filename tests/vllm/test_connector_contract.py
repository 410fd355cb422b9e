"""KVPushConnector against the connector contract of vLLM 0.33 and 0.34 (issue 41), read from the wheels.

Two parts:
* the accounting: every method of 0.33's and 0.34's base classes is either implemented by
  KVPushConnector (with vLLM's parameters) or in INHERITED, which says why vLLM's default is right for
  kvpush; a hook a later vLLM adds fails here until someone decides.
* the four decisions of issue 41, checked against vLLM's own definitions: `kv_cache_access` (vLLM's
  `KVCacheAccess` where the installed vLLM has it, else the flags executed from 0.34's source),
  `supports_sleep_mode`, `requires_piecewise_for_cudagraph` and `may_load_async`, each with where vLLM
  calls it.
"""

from __future__ import annotations

import ast
import enum
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from tests.vllm.connector_sigs import BASE_PY, base_methods, our_methods, problems
from tests.vllm.vllm_wheels import KV_TRANSFER_PY, VERSIONS, read

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from kvpush.platforms.vllm.connector import KVPushConnector
    from kvpush.platforms.vllm.contract import KVCacheAccess
    from kvpush.platforms.vllm.decode_scheduler import DecodeScheduler
    from kvpush.platforms.vllm.params import ConnectorSettings
    from kvpush.platforms.vllm.prefill_scheduler import PrefillScheduler

# Base-class methods kvpush leaves to vLLM's default, and why that default is right for kvpush.
INHERITED: dict[str, str] = {
    "role": "the role vLLM constructed the connector with",
    "clear_connector_metadata": "drops the step's metadata; kvpush keeps no per-step state of its own there",
    "has_connector_metadata": "vLLM's bookkeeping of the bound metadata",
    "get_mem_pool_context": "kvpush registers vLLM's own KV allocation; it needs no memory pool",
    "set_host_xfer_buffer_ops": "kvpush's host staging copies with its own backend (backends/staging.py)",
    "finish_forward": "the push starts from wait_for_save/get_transfer_results; nothing to do when the "
    "model stops reading the step's KV",
    "reset_capture_state": "no worker state changes while CUDA graphs are captured (layer hooks only run "
    "with piecewise graphs: requires_piecewise_for_cudagraph)",
    "handle_preemptions": "a preempted prefill's hand-off is redone by vLLM (requires_kv_delivery); a "
    "decode's preempted request computes locally (do_remote_prefill cleared)",
    "get_kv_connector_kv_cache_events": "kvpush emits no KV cache events",
    "get_handshake_metadata": "kvpush handshakes over its own side channel, not vLLM's",
    "build_connector_worker_meta": "results go through get_transfer_results/get_finished",
    "bind_kv_cache_manager": "vLLM's default stores the manager as self._kv_cache_manager, which the "
    "prefill scheduler reads (block_table.manager_or_table)",
    "bind_gpu_block_pool": "kvpush does not touch block reference counts",
    "get_external_cache_hit_sources": "the default attributes every loaded token to one source, as kvpush "
    "pushes the whole prompt from one prefill",
    "register_finished_partial_tail": "kvpush offloads no partial tails",
    "take_events": "kvpush emits no KV cache events",
    "has_pending_block_frees": "kvpush frees blocks only when a transfer ends",
    "get_finished_count": "every worker rank reports its own completions (the world-size default)",
    "set_xfer_handshake_metadata": "handshakes go over kvpush's side channel",
    "set_xfer_handshake_metadata_pp_aware": "kvpush refuses pipeline parallelism (pp_size 1)",
    "reset_cache": "kvpush keeps no KV cache of its own to reset",
    "supports_divergent_local_hybrid_hits": "kvpush refuses hybrid (recurrent) caches: False is right",
    "requires_kv_delivery": "the producer-role default is right: a prefill preempted while its hand-off is "
    "pending is recomputed instead of pushing freed blocks",
    "supports_lookahead_block_hashes": "kvpush matches by transfer key, never by block hash: False",
    "unregister_kv_caches": "sleep mode is refused (supports_sleep_mode is False), so never called",
    "restore_kv_caches": "sleep mode is refused (supports_sleep_mode is False), so never called",
}
PRIVATE = {"_get_connector_metadata"}  # vLLM's own helper, for subclasses to call

# Where each version's vLLM asks the class (file, the call) for the decisions of issue 41.
CALLERS = {
    "kv_cache_access": ("vllm/distributed/kv_transfer/kv_connector/factory.py", ".kv_cache_access("),
    "supports_sleep_mode": ("vllm/config/vllm.py", "connector_cls.supports_sleep_mode("),
    "requires_piecewise_for_cudagraph": (
        "vllm/config/vllm.py",
        "connector_cls.requires_piecewise_for_cudagraph(",
    ),
    "may_load_async": ("vllm/v1/core/sched/scheduler.py", "self.connector.may_load_async(request)"),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_hook_is_implemented_or_deliberately_inherited(version: str) -> None:
    base = base_methods(read(version, BASE_PY))
    ours = our_methods()
    undecided = [n for n in base if n not in ours and n not in PRIVATE and n not in INHERITED]
    assert undecided == [], f"vLLM {version}: implement these or say in INHERITED why the default is right"
    newest = base_methods(read(VERSIONS[-1], BASE_PY))  # 0.33 lacks 0.34's hooks, which ours implement
    assert problems(base, ours, version, newest) == []


def test_the_inherited_list_is_not_stale() -> None:
    """A name listed as inherited that kvpush now implements, or that no base declares, is a stale
    reason: the list must say what is true."""
    declared: set[str] = set()
    for version in VERSIONS:
        declared |= set(base_methods(read(version, BASE_PY)))
    ours = our_methods()
    stale = [n for n, why in INHERITED.items() if n in ours or n not in declared]
    assert stale == []


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_asks_the_class(version: str) -> None:
    """Each decision is a method some vLLM calls (0.34: all four; 0.33: not yet the 0.34 ones), with
    the parameters kvpush's method takes."""
    base = base_methods(read(version, BASE_PY))
    ours = our_methods()
    for hook, (path, call) in CALLERS.items():
        if hook not in base:
            assert version == "0.33.0" and hook in ("kv_cache_access", "may_load_async"), hook
            continue
        assert call in read(version, path), f"vLLM {version} no longer calls {hook} in {path}"
        assert ours[hook].kind == base[hook].kind and ours[hook].positional == base[hook].positional


def wheel_flags() -> Any:
    """vLLM 0.34's KVCacheAccess, executed from the wheel's source (that class only, not the module)."""
    tree = ast.parse(read("0.34.0", KV_TRANSFER_PY))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVCacheAccess")
    space: dict[str, Any] = {"enum": enum}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), KV_TRANSFER_PY, "exec"), space)
    return space["KVCacheAccess"]


def access(kv_buffer_device: str) -> Any:
    return KVPushConnector.kv_cache_access(SimpleNamespace(kv_buffer_device=kv_buffer_device))


def test_kv_cache_access_per_memory_backend() -> None:
    """Device memory registered with NIXL: REGISTERS (one physical allocation per segment) and
    EXPORTS_FABRIC (CUDA IPC between a prefill and a decode on one host), as vLLM's own NIXL connector;
    host staging or host KV: IN_PROCESS, any allocation works."""
    ref = wheel_flags()
    assert [(m.name, m.value) for m in KVCacheAccess] == [(m.name, m.value) for m in ref]
    try:  # vLLM >= 0.34: the connector returns vLLM's own flags
        from vllm.config.kv_transfer import KVCacheAccess as installed  # type: ignore[attr-defined]
    except ImportError:
        installed = None
    for device in ("cuda", "CUDA"):
        flags = access(device)
        if installed is not None:
            assert isinstance(flags, installed)
        assert ref(int(flags)) == ref.REGISTERS | ref.EXPORTS_FABRIC
        assert ref(int(flags)).needs_single_chunk()
        assert not ref(int(flags)) & (ref.LEGACY_IPC | ref.EXPORTS_FD)
    assert ref(int(access("cpu"))) == ref.IN_PROCESS and not ref(int(access("cpu"))).needs_single_chunk()


def test_sleep_mode_is_refused() -> None:
    """vLLM >= 0.33 refuses --enable-sleep-mode when the connector's class says False: a slept decode
    frees the KV memory that kvpush's registrations (and prefills' WRITEs) point at."""
    for device in ("cuda", "cpu"):
        assert KVPushConnector.supports_sleep_mode(SimpleNamespace(kv_buffer_device=device)) is False


def test_layer_hooks_need_piecewise_cuda_graphs() -> None:
    """stream_layers pushes from save_kv_layer, which full CUDA-graph replay skips."""
    assert KVPushConnector.requires_piecewise_for_cudagraph({"stream_layers": 2}) is True
    assert KVPushConnector.requires_piecewise_for_cudagraph({"stream_layers": 1, "stream": True}) is True
    for extra in ({}, {"stream_layers": 0}, {"stream": True}, {"stream_layers": False}):
        assert KVPushConnector.requires_piecewise_for_cudagraph(extra) is False, extra


BLOCK = 16
EXTRA = {"host": "10.0.0.5", "port": 7100, "idle_wait_ms": 0}
PREFILL_AT = {"remote_engine_id": "prefill-0", "remote_host": "10.0.0.9", "remote_port": 7000}


def connector(role: str) -> Any:
    """A scheduler-side connector around one scheduler (vLLM's config is not needed for this hook)."""
    settings = ConnectorSettings.from_extra(role, f"{role}-0", EXTRA, block_size=BLOCK, tp_size=1, pp_size=1)
    c = KVPushConnector.__new__(KVPushConnector)
    c._sched = DecodeScheduler(settings) if role == "decode" else PrefillScheduler(settings)
    c._worker = None
    return c


def request(params: dict[str, Any] | None, prompt: int = 40) -> Any:
    return SimpleNamespace(
        request_id="r-1", kv_transfer_params=params, num_prompt_tokens=prompt, num_computed_tokens=0
    )


def test_may_load_async_says_what_the_decode_will_load() -> None:
    """vLLM 0.34 asks whenever a request enters its waiting queues; with --max-num-inflight-kv-loads a
    True lets the request get (and kvpush register) its blocks while the running batch is full. It
    answers as get_num_new_matched_tokens will, so no false positive holds back other loads."""
    decode, prefill = connector("decode"), connector("prefill")
    cases = {
        "pushed": ({"do_remote_prefill": True, **PREFILL_AT}, 40, True),
        "no params": (None, 40, False),
        "not remote": ({"do_remote_decode": True}, 40, False),
        "empty prompt": ({"do_remote_prefill": True, **PREFILL_AT}, 0, False),
        # refused by KVTransferParams (served without transfer): the base default would say True
        "pipeline parallel prefill": ({"do_remote_prefill": True, "pp_size": 2, **PREFILL_AT}, 40, False),
        "malformed": ({"do_remote_prefill": True, "tp_size": "two", **PREFILL_AT}, 40, False),
    }
    for name, (params, prompt, expected) in cases.items():
        req = request(params, prompt)
        assert decode.may_load_async(req) is expected, name
        assert decode._sched.get_num_new_matched_tokens(req, 0)[1] is expected, name
        # a prefill never loads, even for a request that names a prefill (the base default says True)
        assert prefill.may_load_async(req) is False, name
    # after its first allocation the decode clears do_remote_prefill: a preempted request that comes
    # back computes locally, and says so before it is queued again
    req = request({"do_remote_prefill": True, **PREFILL_AT})
    decode._sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 40)
    assert decode.may_load_async(req) is False


def test_a_wheel_that_cannot_be_downloaded_fails_unless_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """CI must not pass by skipping the wheel checks: a failed download fails them; only KVPUSH_OFFLINE=1
    (a machine without a package index, said so explicitly) turns that into a skip."""
    import subprocess

    from tests.vllm import vllm_wheels

    monkeypatch.setattr(vllm_wheels, "CACHE", tmp_path)
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no index reachable")
    )
    monkeypatch.delenv(vllm_wheels.OFFLINE_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="no index reachable"):
        vllm_wheels.wheel("0.34.0")
    monkeypatch.setenv(vllm_wheels.OFFLINE_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match="KVPUSH_OFFLINE=1"):
        vllm_wheels.wheel("0.34.0")
