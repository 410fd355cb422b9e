"""vLLM's own router (`vllm-router`, PyPI, a prebuilt Rust binary) in front of kvpush engines.

Its default P/D mode (`--kv-connector nixl`) already fits kvpush's push: once a prefill's first answer
carries `kv_transfer_params.transfer_mode: "push"` with the prefill's identity (engine id, side-channel
host and port, tp_size), the router remembers it and from then on sends both legs at once, each with a
fresh `X-Request-Id`, from which both engines derive the same transfer key. The first request per
prefill goes prefill first, then decode. docs/vllm.md lists what it does not do that `kvpush proxy` does.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from kvpush.errors import ConfigError

ROUTERS = ("kvpush", "vllm-router")


def find_router() -> str:
    """The `vllm-router` executable: beside this Python (a venv), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise ConfigError(
            "vllm-router is not installed: `pip install vllm-router` (a prebuilt wheel; "
            "the Makefile's router-tools target does it for the tests)"
        )
    return found


def router_argv(
    port: int, prefills: list[str], decodes: list[str], prometheus_port: int, host: str = "127.0.0.1"
) -> list[str]:
    """vllm-router in P/D mode, round robin on both roles, checking its workers every second."""
    argv = [find_router(), "--host", host, "--port", str(port), "--vllm-pd-disaggregation"]
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    return [
        *argv,
        "--kv-connector",
        "nixl",
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warning",
    ]
