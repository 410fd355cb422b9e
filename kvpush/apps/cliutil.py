"""Argument types and helpers shared by kvpush's commands, so every command refuses a bad value the same
way (one line from argparse, exit status 2) and keeps the flag names a script may already use."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "a non-negative integer")


def port(text: str) -> int:
    """A TCP port; 0 lets the system (or the command) pick a free one."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def log_level(text: str) -> str:
    """A logging level name, case-insensitive; refused at parse time instead of by logging later."""
    name = text.upper()
    if name not in LOG_LEVELS or not isinstance(logging.getLevelName(name), int):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level; choose one of {', '.join(LOG_LEVELS)}"
        )
    return name


def alias(parser: argparse.ArgumentParser, old: str, dest: str, **kwargs: object) -> None:
    """Keep an old flag name working after it was renamed to a new one for `dest`; --help lists it as
    the old name of the new flag (the docs still show some old names, and a script may use them)."""
    new = next((a.option_strings[0] for a in parser._actions if a.dest == dest and a.option_strings), dest)
    parser.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=f"old name of {new}", **kwargs)  # type: ignore[arg-type]


def add_output_flags(parser: argparse.ArgumentParser, what: str, *old: str) -> None:
    """`--json` and `--output PATH`, the same in every command: `--json` prints `what` as JSON on stdout
    (instead of the text), `--output PATH` writes it to a file (beside the text). `old` spellings of
    --output stay, shown in --help."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")
    parser.add_argument(
        "--output", *old, dest="output", metavar="PATH", default=None, help=f"write {what} as JSON to PATH"
    )


def emit_json(args: argparse.Namespace, data: object, sort_keys: bool = False) -> bool:
    """Write and print `data` as the flags from add_output_flags ask; True when stdout took the JSON (the
    caller then prints no text there). Keys keep their order unless `sort_keys`."""
    import json
    import os

    text = json.dumps(data, indent=2, sort_keys=sort_keys, default=str)
    out = getattr(args, "json_stdout", None) or sys.stdout
    path = getattr(args, "output", None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text + "\n")
    if getattr(args, "json", False):
        print(text, file=out)
        return True
    return False


@contextlib.contextmanager
def text_to_stderr(args: argparse.Namespace) -> Iterator[None]:
    """With --json, the text a command prints goes to stderr, so stdout carries only the JSON (emit_json
    still writes to the real stdout)."""
    if not getattr(args, "json", False):
        yield
        return
    args.json_stdout = getattr(args, "json_stdout", None) or sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (a terminal only: logs and pipes get none); yields `update(done)`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(what, total=total)
        yield lambda done: bar.update(task, completed=done)
