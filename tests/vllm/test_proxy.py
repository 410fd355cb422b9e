"""Unit tests of `kvpush proxy` (platforms/vllm/proxy/) against fake vLLM backends.

Everything runs in-process on 127.0.0.1: the fake prefill/decode backends and the proxy are aiohttp apps
on ephemeral ports, and a plain aiohttp ClientSession talks to the proxy. No vLLM, no GPU. Each test is a
sync function that runs its async body with `asyncio.run` under an overall deadline, and every call to
the proxy has its own short timeout, so a hang fails the test instead of blocking the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402

from kvpush.platforms.vllm.proxy import PrefillBackend, ProxyConfig, build_app  # noqa: E402
from kvpush.platforms.vllm.proxy import cli as proxy_mod  # noqa: E402
from kvpush.platforms.vllm.proxy.server import start_server  # noqa: E402

CALL_TIMEOUT_S = 5.0  # one proxy call
TEST_TIMEOUT_S = 20.0  # one whole test body
SLOW_S = 10.0  # how long a "slow" fake takes: far above anything a passing test waits for
TIMINGS_TOKEN = "test-timings-token-0123456789"  # the environment enables GET /kvpush/timings with it

# What pull-mode prefills answer with (vLLM's NixlConnector shape).
PULL_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "p0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "x",
    "tp_size": 1,
}


def run(body: Callable[[], Awaitable[Any]], timeout: float = TEST_TIMEOUT_S) -> Any:
    return asyncio.run(asyncio.wait_for(body(), timeout))


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port we bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def sse_chunks(name: str, n: int = 3) -> list[bytes]:
    out = []
    for i in range(n):
        data = {
            "id": f"cmpl-{name}",
            "object": "text_completion",
            "choices": [{"index": 0, "text": f"{name}-{i}"}],
        }
        out.append(f"data: {json.dumps(data)}\n\n".encode())
    out.append(b"data: [DONE]\n\n")
    return out


class Fake:
    """A vLLM-like backend: records each request and answers as configured.

    gate: awaited (with a deadline) before answering; delay: seconds slept before the response headers;
    first_chunk_delay: seconds slept after the headers of a streamed answer, before its first chunk;
    raw_answer: a 200 body sent instead of the JSON answer; die_mid_stream: close the connection after
    the first chunk of a streamed answer (an engine that crashes while generating).
    """

    def __init__(
        self,
        name: str,
        *,
        log: list[str] | None = None,
        kv: dict[str, Any] | None = None,
        status: int = 200,
        gate: asyncio.Event | None = None,
        delay: float = 0.0,
        first_chunk_delay: float = 0.0,
        health_status: int = 200,
        raw_answer: bytes | None = None,
        die_mid_stream: bool = False,
    ):
        self.name = name
        self.log = log if log is not None else []
        self.kv = kv
        self.status = status
        self.gate = gate
        self.gate_timed_out = False
        self.delay = delay
        self.first_chunk_delay = first_chunk_delay
        self.health_status = health_status
        self.raw_answer = raw_answer
        self.die_mid_stream = die_mid_stream
        self.chunks = sse_chunks(name)
        self.received: list[dict[str, Any]] = []
        self.entered = asyncio.Event()
        self.answered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.url = ""

    def answer(self, path: str) -> dict[str, Any]:
        if path.endswith("/chat/completions"):
            choice = {"index": 0, "message": {"role": "assistant", "content": f"hello from {self.name}"}}
            out: dict[str, Any] = {
                "id": f"chatcmpl-{self.name}",
                "object": "chat.completion",
                "choices": [choice],
            }
        else:
            choice = {"index": 0, "text": f"hello from {self.name}"}
            out = {"id": f"cmpl-{self.name}", "object": "text_completion", "choices": [choice]}
        if self.kv is not None:
            out["kv_transfer_params"] = self.kv
        return out

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(
            {"path": request.path, "request_id": request.headers.get("X-Request-Id"), "body": body}
        )
        self.log.append(f"{self.name}:start")
        self.entered.set()
        try:
            if self.gate is not None:
                try:
                    await asyncio.wait_for(self.gate.wait(), 3.0)
                except asyncio.TimeoutError:
                    self.gate_timed_out = True
                    raise
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.status != 200:
                return web.json_response(
                    {"object": "error", "message": f"{self.name} failed", "code": self.status},
                    status=self.status,
                )
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                if self.first_chunk_delay:
                    await asyncio.sleep(self.first_chunk_delay)
                for chunk in self.chunks:
                    await resp.write(chunk)
                    await asyncio.sleep(0.01)
                    if self.die_mid_stream:
                        assert request.transport is not None
                        request.transport.close()
                        return resp
                await resp.write_eof()
                return resp
            if self.raw_answer is not None:
                return web.Response(body=self.raw_answer, content_type="application/json")
            return web.json_response(self.answer(request.path))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.answered.set()
            self.log.append(f"{self.name}:end")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})


async def serve(
    app: web.Application,
    stack: contextlib.AsyncExitStack,
    *,
    handler_cancellation: bool = True,
    **runner_kwargs: Any,
) -> str:
    """Serve app on 127.0.0.1 (ephemeral port) until the stack closes; returns its base URL.

    handler_cancellation=True (as aiohttp's TestServer does) cancels a handler whose client disconnects:
    the fakes rely on it to observe a dropped connection.
    """
    runner = web.AppRunner(
        app, handler_cancellation=handler_cancellation, shutdown_timeout=0.5, **runner_kwargs
    )
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def prefill_backend(url: str, i: int) -> PrefillBackend:
    # Deliberately not the defaults, so the test sees that the configured values are forwarded.
    return PrefillBackend(
        url, engine_id=f"engine-{i}", kv_host=f"10.0.0.{i + 1}", kv_port=5600 + i, tp_size=2, pp_size=3
    )


def expected_push_params(pb: PrefillBackend, request_id: str, transfer_id: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": pb.engine_id,
        "remote_host": pb.kv_host,
        "remote_port": pb.kv_port,
        "tp_size": pb.tp_size,
        "pp_size": pb.pp_size,
        "remote_request_id": request_id,
        "remote_block_ids": None,
        "transfer_id": transfer_id,
        "transfer_mode": None,
        "decode_engine_id": None,  # named on the prefill leg only
    }


def check_push_pair(p: dict[str, Any], d: dict[str, Any], pb: PrefillBackend, request_id: str) -> str:
    """The prefill and decode bodies of one push dispatch agree on one fresh transfer id; returns it."""
    tid = p["body"]["kv_transfer_params"].get("transfer_id", "")
    assert tid.startswith("kvp-") and len(tid) > 20, p["body"]["kv_transfer_params"]
    assert p["body"]["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
    assert d["body"]["kv_transfer_params"] == expected_push_params(pb, request_id, tid)
    return tid


class Env:
    """Fakes + proxy + a client session, all torn down by the exit stack."""

    def __init__(
        self,
        stack: contextlib.AsyncExitStack,
        proxy: str,
        session: aiohttp.ClientSession,
        prefill: list[PrefillBackend],
        app: web.Application,
        server: Any = None,
    ):
        self.stack = stack
        self.proxy = proxy
        self.session = session
        self.prefill = prefill
        self.app = app
        self.server = server  # proxy.server.RunningServer: its ConnectionGuard

    async def call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = CALL_TIMEOUT_S,
    ):
        """(status, headers, body bytes, seconds) of one proxy call, or TimeoutError after `timeout`."""

        async def go():
            t0 = time.perf_counter()
            async with self.session.request(
                method, self.proxy + path, json=json_body, data=data, headers=headers
            ) as r:
                return r.status, r.headers, await r.read(), time.perf_counter() - t0

        return await asyncio.wait_for(go(), timeout)

    async def timings(self, clear: bool = False) -> list[dict[str, Any]]:
        """GET /kvpush/timings with the environment's token."""
        status, _, raw, _ = await self.call(
            "GET",
            "/kvpush/timings" + ("?clear=1" if clear else ""),
            headers={"Authorization": f"Bearer {TIMINGS_TOKEN}"},
        )
        assert status == 200, raw
        return json.loads(raw)


@contextlib.asynccontextmanager
async def environment(
    prefill: list[Fake | str],
    decode: list[Fake | str],
    mode: str = "push",
    pairing: list[Any] | None = None,
    **limits: Any,
):
    """Fakes and the proxy, served as `kvpush proxy` serves it (proxy.server.start_server). limits:
    ProxyConfig fields (the timings endpoint is on, with TIMINGS_TOKEN, unless timings_token="")."""
    async with contextlib.AsyncExitStack() as stack:
        urls: list[list[str]] = [[], []]
        for out, backends in zip(urls, (prefill, decode), strict=True):
            for b in backends:
                if isinstance(b, Fake):
                    b.url = await serve(b.app(), stack)
                    out.append(b.url)
                else:
                    out.append(b)
        pbs = [prefill_backend(u, i) for i, u in enumerate(urls[0])]
        pairing_urls = []
        for checker in pairing or []:
            pairing_urls.append(await serve(checker.app(), stack))
        app = build_app(
            ProxyConfig(
                prefill=pbs,
                decode=urls[1],
                mode=mode,
                decode_pairing=pairing_urls,
                connect_timeout_s=2.0,
                request_timeout_s=30.0,
                **{"timings_token": TIMINGS_TOKEN, **limits},
            )
        )
        server = await start_server(app, "127.0.0.1", 0, idle_timeout_s=limits.get("idle_timeout_s", 30.0))
        stack.push_async_callback(server.close)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S * 2))
        stack.push_async_callback(session.close)
        yield Env(stack, server.url, session, pbs, app, server)


