"""The decode engine's worker side: register each request's blocks with kvpush and report its KV.

One `_Recv` record per request, from expect() (the start of the step that allocated its blocks) until the
endpoint reports the KV ready or failed; then it is in finished_recving and, failed, in failed_recving
(vLLM >= 0.32) and its blocks in get_block_ids_with_load_errors (the only failure channel before 0.32), so
vLLM's kv_load_failure_policy decides between failing the request and recomputing it. A request
aborted while waiting stays recorded until the endpoint confirms that no WRITE can still land.

With extra config `pairing_port`, rank r also answers GET /kvpush/pairing?engine_id=&host=&port=&tp_size=
on pairing_host (default 127.0.0.1):pairing_port+r: it handshakes with that prefill (or reuses the
handshake) and says whether KV can move, naming the mismatch if not. `kvpush proxy --decode-pairing` asks
it before sending traffic. With a shared key every request must be signed (params.PAIRING_HEADER); beyond
loopback a key is required (ConnectorSettings refuses otherwise).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush.endpoint import DecodeEndpoint, PrefillAddress
from kvpush.errors import HandshakeTimeout, KVPushError, LayoutError

from .block_table import GroupIds, expand_group_ids, first_table, real_ids
from .overdue import Held, OverdueCheck
from .pairing import PairingServer
from .probe import debug_checksums
from .scheduler import FailItem, KVPushConnectorMetadata
from .worker_common import WorkerBase

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .params import ConnectorSettings

log = logging.getLogger("kvpush.vllm")

# beyond the protocol's own bound: the transfer thread's tick and one engine step
OVERDUE_SLACK_S = 2.0


@dataclass
class _Recv:
    req_id: str  # vLLM's internal id
    key: str  # the transfer key both engines agree on
    block_ids: GroupIds  # vLLM's block ids, per KV-cache group (before expanding to kernel blocks)
    num_tokens: int
    expected_at: float
    aborted: bool = False  # vLLM finished it while it waited: report it, but not as a load failure


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig) -> None:
        super().__init__(settings, vllm_config)
        self.endpoint: DecodeEndpoint | None = None
        self.by_key: dict[str, _Recv] = {}
        self.by_req: dict[str, _Recv] = {}
        self.instant_fail: list[FailItem] = []  # failed before expect()
        self.failed_blocks: set[int] = set()  # of failed requests since vLLM last asked
        self.pairing: PairingServer | None = None
        self.expects = 0
        self.recv_ok = 0
        self.recv_failed = 0
        self.recv_bytes = 0
        self.ready_s: list[float] = []
        leases = settings.config.leases
        # the longest an expected request can live by the protocol: its registration's fence (ready
        # deadline + the WRITE bound), plus a moment for the result to reach an engine step
        self.overdue = OverdueCheck("decode", leases.ready_timeout_s + leases.write_bound_s + OVERDUE_SLACK_S)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        cache = self.probe(kv_caches)
        self.endpoint = DecodeEndpoint(
            self.settings.config,
            cache.layout,
            cache.mem_type,
            hooks=cache.setup.hooks,  # type: ignore[arg-type]  # a TransferHooks when staged
        )
        self.endpoint.start()
        for spec in self.settings.prefill_addresses:
            pa = PrefillAddress(spec.engine_id, spec.host, spec.port, spec.tp_size, spec.pp_size)
            try:
                self.endpoint.connect(pa, self.settings.connect_timeout_s)
            except LayoutError as exc:
                self.endpoint.close()
                raise LayoutError(
                    f"kvpush: this decode engine cannot receive KV from prefill {pa.engine_id!r} at "
                    f"{pa.host}:{pa.port}: {exc}. Start both engines with the same model, dtype and KV "
                    "cache layout."
                ) from exc
        if self.settings.pairing_port:
            self.pairing = PairingServer(
                self, self.settings.pairing_host, self.settings.pairing_port + cache.rank
            )
        self.start_stats()

    def start_step(self, meta: KVPushConnectorMetadata) -> None:
        if self.endpoint is None or self.cache is None:
            return
        self.bind_waker(meta.wake_path, self.endpoint)
        now = time.monotonic()
        for it in meta.expect:
            if it.key in self.by_key:
                # The scheduler refuses colliding keys; should one still get here, fail it alone.
                self.instant_fail.append(
                    FailItem(it.req_id, f"transfer key {it.key!r} is in use", it.block_ids)
                )
                continue
            try:
                self.endpoint.expect(
                    it.key, expand_group_ids(it.block_ids, self.cache.ratio), it.num_tokens, it.prefill
                )
            except LayoutError as exc:
                # a table kvpush cannot fill (e.g. a window block vLLM never allocated): this request
                # fails and vLLM's kv_load_failure_policy applies; the engine goes on
                self.instant_fail.append(FailItem(it.req_id, str(exc), it.block_ids))
                continue
            rec = _Recv(it.req_id, it.key, it.block_ids, it.num_tokens, now)
            self.by_key[it.key] = rec
            self.by_req[it.req_id] = rec
            self.expects += 1
        self.instant_fail.extend(meta.fail_recv)
        for rid in meta.abort_recv:
            waiting = self.by_req.get(rid)
            if waiting is not None and not waiting.aborted:
                waiting.aborted = True
                self.endpoint.abort(waiting.key, "request aborted on decode")
        for c in meta.cancel_recv:
            self.endpoint.cancel(
                c.key,
                c.prefill,
                "request dropped on decode before its blocks were allocated",
            )
        if meta.expect or meta.abort_recv:
            self.publish_stats(news=True)

    def end_step(self, meta: KVPushConnectorMetadata) -> None:
        return None

    def collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step."""
        recving: set[str] = set()
        failed: set[str] = set()
        if self.endpoint is None or self.cache is None:
            return set(), recving, failed
        news = bool(self.instant_fail)
        for fail in self.instant_fail:
            recving.add(fail.req_id)
            failed.add(fail.req_id)
            self.failed_blocks.update(real_ids(fail.block_ids))
            self.recv_failed += 1
            log.warning("kvpush: request %s cannot receive KV: %s", fail.req_id, fail.reason)
        self.instant_fail.clear()
        for r in self.endpoint.finished():
            rec = self.by_key.pop(r.request_id, None)
            if rec is None:
                continue
            del self.by_req[rec.req_id]
            news = True
            recving.add(rec.req_id)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvpush D %s ok=%s blocks %s sums %s",
                    r.request_id,
                    r.ok,
                    rec.block_ids,
                    debug_checksums(
                        self.kv_caches,
                        first_table(expand_group_ids(rec.block_ids, self.cache.ratio)),
                        rec.num_tokens,
                        self.cache.layout.block_size,
                    ),
                )
            if r.ok:
                self.recv_ok += 1
                self.recv_bytes += r.nbytes
                self.ready_s.append(round(r.ready_at - rec.expected_at, 6))
            else:
                self.recv_failed += 1
                if not rec.aborted:
                    failed.add(rec.req_id)
                    self.failed_blocks.update(real_ids(rec.block_ids))
                    log.warning("kvpush: KV for %s did not arrive: %s", rec.req_id, r.reason)
        self.check_overdue(time.monotonic())
        self.publish_stats(news)
        return set(), recving, failed

    def check_overdue(self, now: float) -> list[Held]:
        """Name every request held past its bound (rate limited; see overdue.py)."""
        if not self.by_key or not self.overdue.due(now):
            return []
        endpoint = self.endpoint
        held = [
            Held(
                rec.key,
                rec.req_id,
                rec.expected_at,
                (
                    "aborted by vLLM, waiting for the prefill to confirm"
                    if rec.aborted
                    else "waiting for its KV"
                )
                + f"; endpoint: {endpoint.describe(rec.key) if endpoint is not None else 'closed'}",
            )
            for rec in self.by_key.values()
        ]
        return self.overdue.check(held, now)

    def take_failed_blocks(self) -> set[int]:
        """The blocks of every request reported failed since the last call (all of a failed request's
        blocks are invalid); vLLM without failed_recving learns of the failures from them."""
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    # ---- pairing check (called from the pairing server's thread) -----------------------------
    def check_pairing(self, prefill: PrefillAddress, timeout_s: float) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body): 200 when KV can move from `prefill` to this rank, 409 naming the mismatch
        when not, 504 when the prefill does not answer the handshake."""
        endpoint = self.endpoint
        mine = {
            "decode_engine_id": self.settings.config.engine_id,
            "rank": self.cache.rank if self.cache else 0,
            "compat": self.layout.compat_hash(),
            "block_size": self.layout.block_size,
            "atomic_blocks": self.layout.atomic_blocks,
            "prefill_engine_id": prefill.engine_id,
        }
        if endpoint is None:
            return 503, {**mine, "ok": False, "error": "the decode's kvpush endpoint is closed"}
        try:
            endpoint.connect(prefill, timeout_s)
        except HandshakeTimeout as exc:
            return 504, {**mine, "ok": False, "error": str(exc)}
        except KVPushError as exc:
            return 409, {**mine, "ok": False, "error": str(exc)}
        return 200, {**mine, "ok": True}

    def release_transfers(self, prefill: PrefillAddress, keys: list[str]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for GET /kvpush/release: the proxy's client left. Each key this rank does
        not track (its request may never have reached this engine) is cancelled, so the prefill ranks
        that hold its KV free it now rather than at their lease; a tracked one is left to vLLM's abort."""
        endpoint = self.endpoint
        if endpoint is None:
            return 503, {"ok": False, "error": "the decode's kvpush endpoint is closed"}
        tracked = set(self.by_key)  # a racy read of the engine thread's dict: a key it gains later is
        # cancelled anyway, and then fails its load as a request whose client is gone would
        cancelled = [k for k in keys if k not in tracked]
        for k in cancelled:
            endpoint.cancel(k, prefill, "released by the proxy: the client left before the decode had it")
        return 200, {"ok": True, "cancelled": cancelled, "left_to_vllm": [k for k in keys if k in tracked]}

    # ---- stats -------------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        return {
            "expects": self.expects,
            "recv_ok": self.recv_ok,
            "recv_failed": self.recv_failed,
            "recv_bytes": self.recv_bytes,
            "ready_s": list(self.ready_s),
        }

    def outstanding(self) -> int:
        return len(self.by_key)

    def endpoint_stats(self) -> dict[str, int]:
        return self.endpoint.stats() if self.endpoint is not None else {}

    def shutdown(self) -> None:
        if self.pairing is not None:
            self.pairing.close()
            self.pairing = None
        if self.endpoint is not None:
            self.close_stats()
            self.endpoint.close()
            self.endpoint = None
        self.close_waker()
