"""Two hosts for real (issue 17): the engine API push from a prefill in one network namespace to a decode
in another, over UCX/TCP across a veth pair, with the shared key from a file and configs written as
docs/deploy.md shows. Every byte is verified, and the veth's counters show the KV crossed it. ~15 s."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import ADDR_A, TwoHosts, host_env, two_hosts  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

PEER = Path(__file__).with_name("netns_peer.py")
N = 4
KV_BYTES = N * 40 * 4 * 2 * 2 * 64 * 2  # requests x tokens x layers x (K, V) x heads x dim x dtype


def write_configs(tmp: Path) -> tuple[Path, Path, bytes]:
    key = os.urandom(32)
    key_file = tmp / "kvpush.key"
    key_file.write_text(base64.b64encode(key).decode() + "\n")
    key_file.chmod(0o600)
    prefill = {"engine_id": "P", "host": ADDR_A, "port": 5600, "hmac_key_file": str(key_file)}
    decode = {"engine_id": "D", "hmac_key_file": str(key_file)}
    paths = tmp / "prefill.json", tmp / "decode.json"
    for path, cfg in zip(paths, (prefill, decode), strict=True):
        path.write_text(json.dumps(cfg))
    return *paths, key


def test_engine_api_push_across_two_namespaces_over_tcp(two_hosts: TwoHosts, tmp_path: Path) -> None:  # noqa: F811
    prefill_cfg, decode_cfg, key = write_configs(tmp_path)
    env = host_env(PYTHONPATH=str(Path(__file__).parents[2]))
    before = two_hosts.veth_bytes()
    out = subprocess.PIPE
    prefill = two_hosts.popen(
        two_hosts.ns_a,
        [sys.executable, str(PEER), "prefill", str(prefill_cfg), str(N)],
        env,
        stdout=out,
        stderr=out,
    )
    try:
        assert prefill.stdout is not None
        first = prefill.stdout.readline()
        assert first.split()[:2] == ["listening", ADDR_A], first + (
            prefill.stderr.read() if prefill.stderr else ""
        )
        decode = subprocess.run(
            two_hosts.argv(
                two_hosts.ns_b,
                [sys.executable, str(PEER), "decode", str(decode_cfg), str(N), ADDR_A, "5600"],
            ),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        p_out, p_err = prefill.communicate(timeout=60)
    finally:
        prefill.kill()
    assert decode.returncode == 0, decode.stderr[-3000:]
    got = json.loads(decode.stdout.strip().splitlines()[-1])
    assert got["ok"] == N and got["wrong_bytes"] == 0, (got, decode.stderr[-3000:])
    assert json.loads(p_out.strip().splitlines()[-1])["ok"] == N, p_err[-3000:]
    crossed = two_hosts.veth_bytes() - before
    assert crossed > KV_BYTES, f"only {crossed} bytes crossed the veth; the KV is {KV_BYTES}"
    secret = base64.b64encode(key).decode()
    for text in (decode.stdout, decode.stderr, p_out, p_err):
        assert secret not in text and key.hex() not in text
