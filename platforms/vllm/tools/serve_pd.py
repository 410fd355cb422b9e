"""`kvpush serve-pd`: start prefill, decode and the proxy on 127.0.0.1, wait for /health, stop them again.

Every process is started in its own session (process group); stopping sends SIGTERM to exactly those
groups, then SIGKILL to what is left after a grace period. Nothing else on the machine is touched
(serve_procs.py). What each engine's command line holds is serve_engines.py's; here, the deployments.

On a 2-core box each engine gets one core (VLLM_CPU_OMP_THREADS_BIND), a 1 GiB KV cache and eager mode.
The same launcher serves the tests and `kvpush bench-vllm`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpush.apps.cliutil import port, positive_int

from .serve_engines import CONNECTORS, EngineSpec, free_port, free_ports, parse_cores, proxy_argv
from .serve_procs import Started, wait_healthy
from .vllm_router import ROUTERS, router_argv

# the names other tools and the tests import from here, wherever they live now
__all__ = [
    "CONNECTORS",
    "Deployment",
    "EngineSpec",
    "Started",
    "add_decode",
    "add_router",
    "free_port",
    "free_ports",
    "parse_cores",
    "serving",
    "start_pd",
    "start_single",
    "wait_healthy",
]


@dataclass
class Deployment:
    """prefill + decode + proxy (or one single engine) that this process started."""

    connector: str | None
    url: str
    procs: list[Started]
    engines: list[EngineSpec]
    # the bearer token of the proxy's GET /kvpush/timings ("" = no proxy); given to the proxy through
    # its environment, never its command line
    timings_token: str = ""

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in self.procs}


def start_pd(
    connector: str,
    model: str,
    log_dir: Path,
    *,
    proxy_port: int | None = None,
    prefill_cores: str = "0",
    decode_cores: str = "1",
    max_model_len: int = 16384,
    block_size: int | None = None,
    prefill_extra: dict[str, Any] | None = None,
    decode_extra: dict[str, Any] | None = None,
    decode_env: dict[str, str] | None = None,
    prefill_env: dict[str, str] | None = None,
    prefill_args: list[str] | None = None,
    decode_args: list[str] | None = None,
    health_timeout_s: float = 300.0,
    start_proxy: bool = True,
    confine_engines: bool = False,
    decode_block_size: int | None = None,
    pair_at_startup: bool = True,
    proxy_must_be_healthy: bool = True,
    router: str = "kvpush",
) -> Deployment:
    """Start prefill, decode and (by default) the proxy. confine_engines: run each engine's whole process
    tree (API server, EngineCore, workers) on its own cores, as if prefill and decode were two hosts;
    otherwise only the model's compute threads are bound (VLLM_CPU_OMP_THREADS_BIND) and vLLM's
    other processes float over all cores.

    kvpush: the decode is given the prefill's address (extra config prefill_addresses), so it handshakes
    at start-up and refuses to start on a layout mismatch (pair_at_startup=False leaves that out, to
    see what the proxy's pairing check does with a mismatch), and a pairing_port the proxy checks the
    pairing on (at its start and on /health). decode_block_size: a different block size for the decode.
    router: "kvpush" (the proxy) or "vllm-router" (vLLM's router, started once the engines are healthy;
    it has no pairing check, so the decode's start-up handshake is the only one)."""
    if connector not in CONNECTORS:
        raise ValueError(f"unknown connector {connector!r}; choose one of {', '.join(CONNECTORS)}")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    use_proxy = start_proxy and router == "kvpush"
    p_port, d_port, p_kv, d_kv = free_ports(4, span=8)
    x_port = proxy_port or free_port()
    tag = connector.replace("-", "_")
    pairing_port = free_port() if connector == "kvpush" else 0
    decode_extra = dict(decode_extra or {})
    if pairing_port:
        decode_extra.setdefault("pairing_port", pairing_port)
        if pair_at_startup:
            decode_extra.setdefault(
                "prefill_addresses", [{"engine_id": f"{tag}-prefill", "host": "127.0.0.1", "port": p_kv}]
            )
    prefill = EngineSpec(
        "prefill",
        model,
        p_port,
        prefill_cores,
        connector,
        f"{tag}-prefill",
        p_kv,
        max_model_len,
        block_size,
        dict(prefill_extra or {}),
        list(prefill_args or ()),  # e.g. --max-num-batched-tokens: chunked prefill in several steps
        env=dict(prefill_env or {}),
    )
    decode = EngineSpec(
        "decode",
        model,
        d_port,
        decode_cores,
        connector,
        f"{tag}-decode",
        d_kv,
        max_model_len,
        decode_block_size or block_size,
        decode_extra,
        list(decode_args or ()),
        env=dict(decode_env or {}),
    )
    procs: list[Started] = []
    timings_token = secrets.token_urlsafe(24) if use_proxy else ""
    try:
        url = ""
        if use_proxy:
            # The proxy binds first: engines grab ephemeral ports while starting.
            mode = "pull" if connector == "nixl-pull" else "push"
            argv = [*proxy_argv(x_port, mode, prefill, decode, p_kv), "--timings"]
            if pairing_port:
                argv += ["--decode-pairing", f"http://127.0.0.1:{pairing_port}"]
                argv += ["--decode-engine-id", decode.engine_id]
            proxy_env = {**os.environ, "KVPUSH_PROXY_TIMINGS_TOKEN": timings_token}
            procs.append(Started(f"{connector}-proxy", argv, proxy_env, log_dir / f"{connector}-proxy.log"))
            url = f"http://127.0.0.1:{x_port}"
        for spec in (prefill, decode):
            argv, env = spec.command()
            cpus = parse_cores(spec.cores) if confine_engines else None
            procs.append(
                Started(f"{connector}-{spec.role}", argv, env, log_dir / f"{connector}-{spec.role}.log", cpus)
            )
        for spec in (prefill, decode):
            wait_healthy(spec.url, procs, health_timeout_s)
        if start_proxy and router == "vllm-router":
            procs.append(_router_proc(x_port, [prefill.url], [decode.url], log_dir / "vllm-router.log"))
            url = f"http://127.0.0.1:{x_port}"
        if url:
            wait_healthy(url, procs, 60, any_answer=not proxy_must_be_healthy)
        return Deployment(connector, url, procs, [prefill, decode], timings_token)
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise


def _router_proc(port: int, prefills: list[str], decodes: list[str], log: Path) -> Started:
    return Started(log.stem, router_argv(port, prefills, decodes, free_port()), dict(os.environ), log)


def add_decode(
    dep: Deployment, log_dir: Path, extra: dict[str, Any] | None = None, health_timeout_s: float = 300.0
) -> EngineSpec:
    """One more decode for dep's prefill (1P-nD behind a router): the first decode's settings with its own
    ports, engine id and pairing port, plus `extra` (give it its own stats_dir). Stopped with dep."""
    first = next(e for e in dep.engines if e.role == "decode")
    n = sum(e.role == "decode" for e in dep.engines)
    config = {**first.extra_config, **(extra or {})}
    if "pairing_port" in first.extra_config:
        config["pairing_port"] = free_port()
    d_port, d_kv = free_ports(2, span=8)
    spec = replace(first, port=d_port, kv_port=d_kv, engine_id=f"{first.engine_id}-{n}", extra_config=config)
    argv, env = spec.command()
    name = f"{dep.connector}-decode-{n}"
    dep.procs.append(Started(name, argv, env, log_dir / f"{name}.log"))
    dep.engines.append(spec)
    wait_healthy(spec.url, dep.procs[-1:], health_timeout_s)
    return spec


def add_router(dep: Deployment, log_dir: Path, prefills: list[str], decodes: list[str], name: str) -> str:
    """Another vllm-router in front of these engines (log `name`.log); its URL once it answers /health."""
    x_port = free_port()
    dep.procs.append(_router_proc(x_port, prefills, decodes, log_dir / f"{name}.log"))
    url = f"http://127.0.0.1:{x_port}"
    wait_healthy(url, dep.procs[-1:], 60)
    return url


def start_single(
    model: str,
    log_dir: Path,
    *,
    cores: str = "0",
    max_model_len: int = 16384,
    block_size: int | None = None,
    health_timeout_s: float = 300.0,
    confine: bool = False,
    env: dict[str, str] | None = None,
    engine_args: list[str] | None = None,
) -> Deployment:
    spec = EngineSpec(
        "single",
        model,
        free_port(),
        cores,
        None,
        "",
        0,
        max_model_len,
        block_size,
        extra_args=list(engine_args or ()),
        env=dict(env or {}),
    )
    argv, proc_env = spec.command()
    proc = Started("single", argv, proc_env, log_dir / "single.log", parse_cores(cores) if confine else None)
    try:
        wait_healthy(spec.url, [proc], health_timeout_s)
    except BaseException:
        proc.stop()
        raise
    return Deployment(None, spec.url, [proc], [spec])


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connector", choices=CONNECTORS, default="kvpush")
    parser.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    parser.add_argument("--variant", default="realistic", help="tiny model variant: fast | realistic | ...")
    parser.add_argument("--port", type=port, default=8000, help="proxy (or router) port")
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default="kvpush",
        help="what faces clients: kvpush's proxy, or vLLM's own vllm-router (pip install vllm-router)",
    )
    parser.add_argument("--prefill-cores", default="0")
    parser.add_argument("--decode-cores", default="1")
    parser.add_argument("--max-model-len", type=positive_int, default=16384)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--log-dir", default="out/serve-pd")
    parser.add_argument(
        "--exit-after-ready", action="store_true", help="stop everything once healthy (a smoke test)"
    )


def run(args: argparse.Namespace) -> int:
    from .tiny_model import build

    model = args.model or str(build(args.variant))
    dep = start_pd(
        args.connector,
        model,
        Path(args.log_dir),
        proxy_port=args.port,
        prefill_cores=args.prefill_cores,
        decode_cores=args.decode_cores,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        router=args.router,
    )
    print(f"ready: {dep.url} (connector {args.connector}, model {model}); pids {dep.pids()}", flush=True)
    if args.exit_after_ready:
        dep.stop()
        return 0
    stop = {"now": False}

    def _on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop["now"]:
            for p in dep.procs:
                if not p.alive():
                    print(f"{p.name} exited ({p.proc.returncode}); stopping", file=sys.stderr)
                    stop["now"] = True
            time.sleep(0.5)
    finally:
        dep.stop()
    return 0


@contextlib.contextmanager
def serving(connector: str | None, model: str, log_dir: Path, **kw: Any) -> Iterator[Deployment]:
    dep = (
        start_single(model, log_dir, **kw) if connector is None else start_pd(connector, model, log_dir, **kw)
    )
    try:
        yield dep
    finally:
        dep.stop()