def error_message(raw: bytes) -> str:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    return body["error"]["message"]


# ---- push mode ----------------------------------------------------------------------------------------


def test_push_streaming_completions():
    """Concurrent dispatch, same request id, the right bodies, decode's stream relayed byte for byte."""

    async def body():
        log: list[str] = []
        decode = Fake("decode", log=log)
        # The prefill answers only once the decode has the request (a sequential proxy would deadlock
        # here and fail on the gate), and the decode streams only after the prefill answered, as in vLLM.
        prefill = Fake("prefill", log=log, gate=decode.entered, kv={"do_remote_decode": True})
        decode.gate = prefill.answered
        async with environment([prefill], [decode]) as env:
            req = {
                "model": "m",
                "prompt": "hello world",
                "max_tokens": 16,
                "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": 0,
            }
            status, headers, raw, _ = await env.call(
                "POST", "/v1/completions", json_body=req, headers={"X-Request-Id": "req-push-1"}
            )
            assert status == 200, raw
            assert headers["Content-Type"].startswith("text/event-stream")
            assert raw == b"".join(decode.chunks)
            assert not prefill.gate_timed_out and not decode.gate_timed_out
            assert log.index("decode:start") < log.index("prefill:end")

            [p] = prefill.received
            [d] = decode.received
            assert p["request_id"] == d["request_id"] == "req-push-1"
            assert p["path"] == d["path"] == "/v1/completions"
            check_push_pair(p, d, env.prefill[0], "req-push-1")
            assert p["body"]["max_tokens"] == 1
            assert p["body"]["stream"] is False
            assert "stream_options" not in p["body"]
            assert p["body"]["prompt"] == "hello world"
            assert {k: v for k, v in d["body"].items() if k != "kv_transfer_params"} == req

            [rec] = [r for r in await env.timings() if r["id"] == "req-push-1"]
            assert rec["prefill_done"] >= 0
            assert rec["first_chunk"] >= 0
            # The decode streamed only after the prefill answered.
            assert rec["first_chunk"] >= rec["prefill_done"]

    run(body)


