"""What one vLLM server of `kvpush serve-pd` is: its role, ports, cores and connector settings, and the
command line and environment that start it (--kv-transfer-config for kvpush or vLLM's NIXL connectors).

Changes with vLLM's flags and the connectors' configs; starting and stopping the processes is
serve_procs.py's, putting a deployment together serve_pd.py's.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.apps.ports import free_port_range

CONNECTORS = ("kvpush", "nixl-push", "nixl-pull")
_VLLM_CLASS = {"nixl-push": "NixlPushConnector", "nixl-pull": "NixlConnector"}


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_range(1, host)


def free_ports(n: int, host: str = "127.0.0.1", span: int = 1) -> list[int]:
    """n ports p such that p..p+span-1 are all free now (side channels listen on port + tp_rank)."""
    out: list[int] = []
    taken: set[int] = set()
    while len(out) < n:
        p = free_port_range(span, host, exclude=taken)
        out.append(p)
        taken.update(range(p, p + span))
    return out


def parse_cores(spec: str) -> set[int]:
    """'0', '0-3', '0,2,4-5' -> the set of CPU ids."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"no CPU ids in {spec!r}")
    return out


@dataclass
class EngineSpec:
    """One vLLM server. role: 'prefill' | 'decode' | 'single'."""

    role: str
    model: str
    port: int
    cores: str
    connector: str | None = None  # kvpush | nixl-push | nixl-pull | None (single)
    engine_id: str = ""
    kv_port: int = 0
    max_model_len: int = 16384
    block_size: int | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.connector is None:
            return None
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}[self.role]
        cfg: dict[str, Any] = {"kv_role": role, "kv_buffer_device": "cpu", "engine_id": self.engine_id}
        if self.connector == "kvpush":
            cfg.update(kv_connector="KVPushConnector", kv_connector_module_path="kvpush.platforms.vllm")
            extra = {"host": "127.0.0.1", "port": self.kv_port}
            extra.update(self.extra_config)
            cfg["kv_connector_extra_config"] = extra
        elif self.connector in _VLLM_CLASS:
            cfg["kv_connector"] = _VLLM_CLASS[self.connector]
            if self.extra_config:
                cfg["kv_connector_extra_config"] = dict(self.extra_config)
        else:
            raise ValueError(f"unknown connector {self.connector!r}; choose one of {', '.join(CONNECTORS)}")
        return cfg

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "64",
        ]
        spec_file = Path(self.model) / "kvpush_spec.json"
        if spec_file.exists():  # our tiny models: serve them in the dtype they were built in
            argv += ["--dtype", json.loads(spec_file.read_text()).get("dtype", "auto")]
        if self.block_size:
            argv += ["--block-size", str(self.block_size)]
        kvc = self.kv_transfer_config()
        if kvc is not None:
            argv += ["--kv-transfer-config", json.dumps(kvc)]
        argv += self.extra_args
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": self.cores,
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "UCX_NET_DEVICES": env.get("UCX_NET_DEVICES", "lo"),
                "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "WARN"),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.kv_port or free_port()),
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
                "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.env)
        return argv, env


def proxy_argv(
    port: int, mode: str, prefill: EngineSpec, decode: EngineSpec, prefill_kv_port: int
) -> list[str]:
    """`kvpush proxy`'s command line in front of one prefill and one decode on this host."""
    return [
        sys.executable,
        "-m",
        "kvpush.platforms.vllm.proxy",
        "--port",
        str(port),
        "--mode",
        mode,
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--prefill-engine-id",
        prefill.engine_id,
        "--prefill-kv-host",
        "127.0.0.1",
        "--prefill-kv-port",
        str(prefill_kv_port),
    ]
