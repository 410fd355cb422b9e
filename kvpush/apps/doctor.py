"""`kvpush doctor [--json]`: is this host ready for kvpush, and which memory path and transport would it
use? A gate, not only a report: it exits 1 when it finds a blocking problem (the transport it would use
does not load, NIXL is missing, memory registration would fail on memlock) and names the fix for each
problem it finds. The JSON schema is in docs/doctor.md.
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from kvpush.apps.cliutil import add_output_flags, emit_json
from kvpush.apps.doctor_probes import (
    cuda_report,
    efa_report,
    gpudirect_report,
    imds_instance_type,
    memlock_report,
    neuron_report,
    nixl_report,
    ucx_report,
    versions,
)
from kvpush.apps.install_hint import install_command
from kvpush.apps.versions import wire_text, wire_versions

__all__ = ["DEVICES_PER_EFA", "NO_DEVICE_DIRECT", "Probes", "collect", "decide", "find_problems", "run"]

SCHEMA_VERSION = 1
# Sizes whose Neuron devices cannot each reach their own EFA (NIXL PR #1994; no FI_HMEM_NEURON there).
NO_DEVICE_DIRECT = {
    "trn2.3xlarge": "a single host EFA cannot be routed to individual Neuron devices (no FI_HMEM_NEURON)",
}
# Neuron devices per EFA device on the sizes kvpush supports (Neuron device maps; trn1: 2 per EFA).
DEVICES_PER_EFA = {"trn1.32xlarge": 2, "trn1n.32xlarge": 1, "trn2.48xlarge": 1}
NIXL_SUPPORTED = ((1, 5, 1), (1, 5, 2))  # [low, high): what the nixl extra pins (pyproject.toml)
MEMLOCK_RDMA_MIN = 64 << 30  # below this, pinning a production KV cache for RDMA fails part-way
BLOCKING, WARNING = "blocking", "warning"


@dataclass
class Probes:
    """What doctor looks at; tests replace any of them."""

    instance_type: Callable[[], str | None] = imds_instance_type
    nixl: Callable[[], dict[str, Any]] = nixl_report
    cuda: Callable[[], dict[str, Any]] = cuda_report
    neuron: Callable[[], dict[str, Any]] = neuron_report
    efa: Callable[[], dict[str, Any]] = efa_report
    ucx: Callable[[], dict[str, Any]] = ucx_report
    memlock: Callable[[], dict[str, int | None]] = memlock_report
    gpudirect: Callable[[], dict[str, Any]] = gpudirect_report
    versions: Callable[[], dict[str, str | None]] = versions
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


def _problem(pid: str, severity: str, what: str, fix: str) -> dict[str, str]:
    return {"id": pid, "severity": severity, "what": what, "fix": fix}


def _version_tuple(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "").split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n >> 10} KiB"


def find_problems(report: dict[str, Any]) -> list[dict[str, str]]:
    """Every problem doctor sees, blocking ones first, each with the fix."""
    found: list[dict[str, str]] = []
    nixl, choice = report["nixl"], report["choice"]
    efa, neuron, cuda = report["efa"], report["neuron"], report["cuda"]
    rdma = [d for d in efa.get("rdma", []) if d.get("driver")] or [{"name": "efa", "driver": "efa"}] * int(
        efa["devices"]
    )
    if not nixl.get("installed", True):
        found.append(
            _problem(
                "nixl-missing",
                BLOCKING,
                "NIXL is not installed: kvpush has no transport between processes",
                f"{install_command('nixl')} (install the torch build you want first: NIXL's wheels need one)",
            )
        )
    else:
        chosen = nixl["backends"].get(choice["transport"], {})
        if not chosen.get("ok"):
            fix = (
                "install the EFA software (aws-efa-installer) so libfabric with the efa provider is on the "
                "loader path (/opt/amazon/efa/lib)"
                if choice["transport"] == "LIBFABRIC"
                else f"reinstall NIXL ({install_command('nixl')} --force-reinstall); unset NIXL_PLUGIN_DIR "
                "if it points at another build"
            )
            found.append(
                _problem(
                    "transport-unavailable",
                    BLOCKING,
                    f"the chosen transport {choice['transport']} does not load: {chosen.get('error', 'not tried')}",
                    fix,
                )
            )
        have = _version_tuple(nixl.get("version"))
        low, high = NIXL_SUPPORTED
        if have and not (low <= have[:3] < high):
            found.append(
                _problem(
                    "nixl-version",
                    WARNING,
                    f"NIXL {nixl.get('version')} is not the version the nixl extra pins (>=1.5.1,<1.5.2; 1.3.2 "
                    "is tested too, see docs/backends.md)",
                    f"{install_command('nixl')} (on a Neuron DLAMI see docs/backends.md before replacing its NIXL)",
                )
            )
    soft = report["memlock"].get("soft")
    if rdma and soft is not None and soft < MEMLOCK_RDMA_MIN:
        found.append(
            _problem(
                "memlock",
                BLOCKING,
                f"RLIMIT_MEMLOCK is {_gib(soft)} on a host with RDMA devices: registering the KV cache pins it "
                "and fails past that limit",
                "raise it to unlimited: `ulimit -l unlimited` in the launching shell, `* - memlock unlimited` "
                "in /etc/security/limits.d/, LimitMEMLOCK=infinity for systemd, --ulimit memlock=-1 for docker",
            )
        )
    if efa["devices"] and not nixl["backends"].get("LIBFABRIC", {}).get("ok"):
        found.append(
            _problem(
                "efa-without-libfabric",
                WARNING,
                f"{efa['devices']} EFA devices but NIXL's LIBFABRIC backend does not load: transfers between "
                "hosts would go over UCX instead of EFA",
                "install the EFA software (aws-efa-installer) and a NIXL build with the LIBFABRIC plugin",
            )
        )
    fi = efa.get("fi_info")
    if efa["devices"] and (not fi or fi.get("rc") != 0 or not fi.get("efa_domains")):
        found.append(
            _problem(
                "efa-fi-info",
                WARNING,
                "EFA devices present but `fi_info -p efa -t FI_EP_RDM` finds no EFA domain",
                "install the EFA software (aws-efa-installer) and put /opt/amazon/efa/bin on PATH",
            )
        )
    ucx_net = report["ucx"].get("env", {}).get("UCX_NET_DEVICES", "")
    if ucx_net in ("lo", "lo0") and choice["transport"] == "UCX":
        found.append(
            _problem(
                "ucx-loopback",
                WARNING,
                "UCX_NET_DEVICES=lo: UCX is confined to loopback, so only peers on this host can be reached",
                "unset UCX_NET_DEVICES (or name the NICs to use) for a deployment across hosts",
            )
        )
    if (
        cuda.get("available")
        and rdma
        and not report["gpudirect"].get("peermem")
        and choice["memory"].startswith("cuda, host")
    ):
        found.append(
            _problem(
                "gpudirect-rdma",
                WARNING,
                "CUDA GPUs and RDMA devices, but no GPUDirect RDMA: the KV cache is staged through host memory",
                "load the peer-memory module (`modprobe nvidia_peermem`), or use an EFA driver and kernel with "
                "dma-buf support (Linux >= 5.12)",
            )
        )
    if not cuda.get("available") and cuda.get("dev_nodes"):
        found.append(
            _problem(
                "cuda-not-visible",
                WARNING,
                f"{cuda['dev_nodes']} NVIDIA devices in /dev but torch sees no CUDA device ({cuda.get('reason')})",
                "install a CUDA build of torch matching the driver, and check CUDA_VISIBLE_DEVICES",
            )
        )
    if neuron["devices"] and choice["memory"].startswith("neuron, host"):
        found.append(
            _problem(
                "neuron-staging",
                WARNING,
                f"Neuron devices, but no device-direct transfers: {choice['reason']}",
                "for device-direct: Neuron runtime >= 2.31.24 (aws-neuronx-runtime-lib), one EFA per Neuron "
                "device, NIXL's LIBFABRIC plugin; see docs/backends.md",
            )
        )
    return sorted(found, key=lambda p: p["severity"] != BLOCKING)


def collect(probes: Probes | None = None) -> dict[str, Any]:
    p = probes or Probes()
    from kvpush.protocol.wire import WIRE_VERSION

    low, high = wire_versions()
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "platform": {
            "system": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "wire_version": WIRE_VERSION,
        "wire_versions": [low, high],
        "wire": wire_text(),
        "versions": p.versions(),
        "instance_type": p.instance_type(),
        "nixl": p.nixl(),
        "ucx": p.ucx(),
        "memlock": p.memlock(),
        "cuda": p.cuda(),
        "gpudirect": p.gpudirect(),
        "neuron": p.neuron(),
        "efa": p.efa(),
        **p.extra,
    }
    report["choice"] = decide(report)
    report["problems"] = find_problems(report)
    report["ok"] = not any(pr["severity"] == BLOCKING for pr in report["problems"])
    return report


def configure(parser: argparse.ArgumentParser) -> None:
    add_output_flags(parser, "the report (schema: docs/doctor.md)")


def _cell(value: Any) -> str:
    """A probe's dict as `key value` pairs, not a raw dict."""
    if isinstance(value, dict):
        return "; ".join(f"{k} {_cell(v)}" for k, v in value.items() if v not in (None, [], {}, "")) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value) or "-"
    return str(value)


