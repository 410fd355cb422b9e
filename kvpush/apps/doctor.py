"""`kvpush doctor [--json]`: what this machine offers kvpush, and the memory path and transport it would
choose, with the reason.

Every probe is best-effort and quick: the instance type comes from IMDS only if 169.254.169.254 answers
within a fraction of a second, NIXL backends are tried on a throw-away agent, the Neuron runtime is probed
through its symbols (never initialised here). Nothing is required; what is missing is reported.
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import shutil
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IMDS = "http://169.254.169.254"
# Sizes whose Neuron devices cannot each reach their own EFA (NIXL PR #1994; no FI_HMEM_NEURON there).
NO_DEVICE_DIRECT = {
    "trn2.3xlarge": "a single host EFA cannot be routed to individual Neuron devices (no FI_HMEM_NEURON)",
}
# Neuron devices per EFA device on the sizes kvpush supports (Neuron device maps; trn1: 2 per EFA).
DEVICES_PER_EFA = {"trn1.32xlarge": 2, "trn1n.32xlarge": 1, "trn2.48xlarge": 1}


def imds_instance_type(timeout: float = 0.3) -> str | None:
    """IMDSv2 instance type, or None when IMDS does not answer at once (not on EC2, or blocked)."""
    try:
        req = urllib.request.Request(
            f"{IMDS}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            token = resp.read().decode()
        req = urllib.request.Request(
            f"{IMDS}/latest/meta-data/instance-type", headers={"X-aws-ec2-metadata-token": token}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return str(resp.read().decode().strip()) or None
    except (OSError, ValueError):
        return None


def nixl_report() -> dict[str, Any]:
    """NIXL version, the plugins it can see, and which of UCX / LIBFABRIC instantiate (with mem types)."""
    out: dict[str, Any] = {"version": None, "plugins": [], "backends": {}}
    try:
        from importlib.metadata import version

        out["version"] = version("nixl")
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - metadata lookups fail in many ways; report, never crash
        out["version_error"] = str(exc)
    try:
        from kvpush.transport.nixl import NixlTransport, prepare_environment
    except ImportError as exc:
        out["error"] = str(exc)
        return out
    prepare_environment("lo")
    for backend in ("UCX", "LIBFABRIC"):
        try:
            t = NixlTransport(f"kvpush-doctor-{backend}", (backend,), environ={})
        except Exception as exc:  # noqa: BLE001 - the reason is the report
            out["backends"][backend] = {"ok": False, "error": str(exc)}
            continue
        out["plugins"] = sorted(t._agent.get_plugin_list())
        out["backends"][backend] = {"ok": True, "mem_types": list(t._agent.get_backend_mem_types(backend))}
        t.close()
    return out


def cuda_report() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch not installed"}
    if not torch.cuda.is_available():
        return {"available": False, "reason": "torch sees no CUDA device"}
    return {
        "available": True,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def neuron_report() -> dict[str, Any]:
    devices = sorted(glob.glob("/dev/neuron[0-9]*"))
    out: dict[str, Any] = {"devices": len(devices)}
    try:
        from kvpush.backends.neuron import EFA_BDF_SYMBOL, NeuronRuntime
        from kvpush.errors import KVPushError

        rt = NeuronRuntime.load()
        out["runtime"] = {
            "path": rt.path,
            "version": ".".join(map(str, rt.version())),
            EFA_BDF_SYMBOL: rt.has_symbol(EFA_BDF_SYMBOL),
        }
    except KVPushError as exc:
        out["runtime"] = None
        out["runtime_error"] = str(exc)
    return out


def efa_report(run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    out: dict[str, Any] = {"devices": len(glob.glob("/sys/class/infiniband/*")), "fi_info": None}
    if shutil.which("fi_info"):
        try:
            res = run(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=5)
            domains = {
                ln.split(":", 1)[1].strip()
                for ln in res.stdout.splitlines()
                if ln.strip().startswith("domain:")
            }
            out["fi_info"] = {"rc": res.returncode, "efa_domains": sorted(domains)}
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["fi_info"] = {"error": str(exc)}
    return out


@dataclass
class Probes:
    """What doctor looks at; tests replace any of them."""

    instance_type: Callable[[], str | None] = imds_instance_type
    nixl: Callable[[], dict[str, Any]] = nixl_report
    cuda: Callable[[], dict[str, Any]] = cuda_report
    neuron: Callable[[], dict[str, Any]] = neuron_report
    efa: Callable[[], dict[str, Any]] = efa_report
    extra: dict[str, Any] = field(default_factory=dict)


def decide(report: dict[str, Any]) -> dict[str, str]:
    """The memory path and transport kvpush would use here, and why."""
    itype = report.get("instance_type") or ""
    lf = report["nixl"]["backends"].get("LIBFABRIC", {})
    lf_vram = bool(lf.get("ok")) and any(m.upper().startswith("VRAM") for m in lf.get("mem_types", []))
    efa = int(report["efa"]["devices"])
    neuron = int(report["neuron"]["devices"])
    cuda = bool(report["cuda"].get("available"))
    transport = "LIBFABRIC" if lf.get("ok") and efa else "UCX"
    why_t = (
        "EFA present and LIBFABRIC loads"
        if transport == "LIBFABRIC"
        else ("no EFA device" if not efa else f"LIBFABRIC does not load: {lf.get('error', 'not tried')}")
        + "; UCX (one host)"
    )
    if neuron:
        if itype in NO_DEVICE_DIRECT:
            return {
                "memory": "neuron, host staging",
                "transport": transport,
                "reason": f"{itype}: {NO_DEVICE_DIRECT[itype]}; staging through host memory would be used",
            }
        ratio = DEVICES_PER_EFA.get(itype, 1)
        if efa * ratio < neuron:
            return {
                "memory": "neuron, host staging",
                "transport": transport,
                "reason": f"{neuron} Neuron devices but {efa} EFA devices: not every device has its own EFA",
            }
        rt = report["neuron"].get("runtime") or {}
        if not rt.get("nrt_get_attached_efa_bdf"):
            return {
                "memory": "neuron, host staging",
                "transport": transport,
                "reason": "the Neuron runtime lacks nrt_get_attached_efa_bdf (needs >= 2.31.24) or is missing",
            }
        if not lf_vram:
            return {
                "memory": "neuron, host staging",
                "transport": transport,
                "reason": "LIBFABRIC does not list VRAM (Neuron runtime must be initialised before NIXL)",
            }
        return {
            "memory": "neuron HBM as VRAM (device-direct)",
            "transport": "LIBFABRIC",
            "reason": f"{neuron} Neuron devices, {efa} EFA, LIBFABRIC lists VRAM",
        }
    if cuda:
        if transport == "LIBFABRIC" and not lf_vram:
            return {
                "memory": "cuda, host staging",
                "transport": transport,
                "reason": "LIBFABRIC does not list VRAM (no GPUDirect RDMA)",
            }
        return {"memory": "cuda VRAM", "transport": transport, "reason": f"CUDA GPUs visible; {why_t}"}
    return {"memory": "host DRAM", "transport": transport, "reason": f"no accelerator visible; {why_t}"}


def collect(probes: Probes | None = None) -> dict[str, Any]:
    p = probes or Probes()
    report: dict[str, Any] = {
        "platform": {
            "system": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "instance_type": p.instance_type(),
        "nixl": p.nixl(),
        "cuda": p.cuda(),
        "neuron": p.neuron(),
        "efa": p.efa(),
        **p.extra,
    }
    report["choice"] = decide(report)
    return report


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace, probes: Probes | None = None) -> int:
    report = collect(probes)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    c = report["choice"]
    print(f"platform      {report['platform']['system']} ({report['platform']['machine']})")
    print(f"instance type {report['instance_type'] or 'unknown (IMDS not reachable)'}")
    nixl = report["nixl"]
    print(f"NIXL          {nixl.get('version')}; plugins: {', '.join(nixl.get('plugins', [])) or 'none'}")
    for name, b in nixl["backends"].items():
        print(f"  {name:<10}  " + (f"loads, memory {b['mem_types']}" if b["ok"] else f"no: {b['error']}"))
    print(f"CUDA          {report['cuda']}")
    print(f"Neuron        {report['neuron']}")
    print(f"EFA           {report['efa']}")
    print(f"choice        {c['memory']} over {c['transport']}: {c['reason']}")
    return 0
