"""`kvpush bench-vllm`'s instruments: one point through vLLM's own `vllm bench serve`, the proxy's
per-request timings, idle CPU of each set-up's engines (and of kvpush's own threads), the single-engine
prefill calibration behind --loads, and the environment vLLM's own NIXL servers are tuned with."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from kvpush.apps.procstat import thread_run_ns

from . import client
from .serve_pd import Deployment
from .vllm_bench import bench_serve_argv, run_bench_serve

CLK = os.sysconf("SC_CLK_TCK")


def _tree_pids(dep: Deployment) -> list[int]:
    groups = {p.pid for p in dep.procs if "proxy" not in p.name}
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.getpgid(int(d)) in groups:
                out.append(int(d))
        except (ProcessLookupError, PermissionError):
            continue
    return out


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / CLK


def _thread_ns(pid: int, tid: int) -> int | None:
    return thread_run_ns(pid, tid)


def kvpush_threads(stats_dir: Path) -> dict[str, tuple[int, int]]:
    """kvpush's own threads in the engines, as the connector reports them: label -> (pid, tid)."""
    out: dict[str, tuple[int, int]] = {}
    for f in sorted(stats_dir.glob("*.json")):
        try:
            snap = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for name, tid in (snap.get("threads") or {}).items():
            out[f"{snap.get('role', f.stem)}:{name}"] = (int(snap["pid"]), int(tid))
    return out


def idle_cpu(
    dep: Deployment, seconds: float = 5.0, threads: dict[str, tuple[int, int]] | None = None
) -> tuple[float, dict[str, float]]:
    """Cores the set-up's engine processes burn while no request is in flight, and, per named thread,
    the cores that thread burns (schedstat: exact run time, not tick samples)."""
    pids = _tree_pids(dep)
    threads = threads or {}
    t0 = time.monotonic()
    a = _cpu_seconds(pids)
    ta = {k: _thread_ns(*v) for k, v in threads.items()}
    time.sleep(seconds)
    tb = {k: _thread_ns(*v) for k, v in threads.items()}
    wall = time.monotonic() - t0
    per_thread: dict[str, float] = {}
    for k in threads:
        before, after = ta[k], tb[k]
        if before is not None and after is not None:
            per_thread[k] = (after - before) / 1e9 / wall
    return (_cpu_seconds(pids) - a) / wall, per_thread


