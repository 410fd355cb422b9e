"""`kvpush proxy`: an OpenAI-compatible router for disaggregated prefill/decode.

Push mode (kvpush, vLLM's NixlPushConnector): the request goes to a prefill and a decode backend at the
same time, with the same X-Request-Id. Prefill gets `do_remote_decode` and max_tokens 1; decode gets
`do_remote_prefill` plus the prefill's coordinates (engine id, KV host, side-channel port, TP, PP), so the
decode can register its blocks while the prefill is still computing. The client sees the decode's answer.

Pull mode (vLLM's NixlConnector): prefill first; its returned kv_transfer_params go to decode.

A backend that is down, or a prefill that fails, gives the client a 502/503 with a JSON error at once;
the decode request is then cancelled (closing the connection makes vLLM abort it), never left hanging.

Every push dispatch carries a fresh `transfer_id` in both engines' kv_transfer_params, so two client
requests with the same X-Request-Id never share a transfer key.

Pairing (kvpush decodes started with `pairing_port`, given here as --decode-pairing): at start and on
every /health, the proxy asks each decode whether it can receive KV from each prefill (the decode
handshakes with that prefill, checking the real layouts). A refused pairing makes /health 503 naming the
mismatch, a request routed to it is answered with that reason, and a decode failure is re-checked so
a pairing that broke between checks is named too, instead of the engine's bare "Internal server error".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import itertools
import json
import logging
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvpush.apps.cliutil import log_level, port, positive_float

from ..params import KVTransferParams

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
    # per decode: base URL of its kvpush pairing check ("" = none; vLLM's own connectors have none)
    decode_pairing: list[str] = field(default_factory=list)
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


@dataclass
class Pairing:
    """What a decode said about receiving KV from one prefill: ok None = not known yet."""

    prefill: PrefillBackend
    decode: str
    pairing_url: str
    ok: bool | None = None
    error: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.url,
            "prefill_engine_id": self.prefill.engine_id,
            "decode": self.decode,
            "ok": self.ok,
            "error": self.error,
        }

    def refusal(self) -> str:
        return (
            f"prefill {self.prefill.engine_id!r} ({self.prefill.url}) cannot push KV to decode {self.decode}: "
            f"{self.error}"
        )


class Router:
    """Round robin over prefill and decode backends, and the two dispatch modes."""

    def __init__(self, cfg: ProxyConfig):
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the proxy needs at least one prefill and one decode backend")
        if cfg.mode not in ("push", "pull"):
            raise ValueError(f"mode must be 'push' or 'pull', got {cfg.mode!r}")
        if cfg.decode_pairing and len(cfg.decode_pairing) != len(cfg.decode):
            raise ValueError(
                f"decode_pairing has {len(cfg.decode_pairing)} entries for {len(cfg.decode)} decode backends"
            )
        self.cfg = cfg
        self.pairings: dict[tuple[str, str], Pairing] = {
            (p.url, d): Pairing(p, d, u.rstrip("/"))
            for d, u in zip(cfg.decode, cfg.decode_pairing or [""] * len(cfg.decode), strict=True)
            if u
            for p in cfg.prefill
        }
        self._pairing_task: asyncio.Task[None] | None = None
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
        if self.pairings:
            self._pairing_task = asyncio.ensure_future(self._keep_checking())

    async def close(self) -> None:
        if self._pairing_task is not None:
            self._pairing_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pairing_task
        if self._session is not None:
            await self._session.close()

    # ---- pairing checks ------------------------------------------------------------------------
    async def check_pairing(self, pair: Pairing) -> Pairing:
        """Ask the decode whether it can receive from pair.prefill; an unreachable decode leaves it unknown."""
        import aiohttp

        query = urllib.parse.urlencode(
            {
                "engine_id": pair.prefill.engine_id,
                "host": pair.prefill.kv_host,
                "port": pair.prefill.kv_port,
                "tp_size": pair.prefill.tp_size,
                "pp_size": pair.prefill.pp_size,
            }
        )
        try:
            async with self._session.get(
                f"{pair.pairing_url}/kvpush/pairing?{query}", timeout=aiohttp.ClientTimeout(total=15)
            ) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            pair.ok, pair.error = None, f"pairing check at {pair.pairing_url} failed: {exc!r}"
            return pair
        if r.status == 200 and isinstance(body, dict) and body.get("ok"):
            pair.ok, pair.error = True, ""
        elif r.status == 409 and isinstance(body, dict):
            pair.ok, pair.error = False, str(body.get("error") or body)
        else:  # the prefill did not answer the handshake (504) or something else: not known yet
            pair.ok, pair.error = None, f"pairing check answered {r.status}: {str(body)[:300]}"
        if pair.ok is False:
            log.error("pairing refused: %s", pair.refusal())
        return pair

    async def check_pairings(self) -> list[Pairing]:
        return list(await asyncio.gather(*(self.check_pairing(p) for p in self.pairings.values())))

    async def _keep_checking(self) -> None:
        """From start (engines may still be loading) for the proxy's life: every 2 s while any pairing
        is refused or unknown, every 10 s once all are fine (a restarted engine may break one)."""
        while True:
            pairs = await self.check_pairings()
            await asyncio.sleep(10.0 if all(p.ok for p in pairs) else 2.0)

    def _pick(self) -> tuple[PrefillBackend, str]:
        """The next (prefill, decode) in round robin, skipping pairings known to be refused; if every
        pairing is refused, a BackendError naming the mismatch."""
        tries = len(self.cfg.prefill) * len(self.cfg.decode)
        first: Pairing | None = None
        for _ in range(tries):
            prefill, decode = next(self._prefill), next(self._decode)
            pair = self.pairings.get((prefill.url, decode))
            if pair is None or pair.ok is not False:
                return prefill, decode
            first = first or pair
        assert first is not None
        raise BackendError(503, first.refusal(), first.decode)

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

    @staticmethod
    def _push_params(prefill: PrefillBackend, request_id: str, transfer_id: str) -> dict[str, Any]:
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=prefill.engine_id,
            remote_host=prefill.kv_host,
            remote_port=prefill.kv_port,
            tp_size=prefill.tp_size,
            pp_size=prefill.pp_size,
            remote_request_id=request_id,
            transfer_id=transfer_id,
        ).to_dict()

    async def dispatch(self, path: str, body: dict[str, Any], request_id: str, client: Any) -> Any:
        """Run one request; returns an aiohttp response (streamed or JSON)."""
        prefill, decode_url = self._pick()
        try:
            return await self._dispatch(prefill, decode_url, path, body, request_id, client)
        except BackendError as exc:
            pair = self.pairings.get((prefill.url, decode_url))
            if pair is None or exc.backend != decode_url + path:
                raise
            # The decode failed: if the pairing broke since the last check, say that, not "error 500".
            await self.check_pairing(pair)
            if pair.ok is False:
                raise BackendError(503, pair.refusal(), decode_url) from exc
            raise

    async def _dispatch(
        self,
        prefill: PrefillBackend,
        decode_url: str,
        path: str,
        body: dict[str, Any],
        request_id: str,
        client: Any,
    ) -> Any:
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        self.cfg.stats["requests"] += 1
        rec: dict[str, Any] = {"id": request_id, "start": time.perf_counter()}
        self.timings.append(rec)
        if self.cfg.mode == "pull":
            pull_params = KVTransferParams(do_remote_decode=True).to_dict()
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
        # One transfer id per dispatch, to both engines: a client's X-Request-Id need not be unique.
        transfer_id = f"kvp-{uuid.uuid4().hex}"
        prefill_params = KVTransferParams(do_remote_decode=True, transfer_id=transfer_id).to_dict(sparse=True)
        prefill_task = asyncio.ensure_future(
            self._post_json(prefill.url + path, self._prefill_body(body, prefill_params), headers)
        )
        prefill_task.add_done_callback(lambda _f: rec.__setitem__("prefill_done", time.perf_counter()))
        decode_body = copy.deepcopy(body)
        decode_body["kv_transfer_params"] = self._push_params(prefill, request_id, transfer_id)
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
        out: dict[str, Any] = {"status": "down" if down else "ok", "down": down, "mode": self.cfg.mode}
        if self.pairings:
            pairs = await self.check_pairings()
            out["pairings"] = [p.describe() for p in pairs]
            refused = [p.refusal() for p in pairs if p.ok is False]
            if refused:
                out["status"] = "misconfigured"
                out["refused"] = refused
            elif not down and any(p.ok is None for p in pairs):
                out["status"] = "down"
        return (200 if out["status"] == "ok" else 503), out


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
    parser.add_argument("--port", type=port, default=8000)
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
    parser.add_argument(
        "--decode-pairing",
        action="append",
        metavar="URL",
        help="base URL of each kvpush decode's pairing check (its pairing_port); checked at start and on "
        "/health (give it once per --decode, '' for a decode without one)",
    )
    parser.add_argument("--prefill-tp-size", action="append", type=int)
    parser.add_argument("--prefill-pp-size", action="append", type=int)
    parser.add_argument("--connect-timeout", type=positive_float, default=5.0)
    parser.add_argument("--request-timeout", type=positive_float, default=600.0)
    parser.add_argument("--log-level", type=log_level, default="WARNING")


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
    decode = [u.rstrip("/") for u in args.decode]
    pairing = list(args.decode_pairing or [])
    if pairing and len(pairing) != len(decode):
        raise SystemExit(f"--decode-pairing was given {len(pairing)} times; give it once per --decode")
    return ProxyConfig(
        prefill=prefill,
        decode=decode,
        mode=args.mode,
        decode_pairing=pairing,
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
