"""scripts/neuron_node_check.py: the Trainium node checks, on `kvpush doctor --json`-shaped reports.

The reports are written here in doctor's format (no Trainium, EFA or Neuron runtime on this machine); the
library resolver is a fake except in the test of the real one.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.infra.infra_tools import ROOT

SCRIPT = ROOT / "scripts" / "neuron_node_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("neuron_node_check", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


nc = _load()

GOOD: dict[str, Any] = {  # what doctor would print on a healthy trn2.48xlarge (not observed: built here)
    "instance_type": "trn2.48xlarge",
    "neuron": {
        "devices": 16,
        "runtime": {
            "path": "/opt/aws/neuron/lib/libnrt.so.1",
            "version": "2.32.5.0",
            "nrt_get_attached_efa_bdf": True,
        },
    },
    "nixl": {
        "version": "1.3.2",
        "plugins": ["LIBFABRIC", "UCX"],
        "backends": {"LIBFABRIC": {"ok": True, "mem_types": ["DRAM_SEG", "VRAM_SEG"]}},
    },
    "efa": {"devices": 16},
    "choice": {"memory": nc.DEVICE_DIRECT, "transport": "LIBFABRIC", "reason": "16 Neuron devices, 16 EFA"},
}
ENV = {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}


def _found(name: str) -> str | None:
    return f"/fake/{name}"


def _run(report: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        report=report or GOOD,
        node_env=ENV,
        process_env={},
        instance_type="trn2.48xlarge",
        neuron_devices=16,
        efa_found=16,
        resolve=_found,
    )
    args.update(kw)
    return {c.name: c for c in nc.check_node(**args)}


def _with(path: str, value: Any) -> dict[str, Any]:
    report = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = report
    for p in parents:
        node = node[p]
    node[last] = value
    return report


def test_healthy_trn2_passes_every_check() -> None:
    checks = _run()
    assert set(checks) == {
        "neuron-runtime-version",
        "neuron-efa-bdf-symbol",
        "libcuda.so.1",
        "libfabric.so.1",
        "nixl-libfabric",
        "efa-per-neuron-device",
        "efa-shm-transfer",
        "kvpush-memory-path",
    }
    assert all(c.ok for c in checks.values()), [c.line() for c in checks.values() if not c.ok]
    assert checks["libcuda.so.1"].line() == "libcuda.so.1: ok (loader finds /fake/libcuda.so.1)"


@pytest.mark.parametrize(
    ("change", "failing", "fix_says"),
    [
        (("neuron.runtime.version", "2.30.1.0"), "neuron-runtime-version", "SDK >= 2.29"),
        (("neuron.runtime.nrt_get_attached_efa_bdf", False), "neuron-efa-bdf-symbol", ">= 2.31.24"),
        (("neuron.runtime", None), "neuron-runtime-lib", "/opt/aws/neuron/lib"),
        (
            ("nixl.backends.LIBFABRIC", {"ok": False, "error": "NIXL_ERR_NOT_FOUND"}),
            "nixl-libfabric",
            "NIXL >= 0.10",
        ),
        (("nixl.backends.LIBFABRIC.mem_types", ["DRAM_SEG"]), "nixl-libfabric", "Neuron PCI devices"),
        (("choice.memory", "neuron, host staging"), "kvpush-memory-path", "host memory"),
    ],
)
def test_each_problem_fails_its_check_and_says_what_to_do(
    change: tuple[str, Any], failing: str, fix_says: str
) -> None:
    checks = _run(_with(*change))
    bad = {n for n, c in checks.items() if not c.ok}
    assert failing in bad
    assert bad <= {failing, "kvpush-memory-path"}, bad  # nothing unrelated fails
    line = checks[failing].line()
    assert line.startswith(f"{failing}: FAILED: ") and "; fix: " in line and fix_says in line


def test_libfabric_without_vram_is_named() -> None:
    line = _run(_with("nixl.backends.LIBFABRIC.mem_types", ["DRAM_SEG"]))["nixl-libfabric"].line()
    assert "(no VRAM)" in line


def test_unresolvable_libraries_fail_with_the_loader_path_fix() -> None:
    checks = _run(resolve=lambda name: None)
    for lib in ("libcuda.so.1", "libfabric.so.1"):
        assert not checks[lib].ok and "LD_LIBRARY_PATH" in checks[lib].fix
    assert "stub" in checks["libcuda.so.1"].fix


@pytest.mark.parametrize(
    ("itype", "devices", "efa", "ok"),
    [
        ("trn2.48xlarge", 16, 16, True),
        ("trn2.48xlarge", 16, 15, False),
        ("trn1.32xlarge", 16, 8, True),  # two Trainium devices per EFA there
        ("trn1.32xlarge", 16, 7, False),
        ("trn1n.32xlarge", 16, 8, False),
        ("trn2.48xlarge", 0, 16, False),  # neuron-ls saw nothing
        ("trn2.3xlarge", 1, 1, False),  # no EFA per device on that size
    ],
)
def test_efa_count_against_neuron_devices(itype: str, devices: int, efa: int, ok: bool) -> None:
    check = _run(instance_type=itype, neuron_devices=devices, efa_found=efa)["efa-per-neuron-device"]
    assert check.ok is ok, check.line()


@pytest.mark.parametrize(
    ("node_env", "process_env", "ok"),
    [
        ({"FI_EFA_ENABLE_SHM_TRANSFER": "0"}, {}, True),
        ({}, {}, False),
        ({"FI_EFA_ENABLE_SHM_TRANSFER": "1"}, {}, False),
        ({"FI_EFA_ENABLE_SHM_TRANSFER": "0"}, {"FI_EFA_ENABLE_SHM_TRANSFER": "1"}, False),
    ],
)
def test_shm_transfer_flag(node_env: dict[str, str], process_env: dict[str, str], ok: bool) -> None:
    check = _run(node_env=node_env, process_env=process_env)["efa-shm-transfer"]
    assert check.ok is ok, check.line()


def test_real_resolver_follows_the_given_environment(tmp_path: Path) -> None:
    resolve = nc.library_resolver(dict(os.environ))
    libc = resolve("libc.so.6")
    assert libc and Path(libc).name.startswith("libc.so.6")
    assert resolve("libkvpush-does-not-exist.so.1") is None


def test_main_reads_the_env_file_and_a_saved_report(tmp_path: Path) -> None:
    env_file = tmp_path / "node.env"
    env_file.write_text("# node env\nKVPUSH_ROLE=prefill\nFI_EFA_ENABLE_SHM_TRANSFER=0\n")
    report = tmp_path / "doctor.json"
    report.write_text(json.dumps(GOOD))
    env = {k: v for k, v in os.environ.items() if k != "FI_EFA_ENABLE_SHM_TRANSFER"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--env-file", str(env_file), "--neuron-devices", "16", "--efa-found", "16",
         "--doctor-json", str(report)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    lines = dict(ln.split(": ", 1) for ln in proc.stdout.splitlines())
    assert lines["efa-shm-transfer"].startswith("ok") and lines["neuron-runtime-version"].startswith("ok")
    assert len(lines) == 8
    # libcuda.so.1 / libfabric.so.1 are looked up on this machine's loader path: the exit status follows
    all_ok = all(v.startswith("ok") for v in lines.values())
    assert proc.returncode == (0 if all_ok else 1), proc.stdout
