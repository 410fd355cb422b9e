"""Issue 45 finding 2: the decode's pairing check made it handshake with any address, as often as asked (600
GETs naming distinct engine ids ran ZeroMQ out of sockets). It now refuses checks beyond a rate and
requests beyond a number in flight with 429 and a Retry-After, before any work."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpush.apps.ports import free_port_range
from kvpush.endpoint import PrefillAddress
from kvpush.platforms.vllm.pairing import PairingLimits, PairingServer
from kvpush.platforms.vllm.params import ConnectorSettings


@dataclass
class _Worker:
    settings: ConnectorSettings
    delay_s: float = 0.0
    asked: list[PrefillAddress] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check_pairing(self, prefill: PrefillAddress, timeout_s: float) -> tuple[int, dict[str, Any]]:
        time.sleep(self.delay_s)
        with self.lock:
            self.asked.append(prefill)
        return 200, {"ok": True}

    def release_transfers(self, prefill: PrefillAddress, keys: list[str]) -> tuple[int, dict[str, Any]]:
        time.sleep(self.delay_s)
        return 200, {"ok": True}


def _settings() -> ConnectorSettings:
    return ConnectorSettings.from_extra("decode", "d0", {}, block_size=16, tp_size=1, pp_size=1)


def get(port: int, i: int, route: str = "pairing") -> tuple[int, dict[str, Any], str | None]:
    target = f"/kvpush/{route}?engine_id=p{i}&host=127.0.0.1&port={5600 + i}&key=k"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{target}", timeout=10) as r:
            return int(r.status), json.loads(r.read()), r.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read()), exc.headers.get("Retry-After")


def test_pairing_checks_beyond_the_rate_are_refused_with_429_before_any_work():
    worker = _Worker(_settings())
    port = free_port_range(1)
    server = PairingServer(worker, "127.0.0.1", port, PairingLimits(checks_per_s=5.0, burst=10))
    try:
        answers = [get(port, i) for i in range(60)]
        ok = [a for a in answers if a[0] == 200]
        refused = [a for a in answers if a[0] == 429]
        assert len(ok) + len(refused) == 60
        assert 10 <= len(ok) <= 20, len(ok)  # the burst, and what the rate refilled meanwhile
        assert len(worker.asked) == len(ok)  # a refused check did nothing
        status, body, retry = refused[0]
        assert "pairing checks per second" in body["error"] and retry == "1", refused[0]
        time.sleep(0.5)
        assert get(port, 999)[0] == 200  # the bucket refills
    finally:
        server.close()


def test_requests_beyond_the_number_in_flight_are_refused_with_429():
    worker = _Worker(_settings(), delay_s=0.5)
    port = free_port_range(1)
    limits = PairingLimits(checks_per_s=1000.0, burst=1000, max_in_flight=3)
    server = PairingServer(worker, "127.0.0.1", port, limits)
    try:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda i: get(port, i, "release" if i % 2 else "pairing"), range(12)))
        codes = sorted(a[0] for a in answers)
        assert codes.count(200) >= 3 and codes.count(429) >= 6, codes
        busy = next(a for a in answers if a[0] == 429)
        assert "in flight (at most 3)" in busy[1]["error"], busy
        assert get(port, 100)[0] == 200  # once they are answered, the next one goes through
    finally:
        server.close()
