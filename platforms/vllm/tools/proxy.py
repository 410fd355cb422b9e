"""`kvpush proxy`: an OpenAI-compatible router for disaggregated prefill/decode.

Push mode (kvpush, vLLM's NixlPushConnector): the request goes to a prefill and a decode backend at the
same time, with the same X-Request-Id. Prefill gets `do_remote_decode` and max_tokens 1; decode gets
`do_remote_prefill` plus the prefill's coordinates (engine id, KV host, side-channel port, TP, PP), so the
decode can register its blocks while the prefill is still computing. The client sees the decode's answer.

Pull mode (vLLM's NixlConnector): prefill first; its returned kv_transfer_params go to decode.

A backend that is down, or a prefill that fails, gives the client a 502/503 with a JSON error at once;
the decode request is then cancelled (closing the connection makes vLLM abort it), never left hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvpush.proxy")


@dataclass(frozen=True)
class PrefillBackend:
    url: str
    engine_id: str = ""
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    tp_size: int = 1
    pp_size: int = 1


@dataclass
class ProxyConfig:
    prefill: list[PrefillBackend]
    decode: list[str]
    mode: str = "push"  # push | pull
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    stats: dict[str, int] = field(default_factory=lambda: {"requests": 0, "errors": 0})


class BackendError(Exception):
    def __init__(self, status: int, message: str, backend: str):
        super().__init__(message)
        self.status = status
        self.backend = backend


def _error_body(message: str, status: int, kind: str = "BackendError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


class Router:
    """Round robin over prefill and decode backends, and the two dispatch modes."""

    def __init__(self, cfg: ProxyConfig):
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the proxy needs at least one prefill and one decode backend")
        if cfg.mode not in ("push", "pull"):
            raise ValueError(f"mode must be 'push' or 'pull', got {cfg.mode!r}")
        self.cfg = cfg
        self._prefill = itertools.cycle(cfg.prefill)
        self._decode = itertools.cycle(cfg.decode)
        self._session: Any = None
        # Per-request timestamps (proxy clock): when the prefill answered and when decode's first chunk
        # arrived. The same instrument for every connector: `kvpush bench-vllm` reads it from
        # GET /kvpush/timings to report prefill-done -> first decode token.
        self.timings: collections.deque[dict[str, Any]] = collections.deque(maxlen=100_000)

    async def start(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- backend calls -------------------------------------------------------------------------
    async def _post_json(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        import aiohttp

        try:
            async with self._session.post(url, json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise BackendError(
                        502 if resp.status < 500 else resp.status,
                        f"{url} answered {resp.status}: {text[:500]}",
                        url,
                    )
                try:
                    data = json.loads(text)
                except ValueError as exc:
                    raise BackendError(
                        502, f"{url} answered 200 with a body that is not JSON: {text[:200]!r}", url
                    ) from exc
                if not isinstance(data, dict):
                    raise BackendError(
                        502, f"{url} answered 200 with JSON that is not an object: {text[:200]!r}", url
                    )
                return data
        except aiohttp.ClientConnectorError as exc:
            raise BackendError(503, f"backend {url} is unreachable: {exc}", url) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BackendError(502, f"backend {url} failed: {exc!r}", url) from exc

    @staticmethod
    def _prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(body)
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out["stream"] = False
        out.pop("stream_options", None)
        out["kv_transfer_params"] = params
        return out

    def _push_params(self, prefill: PrefillBackend, request_id: str) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": prefill.engine_id,
            "remote_host": prefill.kv_host,
            "remote_port": prefill.kv_port,
            "tp_size": prefill.tp_size,
            "pp_size": prefill.pp_size,
            "remote_request_id": request_id,
            "remote_block_ids": None,
        }

    async def dispatch(self, path: str, body: dict[str, Any], request_id: str, client: Any) -> Any:
        """Run one request; returns an aiohttp response (streamed or JSON)."""
        prefill = next(self._prefill)
        decode_url = next(self._decode)
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        self.cfg.stats["requests"] += 1
        rec: dict[str, Any] = {"id": request_id, "start": time.perf_counter()}
        self.timings.append(rec)
        pull_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        if self.cfg.mode == "pull":
            resp = await self._post_json(prefill.url + path, self._prefill_body(body, pull_params), headers)
            rec["prefill_done"] = time.perf_counter()
            kv = resp.get("kv_transfer_params")
            if not kv:
                raise BackendError(
                    502,
                    f"prefill {prefill.url} returned no kv_transfer_params "
                    "(is it started with a kv_producer connector?)",
                    prefill.url,
                )
            decode_body = copy.deepcopy(body)
            decode_body["kv_transfer_params"] = kv
            return await self._relay(decode_url + path, decode_body, headers, client, None, rec)
        prefill_task = asyncio.ensure_future(
            self._post_json(prefill.url + path, self._prefill_body(body, {"do_remote_decode": True}), headers)
        )
        prefill_task.add_done_callback(lambda _f: rec.__setitem__("prefill_done", time.perf_counter()))
        decode_body = copy.deepcopy(body)
        decode_body["kv_transfer_params"] = self._push_params(prefill, request_id)
        try:
            return await self._relay(decode_url + path, decode_body, headers, client, prefill_task, rec)
        except asyncio.CancelledError:
            # The client went away: abort the prefill too (closing its connection makes vLLM abort it).
            prefill_task.cancel()
            raise
        finally:
            if not prefill_task.done():
                # The client is answered; let the prefill finish in the background (its KV is pushed
                # or its blocks are released by lease) but never leak an unobserved exception.
                prefill_task.add_done_callback(_swallow)

    async def _relay(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        client: Any,
        prefill_task: asyncio.Future[Any] | None,
        rec: dict[str, Any] | None = None,
    ) -> Any:
        """Send to decode and relay its answer; fail fast when the prefill fails first."""
        import aiohttp
        from aiohttp import web

        stream = bool(body.get("stream"))
        try:
            ctx = self._session.post(url, json=body, headers=headers)
            resp_task = asyncio.ensure_future(ctx.__aenter__())
            try:
                resp = await self._race(resp_task, prefill_task)
            except BaseException:
                resp_task.cancel()
                raise
            try:
                if resp.status != 200:
                    text = await resp.text()
                    raise BackendError(
                        502 if resp.status < 500 else resp.status,
                        f"decode {url} answered {resp.status}: {text[:500]}",
                        url,
                    )
                if not stream:
                    data_task = asyncio.ensure_future(resp.read())
                    try:
                        data = await self._race(data_task, prefill_task)
                    except BaseException:
                        data_task.cancel()
                        raise
                    return web.Response(body=data, status=200, content_type="application/json")
                # Streaming: hold the client's headers until the first chunk (or a prefill failure).
                it = resp.content.iter_any()
                first_task = asyncio.ensure_future(it.__anext__())
                try:
                    first = await self._race(first_task, prefill_task)
                    if rec is not None:
                        rec["first_chunk"] = time.perf_counter()
                except StopAsyncIteration:
                    first = b""
                except BaseException:
                    first_task.cancel()
                    raise
                out = web.StreamResponse(
                    status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await out.prepare(client)
                if first:
                    await out.write(first)
                try:
                    async for chunk in it:
                        await out.write(chunk)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    # The 200 and its headers are already out: say so in-band (an SSE error event, no
                    # [DONE]), end the stream and close the connection rather than start a second response.
                    log.warning("decode %s failed mid-stream: %r", url, exc)
                    err = _error_body(f"decode {url} failed mid-stream: {exc!r}", 502)
                    await out.write(f"data: {json.dumps(err)}\n\n".encode())
                    out.force_close()
                await out.write_eof()
                return out
            finally:
                await ctx.__aexit__(None, None, None)
        except aiohttp.ClientConnectorError as exc:
            raise BackendError(503, f"backend {url} is unreachable: {exc}", url) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BackendError(502, f"backend {url} failed: {exc!r}", url) from exc

    @staticmethod
    async def _race(task: asyncio.Future[Any], prefill_task: asyncio.Future[Any] | None) -> Any:
        """Wait for task; if the prefill fails first, raise its error (the caller cancels task)."""
        if prefill_task is None or (prefill_task.done() and prefill_task.exception() is None):
            return await task
        done, _ = await asyncio.wait({task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task in done and prefill_task.exception() is not None:
            raise prefill_task.exception()  # type: ignore[misc]
        return await task

    async def health(self) -> tuple[int, dict[str, Any]]:
        import aiohttp

        urls = [p.url for p in self.cfg.prefill] + list(self.cfg.decode)

        async def probe(u: str) -> tuple[str, bool]:
            try:
                async with self._session.get(u + "/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
                    return u, r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return u, False

        results = dict(await asyncio.gather(*(probe(u) for u in urls)))
        down = [u for u, ok in results.items() if not ok]
        return (503 if down else 200), {
            "status": "down" if down else "ok",
            "down": down,
            "mode": self.cfg.mode,
        }


def _swallow(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("prefill finished after the client was answered: %s", fut.exception())


def build_app(cfg: ProxyConfig) -> Any:
    from aiohttp import web

    router = Router(cfg)

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.close()

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response(_error_body("request body is not JSON", 400, "BadRequest"), status=400)
        if not isinstance(body, dict):
            return web.json_response(
                _error_body("request body must be a JSON object", 400, "BadRequest"), status=400
            )
        request_id = request.headers.get("X-Request-Id") or f"kvp-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        try:
            return await router.dispatch(request.path, body, request_id, request)
        except BackendError as exc:
            cfg.stats["errors"] += 1
            log.warning("request %s failed after %.3fs: %s", request_id, time.perf_counter() - t0, exc)
            return web.json_response(_error_body(str(exc), exc.status), status=exc.status)

    async def health(request: web.Request) -> web.Response:
        status, body = await router.health()
        return web.json_response(body, status=status)

    async def timings(request: web.Request) -> web.Response:
        """Per-request proxy timestamps in seconds since the request arrived; ?clear=1 empties the log."""
        out = []
        for rec in list(router.timings):
            t0 = rec["start"]
            out.append(
                {"id": rec["id"], **{k: round(v - t0, 6) for k, v in rec.items() if k not in ("id", "start")}}
            )
        if request.query.get("clear") == "1":
            router.timings.clear()
        return web.json_response(out)

    async def models(request: web.Request) -> web.StreamResponse:
        try:
            async with router._session.get(cfg.decode[0] + "/v1/models") as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except Exception as exc:  # noqa: BLE001 - any failure is a 503 for this informational route
            return web.json_response(_error_body(f"decode backend unreachable: {exc}", 503), status=503)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/kvpush/timings", timings)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _expand(values: list[Any] | None, n: int, default: Any, name: str) -> list[Any]:
    if not values:
        return [default] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SystemExit(f"--{name} was given {len(values)} times; give it once or once per --prefill ({n})")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill backend base URL (repeat for several; round robin)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode backend base URL (repeat for several; round robin)",
    )
    parser.add_argument(
        "--mode",
        choices=("push", "pull"),
        default="push",
        help="push: concurrent dispatch (kvpush, NixlPushConnector); pull: prefill first (NixlConnector)",
    )
    parser.add_argument("--prefill-engine-id", action="append", help="engine_id of each prefill")
    parser.add_argument("--prefill-kv-host", action="append", help="KV side-channel host of each prefill")
    parser.add_argument(
        "--prefill-kv-port", action="append", type=int, help="KV side-channel port of each prefill"
    )
    parser.add_argument("--prefill-tp-size", action="append", type=int)
    parser.add_argument("--prefill-pp-size", action="append", type=int)
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--log-level", default="WARNING")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    n = len(args.prefill)
    ids = _expand(args.prefill_engine_id, n, "", "prefill-engine-id")
    hosts = _expand(args.prefill_kv_host, n, "127.0.0.1", "prefill-kv-host")
    ports = _expand(args.prefill_kv_port, n, 0, "prefill-kv-port")
    tps = _expand(args.prefill_tp_size, n, 1, "prefill-tp-size")
    pps = _expand(args.prefill_pp_size, n, 1, "prefill-pp-size")
    if args.mode == "push" and (not all(ids) or not all(ports)):
        raise SystemExit("push mode needs --prefill-engine-id and --prefill-kv-port for each --prefill")
    prefill = [
        PrefillBackend(u.rstrip("/"), i, h, p, t, q)
        for u, i, h, p, t, q in zip(args.prefill, ids, hosts, ports, tps, pps, strict=True)
    ]
    return ProxyConfig(
        prefill=prefill,
        decode=[u.rstrip("/") for u in args.decode],
        mode=args.mode,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
    )


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build_app(config_from_args(args))
    # handler_cancellation: a client that goes away cancels dispatch, which cancels both backend requests
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="kvpush proxy")
    configure(p)
    raise SystemExit(run(p.parse_args()))
