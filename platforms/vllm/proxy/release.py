"""The proxy's release of a transfer whose client left: asks the decode to tell the prefill to free it.

A client that closes its connection early makes vLLM cancel both engines' handlers. When the decode's
handler is cancelled before it passed the request to its engine (vLLM's API server does that on a
disconnect, before `add_request`), no decode engine ever hears of the request, so nothing tells the
prefill, which holds the prompt's KV blocks until its lease runs out (120 s by default): under a storm of
early disconnects that is KV capacity gone for minutes. The proxy knows the transfer keys, so it asks the
decode's pairing server (GET /kvpush/release, signed like the pairing check) to cancel them: the decode
sends the prefill an Abort for each key it does not track itself, the prefill frees the blocks at once.
A request the decode engine does track is left to vLLM's own abort.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from ..params import RELEASE_ROUTE
from .pairing import PrefillBackend, prefill_query


def transfer_keys(transfer_id: str, path: str, body: dict[str, Any]) -> list[str]:
    """The transfer keys both engines derive from one dispatch (params.transfer_key's rule): a completion
    is one vLLM request per prompt, "cmpl-<id>-<index>", keyed "<transfer_id>-<index>"; anything else
    (a chat completion) is one request keyed by the transfer id itself."""
    if not path.endswith("/completions") or path.endswith("/chat/completions"):
        return [transfer_id]
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    n = len(prompt) if batch and isinstance(prompt, list) else 1
    return [f"{transfer_id}-{i}" for i in range(n)]


def release_target(prefill: PrefillBackend, keys: list[str]) -> str:
    """Path and query of the release call (what its signature covers)."""
    query = urllib.parse.urlencode([*prefill_query(prefill), *(("key", k) for k in keys)])
    return f"{RELEASE_ROUTE}?{query}"