def proxy_timings(url: str, token: str, clear: bool = True) -> list[dict[str, Any]]:
    """The proxy's per-request timestamps (see proxy/server.py TimingsLog; the proxy serves them only with
    its token, Deployment.timings_token); [] if the proxy has none."""
    import urllib.request

    req = urllib.request.Request(
        f"{url}/kvpush/timings{'?clear=1' if clear else ''}", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def prefill_to_first_token(timings: list[dict[str, Any]]) -> list[float]:
    """Seconds from the prefill's answer reaching the proxy to decode's first chunk reaching it.

    The same instrument for every connector: transfer, decode noticing and one decode step. Negative
    when decode's first token arrives before the prefill's HTTP answer does."""
    return [
        t["first_chunk"] - t["prefill_done"] for t in timings if "first_chunk" in t and "prefill_done" in t
    ]


def run_point(
    url: str,
    model: str,
    input_len: int,
    qps: float,
    out_len: int,
    num_prompts: int,
    seed: int,
    out_dir: Path,
    name: str,
    timeout_s: float = 600.0,
    timings_token: str = "",
) -> dict[str, Any]:
    """One point driven by vLLM's own `vllm bench serve`; its result file plus our extras:
    prefill_to_first_token_s (the proxy's clock, same instrument for every connector)."""
    proxy_timings(url, timings_token)  # drop the warm-up's and earlier points' records
    result = out_dir / name
    argv = bench_serve_argv(
        url,
        model,
        input_len=input_len,
        output_len=out_len,
        num_prompts=num_prompts,
        request_rate=qps,
        seed=seed,
        result_dir=out_dir,
        result_filename=name,
        request_id_prefix=f"b{seed}-{time.time_ns()}-",
    )
    # the whole point may take num_prompts x the per-request timeout at worst; bound it anyway
    out = run_bench_serve(argv, result, max(600.0, timeout_s * 4), out_dir / "logs" / f"{name}.log")
    out["prefill_to_first_token_s"] = prefill_to_first_token(proxy_timings(url, timings_token))
    out["load_generator"] = " ".join(argv[: argv.index("--backend")])
    return out


def _words_for_tokens(n: int) -> int:
    return max(1, n // 2)  # the tiny tokenizer gives about 2 tokens per corpus word


def _warm_up(url: str, model: str, tries: int, timeout_s: float) -> dict[str, Any]:
    """A first request through the proxy; retried, because a first NIXL handshake can time out."""
    out: dict[str, Any] = {"ok": False, "attempts": []}
    for _ in range(max(1, tries)):
        r = client.stream_complete(url, model, "warm up", 4, timeout=timeout_s)
        out["attempts"].append({"ok": r.ok, "latency_s": round(r.latency, 3), "error": r.error})
        if r.ok:
            out["ok"] = True
            break
    return out


def _vllm_xfer_metrics(log_dir: Path) -> list[tuple[int, float]]:
    """(count, avg xfer ms) from vLLM's periodic 'KV Transfer metrics' log lines (both engines)."""
    pat = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([0-9.]+)")
    out: list[tuple[int, float]] = []
    for f in sorted(log_dir.glob("*.log")):
        for m in pat.finditer(f.read_text(errors="replace")):
            if int(m.group(1)) > 0:
                out.append((int(m.group(1)), float(m.group(2))))
    return out


def _nixl_tune_env(delay_us: int, *, unpin: bool = True) -> dict[str, str]:
    """Environment for a vLLM NIXL server: progress-thread delay and/or no KV core pin (see the shim)."""
    env: dict[str, str] = {}
    if delay_us > 0:
        env["KVPUSH_NIXL_PTHR_DELAY_US"] = str(delay_us)
        env["UCX_RCACHE_MAX_UNRELEASED"] = "1024"
    if unpin:
        env["KVPUSH_VLLM_NO_KV_CORE_PIN"] = "1"
    if env:
        here = Path(__file__).with_name("_nixl_sitecustomize")
        env["PYTHONPATH"] = f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def points_from_loads(prefill_s: dict[int, float], loads: list[float]) -> list[tuple[int, float]]:
    """(input, QPS) points that offer each prefill engine the given fractions of its capacity.

    A 1P1D set-up saturates when arrivals x prefill time reaches 1; above that every connector's TTFT is
    the queue's growth over the run, not the transfer. QPS are rounded to two significant digits so the
    file names stay readable; the offered load is recorded with each point.
    """
    out: list[tuple[int, float]] = []
    for n, t in prefill_s.items():
        if t <= 0:
            raise ValueError(f"prefill time for {n} tokens must be positive, got {t}")
        for load in loads:
            if not 0 < load < 1.5:
                raise ValueError(f"load {load} is outside (0, 1.5): it is a fraction of prefill capacity")
            out.append((n, float(f"{load / t:.2g}")))
    return out


def calibrate_prefill(
    model: str,
    in_lens: list[int],
    log_dir: Path,
    seed: int,
    tries: int = 3,
    confine: bool = True,
    kv_cache_gib: float = 4.0,
    engine_args: list[str] | None = None,
) -> dict[int, float]:
    """Median time for one engine alone (no connector, the prefill engine's core) to prefill each prompt
    length: the unit that --loads is measured in."""
    from .serve_pd import start_single

    out: dict[int, float] = {}
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"}
    dep = start_single(model, log_dir, confine=confine, env=env, engine_args=engine_args)
    try:
        client.stream_complete(dep.url, model, "warm up", 2, timeout=120)
        for n in in_lens:
            prompts = client.make_prompts(tries, [_words_for_tokens(n)], seed=seed + 7 * n)
            times = []
            for p in prompts:
                r = client.stream_complete(dep.url, model, p, 1, timeout=300)
                if not r.ok:
                    raise RuntimeError(f"calibration request of {n} tokens failed: {r.error}")
                times.append(r.ttft)
            out[n] = statistics.median(times)
    finally:
        dep.stop()
    return out
