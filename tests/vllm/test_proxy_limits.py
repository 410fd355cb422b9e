"""`kvpush proxy` facing clients (proxy/server.py): what a client can make it read, parse, keep or hold
open is bounded, each refusal names its limit, and the proxy keeps serving others meanwhile.

Same set-up as test_proxy.py: fake backends and the proxy in-process on 127.0.0.1, the proxy served by
proxy.server.start_server exactly as `kvpush proxy` serves it. Bare sockets play the misbehaving clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gzip
import io
import json
import socket
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from kvpush.platforms.vllm.proxy import PrefillBackend, ProxyConfig, Router, build_app  # noqa: E402
from kvpush.platforms.vllm.proxy import cli as proxy_mod  # noqa: E402
from kvpush.platforms.vllm.proxy.server import LINGER_S, TIMINGS_TOKEN_ENV, json_depth_exceeds  # noqa: E402
from kvpush.platforms.vllm.tools import bench_vllm  # noqa: E402

from .test_proxy import TIMINGS_TOKEN, Env, Fake, environment, error_message, run  # noqa: E402

OK_BODY = {"prompt": "x", "max_tokens": 2}


def push_fakes() -> tuple[Fake, Fake]:
    return Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")


async def still_serves(env: Env, request_id: str = "after") -> None:
    """A plain request is answered 200 (the proxy survived whatever came before)."""
    status, _, raw, _ = await env.call(
        "POST", "/v1/completions", json_body=OK_BODY, headers={"X-Request-Id": request_id}
    )
    assert status == 200, raw


class Raw:
    """One bare TCP connection to the proxy."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, env: Env) -> Raw:
        """A connection closed with env at the latest."""
        host, port = env.proxy.removeprefix("http://").split(":")
        conn = cls(*await asyncio.open_connection(host, int(port)))
        env.stack.callback(conn.close)
        return conn

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_closed(self, timeout: float) -> bytes:
        """Every byte until the proxy closes the connection; TimeoutError if it is still open."""
        data = b""

        async def go() -> None:
            nonlocal data
            with contextlib.suppress(ConnectionResetError):
                while chunk := await self.reader.read(65536):
                    data += chunk

        await asyncio.wait_for(go(), timeout)
        return data

    def close(self) -> None:
        self.writer.close()


def post_head(length: int | None = None, extra: str = "") -> bytes:
    framing = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n{framing}{extra}\r\n"
    ).encode()


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def body_of(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


# ---- body size, encoding, time --------------------------------------------------------------------


def test_declared_oversized_body_is_413_naming_the_limit_before_it_is_sent():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], max_body_bytes=1000) as env:
            status, _, raw, _ = await env.call("POST", "/v1/completions", data=b"x" * 1001)
            assert status == 413, raw
            assert "1000 bytes" in error_message(raw) and "--max-body-bytes" in error_message(raw)
            # 10 GB declared, nothing sent: answered at once, the connection closed (nothing is drained)
            conn = await Raw.open(env)
            await conn.send(post_head(10**10))
            answer = await conn.until_closed(LINGER_S + 2.0)
            assert status_of(answer) == 413 and b"10000000000" in answer
            conn.close()
            # at the limit: accepted
            padded = json.dumps({**OK_BODY, "pad": ""}).encode()
            padded = json.dumps({**OK_BODY, "pad": "p" * (1000 - len(padded))}).encode()
            assert len(padded) == 1000
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", data=padded, headers={"Content-Type": "application/json"}
            )
            assert status == 200, raw
            assert len(prefill.received) == len(decode.received) == 1

    run(body)


def test_chunked_body_over_the_limit_is_413_and_the_proxy_keeps_serving():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], max_body_bytes=1000) as env:
            conn = await Raw.open(env)
            chunk = b"258\r\n" + b" " * 600 + b"\r\n"  # 0x258 = 600 bytes; two are over the limit
            await conn.send(post_head(None) + chunk + chunk)
            answer = await conn.until_closed(LINGER_S + 2.0)
            assert status_of(answer) == 413
            assert "the limit is 1000 bytes" in json.loads(body_of(answer))["error"]["message"]
            assert prefill.received == [] and decode.received == []
            await still_serves(env)

    run(body)


