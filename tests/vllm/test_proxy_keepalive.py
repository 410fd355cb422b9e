"""The proxy's pooled connections to its backends must expire before the backends close them.

vLLM's API server (uvicorn) closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default);
aiohttp keeps idle connections for 15 s unless told otherwise and retries no POST. A request the proxy
writes on a connection the server is closing at that moment is lost: the client gets a 502
(ServerDisconnectedError). Seen in CI: tests/vllm/test_kvpush_vllm.py's abort test, its first request
after ~5 s of waiting.

The backends here are stand-ins with a short keep-alive that always lose that race: a request arriving on
a connection idle for their keep-alive or longer is dropped unanswered, as a closing server drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

aiohttp = pytest.importorskip("aiohttp")

from kvpush.platforms.vllm.proxy import ProxyConfig  # noqa: E402

from .test_proxy import environment, run  # noqa: E402

BACKEND_KEEPALIVE_S = 0.6  # the stand-ins' keep-alive (vLLM's is 5 s)
IDLE_S = 0.9  # the client's pause between requests: past the stand-ins' keep-alive


class ClosingBackend:
    """HTTP/1.1 with keep-alive, answering every POST with a small JSON object; a request on a connection
    idle for keepalive_s or more is dropped without an answer (counted in `dropped`)."""

    def __init__(self, keepalive_s: float, answer: dict[str, object]):
        self.keepalive_s = keepalive_s
        self.answer = json.dumps(answer).encode()
        self.answered = 0
        self.dropped = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        loop = asyncio.get_running_loop()
        idle_since: float | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                if idle_since is not None and loop.time() - idle_since >= self.keepalive_s:
                    self.dropped += 1
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(self.answer)}\r\n\r\n".encode()
                    + self.answer
                )
                await writer.drain()
                self.answered += 1
                idle_since = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(backend: ClosingBackend) -> AsyncIterator[str]:
    server = await asyncio.start_server(backend.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def _two_requests_apart(keepalive_s: float) -> tuple[list[int], ClosingBackend, ClosingBackend]:
    prefill = ClosingBackend(BACKEND_KEEPALIVE_S, {"kv_transfer_params": None})
    decode = ClosingBackend(BACKEND_KEEPALIVE_S, {"choices": [{"text": "x", "token_ids": [1]}]})
    statuses = []
    async with (
        serving(prefill) as p_url,
        serving(decode) as d_url,
        environment([p_url], [d_url], backend_keepalive_s=keepalive_s) as env,
    ):
        for i in range(2):
            if i:
                await asyncio.sleep(IDLE_S)
            status, _, _, _ = await env.call(
                "POST", "/v1/completions", json_body={"model": "m", "prompt": "import os", "max_tokens": 1}
            )
            statuses.append(status)
        # the prefill leg may still be finishing in the background after the decode answered
        for _ in range(50):
            if prefill.answered + prefill.dropped == 2:
                break
            await asyncio.sleep(0.02)
    return statuses, prefill, decode


def test_the_proxy_reuses_no_connection_its_backend_may_be_closing():
    statuses, prefill, decode = run(lambda: _two_requests_apart(BACKEND_KEEPALIVE_S / 2))
    assert statuses == [200, 200]
    assert (prefill.dropped, decode.dropped) == (0, 0)
    # the second request went on a new connection to each backend
    assert (prefill.connections, decode.connections) == (2, 2)


def test_a_pool_that_outlives_the_backends_keepalive_loses_requests():
    """The stand-in reproduces the failure: with a pool keep-alive above the backend's, the second
    request is written on a stale connection and the client gets a 502."""
    statuses, prefill, decode = run(lambda: _two_requests_apart(BACKEND_KEEPALIVE_S * 10))
    assert statuses[0] == 200
    assert statuses[1] == 502
    assert prefill.dropped + decode.dropped >= 1


def test_the_default_pool_keepalive_is_below_vllms():
    """vLLM's API server closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s default)."""
    vllm_keepalive_s = 5.0
    with contextlib.suppress(ImportError):
        from vllm import envs  # the installed vLLM's own default, where it is installed

        vllm_keepalive_s = float(envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
    assert ProxyConfig.backend_keepalive_s < vllm_keepalive_s
