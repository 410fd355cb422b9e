"""Waves of clients that hang up early, through `kvpush proxy`, against a running prefill/decode pair.

Each wave sends `per_wave` completions at once (prompts of `min_words`..`max_words` words) on raw sockets
and closes every socket at a random moment `close_min_s`..`close_max_s` after sending. Then it waits, up
to `bound_s`, until both engines are back to rest: vLLM's KV usage 0 and no request running or waiting
(the engines' /metrics), and kvpush outstanding 0 on both sides (the workers' stats files). A wave that
does not settle in time is reported with both sides' state, so a hold names what holds.

One hold is not a bug, and each wave says how often it happened: a client that leaves before the decode's
API server has handed the request to its engine (vLLM cancels the handler on disconnect, before
`add_request`) leaves a decode engine that never heard of it, so nothing tells the prefill, which holds
the prompt's blocks until its `lease_s` runs out ("lease expired: no registration from decode"). Such a
wave settles by `lease_bound_s` with the decode at rest at `bound_s` and the prefill's `failed_expired` count up.

Used by tests/vllm/test_disconnect_stress.py (a few waves in CI) and from the command line for long runs:
    python -m kvpush.platforms.vllm.tools.disconnect_stress --waves 10 --per-wave 8
(it starts its own pair with the fast tiny model, or uses one given with --prefill/--decode/--proxy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import client


@dataclass(frozen=True)
class Target:
    proxy: str  # http://host:port of `kvpush proxy`
    prefill: str  # the engines' own API (for /metrics)
    decode: str
    stats_dir: Path  # the connector's stats_dir (both workers write there)
    model: str


@dataclass
class Wave:
    index: int
    closed_after_s: list[float]
    settled_s: float | None = None  # None: still holding at the bound
    lease_expiries: int = 0  # prefill pushes ended by their lease during the wave (decode never heard)
    at_bound: dict[str, Any] = field(default_factory=dict)  # both sides at bound_s, if not at rest then
    peak_decode_kv: float = 0.0  # the decode's highest KV usage while the clients were connected
    state: dict[str, Any] = field(default_factory=dict)  # both sides' state when it settled or gave up


def _send_and_hang_up(url: str, body: bytes, close_after_s: float) -> None:
    """POST on a raw socket and close it `close_after_s` later, whatever has been answered by then."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(close_after_s)


def _stats(stats_dir: Path, role: str) -> dict[str, Any]:
    for path in sorted(stats_dir.glob(f"*{role}-rank0.json")):
        try:
            loaded: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return loaded
    return {}


def engine_state(url: str) -> dict[str, float]:
    """What vLLM's /metrics says about held blocks and live requests."""
    samples = client.metrics(url)
    return {
        "kv_usage": client.metric(samples, "vllm:kv_cache_usage_perc"),
        "running": client.metric(samples, "vllm:num_requests_running"),
        "waiting": client.metric(samples, "vllm:num_requests_waiting"),
    }


def state(target: Target) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, url in (("prefill", target.prefill), ("decode", target.decode)):
        try:
            side: dict[str, Any] = dict(engine_state(url))
        except (OSError, urllib.error.URLError) as exc:
            side = {"error": repr(exc)}
        st = _stats(target.stats_dir, role)
        side["outstanding"] = st.get("outstanding")
        side["pending"] = st.get("pending")
        side["expired"] = (st.get("endpoint") or {}).get("failed_expired", 0)
        out[role] = side
    return out


def side_at_rest(side: dict[str, Any]) -> bool:
    return (
        side.get("kv_usage") == 0.0
        and side.get("running") == 0.0
        and side.get("waiting") == 0.0
        and side.get("outstanding") == 0
    )


def at_rest(snap: dict[str, Any]) -> bool:
    return all(side_at_rest(side) for side in snap.values())


def lease_explains(wave: Wave) -> bool:
    """A wave not at rest by bound_s is explained by the lease alone if the decode was at rest then, the
    prefill settled afterwards, and the prefill's lease ended at least one push meanwhile."""
    decode = wave.at_bound.get("decode", {})
    return wave.settled_s is not None and side_at_rest(decode) and wave.lease_expiries > 0


def lease_bound(lease_s: float, write_timeout_s: float = 10.0, write_linger_s: float = 1.0) -> float:
    """The latest a handed-over prompt's blocks go back (docs/vllm.md's bound table), plus 5 s for the
    engine steps and the stats files that report it."""
    return lease_s + write_timeout_s + write_linger_s + 5.0


def settled_in_bound(wave: Wave, bound_s: float) -> bool:
    """At rest by bound_s, or later only because a decode never heard of a request (lease_explains)."""
    if wave.settled_s is None:
        return False
    return wave.settled_s <= bound_s or lease_explains(wave)


