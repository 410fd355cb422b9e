"""The vLLM wheels the connector is checked against without being run: 0.33.0 and 0.34.0, the CUDA builds
users deploy (no CPU build of either exists). `make vllm-wheels` (mk/vllm-wheels.mk, part of `make test`)
downloads them without dependencies into .cache/vllm-wheels/ (git ignores .cache/); a test that finds one
missing downloads it the same way. The wheels are opened as zip files and their sources read, never
imported: no vLLM engine of these versions can run here.

A failed download fails the test; KVPUSH_OFFLINE=1 makes it skip instead (a machine with no registry).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "vllm-wheels"
VERSIONS = ("0.33.0", "0.34.0")
BASE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
KV_TRANSFER_PY = "vllm/config/kv_transfer.py"
OFFLINE_ENV = "KVPUSH_OFFLINE"


def _found(version: str) -> Path | None:
    found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    return found[-1] if found else None


def wheel(version: str) -> Path:
    """The vLLM `version` wheel, downloaded once (no dependencies) into .cache/vllm-wheels/."""
    found = _found(version)
    if found is not None:
        return found
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:"]
    proc = subprocess.run([*cmd, "-d", str(CACHE)], capture_output=True, text=True, timeout=900, check=False)
    found = _found(version)
    if proc.returncode == 0 and found is not None:
        return found
    message = (
        f"pip download vllm=={version} failed (run `make vllm-wheels`):\n"
        f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    )
    if os.environ.get(OFFLINE_ENV) == "1":
        pytest.skip(f"{message}\nskipped because {OFFLINE_ENV}=1")
    pytest.fail(message, pytrace=False)


def read(version: str, path: str) -> str:
    """One source file of the vLLM `version` wheel."""
    with zipfile.ZipFile(wheel(version)) as z:
        return z.read(path).decode()
