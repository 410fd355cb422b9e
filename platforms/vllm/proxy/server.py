"""The client-facing side of `kvpush proxy`: everything a client can make the proxy read, parse, keep or
hold open is bounded, so one client cannot starve the others (SECURITY.md, "The proxy").

- Bodies: at most `max_body_bytes` (a declared Content-Length above it is refused before a byte is read),
  read within `body_timeout_s`, not compressed, JSON objects nested at most `max_json_depth` deep. Every
  refusal is a JSON error naming the limit; a refusal that leaves body bytes unread closes the connection.
- Request ids: a client's X-Request-Id is kept only if it is 1..`max_request_id_len` characters of
  [A-Za-z0-9._:-]; any other (absent, empty, too long, other characters) is replaced by a fresh
  `kvp-<32 hex>`. The response's X-Request-Id says which id was used.
- Connections: at most `max_connections` open; a new one beyond that evicts the connection idle longest
  (no request in progress), or is closed at once when every one is busy. Idle and half-sent headers are
  closed after `idle_timeout_s` (aiohttp's keep-alive timer also runs before the first request).
- Timings (`GET /kvpush/timings`): off unless a token is configured (from a file or the environment,
  never the command line); served only to `Authorization: Bearer <token>`; at most `timings_max_records`
  records, whose ids obey the request-id rule above.

aiohttp is imported where used, so `kvpush proxy --help` works without it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hmac
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("kvpush.proxy")

TIMINGS_TOKEN_ENV = "KVPUSH_PROXY_TIMINGS_TOKEN"
MIN_TOKEN_CHARS = 16
LINGER_S = 2.0
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")


def error_body(message: str, status: int, kind: str = "BackendError") -> dict[str, Any]:
    """The OpenAI error shape every proxy refusal uses."""
    return {"error": {"message": message, "type": kind, "code": status}}


class ClientError(Exception):
    """A client request the proxy refuses. close: the body was not read to its end, so the connection
    cannot carry another request (and must not make the proxy drain an unbounded remainder)."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status = status
        self.close = close

    def response(self, request_id: str = "") -> web.Response:
        from aiohttp import web

        headers = {"X-Request-Id": request_id} if request_id else None
        resp = web.json_response(
            error_body(str(self), self.status, "BadRequest"), status=self.status, headers=headers
        )
        if self.close:
            resp.force_close()
        return resp


# ---- bodies -----------------------------------------------------------------------------------------


async def read_body(request: web.BaseRequest, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most max_bytes, all of it within timeout_s (a slow sender holds only its own
    connection, and only that long)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ClientError(
            415, f"compressed request bodies are not accepted (Content-Encoding: {encoding[:40]!r})", True
        )
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise ClientError(413, _too_large(max_bytes, f"Content-Length is {declared}"), True)
    buf = bytearray()

    async def pull() -> None:
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return
            buf.extend(chunk)
            if len(buf) > max_bytes:
                raise ClientError(413, _too_large(max_bytes, f"more than {max_bytes} bytes were sent"), True)

    try:
        await asyncio.wait_for(pull(), timeout_s)
    except asyncio.TimeoutError:
        raise ClientError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (--body-timeout); {len(buf)} bytes came",
            True,
        ) from None
    return bytes(buf)


def _too_large(max_bytes: int, what: str) -> str:
    return f"request body too large: {what}; the limit is {max_bytes} bytes (--max-body-bytes)"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """raw as a JSON object nested at most max_depth deep; ClientError(400) naming the problem otherwise.

    Nesting is bounded below the interpreter's recursion limit so that forwarding the body (json.dumps,
    recursive too) cannot fail where parsing succeeded."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ClientError(400, _too_deep(max_depth)) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, integers over 4300 digits
        raise ClientError(400, f"request body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ClientError(400, f"request body must be a JSON object, not {type(body).__name__}")
    if json_depth_exceeds(body, max_depth):
        raise ClientError(400, _too_deep(max_depth))
    return body


def _too_deep(max_depth: int) -> str:
    return f"request body nested deeper than {max_depth} levels (--max-json-depth)"


def json_depth_exceeds(obj: dict[str, Any] | list[Any], max_depth: int) -> bool:
    """Whether parsed JSON nests objects/arrays more than max_depth deep (the top level is depth 1).
    Iterative: the check itself must not recurse."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        for v in node.values() if isinstance(node, dict) else node:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return False