def test_push_nonstreaming_chat_completions():
    async def body():
        decode = Fake("decode")
        prefill = Fake("prefill", gate=decode.entered, kv={"do_remote_decode": True})
        async with environment([prefill], [decode]) as env:
            req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20}
            status, headers, raw, _ = await env.call("POST", "/v1/chat/completions", json_body=req)
            assert status == 200, raw
            assert headers["Content-Type"].startswith("application/json")
            assert json.loads(raw) == decode.answer("/v1/chat/completions")

            [p] = prefill.received
            [d] = decode.received
            assert p["path"] == d["path"] == "/v1/chat/completions"
            # No X-Request-Id from the client: the proxy makes one and gives both backends the same.
            rid = p["request_id"]
            assert rid and rid.startswith("kvp-") and d["request_id"] == rid
            assert p["body"]["max_tokens"] == 1 and p["body"]["max_completion_tokens"] == 1
            check_push_pair(p, d, env.prefill[0], rid)
            assert p["body"]["messages"] == req["messages"]
            assert d["body"]["max_completion_tokens"] == 20 and "max_tokens" not in d["body"]

            [rec] = [r for r in await env.timings() if r["id"] == rid]
            assert rec["prefill_done"] >= 0

    run(body)


@pytest.mark.parametrize("where", ["before_headers", "before_first_chunk"])
def test_push_prefill_failure_fails_fast_and_cancels_decode(where: str):
    """A prefill 500 answers the client at once and drops the (slow) decode request."""

    async def body():
        if where == "before_headers":
            decode = Fake("decode", delay=SLOW_S)
        else:
            decode = Fake("decode", first_chunk_delay=SLOW_S)
        prefill = Fake("prefill", status=500, gate=decode.entered)
        async with environment([prefill], [decode]) as env:
            req = {"model": "m", "prompt": "x", "max_tokens": 8, "stream": where == "before_first_chunk"}
            status, _, raw, elapsed = await env.call(
                "POST", "/v1/completions", json_body=req, headers={"X-Request-Id": "req-fail"}
            )
            assert not prefill.gate_timed_out
            assert status >= 500, raw
            assert elapsed < 2.0
            msg = error_message(raw)
            assert prefill.url in msg and "500" in msg
            assert json.loads(raw)["error"]["code"] == status
            # The decode's handler is cancelled: the proxy closed its connection.
            await asyncio.wait_for(decode.cancelled.wait(), 3.0)

    run(body)


