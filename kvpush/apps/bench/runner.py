"""The router and load generator: runs engine pairs, sends Poisson load, collects per-request times.

push: concurrent dispatch, the request goes to prefill and decode at once (kvpush's proxy, and vLLM's
push proxy). pull: prefill first; when its response (kv_transfer_params with the block ids) arrives the
router forwards the request to decode (vLLM's toy_proxy_server for NixlConnector).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.apps.bench.engines import decode_main, prefill_main
from kvpush.apps.bench.steps import PUSH


class BenchError(RuntimeError):
    pass


def arrivals(qps: float, n: int, seed: int) -> np.ndarray:
    """Poisson process (vllm bench serve: burstiness 1 -> exponential gaps), first request at t=0."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / qps, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


@dataclass
class EnginePair:
    mode: str
    port: int
    cm_path: Any = None
    procs: list[Any] = field(default_factory=list)

    def start(self, ctx: Any) -> None:
        self.start_prefill(ctx)
        self.start_decode(ctx)

    def start_prefill(self, ctx: Any) -> None:
        """Spawn the prefill engine (returns at once; wait_prefill() waits for it)."""
        self.ctx = ctx
        self.pf_in, self.pf_out = ctx.Queue(), ctx.Queue()
        self.dec_in, self.dec_out, self.acct = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(
            target=prefill_main,
            name=f"prefill-{self.mode}",
            daemon=True,
            args=(self.mode, self.cm_path, self.pf_in, self.pf_out, self.acct, self.port),
        )
        p.start()
        self.procs.append(p)

    def wait_prefill(self) -> None:
        ready = self._wait(self.pf_out, "prefill")
        self.prefill_info = {k: ready[k] for k in ("engine_id", "host", "port")}

    def start_decode(self, ctx: Any, wait: bool = True) -> None:
        if not hasattr(self, "prefill_info"):
            self.wait_prefill()
        d = ctx.Process(
            target=decode_main,
            name=f"decode-{self.mode}",
            daemon=True,
            args=(self.mode, self.cm_path, self.dec_in, self.dec_out, self.acct, self.prefill_info),
        )
        d.start()
        self.procs.append(d)
        if wait:
            self.wait_decode()

    def wait_decode(self) -> None:
        self._wait(self.dec_out, "decode")

    def _wait(self, q: Any, role: str, timeout: float = 300.0) -> dict[str, Any]:
        try:
            msg: dict[str, Any] = q.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.mode} {role} engine did not start in {timeout}s") from None
        if msg["type"] == "error":
            raise BenchError(f"{self.mode} {role} engine failed:\n{msg['trace']}")
        return msg

    def run_point(  # noqa: C901
        self,
        qps: float,
        input_len: int,
        output_len: int,
        n: int,
        seed: int,
        timeout_s: float = 300.0,
        tag: str = "",
    ) -> tuple[list[dict[str, Any]], float]:
        times = arrivals(qps, n, seed)
        records: dict[str, dict[str, Any]] = {}
        pending = threading.Semaphore(0)
        errors: list[str] = []
        stop = threading.Event()

        def messages(q: Any) -> Iterator[dict[str, Any]]:
            """An engine's messages until stopped; an engine crash is recorded and ends one wait."""
            while not stop.is_set():
                try:
                    msg = q.get(timeout=0.05)
                except queue.Empty:
                    continue
                if msg["type"] == "error":
                    errors.append(msg["trace"])
                    pending.release()
                    continue
                yield msg

        def on_prefill() -> None:
            for msg in messages(self.pf_out):
                if msg["type"] == "prefill_error":
                    records[msg["id"]]["error"] = msg["reason"]
                    continue
                rec = records[msg["id"]]
                rec["prefill_stats"] = msg["stats"]
                if self.mode != PUSH:  # pull: forward the prefill's response to decode
                    rec["forwarded"] = time.monotonic()
                    self.dec_in.put(
                        {
                            "type": "req",
                            "id": msg["id"],
                            "prompt_len": input_len,
                            "output_len": output_len,
                            "arrival": rec["arrival"],
                            "kv_params": msg["kv_params"],
                        }
                    )

        def on_decode() -> None:
            for msg in messages(self.dec_out):
                if msg["type"] != "done":
                    continue
                rec = records[msg["id"]]
                rec["tokens"] = msg["tokens"]
                rec["stats"] = msg["stats"]
                if msg["stats"].get("error"):
                    rec["error"] = msg["stats"]["error"]
                pending.release()

        threads = [
            threading.Thread(target=on_prefill, daemon=True),
            threading.Thread(target=on_decode, daemon=True),
        ]
        for t in threads:
            t.start()
        t0 = time.monotonic() + 0.05
        for i, at in enumerate(times):
            rid = f"{self.mode}-{tag}-{i}"
            target = t0 + float(at)
            while (d := target - time.monotonic()) > 0:
                time.sleep(d)
            now = time.monotonic()
            records[rid] = {"arrival": now, "tokens": []}
            msg = {
                "type": "req",
                "id": rid,
                "prompt_len": input_len,
                "output_len": output_len,
                "arrival": now,
            }
            self.pf_in.put(msg)
            if self.mode == PUSH:  # concurrent dispatch
                self.dec_in.put(msg)
        deadline = time.monotonic() + timeout_s
        for _ in range(n):
            if not pending.acquire(timeout=max(0.0, deadline - time.monotonic())):
                stop.set()
                raise BenchError(
                    f"{self.mode} qps={qps} in={input_len}: requests did not finish in {timeout_s}s"
                )
            if errors:
                stop.set()
                raise BenchError(f"{self.mode} engine failed:\n{errors[0]}")
        duration = (
            max(r["tokens"][-1] for r in records.values() if r["tokens"]) - t0
            if any(r["tokens"] for r in records.values())
            else 0.0
        )
        stop.set()
        for t in threads:
            t.join()
        return list(records.values()), duration

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) each engine process has used so far."""
        import os

        out = {}
        for role, p in zip(("prefill", "decode"), self.procs, strict=False):
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[role] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                out[role] = 0.0
        return out

    def stop(self, join: bool = True) -> None:
        for q in (self.pf_in, self.dec_in):
            with contextlib.suppress(Exception):
                q.put({"type": "stop"})
        if join:
            self.join()

    def join(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def breakdown(records: list[dict[str, Any]]) -> dict[str, float]:
    """Medians (ms) of where the time goes between arrival and the first token.

    prefill_done_to_kv_ready: prefill's last step -> the bytes really landed in decode's cache (push:
    the core's ready_at; pull: the loopback READ completed). kv_ready_to_model_ready: the modelled NIC
    (posting thread busy for the descriptors, then the wire time of the unscaled bytes, both serial).
    model_ready_to_seen: until decode's once-per-step get_finished sees it. pull only:
    prefill_done_to_read_start (router forward, decode scheduling, handshake), read_start_to_nic
    (descriptor building + modelled post on the posting thread), post_call (the real NIXL call).
    """
    keys: dict[str, list[float]] = {
        k: []
        for k in (
            "prefill_queue_ms",
            "prefill_compute_ms",
            "prefill_done_to_read_start_ms",
            "read_start_to_nic_ms",
            "prefill_done_to_kv_ready_ms",
            "kv_ready_to_model_ready_ms",
            "model_ready_to_seen_ms",
            "seen_to_first_token_ms",
            "descs",
            "post_model_ms",
            "wire_model_ms",
            "post_call_ms",
        )
    }
    for r in records:
        ps, ds = r.get("prefill_stats", {}), r.get("stats", {})
        if not r["tokens"] or "prefill_done" not in ps or "kv_ready_seen" not in ds:
            continue
        keys["prefill_queue_ms"].append(ps["prefill_start"] - r["arrival"])
        keys["prefill_compute_ms"].append(ps["prefill_done"] - ps["prefill_start"])
        if "read_start" in ds:
            keys["prefill_done_to_read_start_ms"].append(ds["read_start"] - ps["prefill_done"])
            if "nic_posted" in ds:
                keys["read_start_to_nic_ms"].append(ds["nic_posted"] - ds["read_start"])
        if "kv_ready_core" in ds:
            keys["prefill_done_to_kv_ready_ms"].append(ds["kv_ready_core"] - ps["prefill_done"])
        if "model_ready_at" in ds:
            if "kv_ready_core" in ds:
                keys["kv_ready_to_model_ready_ms"].append(ds["model_ready_at"] - ds["kv_ready_core"])
            keys["model_ready_to_seen_ms"].append(ds["kv_ready_seen"] - ds["model_ready_at"])
        keys["seen_to_first_token_ms"].append(r["tokens"][0] - ds["kv_ready_seen"])
        if "descs" in ds:
            keys["descs"].append(ds["descs"] / 1e3)
            keys["post_model_ms"].append(ds["post_model_s"])
            keys["wire_model_ms"].append(ds.get("wire_model_s", 0.0))
        if "post_call_s" in ds:
            keys["post_call_ms"].append(ds["post_call_s"])
    return {k: round(float(np.median(v)) * 1e3, 3) for k, v in keys.items() if v}
