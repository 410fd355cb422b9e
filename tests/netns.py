"""Two hosts on one machine: two network namespaces joined by a veth pair (issue 17's two-host test bed).

Host A is 192.0.2.1/24, host B 192.0.2.2/24 (TEST-NET-1, a documentation range: nothing routes it, and
the pair exists only while the test runs; the fixture deletes both namespaces, which deletes the veth).
Each namespace has only its own loopback and its end of the veth, so a process in A reaches B only
across the veth; `TwoHosts.veth_bytes()` reads the veth's byte counters to show traffic crossed it.
Skips with the reason when not root or when `ip netns` does not work here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest

ADDR_A, ADDR_B = "192.0.2.1", "192.0.2.2"


@dataclass(frozen=True)
class TwoHosts:
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str

    def argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """argv run inside namespace `ns` (ns_a or ns_b)."""
        return ["ip", "netns", "exec", ns, *argv]

    def popen(
        self, ns: str, argv: Sequence[str], env: Mapping[str, str], **kw: object
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(ns, argv), env=dict(env), text=True, **kw)  # type: ignore[call-overload]

    def veth_bytes(self) -> int:
        """Bytes host A's end of the veth sent plus received."""
        total = 0
        for name in ("tx_bytes", "rx_bytes"):
            out = _ip("netns", "exec", self.ns_a, "cat", f"/sys/class/net/{self.dev_a}/statistics/{name}")
            total += int(out)
        return total


def _ip(*args: str) -> str:
    return subprocess.run(
        ["ip", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()


def _why_not() -> str:
    if os.geteuid() != 0:
        return "the two-host test bed needs root (network namespaces and a veth pair)"
    if shutil.which("ip") is None:
        return "the two-host test bed needs iproute2's `ip`"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return ""


@contextlib.contextmanager
def bed() -> Iterator[TwoHosts]:
    """The two namespaces and the veth between them, for as long as the block runs; skips (naming why)
    where they cannot be made. Deleting the namespaces deletes the veth with them."""
    why = _why_not()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    hosts = TwoHosts(f"kvp-a-{tag}", f"kvp-b-{tag}", f"kva{tag}", f"kvb{tag}")
    made: list[str] = []
    try:
        for ns in (hosts.ns_a, hosts.ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", hosts.dev_a, "type", "veth", "peer", "name", hosts.dev_b)
        for ns, dev, addr in ((hosts.ns_a, hosts.dev_a, ADDR_A), (hosts.ns_b, hosts.dev_b, ADDR_B)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", hosts.dev_a], check=False, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[TwoHosts]:
    with bed() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def two_hosts_module() -> Iterator[TwoHosts]:
    """One bed for a whole module: real vLLM engines on it start once and serve every test there."""
    with bed() as hosts:
        yield hosts


def host_env(**extra: str) -> dict[str, str]:
    """The environment of a process on one of the two hosts: UCX left to its defaults (no device named,
    as a user would run it) except that it must use TCP, so no shared-memory or loopback shortcut
    between the two processes of this one machine is possible."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_") and k != "KVPUSH_HMAC_KEY"}
    env.update(UCX_TLS="tcp", NIXL_LOG_LEVEL="WARN", **extra)
    return env
