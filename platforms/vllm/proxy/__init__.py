"""`kvpush proxy`: an OpenAI-compatible router for disaggregated prefill/decode.

Push mode (kvpush, vLLM's NixlPushConnector): the request goes to a prefill and a decode backend at the
same time, with the same X-Request-Id. Prefill gets `do_remote_decode` and max_tokens 1; decode gets
`do_remote_prefill` plus the prefill's coordinates (engine id, KV host, side-channel port, TP, PP), so the
decode can register its blocks while the prefill is still computing. The client sees the decode's answer.

Pull mode (vLLM's NixlConnector): prefill first; its returned kv_transfer_params go to decode.

A backend that is down, or a prefill that fails, gives the client a 502/503 with a JSON error at once;
the decode request is then cancelled (closing the connection makes vLLM abort it), never left hanging.

Every push dispatch carries a fresh `transfer_id` in both engines' kv_transfer_params, so two client
requests with the same X-Request-Id never share a transfer key.

Pairing (kvpush decodes started with `pairing_port`, given here as --decode-pairing; keyed decodes need the
shared key, from --hmac-key-file or $KVPUSH_HMAC_KEY, to sign each check): at start and on
every /health, the proxy asks each decode whether it can receive KV from each prefill (the decode
handshakes with that prefill, checking the real layouts). A refused pairing makes /health 503 naming the
mismatch, a request routed to it is answered with that reason, and a decode failure is re-checked so
a pairing that broke between checks is named too, instead of the engine's bare "Internal server error".

Facing clients (server.py, SECURITY.md "The proxy"): bodies, JSON nesting, request ids, connections
and the timings endpoint are bounded by the limits in ProxyConfig; `GET /kvpush/timings` is served only
when a token is configured (--timings, token from --timings-token-file or $KVPUSH_PROXY_TIMINGS_TOKEN).

The modules: cli.py (the flags, `kvpush proxy`'s entry), config.py (ProxyConfig), app.py (the aiohttp
application and its routes), router.py (dispatch, relay, /health), checks.py (the pairing checks and releases
at the decodes' pairing servers), pairing.py (one pairing as the proxy sees it), release.py (freeing a left
client's transfers through the decode), server.py (what faces clients: bodies, request ids, connections,
timings, serving). aiohttp is imported where used, so `kvpush proxy --help` works without it.
"""

from __future__ import annotations

from .app import build_app
from .config import ProxyConfig, ProxyMode
from .pairing import Pairing, PrefillBackend
from .router import BackendError, Router

__all__ = ["BackendError", "Pairing", "PrefillBackend", "ProxyConfig", "ProxyMode", "Router", "build_app"]
