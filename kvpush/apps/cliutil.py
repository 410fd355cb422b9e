"""Argument types and helpers shared by kvpush's commands, so every command refuses a bad value the same
way (one line from argparse, exit status 2) and keeps the flag names a script may already use."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

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
    """Keep an old flag name working (hidden from --help) after it was renamed to a new one for `dest`."""
    parser.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]


def add_output_flags(parser: argparse.ArgumentParser, what: str, *old: str) -> None:
    """`--json` and `--output PATH`, the same in every command: `--json` prints `what` as JSON on stdout
    (instead of the text), `--output PATH` writes it to a file (beside the text). `old` spellings of
    --output stay, shown in --help."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")
    parser.add_argument(
        "--output", *old, dest="output", metavar="PATH", default=None, help=f"write {what} as JSON to PATH"
    )


def emit_json(args: argparse.Namespace, data: object) -> bool:
    """Write and print `data` as the flags from add_output_flags ask; True when stdout took the JSON (the
    caller then prints no text there)."""
    import json
    import os

    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    path = getattr(args, "output", None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text + "\n")
    if getattr(args, "json", False):
        print(text)
        return True
    return False
