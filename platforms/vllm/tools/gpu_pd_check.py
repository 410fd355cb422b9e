"""One GPU, real `vllm serve` engines: kvpush prefill + decode (behind kvpush's proxy) against one engine
alone, greedy outputs compared token for token; scripts/gpu_check.sh runs it on vLLM 0.34 with the
extensible KV cache on and off (issue 41).

The KV stays in device memory (kv_buffer_device "cuda": NIXL registers VRAM, the path whose
`kv_cache_access` answer decides how 0.34 allocates the cache). `--device cpu` runs the same on a
vLLM CPU build (host KV, kv_buffer_device "cpu") to check this script where no GPU is.

    python -m kvpush.platforms.vllm.tools.gpu_pd_check --extensible on --extensible off --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from .client import complete_many, make_prompts
from .serve_engines import EngineSpec, free_port, free_ports, proxy_argv
from .serve_procs import Started, wait_healthy
from .tiny_model import build

# --enable-extensible-kv-cache is vLLM 0.34's flag (a BooleanOptionalAction: --no-... turns it off);
# "default" passes neither and lets vLLM decide (off for kvpush on the device without an IMEX channel,
# because kvpush asks for EXPORTS_FABRIC as vLLM's NIXL connector does).
EXTENSIBLE_ARGS = {
    "on": ["--enable-extensible-kv-cache"],
    "off": ["--no-enable-extensible-kv-cache"],
    "default": [],
}


@dataclasses.dataclass
class DeviceEngineSpec(EngineSpec):
    """An engine whose kvpush KV stays where `buffer_device` says ("cuda": VRAM registered with NIXL)."""

    buffer_device: str = "cuda"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        cfg = super().kv_transfer_config()
        if cfg is not None:
            cfg["kv_buffer_device"] = self.buffer_device
        return cfg


def engine_args(device: str, extensible: str) -> list[str]:
    """Three engines share one GPU: a fifth of its memory each, short contexts."""
    args = ["--max-num-seqs", "16"]
    if device == "cuda":
        args += ["--gpu-memory-utilization", "0.2", *EXTENSIBLE_ARGS[extensible]]
    return args


def start(spec: EngineSpec, log_dir: Path, procs: list[Started]) -> None:
    argv, env = spec.command()
    procs.append(Started(f"{spec.role}-{spec.engine_id}", argv, env, log_dir / f"{spec.engine_id}.log"))


def run_pair(
    model: str, device: str, extensible: str, prompts: list[str], max_tokens: int, log_dir: Path
) -> list[list[int]]:
    """Prefill + decode + proxy; the greedy tokens of each prompt through them."""
    p_port, d_port, p_kv, d_kv = free_ports(4, span=8)
    x_port = free_port()
    tag = f"kvpush-{extensible}"
    common: dict[str, Any] = {"max_model_len": 2048, "extra_args": engine_args(device, extensible)}
    prefill = DeviceEngineSpec(
        "prefill", model, p_port, "0", "kvpush", f"{tag}-prefill", p_kv, buffer_device=device, **common
    )
    decode = DeviceEngineSpec(
        "decode",
        model,
        d_port,
        "1",
        "kvpush",
        f"{tag}-decode",
        d_kv,
        extra_config={
            "prefill_addresses": [{"engine_id": prefill.engine_id, "host": "127.0.0.1", "port": p_kv}]
        },
        buffer_device=device,
        **common,
    )
    procs: list[Started] = []
    try:
        proxy = proxy_argv(x_port, "push", prefill, decode, p_kv)
        procs.append(Started(f"{tag}-proxy", proxy, dict(os.environ), log_dir / f"{tag}-proxy.log"))
        for spec in (prefill, decode):
            start(spec, log_dir, procs)
        for spec in (prefill, decode):
            wait_healthy(spec.url, procs, 600)
        url = f"http://127.0.0.1:{x_port}"
        wait_healthy(url, procs, 60)
        return complete_many(url, model, prompts, max_tokens)
    finally:
        for p in reversed(procs):
            p.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: build the fast tiny model)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--extensible", action="append", choices=sorted(EXTENSIBLE_ARGS), default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default="out/gpu-pd-check")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(args.model or build("fast"))
    prompts = make_prompts(args.prompts, [48, 200, 700])
    modes = args.extensible or ["on", "off"]
    started = time.monotonic()
    single = EngineSpec("single", model, free_port(), "0", None, "single", max_model_len=2048)
    single.extra_args = engine_args(args.device, "default")
    procs: list[Started] = []
    try:
        start(single, out, procs)
        wait_healthy(single.url, procs, 600)
        expected = complete_many(single.url, model, prompts, args.max_tokens)
    finally:
        for proc in procs:
            proc.stop()
    results: dict[str, Any] = {"device": args.device, "model": model, "prompts": len(prompts), "modes": {}}
    ok = True
    for mode in modes:
        try:
            got = run_pair(model, args.device, mode, prompts, args.max_tokens, out)
            same = sum(g == e for g, e in zip(got, expected, strict=True))
            results["modes"][mode] = {"equal": same, "of": len(expected)}
            ok &= same == len(expected)
        except (RuntimeError, OSError, ValueError, KeyError) as exc:  # reported; the next mode still runs
            results["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
        print(f"gpu_pd_check: extensible KV cache {mode}: {results['modes'][mode]}", flush=True)
    results["ok"], results["seconds"] = ok, round(time.monotonic() - started, 1)
    (out / "gpu_pd_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