def test_compressed_body_is_415():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode]) as env:
            status, _, raw, _ = await env.call(
                "POST",
                "/v1/completions",
                data=gzip.compress(json.dumps(OK_BODY).encode()),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
            assert status == 415, raw
            assert "gzip" in error_message(raw)
            assert decode.received == []
            await still_serves(env)

    run(body)


def test_slow_body_gets_408_within_the_body_timeout_and_does_not_hold_up_others():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], body_timeout_s=0.6) as env:
            stalled, trickle = await Raw.open(env), await Raw.open(env)
            await stalled.send(post_head(100) + b'{"prompt"')  # then nothing
            await trickle.send(post_head(100))

            async def drip() -> None:  # progress, but never the whole body in time
                with contextlib.suppress(ConnectionError):
                    for _ in range(100):
                        await trickle.send(b" ")
                        await asyncio.sleep(0.05)

            dripping = asyncio.ensure_future(drip())
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            # others are served meanwhile, at once
            status, _, raw, elapsed = await env.call("POST", "/v1/completions", json_body=OK_BODY)
            assert status == 200 and elapsed < 0.5, (status, raw, elapsed)

            async def answer_of(conn: Raw) -> tuple[bytes, float]:
                head = await asyncio.wait_for(conn.reader.read(65536), 3.0)
                return head, loop.time() - t0

            for head, after in await asyncio.gather(answer_of(stalled), answer_of(trickle)):
                assert 0.5 < after < 2.5  # answered at the body timeout
                assert status_of(head) == 408
                assert "0.6 s (--body-timeout)" in json.loads(body_of(head))["error"]["message"]
            # and closed (the trickler, which keeps sending, may see a reset instead of an end)
            for conn in (stalled, trickle):
                await conn.until_closed(LINGER_S + 3.0)
            dripping.cancel()
            assert len(decode.received) == 1
            await still_serves(env)

    run(body)


def test_a_client_that_stops_reading_a_stream_is_dropped_and_its_engine_requests_cancelled():
    """A streamed answer the client does not take within write_timeout_s: the client is dropped and the
    decode request cancelled, so a stalled reader cannot hold a decode request (and its KV blocks)."""

    async def body():
        prefill, decode = push_fakes()
        decode.chunks = [b"data: " + b"x" * (256 << 10) + b"\n\n"] * 64  # 16 MiB: more than socket buffers
        async with environment([prefill], [decode], write_timeout_s=0.5) as env:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            host, port = env.proxy.removeprefix("http://").split(":")
            sock.connect((host, int(port)))
            stalled = Raw(*await asyncio.open_connection(sock=sock))
            env.stack.callback(stalled.close)
            payload = json.dumps({**OK_BODY, "stream": True}).encode()
            await stalled.send(post_head(len(payload)) + payload)  # and never read the answer
            await asyncio.wait_for(decode.cancelled.wait(), 5.0)
            assert len(decode.log) == 2  # started, then ended by the cancellation, not by finishing
            await still_serves(env)

    run(body)


# ---- JSON ---------------------------------------------------------------------------------------


def nested(depth: int) -> dict[str, Any]:
    """An object `depth` levels deep."""
    obj: dict[str, Any] = {}
    for _ in range(depth - 1):
        obj = {"a": obj}
    return obj


def test_deeply_nested_bodies_are_400_naming_the_limit_and_the_proxy_keeps_serving():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], max_json_depth=16) as env:
            # 16 levels in all (the body is level 1): forwarded intact to both engines
            ok = {**OK_BODY, "tools": nested(15)}
            status, _, raw, _ = await env.call("POST", "/v1/completions", json_body=ok)
            assert status == 200, raw
            assert decode.received[0]["body"]["tools"] == nested(15)
            for payload in (
                json.dumps({**OK_BODY, "tools": nested(16)}).encode(),  # one level too deep
                b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep, still below the recursion limit
                b"[" * 200_000,  # a RecursionError in json itself
                b'{"a": ' * 200_000,
            ):
                status, _, raw, _ = await env.call(
                    "POST",
                    "/v1/completions",
                    data=io.BytesIO(payload),
                    headers={"Content-Type": "application/json"},
                )
                assert status == 400, raw
                assert "deeper than 16 levels (--max-json-depth)" in error_message(raw), raw
                await still_serves(env)
            assert len(decode.received) == 1 + 4

    run(body)


