"""Regenerate the key tables in docs/config.md from kvpush.config (tests/endpoint/test_config.py checks they match).

.venv/bin/python scripts/config_doc.py          # rewrite docs/config.md in place
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from kvpush.config import FLAT_KEYS, GROUPS

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
BEGIN, END = "<!-- config keys -->", "<!-- end config keys -->"
_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", bytes: "base64 string"}


def json_type(tp: Any) -> str:
    """The type as a user writing kv_connector_extra_config JSON sees it."""
    if tp is type(None):
        return "null"
    if tp in _JSON:
        return _JSON[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(json_type(a) for a in args)
    if origin is tuple:
        return f"list of {json_type(args[0])}"
    if origin is dict:
        return f"object of {json_type(args[1])}"
    raise TypeError(f"no JSON name for {tp!r}")


def json_default(value: Any) -> str:
    text = f"`{msgspec.json.encode(value).decode()}`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
        for shift, unit in ((30, "GiB"), (20, "MiB")):
            if value % (1 << shift) == 0:
                return f"{text} ({value >> shift} {unit})"
    return text


def reference() -> str:
    """Every key: one table per group, in the order of KVPushConfig's fields."""
    flat_of = {where: flat for flat, where in FLAT_KEYS.items()}
    out = [
        "| key | type | default | meaning |",
        "|---|---|---|---|",
        '| `engine_id` | string | `"kvpush"` | This engine\'s id (top level, not in a group). |',
    ]
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls, include_extras=True)
        about = [" ".join(para.split()) for para in (inspect.getdoc(cls) or "").split("\n\n")]
        out += ["", f"### `{group}` ({cls.__name__})", "", "\n\n".join(about), ""]
        out += ["| key | nested | type | default | meaning |", "|---|---|---|---|---|"]
        for f in msgspec.structs.fields(cls):
            base, meta = typing.get_args(hints[f.name])
            default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            out.append(
                f"| `{flat_of[group, f.name]}` | `{group}.{f.name}` | {json_type(base)} | "
                f"{json_default(default)} | {meta.description} |"
            )
    return "\n".join(out)


def main() -> None:
    text = DOC.read_text()
    block = f"{BEGIN}\n{reference()}\n{END}"
    DOC.write_text(re.sub(rf"{BEGIN}.*?{END}", lambda _m: block, text, flags=re.S))


if __name__ == "__main__":
    main()
