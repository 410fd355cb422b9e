"""Engines several real-vLLM test modules share: started once, on first use, and stopped after the last
test that uses them (tests/vllm/conftest.py orders those tests back to back and does the stopping).

A vLLM engine takes ~25 s to start on the idle 2-core box (three interpreters, each importing vLLM and
torch), much more under load; a P/D pair with its proxy is two of those. Tests that need a pair of one
configuration share it; each leaves it at rest (conftest.py checks that after every such test: no KV block
held, no request running or waiting, no kvpush transfer outstanding on either side), so the next test
starts from the state a fresh pair would give it, counters aside: tests compare counters before and after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvpush.platforms.vllm.tools import disconnect_stress
from kvpush.platforms.vllm.tools.serve_pd import Deployment, start_pd, start_single
from kvpush.platforms.vllm.tools.tiny_model import build

# the fast pair's lease: a prefill frees a prompt no decode asked for after this long
FAST_PAIR_LEASE_S = 30.0
# how long a test's leftovers may take to settle: a prompt whose decode never heard of it is freed by the
# prefill's lease (FAST_PAIR_LEASE_S), a receive that never completes by the decode's fence
AT_REST_TIMEOUT_S = disconnect_stress.lease_bound(FAST_PAIR_LEASE_S) + 20.0


def start_fast_pair(logs: Path) -> Deployment:
    """A kvpush P/D pair of the fast tiny model behind the kvpush proxy, writing stats to logs/stats
    (`stats_dir` rides on the deployment): test_kvpush_vllm.py's, and test_router_vllm.py's behind a
    vllm-router of its own."""
    stats = logs / "stats"
    extra = {"stats_dir": str(stats), "lease_s": FAST_PAIR_LEASE_S, "ready_timeout_s": FAST_PAIR_LEASE_S + 10}
    dep = start_pd("kvpush", str(build("fast")), logs, prefill_extra=extra, decode_extra=extra)
    dep.stats_dir = stats  # type: ignore[attr-defined]
    return dep


class SharedEngines:
    """The session's shared deployments by name, each started by its starter on first use (and again if
    one of its processes died)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.deps: dict[str, Deployment] = {}

    def get(self, name: str, start: Callable[[Path], Deployment]) -> Deployment:
        dep = self.deps.get(name)
        if dep is not None and not all(p.alive() for p in dep.procs):
            self.stop(name)
            dep = None
        if dep is None:
            logs = self.root / name
            logs.mkdir(parents=True, exist_ok=True)
            dep = self.deps[name] = start(logs)
        return dep

    def stop(self, name: str) -> None:
        dep = self.deps.pop(name, None)
        if dep is not None:
            dep.stop()

    def stop_all(self) -> None:
        for name in list(self.deps):
            self.stop(name)


def at_rest_or_say_why(dep: Deployment, timeout_s: float = AT_REST_TIMEOUT_S) -> None:
    """Wait until both engines of a shared pair are at rest (disconnect_stress.at_rest: KV usage 0,
    nothing running or waiting, kvpush outstanding 0 on both sides); an AssertionError names what each
    side still holds if they are not within timeout_s."""
    prefill, decode = dep.engines[:2]
    stats_dir = Path(dep.stats_dir)  # type: ignore[attr-defined]
    target = disconnect_stress.Target(dep.url, prefill.url, decode.url, stats_dir, "")
    deadline = time.monotonic() + timeout_s
    while True:
        snap = disconnect_stress.state(target)
        if disconnect_stress.at_rest(snap):
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"the shared pair is not at rest {timeout_s:.0f} s after the test: {snap}")
        time.sleep(0.25)


def start_reference(model: str, max_model_len: int, engine_args: list[str]) -> Callable[[Path], Deployment]:
    """A starter for a reference single engine (core 0, no connector) of `model`."""

    def start(logs: Path) -> Deployment:
        return start_single(
            str(build(model)), logs, cores="0", max_model_len=max_model_len, engine_args=list(engine_args)
        )

    return start
