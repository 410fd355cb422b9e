"""Checks a Trainium node before kvpush pushes Neuron HBM over NIXL's LIBFABRIC plugin.

Run by the node set-up (terraform/modules/efa-cluster/templates/node-setup.sh.tftpl) with the Python of
the virtualenv kvpush was installed into, after /etc/kvpush/node.env was written:

    VENV/bin/python scripts/neuron_node_check.py --env-file /etc/kvpush/node.env \\
        --instance-type trn2.48xlarge --neuron-devices 16 --efa-found 16

The facts come from `kvpush doctor --json` (run in the node env's environment; `--doctor-json FILE` reads a
saved report instead), so the probes are kvpush's own. One line per check, in the set-up's status format:
"name: ok (...)" or "name: FAILED: what is wrong; fix: what to do". Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_RUNTIME = (2, 31, 24)  # first runtime with nrt_get_attached_efa_bdf (Neuron SDK 2.29.0)
EFA_BDF_SYMBOL = "nrt_get_attached_efa_bdf"
DEVICE_DIRECT = "neuron HBM as VRAM (device-direct)"  # kvpush doctor's choice when everything is there


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        if self.ok:
            return f"{self.name}: ok ({self.detail})"
        return f"{self.name}: FAILED: {self.detail}; fix: {self.fix}"


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    if path.exists():
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
    return env


_WHERE = """
import ctypes, os, sys
ctypes.CDLL(sys.argv[1])
paths = [ln.split()[-1] for ln in open("/proc/self/maps") if os.path.basename(ln.split()[-1]).startswith(sys.argv[1])]
print(paths[0] if paths else sys.argv[1])
"""


def library_resolver(env: Mapping[str, str]) -> Callable[[str], str | None]:
    """Where the dynamic loader finds a library for a process started with `env` (a child process, so
    the node env's LD_LIBRARY_PATH counts), or None."""

    def resolve(name: str) -> str | None:
        proc = subprocess.run(
            [sys.executable, "-c", _WHERE, name], env=dict(env), capture_output=True, text=True, check=False
        )
        return proc.stdout.strip() or name if proc.returncode == 0 else None

    return resolve


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def check_node(
    report: Mapping[str, Any],
    node_env: Mapping[str, str],
    process_env: Mapping[str, str],
    instance_type: str,
    neuron_devices: int,
    efa_found: int,
    resolve: Callable[[str], str | None],
) -> list[Check]:
    from kvpush.apps.doctor import DEVICES_PER_EFA, NO_DEVICE_DIRECT

    checks: list[Check] = []
    neuron = report.get("neuron", {})
    rt = neuron.get("runtime")
    if not rt:
        err = neuron.get("runtime_error", "not loadable")
        checks.append(
            Check(
                "neuron-runtime-lib",
                False,
                f"libnrt.so.1 does not load: {err}",
                "install aws-neuronx-runtime-lib (Neuron DLAMI) and keep /opt/aws/neuron/lib on "
                "LD_LIBRARY_PATH in the node env",
            )
        )
    else:
        ver = _version(str(rt.get("version", "")))
        checks.append(
            Check(
                "neuron-runtime-version",
                ver[:3] >= MIN_RUNTIME,
                f"runtime {rt.get('version')} at {rt.get('path')}, need >= {'.'.join(map(str, MIN_RUNTIME))}",
                "use a Neuron DLAMI with SDK >= 2.29 (runtime 2.31.24; DLAMI 2.32 in practice) or upgrade "
                "aws-neuronx-runtime-lib",
            )
        )
        has = bool(rt.get(EFA_BDF_SYMBOL))
        checks.append(
            Check(
                "neuron-efa-bdf-symbol",
                has,
                f"{EFA_BDF_SYMBOL} {'exported' if has else 'missing'} in {rt.get('path')}",
                "upgrade the Neuron runtime to >= 2.31.24: without the symbol NIXL registers each region on "
                "every EFA instead of the one attached to its Neuron device",
            )
        )

    for lib, fix in (
        (
            "libcuda.so.1",
            "NIXL's LIBFABRIC plugin links libcuda.so.1; on Neuron a stub is enough (the DLAMI's vLLM venv "
            "ships one): add the folder holding it to LD_LIBRARY_PATH in /etc/kvpush/node.env",
        ),
        (
            "libfabric.so.1",
            "install the AWS EFA installer (it puts libfabric in /opt/amazon/efa/lib) and keep that folder "
            "on LD_LIBRARY_PATH in /etc/kvpush/node.env",
        ),
    ):
        where = resolve(lib)
        checks.append(Check(lib, where is not None, f"loader finds {where}" if where else "not found", fix))

    nixl = report.get("nixl", {})
    lf = nixl.get("backends", {}).get("LIBFABRIC", {})
    mems = [str(m) for m in lf.get("mem_types", [])]
    vram = any(m.upper().startswith("VRAM") for m in mems)
    if not lf.get("ok"):
        detail = f"NIXL {nixl.get('version')}: LIBFABRIC does not instantiate: {lf.get('error', 'not tried')}"
    else:
        detail = f"NIXL {nixl.get('version')}: LIBFABRIC instantiates, memory {mems}"
    checks.append(
        Check(
            "nixl-libfabric",
            bool(lf.get("ok")) and vram,
            detail + ("" if vram or not lf.get("ok") else " (no VRAM)"),
            "needs NIXL >= 0.10 with the LIBFABRIC plugin (the DLAMI's vLLM venv ships it), libfabric.so.1 and "
            "libcuda.so.1 resolvable; VRAM is listed only when NIXL's topology scan sees the Neuron PCI "
            "devices. Keep NIXL the same version on prefill and decode nodes",
        )
    )

    if instance_type in NO_DEVICE_DIRECT:
        checks.append(
            Check(
                "efa-per-neuron-device",
                False,
                f"{instance_type}: {NO_DEVICE_DIRECT[instance_type]}",
                "use trn2.48xlarge",
            )
        )
    else:
        per_efa = DEVICES_PER_EFA.get(instance_type, 1)
        checks.append(
            Check(
                "efa-per-neuron-device",
                neuron_devices > 0 and efa_found * per_efa >= neuron_devices,
                f"{neuron_devices} Neuron devices, {efa_found} EFA devices, {per_efa} device(s) per EFA on "
                f"{instance_type or 'an unknown type'}",
                "every Neuron device needs its EFA: check that the launch attached one EFA interface per "
                "network card (`kvpush cluster check`) and that neuron-ls sees every device",
            )
        )

    flag = "FI_EFA_ENABLE_SHM_TRANSFER"
    in_file, in_proc = node_env.get(flag), process_env.get(flag)
    ok = in_file == "0" and in_proc in (None, "0")
    checks.append(
        Check(
            "efa-shm-transfer",
            ok,
            f"{flag}={in_file} in the node env"
            + (f", {in_proc} in this environment" if in_proc is not None else ""),
            f"set {flag}=0 in /etc/kvpush/node.env and nowhere else to another value: libfabric's shm "
            "provider cannot copy Neuron memory, and prefill and decode on one host give wrong output "
            "without it (vllm-neuron DI tutorial)",
        )
    )

    choice = report.get("choice", {})
    checks.append(
        Check(
            "kvpush-memory-path",
            choice.get("memory") == DEVICE_DIRECT,
            f"kvpush doctor: {choice.get('memory')} over {choice.get('transport')}: {choice.get('reason')}",
            "fix the checks above; otherwise kvpush can only stage through host memory "
            '(kv_buffer_device "cpu"), at the staging cost in docs/backends.md',
        )
    )
    return checks


def doctor_report(env: Mapping[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "doctor", "--json"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # exit 1: doctor found a blocking problem; its report (on stdout) still says which, and the checks
    # here name the Neuron-specific fix
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"kvpush-doctor: FAILED: exit {proc.returncode}: {proc.stderr[-1500:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env-file", type=Path, default=Path("/etc/kvpush/node.env"))
    ap.add_argument("--instance-type", default="")
    ap.add_argument("--neuron-devices", type=int, required=True)
    ap.add_argument("--efa-found", type=int, required=True)
    ap.add_argument("--doctor-json", type=Path, help="read this saved `kvpush doctor --json` report")
    args = ap.parse_args(argv)
    node_env = read_env_file(args.env_file)
    # Probe in the environment the engines get: the node env's values fill what is unset here.
    env = {**node_env, **os.environ}
    report = json.loads(args.doctor_json.read_text()) if args.doctor_json else doctor_report(env)
    checks = check_node(
        report, node_env, os.environ, args.instance_type or report.get("instance_type") or "",
        args.neuron_devices, args.efa_found, library_resolver(env),
    )  # fmt: skip
    for c in checks:
        print(c.line())
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
