"""The proxy's calls to the decodes' pairing servers (platforms/vllm/pairing.py is the other side): the
pairing check of each (prefill, decode), repeated for the proxy's life, and the release of a left
client's transfers (release.py). Every call is signed when the decodes are keyed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..params import PAIRING_HEADER, pairing_signature
from .pairing import Pairing, PrefillBackend
from .release import release_target

log = logging.getLogger("kvpush.proxy")


class PairingChecks:
    """One Pairing per (prefill, decode with a pairing URL), what the decodes last answered, and the
    engine id each decode is known by (configured, or as its pairing check reported it)."""

    def __init__(
        self,
        prefill: list[PrefillBackend],
        decode: list[str],
        decode_pairing: list[str],
        decode_engine_ids: list[str],
        key: bytes | None,
        stats: dict[str, int],
    ):
        self.pairings: dict[tuple[str, str], Pairing] = {
            (p.url, d): Pairing(p, d, u.rstrip("/"))
            for d, u in zip(decode, decode_pairing or [""] * len(decode), strict=True)
            if u
            for p in prefill
        }
        self._key = key
        self._stats = stats  # adds "released"
        # decode URL -> engine id, as configured or as its pairing check reported it
        self._named = dict(zip(decode, decode_engine_ids or [""] * len(decode), strict=True))
        self.decode_ids = {d: i for d, i in self._named.items() if i}
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Future[None]] = set()  # release calls in flight (kept referenced)

    def start(self, session: Any) -> None:
        """Check from now on over `session` (the router's pooled session to the backends)."""
        self._session = session
        if self.pairings:
            self._task = asyncio.ensure_future(self._keep_checking())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._releases):
            task.cancel()

    def _signed(self, target: str) -> dict[str, str]:
        """Headers for a GET of `target` on a decode's pairing server: signed when the decodes are keyed."""
        key = self._key
        return {} if key is None else {PAIRING_HEADER: pairing_signature(key, target)}

    async def check(self, pair: Pairing) -> Pairing:
        """Ask the decode whether it can receive from pair.prefill; an unreachable decode leaves it unknown."""
        import aiohttp

        target = pair.target()
        try:
            async with self._session.get(
                f"{pair.pairing_url}{target}",
                headers=self._signed(target),
                timeout=aiohttp.ClientTimeout(total=15),
            ) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            pair.ok, pair.error = None, f"pairing check at {pair.pairing_url} failed: {exc!r}"
            return pair
        pair.take_answer(r.status, body, self._named.get(pair.decode, ""))
        if pair.ok and pair.decode_engine_id:
            self.decode_ids[pair.decode] = pair.decode_engine_id
        elif pair.ok is False:
            log.error("pairing refused: %s", pair.refusal())
        return pair

    async def check_all(self) -> list[Pairing]:
        """Check every pairing now, at once."""
        return list(await asyncio.gather(*(self.check(p) for p in self.pairings.values())))

    async def _keep_checking(self) -> None:
        """From start (engines may still be loading) for the proxy's life: every 2 s while any pairing
        is refused or unknown, every 10 s once all are fine (a restarted engine may break one)."""
        while True:
            pairs = await self.check_all()
            await asyncio.sleep(10.0 if all(p.ok for p in pairs) else 2.0)

    def release_later(self, prefill: PrefillBackend, decode_url: str, keys: list[str]) -> None:
        """Ask the decode's pairing server, in the background, to have the prefill free `keys`."""
        pair = self.pairings.get((prefill.url, decode_url))
        if pair is None or not pair.pairing_url:
            return  # no pairing server to ask (vLLM's own connectors, or not configured)
        task = asyncio.ensure_future(self._release(pair.pairing_url, prefill, keys))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, pairing_url: str, prefill: PrefillBackend, keys: list[str]) -> None:
        """Best effort: a decode that does not answer leaves the prefill's lease to free the blocks."""
        import aiohttp

        target = release_target(prefill, keys)
        try:
            async with self._session.get(
                f"{pairing_url}{target}", headers=self._signed(target), timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                if r.status != 200:
                    log.warning("release of %s at %s: %s %s", keys, pairing_url, r.status, await r.text())
                    return
            self._stats["released"] += len(keys)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning(
                "release of %s at %s failed: %r (the prefill's lease frees them)", keys, pairing_url, exc
            )
