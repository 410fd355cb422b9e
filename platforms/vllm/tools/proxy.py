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

Pairing (kvpush decodes started with `pairing_port`, given here as --decode-pairing; keyed decodes need the
shared key, from --hmac-key-file or $KVPUSH_HMAC_KEY, to sign each check): at start and on
every /health, the proxy asks each decode whether it can receive KV from each prefill (the decode
handshakes with that prefill, checking the real layouts). A refused pairing makes /health 503 naming the
mismatch, a request routed to it is answered with that reason, and a decode failure is re-checked so
a pairing that broke between checks is named too, instead of the engine's bare "Internal server error".

Facing clients (proxy_http.py, SECURITY.md "The proxy"): bodies, JSON nesting, request ids, connections
and the timings endpoint are bounded by the limits in ProxyConfig; `GET /kvpush/timings` is served only
when a token is configured (--timings, token from --timings-token-file or $KVPUSH_PROXY_TIMINGS_TOKEN).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from kvpush.apps.cliutil import log_level, port, positive_float
from kvpush.config import key_from_file_or_env
from kvpush.errors import ConfigError

from ..params import check_pp_size
from .proxy_http import (
    TIMINGS_TOKEN_ENV,
    ClientError,
    ConnectionGuard,
    error_body,
    guard_key,
    load_timings_token,
    read_json_object,
    request_id_for,
    run_server,
)
from .proxy_router import BackendError, Pairing, PrefillBackend, ProxyConfig, Router

__all__ = [
    "BackendError",
    "Pairing",
    "PrefillBackend",
    "ProxyConfig",
    "Router",
    "build_app",
    "configure",
    "run",
]

log = logging.getLogger("kvpush.proxy")


def build_app(cfg: ProxyConfig) -> Any:
    from aiohttp import web

    router = Router(cfg)

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.close()

    async def handle(request: web.Request) -> web.StreamResponse:
        request_id = request_id_for(request.headers.get("X-Request-Id"), cfg.max_request_id_len)
        try:
            body = await read_json_object(
                request,
                max_bytes=cfg.max_body_bytes,
                timeout_s=cfg.body_timeout_s,
                max_depth=cfg.max_json_depth,
            )
        except ClientError as exc:
            return exc.response(request_id)
        t0 = time.perf_counter()
        try:
            return await router.dispatch(request.path, body, request_id, request)
        except BackendError as exc:
            cfg.stats["errors"] += 1
            log.warning("request %s failed after %.3fs: %s", request_id, time.perf_counter() - t0, exc)
            return web.json_response(
                error_body(str(exc), exc.status), status=exc.status, headers={"X-Request-Id": request_id}
            )

    async def health(request: web.Request) -> web.Response:
        status, body = await router.health()
        return web.json_response(body, status=status)

    async def models(request: web.Request) -> web.StreamResponse:
        try:
            async with router._session.get(cfg.decode[0] + "/v1/models") as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except Exception as exc:  # noqa: BLE001 - any failure is a 503 for this informational route
            return web.json_response(error_body(f"decode backend unreachable: {exc}", 503), status=503)

    guard = ConnectionGuard(cfg.max_connections)
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[guard.middleware()])
    app[guard_key()] = guard
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    if router.timings.enabled:  # off by default: no route at all
        app.router.add_get("/kvpush/timings", router.timings.handle)
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
    parser.add_argument(
        "--decode-engine-id",
        action="append",
        metavar="ID",
        help="engine_id of each decode (once per --decode, '' to learn it from its pairing check): sent "
        "with the prefill leg, so the prefill pushes only to the decode the request went to",
    )
    parser.add_argument(
        "--hmac-key-file",
        metavar="PATH",
        help="the decodes' shared key (base64, not world-readable), to sign --decode-pairing checks; "
        "or $KVPUSH_HMAC_KEY (never the key itself on the command line)",
    )
    parser.add_argument("--prefill-tp-size", action="append", type=int)
    parser.add_argument("--prefill-pp-size", action="append", type=int)
    parser.add_argument("--connect-timeout", type=positive_float, default=5.0)
    parser.add_argument("--request-timeout", type=positive_float, default=600.0)
    parser.add_argument(
        "--backend-keepalive",
        type=positive_float,
        default=ProxyConfig.backend_keepalive_s,
        help="seconds an idle connection to a backend is reused; keep it below the backends' own "
        "keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default) (default: %(default)s)",
    )
    parser.add_argument("--log-level", type=log_level, default="WARNING")
    d = ProxyConfig(prefill=[], decode=[])
    limits = parser.add_argument_group("client-facing limits (SECURITY.md, 'The proxy')")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body; larger ones get 413 (default: %(default)s)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        help="seconds a client has to send its whole body; then 408 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-json-depth",
        type=int,
        default=d.max_json_depth,
        help="deepest object/array nesting in a body; deeper gets 400 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-request-id-len",
        type=int,
        default=d.max_request_id_len,
        help="longest X-Request-Id kept (characters A-Z a-z 0-9 . _ : -); any other id is replaced by "
        "a fresh one, named in the response's X-Request-Id (default: %(default)s)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open client connections; beyond it the longest-idle one is closed (default: %(default)s)",
    )
    limits.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="seconds an idle connection (or one still sending headers) stays open (default: %(default)s)",
    )
    limits.add_argument(
        "--write-timeout",
        type=float,
        default=d.write_timeout_s,
        help="seconds a client may take to accept a chunk of a streamed answer before it is dropped and "
        "its request cancelled (default: %(default)s)",
    )
    timings = parser.add_argument_group("GET /kvpush/timings (off unless --timings)")
    timings.add_argument(
        "--timings",
        action="store_true",
        help="serve per-request timestamps to 'Authorization: Bearer <token>'; the token comes from "
        f"--timings-token-file or ${TIMINGS_TOKEN_ENV} (at least 16 characters), never the command line",
    )
    timings.add_argument("--timings-token-file", metavar="PATH", help="file holding the timings token")
    timings.add_argument(
        "--timings-max-records",
        type=int,
        default=d.timings_max_records,
        help="records kept, the oldest dropped first (default: %(default)s)",
    )


