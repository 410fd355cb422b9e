"""`kvpush proxy`'s routing: backends, the push and pull dispatch, relaying the decode's answer, pairing
checks and /health (see the package docstring for what the proxy does, server.py for its client-facing
limits)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from ..params import KVTransferParams
from .checks import PairingChecks
from .config import ProxyConfig, ProxyMode
from .pairing import Pairing, PrefillBackend
from .release import transfer_keys
from .server import TimingsLog, error_body

log = logging.getLogger("kvpush.proxy")


class BackendError(Exception):
    """A backend failed or refused: `status` is what the client is answered, `backend` the URL at fault."""

    def __init__(self, status: int, message: str, backend: str):
        super().__init__(message)
        self.status = status
        self.backend = backend


def backend_session(request_timeout_s: float, connect_timeout_s: float, keepalive_s: float) -> Any:
    """The pooled HTTP session to the backends: the request and connect timeouts, and idle connections
    dropped after keepalive_s, before a backend's own keep-alive closes them (ProxyConfig.backend_keepalive_s)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=keepalive_s)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


class Router:
    """Round robin over prefill and decode backends, and the two dispatch modes; the pairing checks and
    releases at the decodes' pairing servers are its PairingChecks' (checks.py)."""

    def __init__(self, cfg: ProxyConfig):
        cfg.check()
        self.cfg = cfg
        self.checks = PairingChecks(
            cfg.prefill, cfg.decode, cfg.decode_pairing, cfg.decode_engine_ids, cfg.pairing_key, cfg.stats
        )
        self._prefill = itertools.cycle(cfg.prefill)
        self._decode = itertools.cycle(cfg.decode)
        self._session: Any = None
        # Per-request timestamps (proxy clock): when the prefill answered and when decode's first chunk
        # arrived. The same instrument for every connector: `kvpush bench-vllm` reads it from
        # GET /kvpush/timings to report prefill-done -> first decode token.
        self.timings = TimingsLog(cfg.timings_token, cfg.timings_max_records)

    async def start(self) -> None:
        cfg = self.cfg
        self._session = backend_session(cfg.request_timeout_s, cfg.connect_timeout_s, cfg.backend_keepalive_s)
        self.checks.start(self._session)

    async def close(self) -> None:
        await self.checks.close()
        if self._session is not None:
            await self._session.close()

    @property
    def pairings(self) -> dict[tuple[str, str], Pairing]:
        return self.checks.pairings

    async def check_pairings(self) -> list[Pairing]:
        """Check every pairing now (also part of /health)."""
        return await self.checks.check_all()

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
        """body with its top-level keys changed for the prefill. A shallow copy: nested values are
        shared, never changed (the client's body may be megabytes; nothing below the top is touched)."""
        out = dict(body)
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
            await self.checks.check(pair)
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
        rec = self.timings.record(request_id)
        if self.cfg.mode is ProxyMode.PULL:
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
            decode_body = {**body, "kv_transfer_params": kv}
            return await self._relay(decode_url + path, decode_body, headers, client, None, rec)
        # One transfer id per dispatch, to both engines: a client's X-Request-Id need not be unique.
        transfer_id = f"kvp-{uuid.uuid4().hex}"
        prefill_params = KVTransferParams(
            do_remote_decode=True,
            transfer_id=transfer_id,
            decode_engine_id=self.checks.decode_ids.get(decode_url) or None,
        ).to_dict(sparse=True)
        prefill_task = asyncio.ensure_future(
            self._post_json(prefill.url + path, self._prefill_body(body, prefill_params), headers)
        )
        prefill_task.add_done_callback(lambda _f: rec.__setitem__("prefill_done", time.perf_counter()))
        decode_body = {**body, "kv_transfer_params": self._push_params(prefill, request_id, transfer_id)}
        try:
            return await self._relay(decode_url + path, decode_body, headers, client, prefill_task, rec)
        except asyncio.CancelledError:
            # The client went away: abort the prefill too (closing its connection makes vLLM abort it).
            prefill_task.cancel()
            if "first_chunk" not in rec:  # the decode may never have had it: free the prefill's blocks
                self.checks.release_later(prefill, decode_url, transfer_keys(transfer_id, path, body))
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
                    return web.Response(
                        body=data,
                        status=200,
                        content_type="application/json",
                        headers={"X-Request-Id": headers["X-Request-Id"]},
                    )
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
                    status=200,
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Request-Id": headers["X-Request-Id"],
                    },
                )
                await self._to_client(out.prepare(client), client)
                if first:
                    await self._to_client(out.write(first), client)
                try:
                    async for chunk in it:
                        await self._to_client(out.write(chunk), client)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    # The 200 and its headers are already out: say so in-band (an SSE error event, no
                    # [DONE]), end the stream and close the connection rather than start a second response.
                    log.warning("decode %s failed mid-stream: %r", url, exc)
                    err = error_body(f"decode {url} failed mid-stream: {exc!r}", 502)
                    await self._to_client(out.write(f"data: {json.dumps(err)}\n\n".encode()), client)
                    out.force_close()
                await self._to_client(out.write_eof(), client)
                return out
            finally:
                await ctx.__aexit__(None, None, None)
        except aiohttp.ClientConnectorError as exc:
            raise BackendError(503, f"backend {url} is unreachable: {exc}", url) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BackendError(502, f"backend {url} failed: {exc!r}", url) from exc

    async def _to_client(self, write: Awaitable[Any], client: Any) -> None:
        """A write to the client that must finish within write_timeout_s. A client that stops reading is
        treated as gone: its connection is aborted and the request ends as on a disconnect (both engine
        requests cancelled), so it cannot hold a decode request and its KV blocks."""
        try:
            await asyncio.wait_for(write, self.cfg.write_timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "a client took nothing for %gs (--write-timeout); dropping it", self.cfg.write_timeout_s
            )
            if client.transport is not None:
                client.transport.abort()
            raise asyncio.CancelledError("the client stopped reading") from None
        except ConnectionError:  # the client went away mid-answer: the same as a disconnect
            raise asyncio.CancelledError("the client went away") from None

    @staticmethod
    async def _race(task: asyncio.Future[Any], prefill_task: asyncio.Future[Any] | None) -> Any:
        """Wait for task; if the prefill fails first, raise its error (the caller cancels task)."""
        if prefill_task is None or (prefill_task.done() and prefill_task.exception() is None):
            return await task
        done, _ = await asyncio.wait({task, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
        if prefill_task in done and prefill_task.exception() is not None:
            raise prefill_task.exception()  # type: ignore[misc]
        return await task

    async def models(self) -> tuple[int, bytes]:
        """The first decode's GET /v1/models answer (status, JSON body); any failure is a 503."""
        try:
            async with self._session.get(self.cfg.decode[0] + "/v1/models") as r:
                return r.status, await r.read()
        except Exception as exc:  # noqa: BLE001 - any failure is a 503 for this informational route
            return 503, json.dumps(error_body(f"decode backend unreachable: {exc}", 503)).encode()

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
        out: dict[str, Any] = {"status": "down" if down else "ok", "down": down, "mode": self.cfg.mode.value}
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
