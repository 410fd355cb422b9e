"""`kvpush serve-pd`: start prefill, decode and the proxy on 127.0.0.1, wait for /health, stop them again.

Every process is started in its own session (process group); stopping sends SIGTERM to exactly those
groups, then SIGKILL to what is left after a grace period. Nothing else on the machine is touched.

On a 2-core box each engine gets one core (VLLM_CPU_OMP_THREADS_BIND), a 1 GiB KV cache and eager mode.
The same launcher serves the tests and `kvpush bench-vllm`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.apps.cliutil import port, positive_int
from kvpush.apps.ports import free_port_range

from .vllm_router import ROUTERS, router_argv

CONNECTORS = ("kvpush", "nixl-push", "nixl-pull")
_VLLM_CLASS = {"nixl-push": "NixlPushConnector", "nixl-pull": "NixlConnector"}


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_range(1, host)


def free_ports(n: int, host: str = "127.0.0.1", span: int = 1) -> list[int]:
    """n ports p such that p..p+span-1 are all free now (side channels listen on port + tp_rank)."""
    out: list[int] = []
    taken: set[int] = set()
    while len(out) < n:
        p = free_port_range(span, host, exclude=taken)
        out.append(p)
        taken.update(range(p, p + span))
    return out


def parse_cores(spec: str) -> set[int]:
    """'0', '0-3', '0,2,4-5' -> the set of CPU ids."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"no CPU ids in {spec!r}")
    return out


@dataclass
class EngineSpec:
    """One vLLM server. role: 'prefill' | 'decode' | 'single'."""

    role: str
    model: str
    port: int
    cores: str
    connector: str | None = None  # kvpush | nixl-push | nixl-pull | None (single)
    engine_id: str = ""
    kv_port: int = 0
    max_model_len: int = 16384
    block_size: int | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.connector is None:
            return None
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}[self.role]
        cfg: dict[str, Any] = {"kv_role": role, "kv_buffer_device": "cpu", "engine_id": self.engine_id}
        if self.connector == "kvpush":
            cfg.update(kv_connector="KVPushConnector", kv_connector_module_path="kvpush.platforms.vllm")
            extra = {"host": "127.0.0.1", "port": self.kv_port}
            extra.update(self.extra_config)
            cfg["kv_connector_extra_config"] = extra
        elif self.connector in _VLLM_CLASS:
            cfg["kv_connector"] = _VLLM_CLASS[self.connector]
            if self.extra_config:
                cfg["kv_connector_extra_config"] = dict(self.extra_config)
        else:
            raise ValueError(f"unknown connector {self.connector!r}; choose one of {', '.join(CONNECTORS)}")
        return cfg

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "64",
        ]
        spec_file = Path(self.model) / "kvpush_spec.json"
        if spec_file.exists():  # our tiny models: serve them in the dtype they were built in
            argv += ["--dtype", json.loads(spec_file.read_text()).get("dtype", "auto")]
        if self.block_size:
            argv += ["--block-size", str(self.block_size)]
        kvc = self.kv_transfer_config()
        if kvc is not None:
            argv += ["--kv-transfer-config", json.dumps(kvc)]
        argv += self.extra_args
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": self.cores,
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "UCX_NET_DEVICES": env.get("UCX_NET_DEVICES", "lo"),
                "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "WARN"),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.kv_port or free_port()),
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
                "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.env)
        return argv, env


class Started:
    """A process we started, in its own process group."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log_path: Path, cpus: set[int] | None = None
    ):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # cpus: set in the child before exec, so every process the engine starts inherits the mask
        confine = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=confine,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        # Engine children (EngineCore, workers) live in the same group; make sure none outlive us.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()


def wait_healthy(url: str, procs: list[Started], timeout_s: float = 300.0, any_answer: bool = False) -> None:
    """Until url/health answers 200 (any_answer: answers at all, e.g. a proxy reporting a refused
    pairing with 503), or one of procs exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(
                    f"{p.name} exited with code {p.proc.returncode} before {url}/health "
                    f"answered; last log lines ({p.log_path}):\n{p.tail()}"
                )
        try:
            with urllib.request.urlopen(url + "/health", timeout=20) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            if any_answer:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f}s")


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
        env=dict(decode_env or {}),
    )
    procs: list[Started] = []
    timings_token = secrets.token_urlsafe(24) if use_proxy else ""
    try:
        url = ""
        if use_proxy:
            # The proxy binds first: engines grab ephemeral ports while starting.
            mode = "pull" if connector == "nixl-pull" else "push"
            argv = [
                sys.executable,
                "-m",
                "kvpush.platforms.vllm.tools.proxy",
                "--port",
                str(x_port),
                "--mode",
                mode,
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--prefill-engine-id",
                prefill.engine_id,
                "--prefill-kv-host",
                "127.0.0.1",
                "--prefill-kv-port",
                str(p_kv),
                "--timings",
            ]
            if pairing_port:
                argv += ["--decode-pairing", f"http://127.0.0.1:{pairing_port}"]
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
            argv = router_argv(x_port, [prefill.url], [decode.url], free_port())
            procs.append(Started("vllm-router", argv, dict(os.environ), log_dir / "vllm-router.log"))
            url = f"http://127.0.0.1:{x_port}"
        if url:
            wait_healthy(url, procs, 60, any_answer=not proxy_must_be_healthy)
        return Deployment(connector, url, procs, [prefill, decode], timings_token)
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise


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
) -> Deployment:
    spec = EngineSpec(
        "single", model, free_port(), cores, None, "", 0, max_model_len, block_size, env=dict(env or {})
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