def _pairing_key(path: str | None) -> bytes | None:
    """The shared key for signing pairing checks, by the connector's own rules (kvpush.config)."""
    try:
        key, _source = key_from_file_or_env(path, os.environ)
    except ConfigError as exc:
        raise SystemExit(f"kvpush proxy: {exc}") from None
    return key


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    n = len(args.prefill)
    ids = _expand(args.prefill_engine_id, n, "", "prefill-engine-id")
    hosts = _expand(args.prefill_kv_host, n, "127.0.0.1", "prefill-kv-host")
    ports = _expand(args.prefill_kv_port, n, 0, "prefill-kv-port")
    tps = _expand(args.prefill_tp_size, n, 1, "prefill-tp-size")
    pps = _expand(args.prefill_pp_size, n, 1, "prefill-pp-size")
    for pp in pps:
        try:
            check_pp_size(pp, "kvpush proxy: --prefill-pp-size")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
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
    decode_ids = list(args.decode_engine_id or [])
    if decode_ids and len(decode_ids) != len(decode):
        raise SystemExit(f"--decode-engine-id was given {len(decode_ids)} times; give it once per --decode")
    return ProxyConfig(
        prefill=prefill,
        decode=decode,
        mode=args.mode,
        decode_pairing=pairing,
        decode_engine_ids=decode_ids,
        pairing_key=_pairing_key(args.hmac_key_file) if pairing else None,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        backend_keepalive_s=args.backend_keepalive,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        max_json_depth=args.max_json_depth,
        max_request_id_len=args.max_request_id_len,
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout,
        write_timeout_s=args.write_timeout,
        timings_token=load_timings_token(args.timings_token_file) if args.timings else "",
        timings_max_records=args.timings_max_records,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.timings_token_file and not args.timings:
        raise SystemExit("--timings-token-file is given but --timings is not")
    cfg = config_from_args(args)
    try:
        app = build_app(cfg)
    except ValueError as exc:
        raise SystemExit(f"kvpush proxy: {exc}") from None
    # proxy_http.server_options: handler cancellation (a client that goes away cancels dispatch, which
    # cancels both backend requests), idle timeout, and the connection guard
    run_server(app, args.host, args.port, cfg.idle_timeout_s)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="kvpush proxy")
    configure(p)
    raise SystemExit(run(p.parse_args()))