@pytest.mark.parametrize(
    "payload",
    [b"null", b"123", b"true", b'{"prompt": NaN}', b'{"n": Infinity}', b'{"n": ' + b"9" * 5000 + b"}", b""],
)
def test_bodies_that_are_not_plain_json_objects_are_400(payload: bytes):
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode]) as env:
            status, _, raw, _ = await env.call(
                "POST", "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
            )
            assert status == 400, raw
            assert error_message(raw).startswith("request body ")
            assert prefill.received == [] and decode.received == []
            await still_serves(env)

    run(body)


def test_json_depth_check_counts_levels_without_recursing():
    assert not json_depth_exceeds(nested(64), 64) and json_depth_exceeds(nested(65), 64)
    assert not json_depth_exceeds([[], [[]], {"a": [1, {"b": 2}]}], 4)
    assert json_depth_exceeds([[], [[]], {"a": [1, {"b": 2}]}], 3)
    assert not json_depth_exceeds([[], [[1]], {"a": 1}], 3) and json_depth_exceeds([[], [[[]]]], 3)
    deep: list[Any] = []
    for _ in range(100_000):  # far beyond the recursion limit: the check itself must not recurse
        deep = [deep]
    assert json_depth_exceeds(deep, 64)


# ---- request ids --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("abc-123_x.y:Z", True),
        ("r" * 128, True),
        ("r" * 129, False),
        ("", False),
        ("a b", False),
        ("../../etc", False),
        ("<script>", False),
        ("id\tx", False),
    ],
)
def test_request_id_is_kept_only_if_short_and_plain_else_replaced_and_named(given: str, kept: bool):
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode]) as env:
            for stream in (False, True):
                status, headers, raw, _ = await env.call(
                    "POST",
                    "/v1/completions",
                    json_body={**OK_BODY, "stream": stream},
                    headers={"X-Request-Id": given},
                )
                assert status == 200, raw
                used = headers["X-Request-Id"]
                assert prefill.received[-1]["request_id"] == decode.received[-1]["request_id"] == used
                assert decode.received[-1]["body"]["kv_transfer_params"]["remote_request_id"] == used
                if kept:
                    assert used == given
                else:
                    assert used.startswith("kvp-") and len(used) == 36
            [rec, _] = await env.timings()
            assert rec["id"] == prefill.received[0]["request_id"]
            # refusals name the id used too
            status, headers, _, _ = await env.call(
                "POST", "/v1/completions", data=b"[]", headers={"X-Request-Id": given}
            )
            assert status == 400 and (headers["X-Request-Id"] == given) == kept

    run(body)


# ---- connections --------------------------------------------------------------------------------


def test_many_idle_connections_cannot_keep_a_real_request_out():
    """Far more idle connections (some with half-sent headers) than max_connections: the ones idle
    longest are closed to make room, and a real request is served at once."""

    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], max_connections=16) as env:
            guard = env.server.guard
            idle = []
            for i in range(60):
                conn = await Raw.open(env)
                if i % 2:
                    await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n")  # never finished
                idle.append(conn)
            await asyncio.sleep(0.2)
            assert len(guard.conns) <= 16
            status, _, raw, elapsed = await env.call("POST", "/v1/completions", json_body=OK_BODY)
            assert status == 200 and elapsed < 1.0, (raw, elapsed)
            assert guard.evicted >= 60 + 1 - 16
            # the oldest were the ones closed
            for conn in idle[:40]:
                assert await conn.until_closed(1.0) == b""
            for conn in idle:
                conn.close()

    run(body)


