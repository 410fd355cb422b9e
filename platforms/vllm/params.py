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
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvpush.config import DEFAULT_ENGINE_ID, LOOPBACK, KVPushConfig
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


# kv_connector_extra_config keys that belong to the vLLM integration (ConnectorKeys); the rest is KVPushConfig.
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


class PrefillAddressSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of extra config "prefill_addresses": a prefill the decode handshakes with at start-up.
    Checked when read (msgspec): an unknown key, a port outside 1..65535 or a TP size below 1 is refused
    with its place (`prefill_addresses[0].port`)."""

    engine_id: Annotated[str, Meta(min_length=1)]
    host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    tp_size: Annotated[int, Meta(ge=1)] = 1
    pp_size: Annotated[int, Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        if self.port == 0:
            raise ValueError("port is required: the prefill's side-channel port (1..65535)")
        check_pp_size(self.pp_size, "pp_size")


class ConnectorKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The connector's own keys in kv_connector_extra_config, typed and checked the way KVPushConfig
    checks its keys (msgspec): a wrong type or value fails naming the key, an unknown key is refused (it
    would be taken for a KVPushConfig key and refused there). JSON null means "not set"."""

    stats_dir: str = ""
    prefill_addresses: tuple[PrefillAddressSpec, ...] = ()
    model_tag: str = ""
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    idle_wait_ms: Annotated[float, Meta(ge=0)] | None = None
    stream: bool = False
    stream_layers: Annotated[int, Meta(ge=0)] = 0
    arm_writes: bool = True
    pairing_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    pairing_host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    kv_cache_layout: str = "auto"

    @classmethod
    def read(cls, own: Mapping[str, Any]) -> ConnectorKeys:
        present = {k: v for k, v in own.items() if v is not None}
        try:  # strict: JSON gives typed values; "4" for a layer count is a mistake, not a number
            return msgspec.convert(present, cls, strict=True)
        except msgspec.ValidationError as exc:
            text = str(exc)
            m = _AT.search(text)
            where = f"`{m.group(1)}`: " if m else ""
            raise ConfigError(
                f"KVPushConnector: invalid kv_connector_extra_config: {where}{text[: m.start()] if m else text}"
            ) from None


_OWN_KEYS = tuple(f.name for f in msgspec.structs.fields(ConnectorKeys))
_AT = re.compile(r" - at `\$\.?([^`]*)`$")


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
        own = ConnectorKeys.read({k: extra[k] for k in _OWN_KEYS if k in extra})
        core = {k: v for k, v in extra.items() if k not in _OWN_KEYS}
        core.setdefault("engine_id", engine_id)
        if isinstance(core.get("backends"), list):
            core["backends"] = tuple(core["backends"])
        config = KVPushConfig.from_mapping(core)
        idle_wait_ms = _IDLE_WAIT_MS[role] if own.idle_wait_ms is None else own.idle_wait_ms
        if own.pairing_port and own.pairing_host not in LOOPBACK and config.security.hmac_key is None:
            raise ConfigError(
                f"KVPushConnector: pairing_host {own.pairing_host!r} is beyond loopback and no shared key is "
                "set: the pairing check makes this decode handshake with any address it is given, so it "
                "needs hmac_key_file (or $KVPUSH_HMAC_KEY) to authenticate its callers"
            )
        if (
            role == "decode"
            and config.engine_id == DEFAULT_ENGINE_ID
            and (own.pairing_port or any(a.host not in LOOPBACK for a in own.prefill_addresses))
        ):
            raise ConfigError(
                f"KVPushConnector: engine_id is the default {DEFAULT_ENGINE_ID!r}: a decode that pairs (pairing_port) "
                "or reaches prefills beyond loopback needs its own engine_id (a prefill binds each decode by "
                "it; two decodes with the default would collide)"
            )
        return cls(
            role=role,
            config=config,
            block_size=block_size,
            tp_size=tp_size,
            pp_size=pp_size,
            stats_dir=own.stats_dir,
            prefill_addresses=own.prefill_addresses,
            model_tag=own.model_tag,
            connect_timeout_s=own.connect_timeout_s,
            idle_wait_s=idle_wait_ms / 1000.0,
            pairing_port=own.pairing_port,
            pairing_host=own.pairing_host,
            stream=own.stream or own.stream_layers > 0,
            stream_layers=own.stream_layers,
            arm_writes=own.arm_writes,
        )
