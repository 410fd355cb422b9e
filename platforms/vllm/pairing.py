"""The decode's pairing check: GET /kvpush/pairing?engine_id=&host=&port=&tp_size=&pp_size= on one rank,
and GET /kvpush/release?<the same>&key=... (the proxy frees a left client's transfers; proxy/release.py).

The check makes the decode handshake with whatever prefill address the query names, so it binds loopback
unless extra config `pairing_host` says otherwise (ConnectorSettings refuses a wider bind without a key),
and with a shared key it answers only requests signed with it (params.PAIRING_HEADER; `kvpush proxy
--decode-pairing` signs with --hmac-key-file or $KVPUSH_HMAC_KEY). Importing it imports neither torch nor
vLLM. Both routes are rate- and count-limited (`PairingLimits`: 429 with Retry-After beyond them), since
each check may open connections to the address it names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvpush.endpoint import PrefillAddress

from .params import (
    PAIRING_HEADER,
    PAIRING_ROUTE,
    RELEASE_ROUTE,
    ConnectorSettings,
    check_pp_size,
    pairing_signature_ok,
)

log = logging.getLogger("kvpush.vllm")


class PairingChecker(Protocol):
    """What the server asks of the decode worker (DecodeWorker.check_pairing)."""

    settings: ConnectorSettings

    def check_pairing(self, prefill: PrefillAddress, timeout_s: float) -> tuple[int, dict[str, Any]]: ...

    def release_transfers(self, prefill: PrefillAddress, keys: list[str]) -> tuple[int, dict[str, Any]]: ...


ROUTES = (PAIRING_ROUTE, RELEASE_ROUTE)
MAX_RELEASE_KEYS = 64  # one dispatch's prompts


@dataclass(frozen=True)
class PairingLimits:
    """How much the pairing server takes on. Each pairing check may open side-channel connections to the
    address it names (the decode's table of prefill ranks is bounded too, `max_prefill_peers`): checks
    beyond `checks_per_s` (with bursts of `burst`) or more than `max_in_flight` requests at once are
    refused with 429 and a Retry-After, before any work."""

    checks_per_s: float = 10.0
    burst: int = 20
    max_in_flight: int = 8


class _Gate:
    """A token bucket for pairing checks and a count of requests in flight (shared by the server's
    handler threads, hence the lock)."""

    def __init__(self, limits: PairingLimits) -> None:
        self.limits = limits
        self.lock = threading.Lock()
        self.tokens = float(limits.burst)
        self.stamp = time.monotonic()
        self.in_flight = 0

    def enter(self, check: bool) -> str:
        """ "" when the request may go on (call leave() after), else why not."""
        lim = self.limits
        with self.lock:
            if self.in_flight >= lim.max_in_flight:
                return (
                    f"{self.in_flight} pairing requests in flight (at most {lim.max_in_flight}): retry later"
                )
            if check:
                now = time.monotonic()
                self.tokens = min(float(lim.burst), self.tokens + (now - self.stamp) * lim.checks_per_s)
                self.stamp = now
                if self.tokens < 1.0:
                    return f"more than {lim.checks_per_s:g} pairing checks per second: retry later"
                self.tokens -= 1.0
            self.in_flight += 1
            return ""

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class _Handler(BaseHTTPRequestHandler):
    """One GET: route, signature, limits, query, then the worker's answer."""

    server: _Server

    def do_GET(self) -> None:
        srv = self.server
        url = urllib.parse.urlsplit(self.path)
        if url.path not in ROUTES:
            self._answer(404, {"error": f"no route {url.path}; use {' or '.join(ROUTES)}"})
            return
        if srv.key is not None and not pairing_signature_ok(
            srv.key, self.path, self.headers.get(PAIRING_HEADER)
        ):
            self._answer(401, {"error": f"missing or wrong {PAIRING_HEADER}: sign with the shared key"})
            return
        refused = srv.gate.enter(check=url.path == PAIRING_ROUTE)
        if refused:
            self._answer(429, {"error": refused}, retry_after=1)
            return
        try:
            self._route(url)
        finally:
            srv.gate.leave()

    def _route(self, url: urllib.parse.SplitResult) -> None:
        worker = self.server.worker
        query = urllib.parse.parse_qs(url.query)
        q = {k: v[0] for k, v in query.items()}
        try:
            prefill = PrefillAddress(
                q["engine_id"],
                q.get("host", "127.0.0.1"),
                int(q["port"]),
                int(q.get("tp_size", 1)),
                int(q.get("pp_size", 1)),
            )
        except (KeyError, ValueError) as exc:
            self._answer(400, {"error": f"need engine_id, port (and host, tp_size): {exc!r}"})
            return
        try:
            check_pp_size(prefill.pp_size, "pairing check")
        except ValueError as exc:
            self._answer(400, {"error": str(exc)})
            return
        if url.path == RELEASE_ROUTE:
            keys = query.get("key", [])
            if not keys or len(keys) > MAX_RELEASE_KEYS or any(len(k) > 256 for k in keys):
                self._answer(400, {"error": f"need 1-{MAX_RELEASE_KEYS} key= transfer keys"})
                return
            self._answer(*worker.release_transfers(prefill, keys))
            return
        self._answer(*worker.check_pairing(prefill, self.server.timeout_s))

    def _answer(self, status: int, body: dict[str, Any], retry_after: int = 0) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if retry_after:
            self.send_header("Retry-After", str(retry_after))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the caller gave up
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None  # the engine's log is not an access log


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], worker: PairingChecker, limits: PairingLimits) -> None:
        self.worker = worker
        self.timeout_s = min(worker.settings.connect_timeout_s, 10.0)
        self.key = worker.settings.config.security.hmac_key
        self.gate = _Gate(limits)
        super().__init__(address, _Handler)


class PairingServer:
    """GET /kvpush/pairing for one decode rank, on its own small HTTP server thread."""

    def __init__(
        self, worker: PairingChecker, host: str, port: int, limits: PairingLimits | None = None
    ) -> None:
        self.server = _Server((host, port), worker, limits or PairingLimits())
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvpush-pairing", daemon=True)
        self.thread.start()
        log.warning("kvpush: decode pairing check on http://%s:%d%s", host, port, PAIRING_ROUTE)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