def run_wave(
    target: Target,
    index: int,
    prompts: list[str],
    rng: random.Random,
    *,
    max_tokens: int = 64,
    close_min_s: float = 0.05,
    close_max_s: float = 0.5,
    bound_s: float = 20.0,
    lease_bound_s: float | None = None,
) -> Wave:
    """Send one wave and wait for rest: `bound_s`, or up to `lease_bound_s` (if given) for a prefill
    holding by lease what a decode never heard of; see the module docstring."""
    expired_before = state(target)["prefill"].get("expired") or 0
    closes = [round(rng.uniform(close_min_s, close_max_s), 3) for _ in prompts]
    threads = []
    for prompt, close_after in zip(prompts, closes, strict=True):
        body = json.dumps(
            {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        ).encode()
        t = threading.Thread(target=_send_and_hang_up, args=(target.proxy, body, close_after), daemon=True)
        t.start()
        threads.append(t)
    wave = Wave(index, closes)
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        # the decode must really hold blocks for these requests, or the wave tests nothing
        try:
            kv = engine_state(target.decode)["kv_usage"]
        except (OSError, urllib.error.URLError):
            kv = 0.0
        wave.peak_decode_kv = max(wave.peak_decode_kv, kv)
        time.sleep(0.05)
    t0 = time.monotonic()
    limit = max(bound_s, lease_bound_s or 0.0)
    while True:
        snap = state(target)
        waited = time.monotonic() - t0
        wave.lease_expiries = (snap["prefill"].get("expired") or 0) - expired_before
        if at_rest(snap):
            wave.settled_s, wave.state = round(waited, 2), snap
            return wave
        if waited > bound_s and not wave.at_bound:
            wave.at_bound = snap
        if waited > limit:
            wave.state = snap
            return wave
        time.sleep(0.25)


def run_waves(
    target: Target,
    waves: int,
    per_wave: int = 8,
    *,
    seed: int = 0,
    min_words: int = 150,
    max_words: int = 750,
    bound_s: float = 20.0,
    lease_bound_s: float | None = None,
    close_min_s: float = 0.05,
    close_max_s: float = 0.5,
    stop_on_hold: bool = False,
    log: Any = None,
) -> list[Wave]:
    """Run `waves` waves; each settles within bound_s (or lease_bound_s, see run_wave) or is reported
    holding (with the state)."""
    rng = random.Random(seed)
    out = []
    for i in range(waves):
        lengths = [rng.randint(min_words, max_words) for _ in range(per_wave)]
        prompts = client.make_prompts(per_wave, lengths, seed=rng.randrange(1 << 30))
        wave = run_wave(
            target,
            i,
            prompts,
            rng,
            bound_s=bound_s,
            lease_bound_s=lease_bound_s,
            close_min_s=close_min_s,
            close_max_s=close_max_s,
        )
        out.append(wave)
        if log is not None:
            log(json.dumps(dataclasses.asdict(wave)))
        if stop_on_hold and wave.settled_s is None:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waves", type=int, default=10)
    p.add_argument("--per-wave", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bound-s", type=float, default=20.0, help="a wave must settle within this")
    p.add_argument("--close-min-s", type=float, default=0.05)
    p.add_argument("--close-max-s", type=float, default=0.5)
    p.add_argument("--log-dir", default="out/disconnect-stress")
    p.add_argument("--lease-s", type=float, default=120.0, help="the engines' lease_s (default: kvpush's)")
    args = p.parse_args(argv)

    from .serve_pd import start_pd
    from .tiny_model import build

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    model = str(build("fast"))
    stats = log_dir / "stats"
    extra = {"stats_dir": str(stats), "lease_s": args.lease_s, "ready_timeout_s": args.lease_s + 30}
    dep = start_pd("kvpush", model, log_dir, prefill_extra=extra, decode_extra=extra)
    try:
        prefill, decode = dep.engines
        target = Target(dep.url, prefill.url, decode.url, stats, model)
        waves = run_waves(
            target,
            args.waves,
            args.per_wave,
            seed=args.seed,
            bound_s=args.bound_s,
            lease_bound_s=lease_bound(args.lease_s),
            close_min_s=args.close_min_s,
            close_max_s=args.close_max_s,
            log=print,
        )
    finally:
        dep.stop()
    held = [w.index for w in waves if not settled_in_bound(w, args.bound_s)]
    by_lease = [w.index for w in waves if lease_explains(w) and (w.settled_s or 0.0) > args.bound_s]
    settled = [w.settled_s for w in waves if w.settled_s is not None]
    print(
        f"{len(waves)} waves, {len(held)} held past {args.bound_s}s without a lease to explain it {held}; "
        f"{len(by_lease)} settled by the prefill's lease {by_lease}; slowest settle "
        f"{max(settled, default=0.0)}s; logs in {log_dir}"
    )
    return 1 if held else 0


if __name__ == "__main__":
    sys.exit(main())