def test_push_prefill_unreachable_gives_503():
    async def body():
        decode = Fake("decode", delay=SLOW_S)
        dead = dead_url()
        async with environment([dead], [decode]) as env:
            status, _, raw, elapsed = await env.call(
                "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 4}
            )
            assert status == 503, raw
            assert elapsed < 2.0
            assert dead in error_message(raw)
            # The connect failure is instant, so the decode request may be dropped before it is even
            # sent; if it did reach the decode, its handler must be cancelled, not left running.
            await asyncio.sleep(0.2)
            if decode.entered.is_set():
                await asyncio.wait_for(decode.cancelled.wait(), 3.0)
            assert decode.log in ([], ["decode:start", "decode:end"])

    run(body)


# ---- pull mode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_pull_mode_prefill_first_then_forwards_kv_params(stream: bool):
    async def body():
        log: list[str] = []
        prefill = Fake("prefill", log=log, kv=PULL_KV, delay=0.1)
        decode = Fake("decode", log=log)
        async with environment([prefill], [decode], mode="pull") as env:
            req = {"model": "m", "prompt": "abc", "max_tokens": 9, "stream": stream}
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", json_body=req, headers={"X-Request-Id": "req-pull"}
            )
            assert status == 200, raw
            if stream:
                assert raw == b"".join(decode.chunks)
            else:
                assert json.loads(raw) == decode.answer("/v1/completions")
            assert log == ["prefill:start", "prefill:end", "decode:start", "decode:end"]

            [p] = prefill.received
            [d] = decode.received
            assert p["request_id"] == d["request_id"] == "req-pull"
            assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False
            assert p["body"]["kv_transfer_params"]["do_remote_decode"] is True
            assert p["body"]["kv_transfer_params"]["do_remote_prefill"] is False
            assert d["body"]["kv_transfer_params"] == PULL_KV
            assert {k: v for k, v in d["body"].items() if k != "kv_transfer_params"} == req

            [rec] = [r for r in await env.timings() if r["id"] == "req-pull"]
            assert rec["prefill_done"] >= 0.1  # the prefill took 0.1 s
            if stream:
                assert rec["first_chunk"] >= rec["prefill_done"]

    run(body)


