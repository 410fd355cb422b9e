"""The wheel a user installs: built from this tree, it carries the files kvpush reads at run time, and
setuptools has nothing to warn about (a folder of .py files shipped only as package data is
"importable" to setuptools, which warns on every install and plans to stop shipping such folders)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# files the installed package opens by path, not by import
RUNTIME_FILES = (
    "kvpush/py.typed",
    "kvpush/platforms/vllm/tools/_nixl_sitecustomize/sitecustomize.py",
    "kvpush/apps/bench/qwen3_32b_tp8_h200.toml",
)


def test_the_wheel_builds_without_setuptools_warnings_and_carries_its_runtime_files(tmp_path: Path) -> None:
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = build.stdout + build.stderr
    assert build.returncode == 0, out[-4000:]
    assert "importable" not in out, out[-4000:]
    (wheel,) = tmp_path.glob("kvpush-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in RUNTIME_FILES if f not in names]
    assert not missing, f"the wheel lacks {missing}"
