"""Regenerate the transition tables in docs/protocol.md from the code (tests check they match).

.venv/bin/python scripts/protocol_tables.py          # rewrite docs/protocol.md in place
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

from kvpush.protocol import receiver, sender

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def table(rows: dict[tuple[Enum, Enum], object], ignore: object) -> str:
    out = ["| state | event | next |", "|---|---|---|"]
    for (state, event), nxt in rows.items():
        shown = "ignore" if nxt is ignore else nxt.value  # type: ignore[attr-defined]
        out.append(f"| `{state.value}` | `{event.value}` | `{shown}` |")
    return "\n".join(out)


def main() -> None:
    text = DOC.read_text()
    for name, rows, ignore in (
        ("sender", sender.SENDER_TRANSITIONS, sender.IGNORE),
        ("receiver", receiver.RECEIVER_TRANSITIONS, receiver.IGNORE),
    ):
        block = f"<!-- {name} table -->\n{table(rows, ignore)}\n<!-- end {name} table -->"
        text = re.sub(
            rf"<!-- {name} table -->.*?<!-- end {name} table -->", lambda _m, b=block: b, text, flags=re.S
        )
    DOC.write_text(text)


if __name__ == "__main__":
    main()
