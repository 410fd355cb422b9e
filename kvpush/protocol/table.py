"""Transition tables, h2-style: a dict from (state, event) to the next state, or IGNORE.

Both state machines keep each peer rank's state as an enum and move it only through their table; a pair
the table does not list is a LocalProtocolError (a bug in the caller or the machine, never absorbed).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from ..errors import LocalProtocolError


class Ignore:
    """Table marker: the event is allowed and changes nothing (a duplicate, or news that no longer matters)."""

    def __repr__(self) -> str:
        return "IGNORE"


IGNORE = Ignore()

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)


def transition(table: dict[tuple[S, E], S | Ignore], state: S, event: E, who: str) -> S:
    """The next state per `table`; `who` names the machine and the kind of rank in the error."""
    try:
        nxt = table[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"{who}: event {event.value!r} is not allowed in state {state.value!r}"
        ) from None
    return state if isinstance(nxt, Ignore) else nxt
