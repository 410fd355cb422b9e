"""The typed parameters vLLM hands the connector: kv_transfer_params per request, extra config per engine.

`KVTransferParams` is the one definition of the per-request dict the router and both engines exchange
(vLLM carries it as `request.kv_transfer_params` and returns the prefill's in its HTTP answer). The
scheduler side reads it and the proxy writes it through this struct, so a key renamed on one side cannot
silently be missed on the other. Importing this module imports neither torch nor vLLM (the proxy uses it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpush.config import LOOPBACK, KVPushConfig
from kvpush.errors import ConfigError
from kvpush.protocol.wire import hmac_tag, tags_equal

_ENGINE_SUFFIX = re.compile(r"-[0-9A-Za-z]{8}$")
_PROMPT_INDEX = re.compile(r"^cmpl-.*-(\d+)$")


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=False):
    """kv_transfer_params as kvpush (and vLLM's NIXL connectors) use them.

    Prefill request: do_remote_decode. Decode request: do_remote_prefill plus where the prefill's KV side
    channel is (remote_engine_id, remote_host, remote_port, tp_size, pp_size). transfer_id: the router's
    dispatch id, sent to both engines, so two client requests with the same X-Request-Id never share a
    transfer key. decode_engine_id (prefill request): the decode engine the router dispatched the other
    leg to; the prefill then lets only that engine register for (or abort) the transfer, instead of
    whichever registers first. Unknown keys (another router's) are ignored when reading.

    pp_size: None when the router left it out (vllm-router forwards no pp_size). kvpush has no pipeline
    parallelism: a prefill refuses PP > 1 at start-up, so a prefill the decode can handshake with is PP 1
    and an omitted pp_size means 1; a pp_size other than 1 is refused here, by name.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    pp_size: int | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    transfer_id: str | None = None
    transfer_mode: str | None = None
    decode_engine_id: str | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> KVTransferParams:
        """Parse a request's kv_transfer_params; ValueError naming the bad field otherwise."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"kv_transfer_params must be a JSON object, got {type(raw).__name__}")
        # JSON null means "not set" for every field (vLLM's pull proxy sends remote_* as null).
        present = {k: v for k, v in raw.items() if v is not None}
        try:
            params = msgspec.convert(present, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid kv_transfer_params: {exc}") from None
        if params.pp_size is not None:
            check_pp_size(params.pp_size, "kv_transfer_params")
        return params

    def to_dict(self, sparse: bool = False) -> dict[str, Any]:
        """Every field (the shape vLLM's connectors expect), or only those not at their default."""
        out = msgspec.structs.asdict(self)
        if sparse:
            defaults = msgspec.structs.asdict(KVTransferParams())
            out = {k: v for k, v in out.items() if v != defaults[k]}
        return out

    def prefill_address_missing(self) -> list[str]:
        """The coordinates a decode request needs but lacks."""
        return [
            k for k in ("remote_engine_id", "remote_host", "remote_port") if getattr(self, k) in (None, "", 0)
        ]


def check_pp_size(pp_size: int, where: str) -> None:
    """Refuse pipeline parallelism by name wherever a peer's pp_size arrives (ValueError: the callers
    turn it into their own refusal: a request served without transfer, a 400, a ConfigError)."""
    if pp_size != 1:
        raise ValueError(
            f"{where}: pp_size={pp_size}, but kvpush does not support pipeline parallelism (a kvpush prefill "
            "runs with pp_size 1 and refuses more at start-up)"
        )


def transfer_key(internal_id: str, params: KVTransferParams) -> str:
    """The id both engines agree on for one request.

    With a router's transfer_id (kvpush's proxy sends a fresh one per dispatch) the key is that id, plus
    the prompt index for a completion with several prompts (vLLM names those "cmpl-<id>-<index>").
    Without one, the key is vLLM's internal id minus the 8 random characters each engine appends: the
    router sends the same X-Request-Id and route to both engines, so the rest is the same on both sides
    (and clients that reuse an X-Request-Id collide; the scheduler refuses the newcomer).
    """
    base = _ENGINE_SUFFIX.sub("", internal_id)
    if not params.transfer_id:
        return base
    m = _PROMPT_INDEX.match(base)
    return f"{params.transfer_id}-{m.group(1)}" if m else params.transfer_id


# kv_connector_extra_config keys that belong to the vLLM integration; everything else is KVPushConfig.
_OWN_KEYS = (
    "stats_dir",
    "prefill_addresses",
    "model_tag",
    "connect_timeout_s",
    "idle_wait_ms",
    "stream",
    "stream_layers",
    "arm_writes",
    "pairing_port",
    "pairing_host",
    "kv_cache_layout",
)

# The decode's pairing check (GET /kvpush/pairing?engine_id=&host=&port=...) makes it handshake with any
# host:port it is given: with a shared key, a request must carry this header, an HMAC of its method and
# target under a key derived from the shared one (a captured request can only repeat the same check).
PAIRING_HEADER = "X-KVPush-Pairing-Auth"
PAIRING_ROUTE = "/kvpush/pairing"  # the decode's pairing check (pairing.py)
RELEASE_ROUTE = "/kvpush/release"  # the proxy frees a left client's transfers (proxy/release.py)


def pairing_signature(key: bytes, target: str) -> str:
    """The header value for GET `target` (path and query, as sent)."""
    return hmac_tag(hmac_tag(key, b"kvpush-pairing"), b"GET", target.encode()).hex()


def pairing_signature_ok(key: bytes, target: str, header: str | None) -> bool:
    return header is not None and tags_equal(header.encode(), pairing_signature(key, target).encode())


# extra config "kv_cache_layout": what kvpush asks vLLM for. "auto" adapts to whatever the attention
# backend chose (both sides must agree; the handshake checks). "block-major" asks for a block-outermost
# cache (every layer's K and V of a block in one run), so a request moves as a few large descriptors.
KV_CACHE_LAYOUTS = {"auto": None, "block-major": "BLHNC", "BLHNC": "BLHNC", "BLNHC": "BLNHC"}


def required_kv_cache_layout(extra: Mapping[str, Any], platform_is_cpu: bool) -> str | None:
    """The vLLM KV cache layout name kvpush needs, from extra config (None: no requirement)."""
    asked = str(extra.get("kv_cache_layout") or "auto")
    if asked not in KV_CACHE_LAYOUTS:
        raise ConfigError(
            f"KVPushConnector: kv_cache_layout must be one of {sorted(KV_CACHE_LAYOUTS)}, got {asked!r}"
        )
    layout = KV_CACHE_LAYOUTS[asked]
    if layout is not None and platform_is_cpu:
        raise ConfigError(
            f"KVPushConnector: kv_cache_layout={asked!r} needs a block-outermost KV cache, which vLLM's CPU "
            "attention backend does not support (it only runs LBHNC); use kv_cache_layout='auto' on CPU"
        )
    return layout


# How long an engine with nothing to compute, waiting only on transfers, sleeps per step (a finished
# transfer wakes it at once; a new request waits at most this long). Decode waits through whole
# prefills; prefill only for its WRITEs to finish, and new prompts arrive there, so it naps briefly.
_IDLE_WAIT_MS = {"decode": 20.0, "prefill": 2.0}


@dataclass(frozen=True)
class PrefillAddressSpec:
    """One entry of extra config "prefill_addresses": a prefill the decode handshakes with at start-up."""

    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector reads from vLLM's config, validated once, in the facade's constructor."""

    role: str  # "prefill" | "decode"
    config: KVPushConfig
    block_size: int
    tp_size: int
    pp_size: int
    stats_dir: str = ""
    prefill_addresses: tuple[PrefillAddressSpec, ...] = ()
    model_tag: str = ""
    connect_timeout_s: float = 120.0
    idle_wait_s: float = 0.0
    pairing_port: int = 0
    pairing_host: str = "127.0.0.1"
    # Prefill: after each chunked-prefill step the prompt's complete blocks move (kvpush's kv_ready); the
    # thresholds are kvpush's stream_min_tokens / stream_min_bytes. Off by default (see README).
    stream: bool = False
    # Prefill: also report every `stream_layers` layers of each step as soon as the attention layers have
    # written them (save_kv_layer), so a chunk's first layers move while its last ones compute. 0 = off;
    # > 0 implies stream.
    stream_layers: int = 0
    # Prefill: name each prompt's blocks to kvpush before the forward pass that completes it
    # (PrefillEndpoint.source_blocks from bind_connector_metadata), so a registered decode's WRITE is made
    # while the model runs and the hand-off after it only posts. On by default.
    arm_writes: bool = True

    @property
    def is_producer(self) -> bool:
        return self.role == "prefill"

    @classmethod
    def from_extra(
        cls, role: str, engine_id: str, extra: Mapping[str, Any], block_size: int, tp_size: int, pp_size: int
    ) -> ConnectorSettings:
        own = {k: extra[k] for k in _OWN_KEYS if k in extra}
        core = {k: v for k, v in extra.items() if k not in _OWN_KEYS}
        core.setdefault("engine_id", engine_id)
        if isinstance(core.get("backends"), list):
            core["backends"] = tuple(core["backends"])
        config = KVPushConfig.from_mapping(core)
        idle_wait_ms = float(own.get("idle_wait_ms", _IDLE_WAIT_MS[role]))
        if idle_wait_ms < 0:
            raise ConfigError(f"KVPushConnector: idle_wait_ms must be >= 0, got {idle_wait_ms:g}")
        pairing_port = int(own.get("pairing_port") or 0)
        if not 0 <= pairing_port < 65536:
            raise ConfigError(f"KVPushConnector: pairing_port must be a TCP port, got {pairing_port}")
        pairing_host = str(own.get("pairing_host") or "127.0.0.1")
        if pairing_port and pairing_host not in LOOPBACK and config.security.hmac_key is None:
            raise ConfigError(
                f"KVPushConnector: pairing_host {pairing_host!r} is beyond loopback and no shared key is "
                "set: the pairing check makes this decode handshake with any address it is given, so it "
                "needs hmac_key_file (or $KVPUSH_HMAC_KEY) to authenticate its callers"
            )
        addresses: list[PrefillAddressSpec] = []
        for i, entry in enumerate(own.get("prefill_addresses") or ()):
            if not isinstance(entry, Mapping) or "engine_id" not in entry or "port" not in entry:
                raise ConfigError(
                    f"KVPushConnector: prefill_addresses[{i}] must be an object with engine_id and port "
                    f"(and optionally host, tp_size, pp_size), got {entry!r}"
                )
            try:
                check_pp_size(int(entry.get("pp_size", 1)), f"KVPushConnector: prefill_addresses[{i}]")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            addresses.append(
                PrefillAddressSpec(
                    str(entry["engine_id"]),
                    str(entry.get("host", "127.0.0.1")),
                    int(entry["port"]),
                    int(entry.get("tp_size", 1)),
                )
            )
        stream_layers = own.get("stream_layers", 0)
        if isinstance(stream_layers, bool) or not isinstance(stream_layers, int) or stream_layers < 0:
            raise ConfigError(
                f"KVPushConnector: stream_layers must be a whole number of layers >= 0, got {stream_layers!r}"
            )
        return cls(
            role=role,
            config=config,
            block_size=block_size,
            tp_size=tp_size,
            pp_size=pp_size,
            stats_dir=str(own.get("stats_dir") or ""),
            prefill_addresses=tuple(addresses),
            model_tag=str(own.get("model_tag") or ""),
            connect_timeout_s=float(own.get("connect_timeout_s", 120.0)),
            idle_wait_s=idle_wait_ms / 1000.0,
            pairing_port=pairing_port,
            pairing_host=pairing_host,
            stream=_flag(own.get("stream", False), "stream") or stream_layers > 0,
            stream_layers=stream_layers,
            arm_writes=_flag(own.get("arm_writes", True), "arm_writes"),
        )


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean (or its usual spellings) from kv_connector_extra_config."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"KVPushConnector: {name} must be true or false, got {value!r}")
