"""The proxy's view of one (prefill, decode) pairing: the decode's GET /kvpush/pairing query for that
prefill, and what its answer means (platforms/vllm/pairing.py is the decode's side)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..params import PAIRING_ROUTE


@dataclass(frozen=True)
class PrefillBackend:
    """A prefill as the proxy reaches it: its HTTP URL and its KV side channel (for the decode)."""

    url: str
    engine_id: str = ""
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    tp_size: int = 1
    pp_size: int = 1


def prefill_query(prefill: PrefillBackend) -> list[tuple[str, str | int]]:
    """The prefill's KV address as the decode's pairing server reads it (pairing.py), for every route."""
    return [
        ("engine_id", prefill.engine_id),
        ("host", prefill.kv_host),
        ("port", prefill.kv_port),
        ("tp_size", prefill.tp_size),
        ("pp_size", prefill.pp_size),
    ]


@dataclass
class Pairing:
    """What a decode said about receiving KV from one prefill: ok None = not known yet."""

    prefill: PrefillBackend
    decode: str
    pairing_url: str
    ok: bool | None = None
    error: str = ""
    decode_engine_id: str = ""  # the engine id the decode reported in its last accepting answer

    def describe(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.url,
            "prefill_engine_id": self.prefill.engine_id,
            "decode": self.decode,
            "ok": self.ok,
            "error": self.error,
        }

    def refusal(self) -> str:
        return (
            f"prefill {self.prefill.engine_id!r} ({self.prefill.url}) cannot push KV to decode {self.decode}: "
            f"{self.error}"
        )

    def target(self) -> str:
        """The path and query of the check (what the signature covers)."""
        return f"{PAIRING_ROUTE}?{urllib.parse.urlencode(prefill_query(self.prefill))}"

    def take_answer(self, status: int, body: Any, named_id: str = "") -> None:
        """Set ok/error from the decode's answer. named_id: the decode's engine id as the proxy was told
        (--decode-engine-id); a decode reporting another one is refused, since the prefill would refuse
        each of its registrations for requests the proxy names it in."""
        if status == 200 and isinstance(body, dict) and body.get("ok"):
            reported = body.get("decode_engine_id")
            reported = reported if isinstance(reported, str) else ""
            if named_id and reported and reported != named_id:
                self.ok, self.error = (
                    False,
                    (
                        f"the decode is engine {reported!r}, but the proxy was told {named_id!r} "
                        "(--decode-engine-id)"
                    ),
                )
                return
            self.ok, self.error, self.decode_engine_id = True, "", reported
        elif status == 401:
            self.ok, self.error = (
                False,
                (
                    f"the decode at {self.pairing_url} refused the pairing check's signature: give the proxy "
                    "the decodes' shared key (--hmac-key-file or $KVPUSH_HMAC_KEY)"
                ),
            )
        elif status == 409 and isinstance(body, dict):
            self.ok, self.error = False, str(body.get("error") or body)
        else:  # the prefill did not answer the handshake (504) or something else: not known yet
            self.ok, self.error = None, f"pairing check answered {status}: {str(body)[:300]}"
