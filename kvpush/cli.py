"""The `kvpush` command line.

Each subcommand lives in its own module and is imported only when chosen, so `kvpush demo` never pays
for importing vLLM or boto3. A module exposes `configure(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvpush.apps.demo.cli", "push N requests prefill->decode over real NIXL and verify every byte"),
    "bench": ("kvpush.apps.bench.cli", "push vs pull on the engine emulator (one run, side by side)"),
    "plot": ("kvpush.apps.bench.plot", "draw the TTFT/TPOT figure from a results folder"),
    "proxy": ("kvpush.platforms.vllm.tools.proxy", "OpenAI-compatible concurrent-dispatch P/D proxy"),
    "serve-pd": ("kvpush.platforms.vllm.tools.serve_pd", "start prefill, decode and proxy on 127.0.0.1"),
    "bench-vllm": ("kvpush.platforms.vllm.tools.bench_vllm", "head-to-head of vLLM connectors on real vLLM"),
    "cluster": ("kvpush.apps.cluster", "find and check the AWS test cluster's nodes"),
    "doctor": ("kvpush.apps.doctor", "what this host offers kvpush; the memory path and transport it picks"),
    "fuzz": ("kvpush.apps.fuzz", "throw N mutated frames at every wire decode path; 0 crashes expected"),
    "soak": (
        "kvpush.apps.soak.cli",
        "chaos soak over real NIXL: kills, stops, lost notifs, attackers; 0 leaks",
    ),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"kvpush {name}", description=COMMANDS[name][1])
    module.configure(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
