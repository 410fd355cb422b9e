"""pp_size where a peer's parameters are parsed (issue 17): vllm-router forwards no pp_size, so an omitted
one means the prefill's (1: a kvpush prefill refuses pipeline parallelism at start-up), and any other
value is refused by name at each entry: a request's kv_transfer_params, the decode's prefill_addresses,
the pairing check's query, and `kvpush proxy --prefill-pp-size`."""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpush.apps.ports import free_port_range
from kvpush.endpoint import PrefillAddress
from kvpush.errors import ConfigError
from kvpush.platforms.vllm.pairing import PairingServer
from kvpush.platforms.vllm.params import ConnectorSettings, KVTransferParams

ROUTED = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "10.0.0.9", "remote_port": 7000}
PP_REFUSED = r"pp_size=2, but kvpush does not support pipeline parallelism"


def test_an_omitted_pp_size_is_left_unset_and_one_is_accepted() -> None:
    assert KVTransferParams.from_dict(ROUTED).pp_size is None
    assert KVTransferParams.from_dict({**ROUTED, "pp_size": None}).pp_size is None  # JSON null: not set
    assert KVTransferParams.from_dict({**ROUTED, "pp_size": 1}).pp_size == 1
    assert "pp_size" not in KVTransferParams.from_dict(ROUTED).to_dict(sparse=True)


@pytest.mark.parametrize("pp", [2, 0, 8])
def test_a_request_naming_pipeline_parallelism_is_refused_by_name(pp: int) -> None:
    with pytest.raises(ValueError, match=rf"kv_transfer_params: pp_size={pp}, but kvpush does not support"):
        KVTransferParams.from_dict({**ROUTED, "pp_size": pp})


def test_the_decodes_start_up_prefill_addresses_refuse_pipeline_parallelism() -> None:
    ok = ConnectorSettings.from_extra(
        "decode", "d0", {"prefill_addresses": [{"engine_id": "p0", "port": 5600}]}, 16, 1, 1
    )
    assert ok.prefill_addresses[0].pp_size == 1
    with pytest.raises(ConfigError, match=r"prefill_addresses\[0\]`: pp_size: " + PP_REFUSED):
        ConnectorSettings.from_extra(
            "decode", "d0", {"prefill_addresses": [{"engine_id": "p0", "port": 5600, "pp_size": 2}]}, 16, 1, 1
        )


@dataclass
class _Worker:
    settings: ConnectorSettings
    asked: list[PrefillAddress] = field(default_factory=list)

    def check_pairing(self, prefill: PrefillAddress, timeout_s: float) -> tuple[int, dict[str, Any]]:
        self.asked.append(prefill)
        return 200, {"ok": True}


def _get(port: int, target: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{target}", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_the_pairing_check_refuses_pipeline_parallelism_before_any_handshake() -> None:
    worker = _Worker(ConnectorSettings.from_extra("decode", "d0", {"pairing_port": 1}, 16, 1, 1))
    port = free_port_range(1)
    server = PairingServer(worker, "127.0.0.1", port)
    try:
        status, body = _get(port, "/kvpush/pairing?engine_id=p0&port=5600&pp_size=2")
        assert status == 400 and "pairing check: pp_size=2" in body and worker.asked == []
        assert _get(port, "/kvpush/pairing?engine_id=p0&port=5600")[0] == 200  # omitted: PP 1
        assert worker.asked == [PrefillAddress("p0", "127.0.0.1", 5600, 1, 1)]
    finally:
        server.close()


def test_the_proxy_refuses_a_pipeline_parallel_prefill_at_start() -> None:
    pytest.importorskip("aiohttp")
    from kvpush.platforms.vllm.proxy import cli as proxy_mod

    parser = argparse.ArgumentParser()
    proxy_mod.configure(parser)
    base = [
        "--prefill",
        "http://p",
        "--decode",
        "http://d",
        "--prefill-engine-id",
        "e",
        "--prefill-kv-port",
        "1",
    ]
    assert proxy_mod.config_from_args(parser.parse_args(base)).prefill[0].pp_size == 1
    with pytest.raises(SystemExit, match=r"--prefill-pp-size: " + PP_REFUSED):
        proxy_mod.config_from_args(parser.parse_args([*base, "--prefill-pp-size", "2"]))
