"""Small OpenAI-API client helpers shared by the tests and `kvpush bench-vllm` (stdlib only)."""

from __future__ import annotations

import json
import random
import re
import sysconfig
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def corpus_words(limit: int = 200_000) -> list[str]:
    """Words from the standard library's sources: present on every machine, never downloaded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    words: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            words += re.findall(r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z_0-9]", path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(words) >= limit:
            break
    return words


def make_prompts(n: int, lengths: list[int], seed: int = 0) -> list[str]:
    """n prompts of roughly `lengths` words (cycled), each a distinct random slice of the corpus."""
    words = corpus_words()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = lengths[i % len(lengths)]
        start = rng.randrange(0, max(1, len(words) - k))
        out.append(" ".join(words[start : start + k]))
    return out


def post_json(
    url: str, body: dict[str, Any], timeout: float = 300.0, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=h)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float = 300.0,
    headers: dict[str, str] | None = None,
) -> list[int]:
    """Greedy completion; returns the generated token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    resp = post_json(base + "/v1/completions", body, timeout, headers)
    return list(resp["choices"][0]["token_ids"])


def complete_many(
    base: str, model: str, prompts: list[str], max_tokens: int, concurrency: int = 4, timeout: float = 300.0
) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(base, model, p, max_tokens, timeout), prompts))


@dataclass
class StreamResult:
    ok: bool
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    text: str = ""


def stream_complete(
    base: str, model: str, prompt: str, max_tokens: int, timeout: float = 600.0, request_id: str | None = None
) -> StreamResult:
    """Streaming completion measuring TTFT and inter-token latencies the way vllm bench does."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    last = t0
    res = StreamResult(ok=False)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.output_tokens = int(msg["usage"].get("completion_tokens", 0))
                    res.prompt_tokens = int(msg["usage"].get("prompt_tokens", 0))
                choices = msg.get("choices") or []
                if choices and choices[0].get("text") is not None:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += choices[0]["text"]
        res.latency = time.perf_counter() - t0
        res.ok = res.ttft > 0
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point, reported as such
        res.error = repr(exc)
        res.latency = time.perf_counter() - t0
    return res


def metrics(base: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (only the samples, no comments)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            continue
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, val in samples.items():
        if not (key == name or key.startswith(name + "{")):
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += val
    return total