def _print_text(report: dict[str, Any], console: Console | None = None) -> None:
    out = console or Console(highlight=False)
    c = report["choice"]
    ml = report["memlock"]["soft"]
    nixl, ucx, efa = report["nixl"], report["ucx"], report["efa"]
    table = Table(title="kvpush doctor", show_header=False, box=box.SIMPLE)
    table.add_column("check", style="bold")
    table.add_column("found", overflow="fold")
    table.add_row("kvpush", f"{report['versions'].get('kvpush')} ({report['wire']})")
    table.add_row("platform", f"{report['platform']['system']} ({report['platform']['machine']})")
    table.add_row("instance type", report["instance_type"] or "unknown (IMDS not reachable)")
    table.add_row("versions", ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v))
    table.add_row("NIXL", f"{nixl.get('version')}; plugins: {', '.join(nixl.get('plugins', [])) or 'none'}")
    for name, b in nixl["backends"].items():
        table.add_row(
            f"  {name}", f"loads, memory {_cell(b['mem_types'])}" if b["ok"] else f"no: {b['error']}"
        )
    table.add_row(
        "UCX",
        f"modules {', '.join(ucx['modules']) or '?'}; env {_cell(ucx['env']) if ucx['env'] else 'default'}",
    )
    if ucx.get("transports") is not None:
        table.add_row(
            "  ucx_info", f"transports {_cell(ucx['transports'])}; devices {_cell(ucx['devices'] or [])}"
        )
    table.add_row("memlock", "unlimited" if ml is None else _gib(ml))
    table.add_row("CUDA", _cell(report["cuda"]))
    table.add_row("GPUDirect", f"peer-memory modules: {', '.join(report['gpudirect']['peermem']) or 'none'}")
    table.add_row("Neuron", _cell(report["neuron"]))
    rdma = ", ".join(f"{d['name']} ({d['driver'] or '?'})" for d in efa.get("rdma", []))
    table.add_row("EFA", f"{efa['devices']} devices; RDMA: {rdma or 'none'}; fi_info {_cell(efa['fi_info'])}")
    table.add_row("choice", f"{c['memory']} over {c['transport']}: {c['reason']}")
    out.print(table)
    if report["problems"]:
        problems = Table(title="problems", box=box.SIMPLE)
        for column in ("severity", "problem", "fix"):
            problems.add_column(column, overflow="fold")
        for pr in report["problems"]:
            problems.add_row(pr["severity"].upper(), pr["what"], pr["fix"])
        out.print(problems)
    blocking = sum(pr["severity"] == BLOCKING for pr in report["problems"])
    out.print("result        " + ("ready" if report["ok"] else f"NOT READY: {blocking} blocking problem(s)"))


def run(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """0 when kvpush can run here (warnings allowed), 1 when a blocking problem was found."""
    report = collect(probes)
    if not emit_json(args, report, sort_keys=True):
        _print_text(report)
    return 0 if report["ok"] else 1