def test_pull_mode_missing_kv_transfer_params_is_502():
    async def body():
        prefill = Fake("prefill", kv=None)
        decode = Fake("decode")
        async with environment([prefill], [decode], mode="pull") as env:
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 4}
            )
            assert status == 502, raw
            assert "kv_transfer_params" in error_message(raw)
            assert len(prefill.received) == 1
            assert decode.received == []

    run(body)


def test_pull_mode_prefill_unreachable_gives_503():
    async def body():
        decode = Fake("decode")
        dead = dead_url()
        async with environment([dead], [decode], mode="pull") as env:
            status, _, raw, elapsed = await env.call(
                "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 4}
            )
            assert status == 503, raw
            assert elapsed < 2.0
            assert dead in error_message(raw)
            assert decode.received == []

    run(body)


# ---- decode errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_unreachable_gives_503_fast(mode: str):
    async def body():
        # A slow push-mode prefill: the 503 must not wait for it.
        prefill = Fake("prefill", kv=PULL_KV, delay=SLOW_S if mode == "push" else 0.0)
        dead = dead_url()
        async with environment([prefill], [dead], mode=mode) as env:
            status, _, raw, elapsed = await env.call(
                "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 4, "stream": True}
            )
            assert status == 503, raw
            assert elapsed < 2.0
            assert dead in error_message(raw)
            assert json.loads(raw)["error"]["code"] == 503

    run(body)


@pytest.mark.parametrize(("decode_status", "client_status"), [(400, 502), (404, 502), (503, 503)])
@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_status(decode_status: int, client_status: int, stream: bool):
    async def body():
        prefill = Fake("prefill", kv={"do_remote_decode": True})
        decode = Fake("decode", status=decode_status)
        async with environment([prefill], [decode]) as env:
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 4, "stream": stream}
            )
            assert status == client_status, raw
            msg = error_message(raw)
            assert decode.url in msg and str(decode_status) in msg

    run(body)


# ---- routing, health, bad requests, timings -------------------------------------------------------------


def test_round_robin_over_prefill_and_decode_backends():
    async def body():
        prefills = [Fake("p0", kv={"do_remote_decode": True}), Fake("p1", kv={"do_remote_decode": True})]
        decodes = [Fake("d0"), Fake("d1")]
        async with environment(prefills, decodes) as env:
            answered_by = []
            for i in range(4):
                status, _, raw, _ = await env.call(
                    "POST",
                    "/v1/completions",
                    json_body={"prompt": f"p{i}", "max_tokens": 2},
                    headers={"X-Request-Id": f"rr-{i}"},
                )
                assert status == 200, raw
                answered_by.append(json.loads(raw)["id"])
            assert [len(f.received) for f in prefills + decodes] == [2, 2, 2, 2]
            assert answered_by == ["cmpl-d0", "cmpl-d1", "cmpl-d0", "cmpl-d1"]
            # Each decode is told the coordinates of the prefill that got the same request.
            for pf, pb in zip(prefills, env.prefill, strict=True):
                for r in pf.received:
                    [d] = [x for dec in decodes for x in dec.received if x["request_id"] == r["request_id"]]
                    check_push_pair(r, d, pb, r["request_id"])

    run(body)


def test_health():
    async def body():
        prefill, decode = Fake("prefill"), Fake("decode")
        async with environment([prefill], [decode]) as env:
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 200, raw
            assert json.loads(raw) == {"status": "ok", "down": [], "mode": "push"}

        dead = dead_url()
        prefill, decode, sick = Fake("prefill"), Fake("decode"), Fake("sick", health_status=500)
        async with environment([prefill, sick], [decode, dead], mode="pull") as env:
            status, _, raw, elapsed = await env.call("GET", "/health")
            assert status != 200 and status >= 500, raw
            out = json.loads(raw)
            assert out["status"] == "down" and out["mode"] == "pull"
            assert sorted(out["down"]) == sorted([sick.url, dead])
            assert elapsed < 3.5

    run(body)


@pytest.mark.parametrize("payload", [b"not json {", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'"a string"'])
def test_bad_request_body_is_400(payload: bytes):
    async def body():
        prefill, decode = Fake("prefill"), Fake("decode")
        async with environment([prefill], [decode]) as env:
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
            )
            assert status == 400, raw
            assert json.loads(raw)["error"]["code"] == 400
            assert prefill.received == [] and decode.received == []

    run(body)


