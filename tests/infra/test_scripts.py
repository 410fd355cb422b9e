"""scripts/serve_pd.sh, run_sweep.sh, cleanup.sh and plot_push_vs_pull.sh: shellcheck, the commands they
build, and real runs against stand-ins for vLLM (fixtures/fake_server.py, fixtures/fake_bench.py)."""

from __future__ import annotations

import base64
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra.infra_tools import FIXTURES, ROOT, SCRIPTS, infra_tool, run

SCRIPT_DIR = ROOT / "scripts"


KEY = base64.b64encode(bytes(range(7, 39))).decode()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no node or cluster env file unless a test writes one; a shared key file."""
    key_file = tmp_path / "hmac.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    env = {
        "HMAC_KEY_FILE": str(key_file),
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "KVPUSH_NODE_ENV": str(tmp_path / "node.env"),
        "KVPUSH_CLUSTER_ENV": str(tmp_path / "cluster.env"),
        "KVPUSH_RUN_DIR": str(tmp_path / "run"),
        "LOG_DIR": str(tmp_path / "logs"),
        "KV_HOST": "10.0.0.11",
    }
    env.update(extra)
    return env


def _script(
    name: str, env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT_DIR / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=env["HOME"],
    )


def _dry_run(tmp_path: Path, **settings: str) -> list[str]:
    proc = _script("serve_pd.sh", _env(tmp_path, DRY_RUN="1", **settings))
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _kv_config(argv: list[str]) -> dict[str, object]:
    config: dict[str, object] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script: str) -> None:
    proc = run([infra_tool("shellcheck"), "-s", "bash", str(SCRIPT_DIR / script)])
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_executable_and_strict(script: str) -> None:
    path = SCRIPT_DIR / script
    assert os.access(path, os.X_OK)
    assert "set -euo pipefail" in path.read_text()


def test_prefill_command_uses_the_kvpush_connector(tmp_path: Path) -> None:
    argv = _dry_run(tmp_path, ROLE="prefill", MODE="push", MODEL="m", TP_SIZE="8", KVPUSH_CLUSTER="c1")
    assert argv[:3] == ["vllm", "serve", "m"]
    assert argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert argv[argv.index("--max-model-len") + 1] == "32768"
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert "--no-enable-prefix-caching" not in argv
    assert _kv_config(argv) == {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.platforms.vllm",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cuda",
        "engine_id": "c1-prefill-0",
        "kv_connector_extra_config": {
            "port": 5600,
            "host": "10.0.0.11",
            "backends": ["LIBFABRIC"],
            "hmac_key_file": str(tmp_path / "hmac.key"),
        },
    }


def test_decode_command_for_each_connector(tmp_path: Path) -> None:
    for mode, connector, cls in (
        ("push", "nixl-push", "NixlPushConnector"),
        ("pull", "nixl-pull", "NixlConnector"),
    ):
        argv = _dry_run(tmp_path, ROLE="decode", MODE=mode, CONNECTOR=connector)
        assert argv[argv.index("--port") + 1] == "8200"
        assert "--no-enable-prefix-caching" in argv
        config = _kv_config(argv)
        assert config["kv_connector"] == cls and config["kv_role"] == "kv_consumer"
        assert "kv_connector_module_path" not in config
        assert config["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}


def test_pull_mode_defaults_to_vllms_nixl_connector(tmp_path: Path) -> None:
    argv = _dry_run(tmp_path, ROLE="prefill", MODE="pull")
    assert _kv_config(argv)["kv_connector"] == "NixlConnector"


def test_proxy_command_reads_the_cluster_env_file(tmp_path: Path) -> None:
    (tmp_path / "cluster.env").write_text(
        "# written by kvpush cluster env\nKVPUSH_CLUSTER=c1\nPREFILL_HOST=10.0.0.5\nDECODE_HOST=10.0.0.6\n"
        "PREFILL_TP_SIZE=16\nPROXY_PORT=9000\n"
    )
    argv = _dry_run(tmp_path, ROLE="proxy", MODE="push", PROXY_PORT="8000")
    assert argv[:2] == ["kvpush", "proxy"]
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert opts == {
        "--host": "0.0.0.0",
        "--port": "8000",  # the environment wins over the file
        "--mode": "push",
        "--prefill": "http://10.0.0.5:8100",
        "--decode": "http://10.0.0.6:8200",
        "--prefill-engine-id": "c1-prefill-0",
        "--prefill-kv-host": "10.0.0.5",
        "--prefill-kv-port": "5600",
        "--prefill-tp-size": "16",
        "--prefill-pp-size": "1",
        "--decode-pairing": "http://10.0.0.6:5700",
        "--hmac-key-file": str(tmp_path / "hmac.key"),
        "--decode-engine-id": "c1-decode-0",
    }


def test_kvpush_decode_is_given_its_prefill_and_a_pairing_port(tmp_path: Path) -> None:
    argv = _dry_run(
        tmp_path,
        ROLE="decode",
        MODE="push",
        KVPUSH_CLUSTER="c1",
        PREFILL_HOST="10.0.0.5",
        PREFILL_TP_SIZE="4",
    )
    assert _kv_config(argv)["kv_connector_extra_config"] == {
        "port": 5600,
        "host": "10.0.0.11",
        "backends": ["LIBFABRIC"],
        "hmac_key_file": str(tmp_path / "hmac.key"),
        "pairing_port": 5700,
        "pairing_host": "10.0.0.11",
        "prefill_addresses": [{"engine_id": "c1-prefill-0", "host": "10.0.0.5", "port": 5600, "tp_size": 4}],
    }
    # without PREFILL_HOST the decode still starts (and says it will not check at start-up)
    proc = _script("serve_pd.sh", _env(tmp_path, DRY_RUN="1", ROLE="decode", MODE="push"))
    assert proc.returncode == 0 and "PREFILL_HOST is not set" in proc.stderr
    assert "prefill_addresses" not in _kv_config(shlex.split(proc.stdout))["kv_connector_extra_config"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ROLE": "prefill", "MODE": "pull", "CONNECTOR": "kvpush"}, "does not do MODE=pull"),
        ({"ROLE": "decode", "MODE": "push", "CONNECTOR": "nixl-pull"}, "does not do MODE=push"),
        ({"ROLE": "router"}, "ROLE must be prefill, decode or proxy"),
        ({"MODE": "push"}, "set ROLE="),
        ({"ROLE": "proxy", "DECODE_HOST": "10.0.0.6"}, "needs PREFILL_HOST"),
        ({"ROLE": "prefill", "MODE": "stream"}, "MODE must be push or pull"),
    ],
)
def test_serve_pd_rejects_bad_settings(tmp_path: Path, settings: dict[str, str], message: str) -> None:
    proc = _script("serve_pd.sh", _env(tmp_path, DRY_RUN="1", **settings))
    assert proc.returncode == 1
    assert message in proc.stderr


def _parsed_by_the_connector(tmp_path: Path, **settings: str) -> dict[str, Any]:
    """serve_pd.sh's --kv-transfer-config for both roles, through the connector's own parser (the
    environment holds no key: from_mapping would read $KVPUSH_HMAC_KEY and refuse a second source)."""
    from kvpush.platforms.vllm.params import ConnectorSettings

    parsed = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = _kv_config(_dry_run(tmp_path, ROLE=role, MODE="push", **settings))
        assert config["kv_role"] == kv_role
        extra = config["kv_connector_extra_config"]
        assert isinstance(extra, dict) and KEY not in json.dumps(config)
        parsed[role] = ConnectorSettings.from_extra(
            role, str(config["engine_id"]), extra, block_size=16, tp_size=8, pp_size=1
        )
    return parsed


def test_the_generated_configs_of_both_roles_pass_the_connectors_own_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What serve_pd.sh writes is what the connector reads: both roles keyed from the file, the prefill
    allowed to listen on the private IP, the decode's pairing check beyond loopback (keyed)."""
    monkeypatch.delenv("KVPUSH_HMAC_KEY", raising=False)
    settings = _parsed_by_the_connector(tmp_path, PREFILL_HOST="10.0.0.5", KVPUSH_CLUSTER="c1")
    prefill, decode = settings["prefill"], settings["decode"]
    assert (prefill.role, prefill.is_producer, decode.role, decode.is_producer) == (
        "prefill",
        True,
        "decode",
        False,
    )
    key_file = str(tmp_path / "hmac.key")
    for s, engine_id in ((prefill, "c1-prefill-0"), (decode, "c1-decode-0")):
        cfg = s.config
        assert cfg.engine_id == engine_id and cfg.nixl.backends == ("LIBFABRIC",)
        assert cfg.side_channel.host == cfg.side_channel.advertised == "10.0.0.11"
        assert cfg.side_channel.port == 5600
        assert cfg.security.hmac_key_file == key_file and cfg.security.hmac_key == base64.b64decode(KEY)
        assert cfg.nixl.ucx_net_devices is None  # UCX picks the device that reaches the peer
    prefill.config.check_listen()  # 10.0.0.11 is beyond loopback: the key makes it legal
    assert prefill.config.auth_required and prefill.pairing_port == 0 and not prefill.prefill_addresses
    assert decode.pairing_host == "10.0.0.11" and decode.pairing_port == 5700
    (address,) = decode.prefill_addresses
    assert (address.engine_id, address.host, address.port, address.tp_size, address.pp_size) == (
        "c1-prefill-0",
        "10.0.0.5",
        5600,
        8,
        1,
    )