async def read_json_object(
    request: web.BaseRequest, *, max_bytes: int, timeout_s: float, max_depth: int
) -> dict[str, Any]:
    return parse_object(await read_body(request, max_bytes, timeout_s), max_depth)


def request_id_for(client_value: str | None, max_len: int) -> str:
    """The client's X-Request-Id if it is 1..max_len characters of [A-Za-z0-9._:-], else a fresh one.

    The id reaches both engines and the KV wire (whose own limit is 512 characters), logs and the timings
    records, so an id a client picks must be short and plain; an odd one is replaced, not refused, and
    the response names the id used."""
    if client_value and len(client_value) <= max_len and _REQUEST_ID.fullmatch(client_value):
        return client_value
    fresh = f"kvp-{uuid.uuid4().hex}"
    if client_value:
        log.info(
            "X-Request-Id %s (%d chars) replaced by %s", ascii(client_value[:80]), len(client_value), fresh
        )
    return fresh


# ---- timings ----------------------------------------------------------------------------------------


def load_timings_token(token_file: str | None, environ: dict[str, str] | None = None) -> str:
    """The timings token from token_file, else from $KVPUSH_PROXY_TIMINGS_TOKEN; SystemExit naming both
    when neither gives one of at least 16 characters (a token on the command line would show in ps)."""
    env = os.environ if environ is None else environ
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token, source = f.read().strip(), f"--timings-token-file {token_file}"
        except OSError as exc:
            raise SystemExit(f"--timings-token-file: cannot read {token_file}: {exc}") from None
    else:
        token, source = env.get(TIMINGS_TOKEN_ENV, "").strip(), f"${TIMINGS_TOKEN_ENV}"
    if not token:
        raise SystemExit(f"--timings needs a token: give --timings-token-file or set ${TIMINGS_TOKEN_ENV}")
    if len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(
            f"the timings token from {source} has {len(token)} characters; use at least {MIN_TOKEN_CHARS}"
        )
    return token