def test_timings_clear():
    async def body():
        prefill = Fake("prefill", kv={"do_remote_decode": True})
        decode = Fake("decode")
        async with environment([prefill], [decode]) as env:
            for i in range(2):
                status, _, _, _ = await env.call(
                    "POST",
                    "/v1/completions",
                    json_body={"prompt": "x", "max_tokens": 2, "stream": True},
                    headers={"X-Request-Id": f"t-{i}"},
                )
                assert status == 200
            recs = await env.timings(clear=True)
            assert [r["id"] for r in recs] == ["t-0", "t-1"]
            assert all("prefill_done" in r and "first_chunk" in r for r in recs)
            assert await env.timings() == []

    run(body)


def test_models_relays_first_decode():
    async def body():
        prefill, decode = Fake("prefill"), Fake("decode")
        async with environment([prefill], [decode]) as env:
            status, _, raw, _ = await env.call("GET", "/v1/models")
            assert status == 200
            assert json.loads(raw)["data"][0]["id"] == "model-of-decode"

    run(body)


# ---- client disconnects -------------------------------------------------------------------------------


async def post_then_disconnect(proxy: str, prefill: Fake, decode: Fake) -> None:
    """Send a request, wait until both backends have it, then drop the client connection."""

    async def go():
        async with session.post(proxy + "/v1/completions", json={"prompt": "x", "max_tokens": 64}) as r:
            await r.read()

    async with aiohttp.ClientSession() as session:
        task = asyncio.ensure_future(go())
        await asyncio.wait_for(asyncio.gather(prefill.entered.wait(), decode.entered.wait()), 3.0)
        assert not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_client_disconnect_cancels_prefill_and_decode():
    """With handler cancellation on, a client that goes away aborts both backend requests."""

    async def body():
        prefill, decode = Fake("prefill", delay=SLOW_S), Fake("decode", delay=SLOW_S)
        async with environment([prefill], [decode]) as env:
            await post_then_disconnect(env.proxy, prefill, decode)
            await asyncio.wait_for(decode.cancelled.wait(), 3.0)
            await asyncio.wait_for(prefill.cancelled.wait(), 3.0)

    run(body)


def test_client_disconnect_cancels_backends_as_run_serves(monkeypatch: pytest.MonkeyPatch):
    """The same, with the app and server exactly as `kvpush proxy` (proxy.run) builds and serves them."""
    captured: dict[str, Any] = {}

    def fake_run_server(app: web.Application, host: str, port: int, idle_timeout_s: float) -> None:
        captured.update(app=app, host=host, port=port, idle_timeout_s=idle_timeout_s)

    async def body():
        prefill, decode = Fake("prefill", delay=SLOW_S), Fake("decode", delay=SLOW_S)
        async with contextlib.AsyncExitStack() as stack:
            purl, durl = await serve(prefill.app(), stack), await serve(decode.app(), stack)
            parser = argparse.ArgumentParser()
            proxy_mod.configure(parser)
            args = parser.parse_args(
                [
                    "--prefill",
                    purl,
                    "--decode",
                    durl,
                    "--prefill-engine-id",
                    "e0",
                    "--prefill-kv-port",
                    "5600",
                ]
            )
            monkeypatch.setattr(proxy_mod, "run_server", fake_run_server)
            assert proxy_mod.run(args) == 0
            assert (captured["host"], captured["port"]) == ("127.0.0.1", 8000)
            # the same server run_server starts, on a free port instead of 8000
            server = await start_server(
                captured["app"], "127.0.0.1", 0, idle_timeout_s=captured["idle_timeout_s"]
            )
            stack.push_async_callback(server.close)
            await post_then_disconnect(server.url, prefill, decode)
            # With cancellation this takes milliseconds (see the test above); 1.5 s keeps the xfail cheap.
            await asyncio.wait_for(decode.cancelled.wait(), 1.5)
            await asyncio.wait_for(prefill.cancelled.wait(), 1.5)

    run(body)


# ---- known defects ------------------------------------------------------------------------------------


