"""The per-rank transition tables: every (state, event) pair is either listed or a LocalProtocolError,
and the state machines, driven through random schedules, only ever take listed transitions."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from kvpush.errors import LocalProtocolError
from kvpush.protocol import receiver, sender, sender_table
from kvpush.protocol.receiver import RECEIVER_TRANSITIONS, PrefillRankState, RecvEvent, receiver_transition
from kvpush.protocol.sender import SENDER_TRANSITIONS, DecodeRankState, RankEvent, sender_transition

TABLES = [
    ("sender", DecodeRankState, RankEvent, SENDER_TRANSITIONS, sender_transition, sender.IGNORE),
    ("receiver", PrefillRankState, RecvEvent, RECEIVER_TRANSITIONS, receiver_transition, receiver.IGNORE),
]


@pytest.mark.parametrize("name, states, events, table, step, ignore", TABLES, ids=[t[0] for t in TABLES])
def test_every_pair_is_listed_or_refused(name, states, events, table, step, ignore):
    for state, event in itertools.product(states, events):
        if (state, event) in table:
            want = table[(state, event)]
            assert step(state, event) is (state if want is ignore else want), (state, event)
        else:
            with pytest.raises(LocalProtocolError, match=f"{event.value}.*{state.value}"):
                step(state, event)


@pytest.mark.parametrize("name, states, events, table, step, ignore", TABLES, ids=[t[0] for t in TABLES])
def test_tables_name_only_their_own_states_and_every_state_is_reachable(
    name, states, events, table, step, ignore
):
    assert all(isinstance(s, states) and isinstance(e, events) for s, e in table)
    targets = {v for v in table.values() if v is not ignore}
    initial = next(iter(states))
    assert targets | {initial} == set(states), (
        f"{name}: unreachable states {set(states) - targets - {initial}}"
    )


def _doc_table(section: str) -> set[tuple[str, str, str]]:
    """The (state, event, next) rows of one table in docs/protocol.md."""
    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    start = text.index(f"<!-- {section} table -->")
    end = text.index(f"<!-- end {section} table -->")
    rows = set()
    for line in text[start:end].splitlines():
        cells = [c.strip(" `") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[a-z_]+", cells[0]) and cells[0] != "state":
            rows.add((cells[0], cells[1], cells[2]))
    return rows


@pytest.mark.parametrize("name, states, events, table, step, ignore", TABLES, ids=[t[0] for t in TABLES])
def test_docs_protocol_md_shows_exactly_the_tables(name, states, events, table, step, ignore):
    want = {(s.value, e.value, "ignore" if v is ignore else v.value) for (s, e), v in table.items()}
    assert _doc_table(name) == want, (
        "docs/protocol.md is out of date: regenerate with scripts/protocol_tables.py"
    )


def test_random_schedules_take_only_listed_transitions(monkeypatch):
    """Drive the hypothesis World (test_protocol_sim) and record every transition the machines take."""
    from tests.protocol import test_protocol_sim as sim

    seen: set[tuple[str, object, object]] = set()
    real_s, real_r = sender.sender_transition, receiver.receiver_transition

    def spy_s(state, event):
        seen.add(("sender", state, event))
        return real_s(state, event)

    def spy_r(state, event):
        seen.add(("receiver", state, event))
        return real_r(state, event)

    monkeypatch.setattr(sender_table, "sender_transition", spy_s)  # every move goes through it
    monkeypatch.setattr(receiver, "receiver_transition", spy_r)
    sim.test_random_schedules_keep_every_invariant()  # hypothesis: random schedules, every invariant checked
    taken_s = {(s, e) for side, s, e in seen if side == "sender"}
    taken_r = {(s, e) for side, s, e in seen if side == "receiver"}
    assert taken_s <= set(SENDER_TRANSITIONS) and taken_r <= set(RECEIVER_TRANSITIONS)
    # the common paths are exercised, not just the table's existence
    assert (DecodeRankState.REGISTERED, RankEvent.START) in taken_s and (
        DecodeRankState.WRITING,
        RankEvent.WRITE_OK,
    ) in taken_s
    assert (PrefillRankState.EXPECTED, RecvEvent.DONE) in taken_r
