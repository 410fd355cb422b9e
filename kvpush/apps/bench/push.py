"""The bench's push connectors: kvpush's own endpoints.

Decode `expect()`s at allocation (vLLM: update_state_after_alloc), prefill calls `prefill_done()` the
step a request finishes, both poll `finished()` each step. Loopback copies inside the post, so the
decode replays what a NIC would add: kvpush's push thread busy posting for the cost model's time, one
request after the other, then the real bytes on a serial link (docs/bench.md)."""

from __future__ import annotations

import queue
import time
from typing import Any

from kvpush.apps.bench.steps import DecodeSide, PrefillSide, Req
from kvpush.protocol.layout import blocks_for


class PushPrefill:
    def __init__(self, eng: PrefillSide) -> None:
        self.eng = eng

    def start(self) -> dict[str, Any]:
        from kvpush.config import KVPushConfig, SideChannel
        from kvpush.endpoint import PrefillEndpoint

        cfg = KVPushConfig(
            engine_id=f"bench-prefill-{self.eng.port}", side_channel=SideChannel(port=self.eng.port)
        )
        self.endpoint = PrefillEndpoint(cfg, self.eng.layout)
        self.endpoint.start()
        host, p = self.endpoint.address
        return {"engine_id": cfg.engine_id, "host": host, "port": p}

    def poll_freed(self) -> None:
        eng = self.eng
        for r in self.endpoint.finished():
            req = eng.held.pop(r.request_id, None)
            if req is not None:
                eng.pool.free(req.blocks)
                if not r.ok:
                    eng.outbox.put({"type": "prefill_error", "id": r.request_id, "reason": r.reason})

    def on_prefill_done(self, r: Req) -> None:
        # kvpush: the blocks go to the push thread in the same step
        self.endpoint.prefill_done(r.id, r.blocks, r.prompt_len)
        self.eng.acct.put((r.id, r.blocks))  # emulation-only: descriptor count for NIC post cost
        self.eng.outbox.put({"type": "prefill_done", "id": r.id, "stats": r.stats})

    def close(self) -> None:
        self.endpoint.close()


class PushDecode:
    def __init__(self, eng: DecodeSide) -> None:
        self.eng = eng
        self.loop_charged_s = 0.0  # the push thread posts, never the engine loop
        # the prefill's block ids (emulation-only side channel) for the modelled NIC posting time of
        # kvpush's push thread, which is emulated as one serial posting thread and a serial link
        self._src_blocks: dict[str, list[int]] = {}
        self._pending: list[tuple[float, Req]] = []  # (core ready_at, request), in ready order
        self._post_free_at = 0.0
        self._link_free_at = 0.0

    def start(self) -> None:
        from kvpush.config import KVPushConfig, SideChannel
        from kvpush.endpoint import DecodeEndpoint, PrefillAddress

        info = self.eng.prefill_info
        cfg = KVPushConfig(
            engine_id=f"bench-decode-{info['port']}", side_channel=SideChannel(port=info["port"] + 50)
        )
        self.endpoint = DecodeEndpoint(cfg, self.eng.layout)
        self.endpoint.start()
        self.prefill_addr = PrefillAddress(info["engine_id"], info["host"], info["port"])

    def on_alloc(self, r: Req) -> None:
        nb = blocks_for(r.prompt_len, self.eng.layout.block_size)
        self.endpoint.expect(r.id, r.blocks[:nb], r.prompt_len, self.prefill_addr)

    def start_load_kv(self) -> None:
        pass  # the prefill pushes: nothing to start

    def get_finished(self) -> list[str]:
        now = time.monotonic()
        out: list[str] = []
        try:
            while True:
                rid, blocks = self.eng.acct.get_nowait()
                self._src_blocks[rid] = blocks
        except queue.Empty:
            pass
        for res in self.endpoint.finished():
            r = self.eng.waiting_kv.get(res.request_id)
            if r is None:
                continue
            if not res.ok:
                r.stats["error"] = res.reason
                out.append(r.id)
                continue
            r.stats["kv_ready_core"] = res.ready_at
            r.stats["nbytes"] = res.nbytes
            self._pending.append((res.ready_at, r))
        self._pending.sort(key=lambda x: x[0])
        # The core's push thread really posted and copied (loopback). On a NIC it would have been
        # busy posting for the modelled time, one request after the other, and the link would
        # have carried the real bytes: replay both as two serial stages after the real completion.
        while self._pending:
            ready_at, r = self._pending[0]
            if "model_ready_at" not in r.stats and not self._model(ready_at, r):
                break  # the prefill's block ids have not arrived yet (keeps FIFO order)
            if now < r.stats["model_ready_at"]:
                break
            self._pending.pop(0)
            del self._src_blocks[r.id]
            out.append(r.id)
        return out

    def _model(self, ready_at: float, r: Req) -> bool:
        """When `r`'s KV would be usable behind a NIC (stats' model_ready_at); False: not known yet."""
        src = self._src_blocks.get(r.id)
        if src is None:
            return False
        cm, layout = self.eng.cm, self.eng.layout
        nb = blocks_for(r.prompt_len, layout.block_size)
        descs = cm.sorted_descriptors(src, r.blocks[:nb], r.prompt_len, layout)
        post, wire = cm.post_cost_s(descs), cm.reference_transfer_s(r.prompt_len)
        self._post_free_at = max(ready_at, self._post_free_at) + post
        self._link_free_at = max(self._post_free_at, self._link_free_at) + wire
        r.stats.update(descs=descs, post_model_s=post, wire_model_s=wire, model_ready_at=self._link_free_at)
        return True

    def close(self) -> None:
        self.endpoint.close()