async def raw_post(url: str, path: str, body: dict[str, Any], idle_s: float = 3.0) -> tuple[bytes, bool]:
    """POST over a bare socket; (every byte received, whether the reply ended within idle_s).

    A bare socket shows the wire as it is, where an HTTP client would hide or choke on broken framing.
    """
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (path.encode(), host.encode(), len(payload), payload)
    )
    await writer.drain()
    data, ended = b"", False
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), idle_s)
            if not chunk:
                ended = True
                break
            data += chunk
            if data.endswith(b"\r\n0\r\n\r\n"):
                ended = True
                break
    except asyncio.TimeoutError:
        pass
    finally:
        writer.close()
    return data, ended


def test_decode_dying_mid_stream_aborts_the_client_stream():
    async def body():
        prefill = Fake("prefill", kv={"do_remote_decode": True})
        decode = Fake("decode", die_mid_stream=True)
        async with environment([prefill], [decode]) as env:
            data, ended = await raw_post(
                env.proxy, "/v1/completions", {"prompt": "x", "max_tokens": 8, "stream": True}
            )
            assert data.startswith(b"HTTP/1.1 200 ")
            assert decode.chunks[0] in data
            assert b"[DONE]" not in data  # the failure must not look like a complete answer
            assert ended  # aborted (EOF) or ended, not left hanging
            assert data.count(b"HTTP/1.1 ") == 1  # one response on the wire, not a second in the body

    run(body)


@pytest.mark.parametrize("answer", [b"<html>not vllm</html>", b"[1, 2]"])
def test_pull_mode_prefill_answer_not_a_json_object_is_502(answer: bytes):
    async def body():
        prefill = Fake("prefill", raw_answer=answer)
        decode = Fake("decode")
        async with environment([prefill], [decode], mode="pull") as env:
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 4}
            )
            assert status == 502, raw
            assert prefill.url in error_message(raw)
            assert decode.received == []

    run(body)


# ---- transfer ids and pairing checks --------------------------------------------------------------


def test_reused_request_id_gets_a_distinct_transfer_id_per_dispatch():
    """Two client requests with one X-Request-Id: each dispatch has its own transfer id, shared by its
    prefill and decode, so the engines' transfer keys cannot collide."""

    async def body():
        prefill, decode = Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")
        async with environment([prefill], [decode]) as env:
            calls = [
                env.call(
                    "POST", "/v1/completions", json_body={"prompt": f"x{i}"}, headers={"X-Request-Id": "same"}
                )
                for i in range(2)
            ]
            for status, _, raw, _ in await asyncio.gather(*calls):
                assert status == 200, raw
            pairs = []
            for p in prefill.received:
                [d] = [d for d in decode.received if d["body"]["prompt"] == p["body"]["prompt"]]
                pairs.append(check_push_pair(p, d, env.prefill[0], "same"))
            assert len(set(pairs)) == 2

    run(body)


