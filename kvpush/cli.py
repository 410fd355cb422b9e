"""The `kvpush` command line.

Each subcommand lives in its own module and is imported only when chosen, so `kvpush demo` never pays
for importing vLLM or boto3. A module exposes `configure(parser)` and `run(args) -> int`. A command whose
optional dependencies are missing, a bad value, a busy port or a kvpush error ends in one line on stderr
(exit status 2), never in a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import sys
from typing import Any, NamedTuple

from kvpush.apps import install_hint as install_hint_module


class Command(NamedTuple):
    module: str
    help: str
    # top-level modules the command needs beyond the base install, and the extra that brings them
    needs: tuple[tuple[str, str], ...] = ()


_NIXL = ("nixl", "nixl")
_VLLM = ("vllm", "vllm")

COMMANDS: dict[str, Command] = {
    "demo": Command(
        "kvpush.apps.demo.cli",
        "push N requests prefill->decode over real NIXL and verify every byte",
        (_NIXL,),
    ),
    "bench": Command(
        "kvpush.apps.bench.cli", "push vs pull on the engine emulator (one run, side by side)", (_NIXL,)
    ),
    "plot": Command(
        "kvpush.apps.bench.plot", "draw the TTFT/TPOT figure from a results folder", (("matplotlib", "plot"),)
    ),
    "proxy": Command(
        "kvpush.platforms.vllm.proxy.cli",
        "OpenAI-compatible concurrent-dispatch P/D proxy",
        (("aiohttp", "proxy"),),
    ),
    "serve-pd": Command(
        "kvpush.platforms.vllm.tools.serve_pd",
        "start prefill, decode and proxy on 127.0.0.1",
        (_VLLM, _NIXL, ("aiohttp", "proxy")),
    ),
    "bench-vllm": Command(
        "kvpush.platforms.vllm.tools.bench_vllm",
        "head-to-head of vLLM connectors on real vLLM",
        (_VLLM, _NIXL, ("aiohttp", "proxy"), ("matplotlib", "plot")),
    ),
    "cluster": Command(
        "kvpush.apps.cluster", "find and check the AWS test cluster's nodes", (("boto3", "cluster"),)
    ),
    "doctor": Command(
        "kvpush.apps.doctor", "check this host for kvpush (exit 1 on a blocking problem); the path it picks"
    ),
    "fuzz": Command(
        "kvpush.apps.fuzz", "throw N mutated frames at every wire decode path; 0 crashes expected"
    ),
    "soak": Command(
        "kvpush.apps.soak.cli",
        "chaos soak over real NIXL: kills, stops, lost notifs, attackers; 0 leaks",
        (_NIXL,),
    ),
}

# a module a command may import late, and the extra that installs it (kept here for scripts that read it)
EXTRA_FOR_MODULE = install_hint_module.EXTRA_FOR_MODULE


# a seam for tests that play a host without an optional dependency
_find_spec = importlib.util.find_spec


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (flags are off by default), also for options declared without help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # a help text that already states its default, and on/off flags, need no "(default: ...)" suffix
        if (action.help and "default" in action.help.lower()) or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if (
            action.help is None
            and action.option_strings
            and action.nargs != 0
            and action.default is not argparse.SUPPRESS
        ):
            action.help = "(default: %(default)s)"
            try:
                return super()._format_action(action)
            finally:
                action.help = None
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; sub-parsers (e.g. `kvpush cluster list`) inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def version_text() -> str:
    """The package version, the wire version(s) it speaks and the NIXL/vLLM found: metadata only, so
    `kvpush --version` imports neither NIXL nor vLLM."""
    from kvpush.apps.versions import version_line

    return version_line()


def _top_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvpush", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def install_hint(module: str) -> str:
    """The one line that tells a user how to get a missing module (kvpush/apps/install_hint.py)."""
    return install_hint_module.hint_for_module(module)


def missing_modules(command: Command) -> list[str]:
    return [module for module, _extra in command.needs if _find_spec(module) is None]


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help", "--version"):
            parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}")
        parser.parse_args(argv)  # --help / --version exit here
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    command = COMMANDS[name]
    prog = f"kvpush {name}"
    missing = missing_modules(command)
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        return _fail(prog, f"needs {exc.name}, which is not installed: {install_hint(exc.name or '')}")
    parser = Parser(prog=prog, description=command.help)
    module.configure(parser)
    args = parser.parse_args(rest)  # --help works without the optional dependencies
    if missing:
        return _fail(prog, f"needs {', '.join(missing)}, not installed: {install_hint(missing[0])}")
    return _run(prog, module, args)


def _run(prog: str, module: Any, args: argparse.Namespace) -> int:
    from kvpush.errors import KVPushError

    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # a command's own usage error, `raise SystemExit("message")`: one line, exit 2
        if isinstance(exc.code, str):
            return _fail(prog, exc.code.removeprefix(f"{prog}: "))
        raise
    except ModuleNotFoundError as exc:
        return _fail(prog, f"needs {exc.name}, which is not installed: {install_hint(exc.name or '')}")
    except KVPushError as exc:
        return _fail(prog, str(exc))
    except Exception as exc:
        if getattr(exc, "errno", None) == errno.EADDRINUSE:
            return _fail(prog, f"a port it needs is already in use ({exc}); pick another with --port")
        if getattr(exc, "errno", None) == errno.EACCES and "bind" in str(exc).lower():
            return _fail(prog, f"not allowed to listen on that port ({exc})")
        raise


if __name__ == "__main__":
    raise SystemExit(main())
