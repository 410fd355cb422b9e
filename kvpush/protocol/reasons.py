"""Why a request failed, as a small closed set: carried on the state machines' actions and the endpoints'
results beside the human-readable reason, and used as the metrics' `reason` label (never the text)."""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    EXPIRED = "expired"  # a lease or a registration expired before the WRITE could start
    TIMEOUT = "timeout"  # a WRITE, or the decode's wait for its KV, ran past its time
    ABORTED = "aborted"  # an engine aborted or cancelled the request (either side)
    PEER_GONE = "peer_gone"  # the other side is proven gone, replaced, or unreachable
    PEER_SILENT = "peer_silent"  # the other side stopped answering (maybe frozen): fence-bound
    CLOSED = "closed"  # this endpoint closed, or its transfer thread died
    WRITE_FAILED = "write_failed"  # the data plane failed a WRITE (or could not post it)
    SUPERSEDED = "superseded"  # a newer attempt of the request replaced this one
    REFUSED = "refused"  # the request cannot be served as asked (TP, token count, limits, identity)
    REMOTE = "remote"  # the prefill reported a failure; the wire carries its text only
