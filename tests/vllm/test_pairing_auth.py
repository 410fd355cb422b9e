"""The decode's pairing check (decode_worker.PairingServer) makes it handshake with any host:port in its
query: it listens on loopback by default, needs a key beyond loopback, and with a key answers only
requests signed with it, which `kvpush proxy --decode-pairing` sends (issue 17)."""

from __future__ import annotations

import asyncio
import base64
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpush.apps.ports import free_port_range
from kvpush.config import KVPushConfig
from kvpush.endpoint import PrefillAddress
from kvpush.errors import ConfigError
from kvpush.platforms.vllm.pairing import PairingServer
from kvpush.platforms.vllm.params import PAIRING_HEADER, ConnectorSettings, pairing_signature
from kvpush.platforms.vllm.proxy import PrefillBackend, ProxyConfig, Router

KEY = os.urandom(32)
QUERY = "/kvpush/pairing?engine_id=p0&host=192.0.2.1&port=5600&tp_size=1&pp_size=1"


@dataclass
class _Worker:
    """What PairingServer asks of a DecodeWorker: its settings, and the check itself (recorded)."""

    settings: ConnectorSettings
    asked: list[PrefillAddress] = field(default_factory=list)

    def check_pairing(self, prefill: PrefillAddress, timeout_s: float) -> tuple[int, dict[str, Any]]:
        self.asked.append(prefill)
        return 200, {"ok": True}


def settings(**extra: Any) -> ConnectorSettings:
    return ConnectorSettings.from_extra("decode", "d0", extra, block_size=16, tp_size=1, pp_size=1)


def get(port: int, target: str, headers: dict[str, str] | None = None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{target}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_pairing_check_binds_loopback_by_default_and_needs_a_key_beyond_it():
    assert settings(pairing_port=5700).pairing_host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"pairing_host '0.0.0.0' is beyond loopback and no shared key"):
        settings(pairing_port=5700, pairing_host="0.0.0.0")
    keyed = settings(pairing_port=5700, pairing_host="0.0.0.0", hmac_key=base64.b64encode(KEY).decode())
    assert keyed.pairing_host == "0.0.0.0"


def test_a_keyed_decode_answers_only_signed_pairing_checks():
    worker = _Worker(settings(pairing_port=1, hmac_key=base64.b64encode(KEY).decode()))
    port = free_port_range(1)
    server = PairingServer(worker, "127.0.0.1", port)
    try:
        assert get(port, QUERY) == 401
        assert get(port, QUERY, {PAIRING_HEADER: pairing_signature(os.urandom(32), QUERY)}) == 401
        other = QUERY.replace("192.0.2.1", "192.0.2.99")  # a captured signature for another target
        assert get(port, other, {PAIRING_HEADER: pairing_signature(KEY, QUERY)}) == 401
        assert worker.asked == []
        assert get(port, QUERY, {PAIRING_HEADER: pairing_signature(KEY, QUERY)}) == 200
        assert [(a.host, a.port) for a in worker.asked] == [("192.0.2.1", 5600)]
    finally:
        server.close()


@pytest.mark.parametrize("proxy_key, ok", [(KEY, True), (None, False)])
def test_the_proxy_signs_its_pairing_checks_with_the_shared_key(proxy_key: bytes | None, ok: bool):
    worker = _Worker(settings(pairing_port=1, hmac_key=base64.b64encode(KEY).decode()))
    port = free_port_range(1)
    server = PairingServer(worker, "127.0.0.1", port)

    async def check() -> tuple[bool | None, str]:
        cfg = ProxyConfig(
            prefill=[PrefillBackend("http://127.0.0.1:9", "p0", "192.0.2.1", 5600)],
            decode=["http://127.0.0.1:9"],
            decode_pairing=[f"http://127.0.0.1:{port}"],
            pairing_key=proxy_key,
        )
        router = Router(cfg)
        await router.start()
        try:
            [pair] = await router.check_pairings()
            return pair.ok, pair.error
        finally:
            await router.close()

    try:
        got, error = asyncio.run(check())
    finally:
        server.close()
    assert got is ok, error
    if not ok:
        assert "refused the pairing check's signature" in error and "--hmac-key-file" in error
    assert KVPushConfig  # the key never reaches the proxy's repr
    assert base64.b64encode(KEY).decode() not in repr(ProxyConfig([], [], pairing_key=KEY))
