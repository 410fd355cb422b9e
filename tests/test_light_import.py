"""What importing the vLLM integration costs, in a fresh interpreter.

vLLM's config process (0.34: while resolving the extensible KV cache; 0.32+: CUDA graph mode; 0.33+:
sleep mode) imports `kvpush.platforms.vllm`, takes KVPushConnector and calls its classmethods, long
before any engine or KV cache exists. That must not load NIXL (its agent, UCX and plugins belong to the
workers) nor initialise CUDA in torch (a process that touched CUDA before vLLM forks its workers breaks
them). The proxy and the CLI import the package without vLLM at all.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

NIXL_MODULES = ("nixl", "nixl._api", "nixl._bindings")


def run_fresh(code: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


REPORT = """
import json, sys
cuda = None
if "torch" in sys.modules:
    import torch
    cuda = bool(torch.cuda.is_initialized())
print(json.dumps({
    "nixl": sorted(m for m in sys.modules if m == "nixl" or m.startswith("nixl.") or m.startswith("nixl_")),
    "torch": "torch" in sys.modules,
    "cuda": cuda,
    "vllm": "vllm" in sys.modules,
}))
"""


def test_the_package_imports_neither_vllm_torch_nor_nixl() -> None:
    found = run_fresh("import kvpush.platforms.vllm\n" + REPORT)
    assert found == {"nixl": [], "torch": False, "cuda": None, "vllm": False}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")
def test_what_vllms_config_process_does_loads_no_nixl_and_no_cuda() -> None:
    """The class as vLLM's factory finds it (kv_connector_module_path), and its config-time classmethods
    called as vLLM calls them."""
    found = run_fresh(
        textwrap.dedent(
            """
        import importlib
        from types import SimpleNamespace
        module = importlib.import_module("kvpush.platforms.vllm")
        cls = getattr(module, "KVPushConnector")
        config = SimpleNamespace(kv_buffer_device="cuda", kv_connector_extra_config={"stream_layers": 2})
        assert cls.kv_cache_access(config)
        assert cls.supports_sleep_mode(config) is False
        assert cls.requires_piecewise_for_cudagraph(config.kv_connector_extra_config) is True
        cls.get_required_kvcache_layout
        """
        )
        + REPORT
    )
    assert found["vllm"] is True and found["torch"] is True
    assert found["nixl"] == [], f"NIXL loaded by the connector's import: {found['nixl']}"
    assert found["cuda"] is False, "torch's CUDA state was initialised by the connector's import"
