"""The decode's pairing check: GET /kvpush/pairing?engine_id=&host=&port=&tp_size=&pp_size= on one rank,
and GET /kvpush/release?<the same>&key=... (the proxy frees a left client's transfers; proxy/release.py).

The check makes the decode handshake with whatever prefill address the query names, so it binds loopback
unless extra config `pairing_host` says otherwise (ConnectorSettings refuses a wider bind without a key),
and with a shared key it answers only requests signed with it (params.PAIRING_HEADER; `kvpush proxy
--decode-pairing` signs with --hmac-key-file or $KVPUSH_HMAC_KEY). Importing it imports neither torch nor
vLLM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import urllib.parse
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


class PairingServer:
    """GET /kvpush/pairing for one decode rank, on its own small HTTP server thread."""

    def __init__(self, worker: PairingChecker, host: str, port: int) -> None:
        timeout_s = min(worker.settings.connect_timeout_s, 10.0)
        key = worker.settings.config.security.hmac_key

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if url.path not in ROUTES:
                    self._answer(404, {"error": f"no route {url.path}; use {' or '.join(ROUTES)}"})
                    return
                if key is not None and not pairing_signature_ok(
                    key, self.path, self.headers.get(PAIRING_HEADER)
                ):
                    self._answer(
                        401, {"error": f"missing or wrong {PAIRING_HEADER}: sign with the shared key"}
                    )
                    return
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
                self._answer(*worker.check_pairing(prefill, timeout_s))

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the caller gave up
                    self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None  # the engine's log is not an access log

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvpush-pairing", daemon=True)
        self.thread.start()
        log.warning("kvpush: decode pairing check on http://%s:%d%s", host, port, PAIRING_ROUTE)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