class FakePairing:
    """A decode's pairing check (decode_worker.PairingServer): answers with `status` and `error`."""

    def __init__(self, status: int = 200, error: str = "", engine_id: str = ""):
        self.status = status
        self.error = error
        self.engine_id = engine_id  # the decode_engine_id it reports ("" = none, as an older decode)
        self.asked: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.asked.append(dict(request.query))
        body: dict[str, Any] = {"ok": self.status == 200, "error": self.error}
        if self.engine_id:
            body["decode_engine_id"] = self.engine_id
        return web.json_response(body, status=self.status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/kvpush/pairing", self.handle)
        return app


MISMATCH = (
    "layout mismatch: blocks are opaque (moved whole) but prefill block_size=32 and decode block_size=64"
)


def test_refused_pairing_fails_health_and_requests_with_the_reason():
    async def body():
        prefill, decode = Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")
        checker = FakePairing(409, MISMATCH)
        async with environment([prefill], [decode], pairing=[checker]) as env:
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 503, raw
            out = json.loads(raw)
            assert out["status"] == "misconfigured" and MISMATCH in out["refused"][0]
            assert out["pairings"][0]["ok"] is False
            # the decode was asked about the configured prefill's KV side channel
            q = checker.asked[-1]
            pb = env.prefill[0]
            assert (q["engine_id"], q["host"], q["port"], q["tp_size"]) == (
                pb.engine_id,
                pb.kv_host,
                str(pb.kv_port),
                str(pb.tp_size),
            )
            status, _, raw, _ = await env.call("POST", "/v1/completions", json_body={"prompt": "x"})
            assert status == 503, raw
            msg = error_message(raw)
            assert MISMATCH in msg and pb.engine_id in msg
            assert not prefill.received and not decode.received  # refused before any traffic

    run(body)


def test_ok_pairing_is_reported_and_a_decode_failure_rechecks_it():
    async def body():
        prefill = Fake("prefill", kv={"do_remote_decode": True})
        decode = Fake("decode", status=500)
        checker = FakePairing(200)
        async with environment([prefill], [decode], pairing=[checker]) as env:
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 200, raw
            assert json.loads(raw)["pairings"][0]["ok"] is True
            # the pairing breaks after the check (a prefill restarted with another block size): the
            # decode's bare 500 is replaced by the reason
            checker.status, checker.error = 409, MISMATCH
            status, _, raw, _ = await env.call("POST", "/v1/completions", json_body={"prompt": "x"})
            assert status == 503, raw
            assert MISMATCH in error_message(raw)
            # fixed again: /health sees it, and a decode failure then keeps the decode's own error
            checker.status, checker.error = 200, ""
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 200, raw
            status, _, raw, _ = await env.call("POST", "/v1/completions", json_body={"prompt": "y"})
            assert status == 500 and "decode failed" in error_message(raw), raw

    run(body)


async def _prefill_leg(env: Env, prefill: Fake, prompt: str) -> dict[str, Any]:
    status, _, raw, _ = await env.call(
        "POST", "/v1/completions", json_body={"prompt": prompt, "max_tokens": 4}
    )
    assert status == 200, raw
    params: dict[str, Any] = prefill.received[-1]["body"]["kv_transfer_params"]
    return params


def test_the_prefill_leg_names_the_decode_it_was_dispatched_with():
    """Ownership on the prefill: the prefill leg's kv_transfer_params carry the engine id of the decode
    the other leg went to (configured, else as its pairing check reported it), so the prefill lets only
    that engine register for the push."""

    async def body():
        decodes = [Fake("decode"), Fake("decode")]
        prefill = Fake("prefill", kv={"do_remote_decode": True})
        async with environment([prefill], decodes, decode_engine_ids=["dec-a", "dec-b"]) as env:
            got = [await _prefill_leg(env, prefill, p) for p in ("x", "y", "z")]
            # round robin: the first and third went to decode a, the second to b
            assert [g.get("decode_engine_id") for g in got] == ["dec-a", "dec-b", "dec-a"]
            assert len(decodes[0].received) == 2 and len(decodes[1].received) == 1
            for g in got:
                assert g["do_remote_decode"] is True and g["transfer_id"].startswith("kvp-")

    run(body)


def test_a_decode_engine_id_is_learned_from_the_pairing_check_and_a_contradiction_refused():
    async def body():
        prefill, decode = Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")
        checker = FakePairing(200, engine_id="dec-7")
        async with environment([prefill], [decode], pairing=[checker]) as env:
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 200, raw
            assert (await _prefill_leg(env, prefill, "x"))["decode_engine_id"] == "dec-7"
        # told one id, the decode reports another: every registration would be refused, so say so
        prefill, decode = Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")
        checker = FakePairing(200, engine_id="dec-7")
        async with environment([prefill], [decode], pairing=[checker], decode_engine_ids=["dec-8"]) as env:
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 503, raw
            assert "'dec-7'" in raw.decode() and "'dec-8'" in raw.decode()
            status, _, raw, _ = await env.call("POST", "/v1/completions", json_body={"prompt": "x"})
            assert status == 503 and "--decode-engine-id" in error_message(raw)
            assert not prefill.received and not decode.received

    run(body)


def test_without_a_known_decode_engine_id_the_prefill_leg_names_none():
    async def body():
        prefill, decode = Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")
        async with environment([prefill], [decode], pairing=[FakePairing(200)]) as env:
            status, _, raw, _ = await env.call("GET", "/health")
            assert status == 200, raw
            assert "decode_engine_id" not in await _prefill_leg(env, prefill, "x")

    run(body)