def test_a_cluster_nodes_env_file_alone_configures_both_roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node of terraform/: node.env (as its set-up writes it: the node's IP, the key file it copied
    from Secrets Manager) and cluster.env are all serve_pd.sh needs; the connector reads the key from that
    file."""
    monkeypatch.delenv("KVPUSH_HMAC_KEY", raising=False)
    key_file = tmp_path / "node-hmac.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    (tmp_path / "node.env").write_text(
        f"KVPUSH_CLUSTER=c2\nKVPUSH_NODE_IP=10.0.1.23\nHMAC_KEY_FILE={key_file}\n"
        "KVPUSH_HMAC_KEY_SECRET=c2/kvpush-hmac-key\nSIDE_CHANNEL_PORT=5601\n"
    )
    (tmp_path / "cluster.env").write_text("PREFILL_HOST=10.0.1.23\nPREFILL_TP_SIZE=4\n")
    base = _env(tmp_path, DRY_RUN="1", MODE="push")
    for name in ("HMAC_KEY_FILE", "KV_HOST"):
        del base[name]
    parsed = {}
    from kvpush.platforms.vllm.params import ConnectorSettings

    for role in ("prefill", "decode"):
        proc = _script("serve_pd.sh", {**base, "ROLE": role})
        assert proc.returncode == 0, proc.stderr
        config = _kv_config(shlex.split(proc.stdout))
        extra = config["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        parsed[role] = ConnectorSettings.from_extra(role, str(config["engine_id"]), extra, 16, 4, 1)
    for s in parsed.values():
        assert s.config.security.hmac_key_file == str(key_file)
        assert s.config.security.hmac_key == base64.b64decode(KEY)
        assert s.config.side_channel.advertised == "10.0.1.23" and s.config.side_channel.port == 5601
    parsed["prefill"].config.check_listen()
    assert parsed["decode"].prefill_addresses[0].engine_id == "c2-prefill-0"


def test_a_real_start_without_the_key_file_is_refused_with_how_to_make_one(tmp_path: Path) -> None:
    env = _env(tmp_path, ROLE="prefill", VLLM_SERVE="false", HMAC_KEY_FILE=str(tmp_path / "absent.key"))
    proc = _script("serve_pd.sh", env)
    assert proc.returncode == 1
    assert "no shared key at HMAC_KEY_FILE=" in proc.stderr and "openssl rand -base64 32" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    wrapper = tmp_path / "fake-server"
    wrapper.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FIXTURES / "fake_server.py"))} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture
def unrelated_process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_serve_then_cleanup_stops_only_what_it_started(
    tmp_path: Path, fake_bin: Path, unrelated_process: subprocess.Popen[bytes]
) -> None:
    port = _free_port()
    env = _env(
        tmp_path,
        ROLE="prefill",
        VLLM_SERVE=str(fake_bin),
        PREFILL_PORT=str(port),
        HEALTH_POLL="0.2",
        HEALTH_TIMEOUT="30",
        FAKE_RECORD=str(tmp_path / "argv.json"),
        FAKE_WORKER_PID=str(tmp_path / "worker.pid"),
        GRACE="5",
    )
    proc = _script("serve_pd.sh", env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "server-prefill is up" in proc.stdout
    server_pid = int((tmp_path / "run" / "server-prefill.pid").read_text())
    worker_pid = int((tmp_path / "worker.pid").read_text())
    assert _alive(server_pid) and _alive(worker_pid)
    recorded = json.loads((tmp_path / "argv.json").read_text())
    assert recorded["env"] == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.11",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }
    assert (tmp_path / "logs" / "server-prefill-push-kvpush.log").exists()

    again = _script("serve_pd.sh", env)
    assert again.returncode == 1 and "already runs" in again.stderr

    # A pid file naming someone else's process (a reused pid): cleanup must leave that process alone.
    (tmp_path / "run" / "server-decode.pid").write_text(str(unrelated_process.pid))
    (tmp_path / "run" / "proxy.pid").write_text("999999999")

    stopped = _script("cleanup.sh", env, "server")
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 10
    while (_alive(server_pid) or _alive(worker_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid) and not _alive(worker_pid), "the engine's process group survived cleanup"
    assert unrelated_process.poll() is None, "cleanup.sh killed a process it did not start"
    # nothing the engine left in the temporary directory or /dev/shm outlives it (vLLM's sockets, file
    # stores and message queues), and its temporary directory was its own
    left = {k: Path(v) for k, v in recorded["left"].items()}
    assert Path(recorded["tmp"]) != Path(tempfile.gettempdir()) and left["socket"].parent == Path(
        recorded["tmp"]
    )
    assert not any(p.exists() for p in left.values()), {k: p.exists() for k, p in left.items()}
    assert not Path(recorded["tmp"]).exists() and not (tmp_path / "run" / "server-prefill.tmp").exists()
    assert "leaving it alone" in stopped.stderr
    assert not (tmp_path / "run" / "server-prefill.pid").exists()

    gone = _script("cleanup.sh", env, "proxy")
    assert gone.returncode == 0 and "is gone" in gone.stdout
    assert _script("cleanup.sh", env, "everything").returncode == 2


def test_serve_reports_an_engine_that_dies(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = _env(
        tmp_path, ROLE="decode", VLLM_SERVE="false", HEALTH_POLL="0.2", HEALTH_TIMEOUT="30", TMPDIR=str(tmp)
    )
    proc = _script("serve_pd.sh", env)
    assert proc.returncode == 1
    assert "exited before answering" in proc.stderr
    assert not (tmp_path / "run" / "server-decode.pid").exists()
    # the temporary directory it made for the engine goes with it
    assert not list(tmp.iterdir()) and not (tmp_path / "run" / "server-decode.tmp").exists()


def _sweep(tmp_path: Path, mode: str, **settings: str) -> subprocess.CompletedProcess[str]:
    bench = f"{shlex.quote(sys.executable)} {shlex.quote(str(FIXTURES / 'fake_bench.py'))} serve"
    env = _env(
        tmp_path,
        MODE=mode,
        VLLM_BENCH=bench,
        SKIP_HEALTH="1",
        RESULT_DIR=str(tmp_path / "results"),
        FAKE_BENCH_LOG=str(tmp_path / "bench.log"),
        MODEL="m",
        **settings,
    )
    return _script("run_sweep.sh", env)


def test_sweep_writes_one_file_per_point(tmp_path: Path) -> None:
    lists = {
        "QPS_LIST": "1 2.5",
        "INPUT_LENS": "128 1024",
        "OUTPUT_LENS": "16",
        "ITERATIONS": "2",
        "NUM_PROMPTS": "7",
    }
    proc = _sweep(tmp_path, "push", **lists)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert names == sorted(
        f"push_qps{q}_in{i}_out16_iter{it}.json" for q in ("1", "2.5") for i in (128, 1024) for it in (0, 1)
    )
    calls = [json.loads(line) for line in (tmp_path / "bench.log").read_text().splitlines()]
    assert len(calls) == 8
    first = calls[0]
    opts = {
        first[i]: first[i + 1]
        for i in range(1, len(first) - 1)
        if first[i].startswith("--") and not first[i + 1].startswith("--")
    }
    assert opts["--backend"] == "openai" and opts["--endpoint"] == "/v1/completions"
    assert opts["--dataset-name"] == "random" and opts["--num-prompts"] == "7"
    assert opts["--base-url"] == "http://127.0.0.1:8000" and opts["--model"] == "m"
    assert {"--save-result", "--ignore-eos"} <= set(first)
    assert {c[c.index("--seed") + 1] for c in calls} == {"0", "1"}

    # The same lists again: every point exists, nothing reruns.
    again = _sweep(tmp_path, "push", **lists)
    assert again.returncode == 0 and again.stdout.count("exists, skipped") == 8
    assert len((tmp_path / "bench.log").read_text().splitlines()) == 8


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"QPS_LIST": "1 fast"}, "not a number"),
        ({"INPUT_LENS": "0"}, "not a positive whole number"),
        ({"ITERATIONS": "0"}, "ITERATIONS must be"),
        ({"LABEL": "Push_1"}, "lower-case letters"),
    ],
)
def test_sweep_rejects_bad_lists(tmp_path: Path, settings: dict[str, str], message: str) -> None:
    proc = _sweep(tmp_path, "push", **settings)
    assert proc.returncode == 1 and message in proc.stderr


def test_sweep_waits_for_the_proxy(tmp_path: Path) -> None:
    env = _env(
        tmp_path, PROXY_PORT=str(_free_port()), HEALTH_TIMEOUT="1", HEALTH_POLL="0.2", VLLM_BENCH="false"
    )
    proc = _script("run_sweep.sh", env)
    assert proc.returncode == 1 and "does not answer 200" in proc.stderr


def test_push_and_pull_sweeps_plot(tmp_path: Path) -> None:
    """The file names run_sweep.sh writes are the ones `kvpush plot` reads."""
    lists = {"QPS_LIST": "1 2", "INPUT_LENS": "128 256", "OUTPUT_LENS": "16"}
    assert _sweep(tmp_path, "push", **lists).returncode == 0
    assert _sweep(tmp_path, "pull", **lists).returncode == 0
    kvpush = Path(sys.executable).with_name("kvpush")
    env = _env(tmp_path, KVPUSH_BIN=str(kvpush), MPLBACKEND="Agg")
    proc = _script("plot_push_vs_pull.sh", env, str(tmp_path / "results"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for metric in ("ttft", "tpot"):
        png = tmp_path / "results" / f"{metric}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_check_says_plainly_that_there_is_no_gpu(tmp_path: Path) -> None:
    """Without a GPU, scripts/gpu_check.sh runs nothing, says why and exits 0 (no pip install, no tests)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"  # a driver that lists no GPU, as on a host with the tools but no device
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    smi.chmod(0o755)
    for path in (os.environ["PATH"], f"{fake_bin}:{os.environ['PATH']}"):
        env = {"PATH": path, "HOME": str(tmp_path), "OUT": str(tmp_path / "out")}
        proc = subprocess.run(
            ["bash", str(SCRIPT_DIR / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        assert "no GPU on this machine" in proc.stdout and "nothing was run" in proc.stdout
        assert not (tmp_path / "out").exists()
