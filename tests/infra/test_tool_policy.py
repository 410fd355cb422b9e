"""Missing infra tools fail the run, unless KVPUSH_SKIP_INFRA=1 says to skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.infra.infra_tools import ROOT


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    target = "tests/infra/test_checkov.py::test_checkov_passes_on_terraform"
    full_env = {k: v for k, v in os.environ.items() if k != "KVPUSH_SKIP_INFRA"}
    full_env.update({"KVPUSH_INFRA_VENV": str(tmp_path / "no-venv"), **env})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", target],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_missing_tool_fails(tmp_path: Path) -> None:
    proc = _pytest(tmp_path)
    assert proc.returncode == 1, proc.stdout
    assert "no-venv/bin/checkov is missing: run `make infra-tools`" in proc.stdout


def test_kvpush_skip_infra_turns_it_into_a_skip(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, KVPUSH_SKIP_INFRA="1")
    assert proc.returncode == 0, proc.stdout
    assert "1 skipped" in proc.stdout and "KVPUSH_SKIP_INFRA=1" in proc.stdout
