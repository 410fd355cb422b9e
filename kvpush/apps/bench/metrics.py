"""Per-request timestamps -> the metrics `vllm bench serve` writes (same key names)."""

from __future__ import annotations

from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
REQUIRED_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    *(f"{s}_{m}_ms" for m in METRICS for s in ("mean", "median", "std", "p99")),
)


def _stats(prefix: str, xs_s: list[float]) -> dict[str, float]:
    a = np.asarray(xs_s, dtype=float) * 1e3
    if a.size == 0:
        return {
            f"mean_{prefix}_ms": 0.0,
            f"median_{prefix}_ms": 0.0,
            f"std_{prefix}_ms": 0.0,
            f"p99_{prefix}_ms": 0.0,
        }
    return {
        f"mean_{prefix}_ms": float(a.mean()),
        f"median_{prefix}_ms": float(np.median(a)),
        f"std_{prefix}_ms": float(a.std()),
        f"p99_{prefix}_ms": float(np.percentile(a, 99)),
    }


def summarize(records: list[dict[str, Any]], duration: float, input_len: int) -> dict[str, Any]:
    """records: {"arrival", "tokens": [monotonic token times], "error"?}."""
    ok = [r for r in records if r["tokens"] and not r.get("error")]
    ttfts = [r["tokens"][0] - r["arrival"] for r in ok]
    e2els = [r["tokens"][-1] - r["arrival"] for r in ok]
    tpots = [(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1) for r in ok if len(r["tokens"]) > 1]
    itls = [b - a for r in ok for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
    out_tokens = sum(len(r["tokens"]) for r in ok)
    res: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration,
        "total_input_tokens": input_len * len(ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + input_len * len(ok)) / duration if duration > 0 else 0.0,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        res.update(_stats(name, xs))
    res["ttfts"] = [t for t in ttfts]
    res["errors"] = [r.get("error", "") for r in records if r.get("error")]
    return res
