"""Free TCP ports for programs and tests that start listeners on 127.0.0.1.

A port the kernel hands out with bind(0) comes from the ephemeral range, which every outgoing connection
(UCX, vLLM, ZeroMQ) also draws from: released and bound again a moment later, it may already be taken.
Ports are therefore picked below (or above) the ephemeral range, at random, and checked bindable.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FLOOR = 10_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32_768, 60_999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port_range(n: int = 1, host: str = "127.0.0.1", exclude: set[int] | None = None) -> int:
    """A base port b such that b .. b+n-1 are all free now and outside the ephemeral range."""
    low, high = _ephemeral_range()
    spans = [(lo, hi) for lo, hi in ((_FLOOR, low - 1), (high + 1, 65_535)) if hi - lo > 10 * n]
    rng = random.SystemRandom()
    taken = exclude or set()
    for _ in range(500):
        lo, hi = rng.choice(spans) if spans else (1024, 65_535)
        base = rng.randrange(lo, hi - n + 1)
        ports = range(base, base + n)
        if not taken.intersection(ports) and all(_bindable(host, p) for p in ports):
            return base
    raise RuntimeError(f"no {n} consecutive free ports on {host} outside the ephemeral range {low}-{high}")
