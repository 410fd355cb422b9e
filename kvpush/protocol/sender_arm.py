"""Armed WRITEs: the engine names a prompt's source blocks before prefill_done (vLLM: during the forward
pass), so a registered decode rank's WRITE is planned, sealed and made ahead; prefill_done with the same
blocks then only posts it. A mixin of SenderState (sender.py).

The machine remembers the StartWrite it armed on the rank (`Rank.armed`) and returns that very object
when prefill_done starts the rank's WRITE (the edge takes what it made by identity). Every other way the
rank or request goes (other blocks or tokens, kv_ready ranges, abort, expiry, a new attempt, a dropped
claim, close) returns a `Disarm` first, so each made WRITE is either posted or released, exactly once.
Arming changes no lease, release or fencing rule: nothing is posted and no source block is read before
prefill_done, and a source named but never finished expires like a registration without prefill_done.
"""

from __future__ import annotations

from .claims import NO_OWNER, Tombstones, foreign
from .groups import BlockIds
from .ranges import Range
from .sender_actions import Arm, Disarm, SenderAction, StartWrite
from .sender_stream import RangePosting
from .sender_table import DecodeRankState, Entry, RankEvent, SendPhase


def disarm(entry: Entry) -> list[SenderAction]:
    """Every WRITE made ahead for the entry's current attempt is dropped (the edge releases each)."""
    out: list[SenderAction] = []
    for d, rank in entry.ranks.items():
        if rank.armed is not None:
            rank.armed = None
            out.append(Disarm(entry.request_id, entry.attempt, d))
    return out


class Arming(RangePosting):
    """Needs the entries, the tombstones, `lease_s` and `owes_nothing` from the machine."""

    lease_s: float
    owes_nothing: bool
    _entries: dict[str, Entry]
    _tombstones: Tombstones

    def on_source_blocks(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        now: float,
        decode_engine_id: str = NO_OWNER,
    ) -> list[SenderAction]:
        """The engine is computing the prompt into `block_ids` (`num_tokens` tokens), prefill_done to
        follow: a registered decode rank's WRITE may be made now. A hint, never a claim: ownership and
        the lease stay as prefill_done and the registrations set them."""
        if self.owes_nothing or (request_id not in self._entries and request_id in self._tombstones):
            return []  # nothing to write, or already finished: prefill_done answers
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._entries[request_id] = Entry(
                request_id, now + self.lease_s, created_by="prefill_first", sourced=True
            )
        if entry.src_blocks is not None or entry.ready is not None:
            return []  # prefill_done or a streamed range came first: nothing to make ahead
        out = disarm(entry) if entry.source is not None else []  # a second word replaces the first
        entry.source = (block_ids, num_tokens, decode_engine_id)
        return out + self._arm(entry, now)

    def _arm(self, entry: Entry, now: float) -> list[SenderAction]:
        """Arm each registered rank that can be: the whole request in one WRITE, as prefill_done would
        start it with the named blocks (nothing streamed into it, not expired, tokens covered)."""
        src = entry.source
        if src is None or entry.phase is not SendPhase.OPEN or entry.src_blocks is not None:
            return []
        if entry.ready is not None:
            return []
        blocks, num_tokens, named = src
        out: list[SenderAction] = []
        for d, rank in sorted(entry.ranks.items()):
            reg = rank.reg
            if (
                rank.state is not DecodeRankState.REGISTERED
                or rank.armed is not None
                or reg is None
                or rank.trouble is not None
                or rank.inflight
                or any(rank.sent)
                or reg.num_tokens > num_tokens
                or now >= reg.expires_at
                or (named and foreign(named, reg.decode_engine_id))
            ):
                continue
            self._move(rank, RankEvent.ARM)
            write = rank.armed = self._write_for(
                entry, d, rank, reg, blocks, Range(0, reg.num_tokens, 0, self.num_layers), True
            )
            out.append(Arm(write))
        return out

    def _post_armed(self, entry: Entry, now: float) -> list[SenderAction] | None:
        """prefill_done named the blocks source_blocks did: start every armed rank with the StartWrite it
        holds, without planning ranges again (what `_advance` would return, found directly). None when
        anything differs (a registered rank not armed, one expired, a streamed range): the general path."""
        if entry.phase is not SendPhase.OPEN or entry.ready is not None:
            return None
        writes: list[StartWrite] = []
        for rank in entry.ranks.values():
            if rank.state is DecodeRankState.OWED:
                continue
            armed, reg = rank.armed, rank.reg
            if (
                rank.state is not DecodeRankState.REGISTERED
                or armed is None
                or reg is None
                or now >= reg.expires_at
                or reg.num_tokens > entry.num_tokens
            ):
                return None
            writes.append(armed)
        if not writes:
            return None
        for w in writes:
            rank = entry.ranks[w.decode_rank]
            self._move(rank, RankEvent.START)
            rank.armed, rank.inflight, rank.final_posted = None, 1, True
            rank.sent = [w.num_tokens] * self.num_layers
        return list(writes)
