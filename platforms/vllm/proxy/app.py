"""The aiohttp application `kvpush proxy` serves: the OpenAI routes go to the router, each body read
within the client-facing limits (server.py); /health and /v1/models; /kvpush/timings when enabled."""

from __future__ import annotations

import logging
import time
from typing import Any

from .config import ProxyConfig
from .router import BackendError, Router
from .server import ClientError, ConnectionGuard, error_body, guard_key, read_json_object, request_id_for

log = logging.getLogger("kvpush.proxy")


def build_app(cfg: ProxyConfig) -> Any:
    """The application for cfg; a ValueError names a setting it cannot run with (ProxyConfig.check)."""
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
        status, body = await router.models()
        return web.Response(body=body, status=status, content_type="application/json")

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