def test_idle_connections_and_unfinished_headers_close_after_the_idle_timeout():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], idle_timeout_s=0.5) as env:
            silent, half = await Raw.open(env), await Raw.open(env)
            await half.send(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Ty")
            # a kept-alive connection after a full request
            kept = await Raw.open(env)
            payload = json.dumps(OK_BODY).encode()
            await kept.send(post_head(len(payload)) + payload)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for conn in (silent, half):
                assert await conn.until_closed(3.0) == b""
            answered = await kept.until_closed(3.0)
            assert status_of(answered) == 200
            assert loop.time() - t0 < 2.5
            assert len(env.server.guard.conns) <= 1  # at most the test client's own pooled connection
            await still_serves(env)

    run(body)


def test_when_every_connection_is_busy_a_new_one_is_closed_until_one_ends():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], max_connections=2, body_timeout_s=1.0) as env:
            guard = env.server.guard
            slow = [await Raw.open(env) for _ in range(2)]
            for conn in slow:
                await conn.send(post_head(100))  # headers, then no body: busy until the body timeout
            for _ in range(100):
                if sum(c.busy for c in guard.conns.values()) == 2:
                    break
                await asyncio.sleep(0.01)
            assert sum(c.busy for c in guard.conns.values()) == 2
            extra = await Raw.open(env)
            assert await extra.until_closed(1.0) == b""  # refused at once, not queued
            assert guard.refused >= 1
            for conn in slow:
                assert status_of(await conn.until_closed(LINGER_S + 3.0)) == 408
                conn.close()
            await still_serves(env)

    run(body)


# ---- timings ------------------------------------------------------------------------------------


def test_timings_are_off_by_default():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], timings_token="") as env:
            await still_serves(env, "secret-id")
            for path in ("/kvpush/timings", "/kvpush/timings?clear=1"):
                status, _, raw, _ = await env.call(
                    "GET", path, headers={"Authorization": f"Bearer {TIMINGS_TOKEN}"}
                )
                assert status == 404 and b"secret-id" not in raw

    run(body)


@pytest.mark.parametrize(
    "auth",
    [
        None,
        "Bearer wrong-token-0123456789",
        f"Basic {TIMINGS_TOKEN}",
        TIMINGS_TOKEN,
        f"Bearer {TIMINGS_TOKEN}x",
    ],
)
def test_timings_need_the_token(auth: str | None):
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode]) as env:
            await still_serves(env, "secret-id")
            for path in ("/kvpush/timings", "/kvpush/timings?clear=1"):
                status, headers, raw, _ = await env.call(
                    "GET", path, headers={"Authorization": auth} if auth else None
                )
                assert status == 401 and b"secret-id" not in raw
                assert headers["WWW-Authenticate"] == "Bearer"
            # nothing was cleared by the refused ?clear=1
            assert [r["id"] for r in await env.timings()] == ["secret-id"]

    run(body)


def test_timings_refuse_a_token_that_is_not_utf8():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode]) as env:
            conn = await Raw.open(env)
            await conn.send(
                b"GET /kvpush/timings HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer \xff\xfe"
                + TIMINGS_TOKEN.encode()
                + b"\r\nConnection: close\r\n\r\n"
            )
            assert status_of(await conn.until_closed(3.0)) == 401

    run(body)


def test_timings_keep_a_bounded_number_of_records_with_bounded_ids():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode], timings_max_records=3, max_request_id_len=8) as env:
            for i in range(5):
                await still_serves(env, f"id-{i}")
            await still_serves(env, "x" * 9)
            recs = await env.timings()
            assert [r["id"] for r in recs[:2]] == ["id-3", "id-4"] and len(recs) == 3
            assert recs[2]["id"].startswith("kvp-")

    run(body)


def test_bench_reads_timings_with_the_deployments_token():
    async def body():
        prefill, decode = push_fakes()
        async with environment([prefill], [decode]) as env:
            await still_serves(env, "bench-1")
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, bench_vllm.proxy_timings, env.proxy, "wrong" * 5) == []
            got = await loop.run_in_executor(None, bench_vllm.proxy_timings, env.proxy, TIMINGS_TOKEN)
            assert [r["id"] for r in got] == ["bench-1"] and "prefill_done" in got[0]
            assert await env.timings() == []  # bench clears by default

    run(body)


