"""One typed configuration object for both sides, in groups.

`KVPushConfig` holds the engine id and one frozen group per concern (side channel, NIXL, leases, liveness,
pacing, posting, security, limits, metrics), each checking its own fields when built, the way an HTTP
client takes separate timeout and limits objects. Rules that span groups are named methods on
`KVPushConfig`.

Deployments write flat keys (vLLM's kv_connector_extra_config JSON: {"port": 5600, "lease_s": 60}), so
`from_mapping` and `replace` take every flat key as well as the nested form ({"leases": {"lease_s": 60}});
an unknown key, a wrong type or a key given both ways fails at start-up with a message naming the key,
rather than being silently ignored. docs/config.md lists every key (scripts/config_doc.py writes it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from .config_errors import _named, _unknown, check_values
from .config_groups import (
    LOOPBACK,
    REDACTED,
    WILDCARDS,
    BackendParams,
    Leases,
    Limits,
    Liveness,
    Metrics,
    Nixl,
    Pacing,
    Posting,
    Security,
    SideChannel,
    Streaming,
    _Group,
)
from .errors import ConfigError
from .keyfile import KEY_ENV, MIN_KEY_BYTES, key_from_file_or_env, merge_env_key

__all__ = [
    "BACKENDS",
    "DEFAULT_ENGINE_ID",
    "FLAT_KEYS",
    "GROUPS",
    "KEY_ENV",
    "LOOPBACK",
    "MIN_KEY_BYTES",
    "REDACTED",
    "WILDCARDS",
    "BackendParams",
    "ConfigError",
    "KVPushConfig",
    "Leases",
    "Limits",
    "Liveness",
    "Metrics",
    "Nixl",
    "Pacing",
    "Posting",
    "Security",
    "SideChannel",
    "Streaming",
    "key_from_file_or_env",
]


# the engine id a config gets when none is given: fine for one engine on loopback, a collision beyond it
DEFAULT_ENGINE_ID = "kvpush"
# the NIXL backends kvpush's transport creates and checks (transport/nixl.py, `kvpush doctor`)
BACKENDS = ("UCX", "LIBFABRIC")


def _group(cls: type[_Group]) -> Any:
    return msgspec.field(default_factory=cls)


class _FlatKeywords(msgspec.StructMeta):
    """Lets `KVPushConfig(port=5601, hmac_key=...)` keep working: flat keywords (and groups given as dicts)
    are sorted into their groups before the Struct is built. msgspec's own paths (convert, replace) do not
    call this, so it is the constructor only. Typed code should pass groups; mypy knows only those."""

    def __call__(cls, **kwargs: Any) -> Any:
        if all(k == "engine_id" or isinstance(v, GROUPS.get(k, ())) for k, v in kwargs.items()):
            return super().__call__(**kwargs)
        # flat keys go through msgspec like from_mapping (strictly: no "5600" for a port), so a wrong
        # type is named by its key instead of failing later as a bare TypeError
        nested, origin = _nest(kwargs)
        try:
            return msgspec.convert(nested, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise _named(exc, origin) from exc


class KVPushConfig(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, metaclass=_FlatKeywords
):
    """The engine's id and one group per concern; the constructor, `from_mapping` and `replace` also
    take today's flat keys (`port=5601` for `side_channel=SideChannel(port=5601)`)."""

    engine_id: str = "kvpush"
    side_channel: SideChannel = _group(SideChannel)
    nixl: Nixl = _group(Nixl)
    leases: Leases = _group(Leases)
    liveness: Liveness = _group(Liveness)
    pacing: Pacing = _group(Pacing)
    posting: Posting = _group(Posting)
    streaming: Streaming = _group(Streaming)
    security: Security = _group(Security)
    limits: Limits = _group(Limits)
    metrics: Metrics = _group(Metrics)

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError(f"engine_id must be a non-empty string, got {self.engine_id!r}")
        check_values(self, GROUPS, _RENAMED, BACKENDS)

    def check_listen(self) -> None:
        """Before a prefill listens: an address decodes can reach is known, and beyond loopback
        authentication is required unless switched off and the engine has its own id."""
        self.side_channel.advertised  # noqa: B018 (refuses a wildcard with nothing to advertise)
        if self.auth_required and self.security.hmac_key is None:
            raise ConfigError(
                f"a prefill listening on {self.side_channel.host!r} (beyond loopback) requires "
                "authentication, and no hmac_key is set: set the same key (>= 16 bytes) on both sides, or "
                "require_auth=False to run unauthenticated on purpose"
            )
        if self.engine_id == DEFAULT_ENGINE_ID and self.side_channel.host not in LOOPBACK:
            raise ConfigError(
                f"a prefill listening on {self.side_channel.host!r} (beyond loopback) needs its own `engine_id` "
                f"(it is the default {DEFAULT_ENGINE_ID!r}): decodes, allow-lists and metrics tell prefills "
                "apart by it, and two engines with the default collide"
            )

    @property
    def auth_required(self) -> bool:
        if self.security.require_auth is not None:
            return self.security.require_auth
        return self.side_channel.host not in LOOPBACK

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> KVPushConfig:
        """Build from flat keys, nested groups or both (JSON types are converted, e.g. base64 to bytes).
        The one place the environment is read: $KVPUSH_HMAC_KEY in `environ` is the shared key (pass {}
        to ignore it); the constructor and `replace` hold only what they are given."""
        nested, origin = _nest(data)
        merge_env_key(nested.setdefault("security", {}), environ)
        try:
            return msgspec.convert(nested, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise _named(exc, origin) from exc

    def replace(self, **changes: Any) -> KVPushConfig:
        """A copy with `changes` (flat keys, group names or both) applied; every changed group is checked."""
        nested, _ = _nest(changes)
        fields: dict[str, Any] = {}
        for name, value in nested.items():
            if name in GROUPS and isinstance(value, dict):
                fields[name] = msgspec.structs.replace(getattr(self, name), **value)
            else:
                fields[name] = value
        return msgspec.structs.replace(self, **fields)


GROUPS: dict[str, type[_Group]] = {
    f.name: f.type for f in msgspec.structs.fields(KVPushConfig) if f.name != "engine_id"
}

# Flat keys whose name is not the field's name in its group (the group name would repeat in the field).
_RENAMED = {
    ("posting", "workers"): "post_workers",
    ("posting", "nudge"): "posted_nudge",
    ("streaming", "min_tokens"): "stream_min_tokens",
    ("streaming", "min_bytes"): "stream_min_bytes",
    ("metrics", "port"): "metrics_port",
    ("metrics", "host"): "metrics_host",
}

# flat key (kv_connector_extra_config) -> (group, field)
FLAT_KEYS: dict[str, tuple[str, str]] = {
    _RENAMED.get((group, f.name), f.name): (group, f.name)
    for group, cls in GROUPS.items()
    for f in msgspec.structs.fields(cls)
}
assert len(FLAT_KEYS) == sum(len(msgspec.structs.fields(c)) for c in GROUPS.values()), "flat keys collide"
assert not set(FLAT_KEYS) & {*GROUPS, "engine_id"}, "a flat key shadows a group"


def _nest(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """Flat and nested keys to the nested form, and each (group, field) -> the key as the caller wrote it.

    A group given as an instance counts as setting each of its fields; a field set twice (flat and
    nested, or by a whole group and a flat key) is refused rather than letting one silently win.
    """
    nested: dict[str, Any] = {}
    origin: dict[tuple[str, str], str] = {}

    def put(group: str, name: str, value: Any, key: str) -> None:
        if (group, name) in origin:
            raise ConfigError(
                f"invalid kvpush config: `{key}` and `{origin[group, name]}` both set {group}.{name}; give it once"
            )
        origin[group, name] = key
        nested.setdefault(group, {})[name] = value

    for key, value in data.items():
        if key == "engine_id":
            nested[key] = value
        elif key in FLAT_KEYS:
            put(*FLAT_KEYS[key], value, key)
        elif key in GROUPS:
            cls = GROUPS[key]
            if isinstance(value, cls):
                for f in msgspec.structs.fields(cls):
                    put(key, f.name, getattr(value, f.name), f"{key}={cls.__name__}(...)")
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"invalid kvpush config: `{key}` must be an object of {cls.__name__} fields"
                )
            names = [f.name for f in msgspec.structs.fields(cls)]
            for name, item in value.items():
                if name not in names:
                    raise _unknown(f"{key}.{name}", [f"{key}.{n}" for n in names])
                put(key, name, item, f"{key}.{name}")
        else:
            raise _unknown(str(key), [*FLAT_KEYS, *GROUPS, "engine_id"])
    return nested, origin
