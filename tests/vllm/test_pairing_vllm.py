"""Real vLLM (CPU) + real NIXL: a misconfigured prefill/decode pairing is caught before traffic.

The CPU backend moves whole blocks, so prefill and decode must use one block size; here the prefill
runs with 32 and the decode with 64. Before, both engines reported healthy, the proxy too, and every
request got HTTP 500 "Internal server error" (only the decode's log named the mismatch).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client
from kvpush.platforms.vllm.tools.serve_pd import start_pd
from kvpush.platforms.vllm.tools.tiny_model import build

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


def _get(url: str, timeout: float = 30.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_proxy_refuses_a_block_size_mismatch_by_name(tmp_path: Path) -> None:
    model = str(build("fast"))
    dep = start_pd(
        "kvpush",
        model,
        tmp_path,
        block_size=32,
        decode_block_size=64,
        pair_at_startup=False,  # let the decode start, to see what the proxy makes of the pairing
        proxy_must_be_healthy=False,
    )
    try:
        status, health = _get(dep.url + "/health")
        assert status == 503, health
        assert health["status"] == "misconfigured", health
        [reason] = health["refused"]
        assert "block_size=32" in reason and "block_size=64" in reason, reason
        assert "kvpush-prefill" in reason, reason

        with pytest.raises(urllib.error.HTTPError) as err:
            client.complete(dep.url, model, "import os", 4, timeout=60)
        assert err.value.code == 503
        message = json.loads(err.value.read())["error"]["message"]
        assert "block_size=32" in message and "block_size=64" in message, message
        assert "Internal server error" not in message
        decode = dep.engines[1]
        assert client.metric(client.metrics(decode.url), "vllm:kv_cache_usage_perc") == 0.0
    finally:
        dep.stop()


def test_serve_pd_decode_refuses_to_start_on_a_block_size_mismatch(tmp_path: Path) -> None:
    """serve-pd gives the decode its prefill's address: the decode handshakes at start-up and exits."""
    model = str(build("fast"))
    with pytest.raises(RuntimeError, match="decode exited") as err:
        start_pd("kvpush", model, tmp_path, block_size=32, decode_block_size=64, health_timeout_s=400)
    log = (tmp_path / "kvpush-decode.log").read_text(errors="replace")
    assert "cannot receive KV from prefill" in log and "block_size=64" in log, str(err.value)[-2000:]