# ---- configuration ------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
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
    return parser.parse_args(base + argv)


def test_cli_limits_and_timings_token_from_file_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv(TIMINGS_TOKEN_ENV, raising=False)
    cfg = proxy_mod.config_from_args(parse([]))
    assert cfg.timings_token == "" and cfg.max_body_bytes == ProxyConfig([], []).max_body_bytes
    cfg = proxy_mod.config_from_args(
        parse(
            [
                *("--max-body-bytes", "5", "--body-timeout", "2", "--max-json-depth", "7"),
                *("--max-request-id-len", "9", "--max-connections", "3", "--idle-timeout", "4"),
                *("--timings-max-records", "6"),
            ]
        )
    )
    assert (cfg.max_body_bytes, cfg.body_timeout_s, cfg.max_json_depth, cfg.max_request_id_len) == (
        5,
        2,
        7,
        9,
    )
    assert (cfg.max_connections, cfg.idle_timeout_s, cfg.timings_max_records) == (3, 4, 6)
    with pytest.raises(SystemExit, match=TIMINGS_TOKEN_ENV):
        proxy_mod.config_from_args(parse(["--timings"]))
    monkeypatch.setenv(TIMINGS_TOKEN_ENV, "short")
    with pytest.raises(SystemExit, match="at least 16"):
        proxy_mod.config_from_args(parse(["--timings"]))
    monkeypatch.setenv(TIMINGS_TOKEN_ENV, "from-the-environment-0123")
    assert proxy_mod.config_from_args(parse(["--timings"])).timings_token == "from-the-environment-0123"
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file-0123456789\n")
    cfg = proxy_mod.config_from_args(parse(["--timings", "--timings-token-file", str(token_file)]))
    assert cfg.timings_token == "from-a-file-0123456789"
    with pytest.raises(SystemExit, match="cannot read"):
        proxy_mod.config_from_args(parse(["--timings", "--timings-token-file", str(tmp_path / "none")]))


@pytest.mark.parametrize(
    "field", ["max_body_bytes", "body_timeout_s", "max_connections", "timings_max_records"]
)
def test_non_positive_limits_are_refused_by_name(field: str):
    with pytest.raises(ValueError, match=field):
        build_app(ProxyConfig(prefill=[PrefillBackend("http://p")], decode=["http://d"], **{field: 0}))


def test_bodies_are_copied_shallowly_not_deeply(monkeypatch: pytest.MonkeyPatch):
    """Only the top level changes per engine: nested values are shared, the client's body untouched."""
    client = {"prompt": [list(range(1000))], "max_tokens": 50, "stream": True, "stream_options": {"a": 1}}
    before = copy.deepcopy(client)
    out = Router._prefill_body(client, {"do_remote_decode": True})
    assert out["prompt"] is client["prompt"] and client == before
    assert (out["max_tokens"], out["stream"], "stream_options" in out) == (1, False, False)

    def no_deepcopy(*a: Any, **k: Any) -> Any:
        raise AssertionError("a whole body was deep-copied")

    monkeypatch.setattr(copy, "deepcopy", no_deepcopy)

    async def body():
        for mode in ("push", "pull"):
            prefill = Fake("prefill", kv={"do_remote_decode": True, "remote_block_ids": [1]})
            decode = Fake("decode")
            async with environment([prefill], [decode], mode=mode) as env:
                await still_serves(env)

    run(body)


def test_the_open_file_limit_is_raised_for_max_connections(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    import resource

    from kvpush.platforms.vllm.proxy.server import ensure_file_limit

    limits = {"soft": 1024, "hard": 1_000_000}

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE and value[1] == limits["hard"]
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], limits["hard"]))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    ensure_file_limit(1024)
    assert limits["soft"] == 3 * 1024 + 256 and "open-file limit" not in caplog.text
    limits.update(soft=1024, hard=2000)
    ensure_file_limit(1024)
    assert limits["soft"] == 2000 and "--max-connections 1024" in caplog.text