class TimingsLog:
    """Per-request proxy timestamps (`kvpush bench-vllm` reads prefill-done -> first decode chunk from
    them). Kept only while a token is set, and at most max_records of them (the oldest go first)."""

    def __init__(self, token: str, max_records: int):
        self.token = token
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_records)

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    def record(self, request_id: str) -> dict[str, Any]:
        """A record to fill in (kept in the log only when the log is enabled)."""
        rec: dict[str, Any] = {"id": request_id, "start": time.perf_counter()}
        if self.enabled:
            self.records.append(rec)
        return rec

    def snapshot(self, clear: bool = False) -> list[dict[str, Any]]:
        """Each record's timestamps in seconds since its request arrived."""
        out = []
        for rec in list(self.records):
            t0 = rec["start"]
            out.append(
                {"id": rec["id"], **{k: round(v - t0, 6) for k, v in rec.items() if k not in ("id", "start")}}
            )
        if clear:
            self.records.clear()
        return out

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return (
            self.enabled
            and scheme.lower() == "bearer"
            # surrogateescape: aiohttp keeps a header's undecodable bytes as surrogates
            and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), self.token.encode())
        )

    async def handle(self, request: web.Request) -> web.Response:
        """GET /kvpush/timings[?clear=1] with the bearer token; 401 without it."""
        from aiohttp import web

        if not self.authorized(request.headers.get("Authorization")):
            return web.json_response(
                error_body(
                    "GET /kvpush/timings needs 'Authorization: Bearer <timings token>'", 401, "Unauthorized"
                ),
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return web.json_response(self.snapshot(clear=request.query.get("clear") == "1"))


# ---- connections ------------------------------------------------------------------------------------


class _Conn(asyncio.Protocol):
    """One client connection: aiohttp's protocol behind a guard that counts it."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests in progress (a handler is running)
        self.idle_since = time.monotonic()
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.admitted = self.guard.admit(self)
        if not self.admitted:
            transport.abort()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        if self.admitted:
            self.inner.connection_lost(exc)


class ConnectionGuard:
    """At most `limit` open client connections. A connection is busy while a request handler runs on it
    (its body is being read, bounded by body_timeout_s, or the backends are answering); otherwise idle,
    including one still sending its request headers. A new connection beyond the limit evicts the one
    idle longest; when all are busy it is closed at once (the busy ones end by their own timeouts)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.conns: dict[asyncio.Transport, _Conn] = {}
        self.evicted = 0
        self.refused = 0

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Conn(self, factory())

    def admit(self, conn: _Conn) -> bool:
        if len(self.conns) >= self.limit:
            idle = [c for c in self.conns.values() if not c.busy]
            if not idle:
                self.refused += 1
                if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                    log.warning(
                        "connection refused: all %d connections are busy (%d refused)",
                        self.limit,
                        self.refused,
                    )
                return False
            oldest = min(idle, key=lambda c: c.idle_since)
            self.forget(oldest)
            self.evicted += 1
            assert oldest.transport is not None
            oldest.transport.close()
        assert conn.transport is not None
        self.conns[conn.transport] = conn
        return True

    def forget(self, conn: _Conn) -> None:
        if conn.transport is not None and self.conns.get(conn.transport) is conn:
            del self.conns[conn.transport]

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """Marks a connection busy while a handler runs on it."""
        from aiohttp import web

        @web.middleware
        async def mark_busy(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            conn = self.conns.get(request.transport) if request.transport is not None else None  # type: ignore[arg-type]
            if conn is None:
                return await handler(request)
            conn.busy += 1
            try:
                return await handler(request)
            finally:
                conn.busy -= 1
                conn.idle_since = time.monotonic()

        return mark_busy


@functools.cache
def guard_key() -> Any:
    from aiohttp import web

    return web.AppKey("kvpush_connection_guard", ConnectionGuard)


def server_options(idle_timeout_s: float) -> dict[str, Any]:
    """aiohttp server options for a client-facing proxy. handler_cancellation: a client that goes away
    cancels dispatch, which cancels both backend requests; keepalive_timeout: idle connections, and
    connections that never finish their headers, close after idle_timeout_s; no request decompression;
    the unread rest of a refused body is discarded for at most LINGER_S."""
    return {
        "handler_cancellation": True,
        "access_log": None,
        "keepalive_timeout": idle_timeout_s,
        "auto_decompress": False,
        # after refusing a body part-read, drain the rest for at most this long so the client sees the
        # answer (closing on unread bytes would reset it), then close
        "lingering_time": LINGER_S,
        "shutdown_timeout": 5.0,
    }


@dataclass
class RunningServer:
    url: str
    guard: ConnectionGuard
    _close: Callable[[], Awaitable[None]]

    async def close(self) -> None:
        await self._close()


async def start_server(
    app: web.Application, host: str, port: int, *, idle_timeout_s: float, backlog: int = 512
) -> RunningServer:
    """Serve app (from proxy.build_app, which holds its ConnectionGuard) on host:port (0 = any free)."""
    from aiohttp import web

    guard: ConnectionGuard = app[guard_key()]
    runner = web.AppRunner(app, **server_options(idle_timeout_s))
    await runner.setup()
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()
    try:
        listener = await loop.create_server(
            guard.wrap(server), host, port, backlog=backlog, reuse_address=True
        )
    except BaseException:
        await runner.cleanup()
        raise
    bound = listener.sockets[0].getsockname()

    async def close() -> None:
        listener.close()
        await runner.cleanup()

    return RunningServer(f"http://{bound[0]}:{bound[1]}", guard, close)


def ensure_file_limit(max_connections: int) -> None:
    """Raise the soft open-file limit (within the hard one) so max_connections client connections, each
    with up to two engine connections, cannot run the process out of descriptors; warn if it cannot."""
    import resource

    want = 3 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning(
                "open-file limit %d is below the %d that --max-connections %d may need; lower it or raise "
                "the limit (ulimit -n)",
                new,
                want,
                max_connections,
            )


async def serve_until_signalled(app: web.Application, host: str, port: int, idle_timeout_s: float) -> None:
    ensure_file_limit(app[guard_key()].limit)
    running = await start_server(app, host, port, idle_timeout_s=idle_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("kvpush proxy serving on %s", running.url)
    try:
        await stop.wait()
    finally:
        await running.close()


def run_server(app: web.Application, host: str, port: int, idle_timeout_s: float) -> None:
    asyncio.run(serve_until_signalled(app, host, port, idle_timeout_s))
