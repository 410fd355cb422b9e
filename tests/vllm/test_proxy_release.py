"""A client that leaves before the decode answered: the proxy asks the decode's pairing server to release
the transfer (GET /kvpush/release), so a prefill whose decode never had the request frees its blocks at
once instead of at its lease. The keys must be the ones both engines derive (params.transfer_key); the
route is signed like the pairing check; the decode cancels only keys it does not track itself."""

from __future__ import annotations

import asyncio
import base64
import os
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402

from kvpush.apps.ports import free_port_range  # noqa: E402
from kvpush.endpoint import PrefillAddress  # noqa: E402
from kvpush.platforms.vllm.pairing import PairingServer  # noqa: E402
from kvpush.platforms.vllm.params import (  # noqa: E402
    PAIRING_HEADER,
    ConnectorSettings,
    KVTransferParams,
    pairing_signature,
    transfer_key,
)
from kvpush.platforms.vllm.proxy.pairing import PrefillBackend  # noqa: E402
from kvpush.platforms.vllm.proxy.release import release_target, transfer_keys  # noqa: E402

from .test_pairing_auth import get  # noqa: E402
from .test_proxy import SLOW_S, Fake, FakePairing, environment, post_then_disconnect, run  # noqa: E402

KEY = os.urandom(32)
TID = "kvp-0123456789abcdef"


@pytest.mark.parametrize(
    "path, prompt, internal_ids",
    [
        ("/v1/completions", "one prompt", ["cmpl-r1-0-abcdEFGH"]),
        ("/v1/completions", [1, 2, 3], ["cmpl-r1-0-abcdEFGH"]),  # one tokenized prompt
        (
            "/v1/completions",
            ["a", "b", "c"],
            ["cmpl-r1-0-a1b2c3d4", "cmpl-r1-1-a1b2c3d4", "cmpl-r1-2-zzzzzzzz"],
        ),
        ("/v1/completions", [[1, 2], [3]], ["cmpl-r1-0-abcdEFGH", "cmpl-r1-1-abcdEFGH"]),
        ("/v1/chat/completions", None, ["chatcmpl-r1-abcdEFGH"]),
    ],
)
def test_the_proxy_derives_the_keys_both_engines_use(path: str, prompt: Any, internal_ids: list[str]):
    params = KVTransferParams(transfer_id=TID)
    body = {"messages": []} if prompt is None else {"prompt": prompt}
    assert transfer_keys(TID, path, body) == [transfer_key(i, params) for i in internal_ids]


class ReleasingPairing(FakePairing):
    """A pairing server that also answers /kvpush/release and records each release's query."""

    def __init__(self) -> None:
        super().__init__(200)
        self.released: list[dict[str, Any]] = []
        self.got = asyncio.Event()

    async def release(self, request: web.Request) -> web.Response:
        q = request.query
        self.released.append({k: q.getall(k) if k == "key" else q[k] for k in q})
        self.got.set()
        return web.json_response({"ok": True, "cancelled": q.getall("key")})

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/kvpush/release", self.release)
        return app


def test_a_client_leaving_before_the_decode_answered_releases_its_transfer():
    async def body() -> None:
        prefill, decode = Fake("prefill", delay=SLOW_S), Fake("decode", delay=SLOW_S)
        checker = ReleasingPairing()
        async with environment([prefill], [decode], pairing=[checker]) as env:
            await post_then_disconnect(env.proxy, prefill, decode)
            await asyncio.wait_for(checker.got.wait(), 3.0)
            tid = prefill.received[0]["body"]["kv_transfer_params"]["transfer_id"]
            [got] = checker.released
            pb = env.prefill[0]
            assert got["key"] == [f"{tid}-0"]
            assert (got["engine_id"], got["host"], got["port"]) == (pb.engine_id, pb.kv_host, str(pb.kv_port))

    run(body)


def test_a_client_served_in_full_releases_nothing():
    async def body() -> None:
        prefill, decode = Fake("prefill", kv={"do_remote_decode": True}), Fake("decode")
        checker = ReleasingPairing()
        async with environment([prefill], [decode], pairing=[checker]) as env:
            status, _, raw, _ = await env.call("POST", "/v1/completions", json_body={"prompt": "x"})
            assert status == 200, raw
            await asyncio.sleep(0.3)
            assert checker.released == []

    run(body)


class _Worker:
    def __init__(self, keyed: bool) -> None:
        extra: dict[str, Any] = {"pairing_port": 1}
        if keyed:
            extra["hmac_key"] = base64.b64encode(KEY).decode()
        self.settings = ConnectorSettings.from_extra(
            "decode", "d0", extra, block_size=16, tp_size=1, pp_size=1
        )
        self.released: list[tuple[PrefillAddress, list[str]]] = []

    def check_pairing(self, prefill: PrefillAddress, timeout_s: float) -> tuple[int, dict[str, Any]]:
        return 200, {"ok": True}

    def release_transfers(self, prefill: PrefillAddress, keys: list[str]) -> tuple[int, dict[str, Any]]:
        self.released.append((prefill, keys))
        return 200, {"ok": True}


def test_the_decode_route_takes_signed_releases_with_their_keys():
    worker = _Worker(keyed=True)
    port = free_port_range(1)
    server = PairingServer(worker, "127.0.0.1", port)
    try:
        target = release_target(PrefillBackend("http://p", "p0", "192.0.2.1", 5600), ["k-0", "k-1"])
        assert get(port, target) == 401  # unsigned
        assert worker.released == []
        assert get(port, target, {PAIRING_HEADER: pairing_signature(KEY, target)}) == 200
        [(prefill, keys)] = worker.released
        assert (prefill.engine_id, prefill.host, prefill.port, keys) == (
            "p0",
            "192.0.2.1",
            5600,
            ["k-0", "k-1"],
        )
        no_keys = release_target(PrefillBackend("http://p", "p0", "192.0.2.1", 5600), [])
        assert get(port, no_keys, {PAIRING_HEADER: pairing_signature(KEY, no_keys)}) == 400
    finally:
        server.close()


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_decode_cancels_only_keys_it_does_not_track():
    pytest.importorskip("vllm")
    with warnings.catch_warnings():  # vLLM imports torch, whose deprecation warnings are not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        from kvpush.platforms.vllm.decode_worker import DecodeWorker

    cancelled: list[tuple[str, PrefillAddress]] = []
    w = DecodeWorker(_Worker(keyed=False).settings, None)  # type: ignore[arg-type]
    w.endpoint = SimpleNamespace(cancel=lambda k, p, reason: cancelled.append((k, p)))  # type: ignore[assignment]
    w.by_key["tracked-0"] = SimpleNamespace()  # type: ignore[assignment]
    prefill = PrefillAddress("p0", "127.0.0.1", 5600)
    status, out = w.release_transfers(prefill, ["tracked-0", "unknown-0"])
    assert status == 200 and out["cancelled"] == ["unknown-0"] and out["left_to_vllm"] == ["tracked-0"]
    assert cancelled == [("unknown-0", prefill)]
