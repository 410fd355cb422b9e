"""Config errors that name the key as the caller wrote it (flat, nested or a typo of either)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from .errors import ConfigError


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ConfigError(f"invalid kvpush config: unknown field `{key}`{hint}")


PREFIX = "invalid kvpush config: "
# one encoding for a key given as text, wherever it is given
KEY_ENCODING = (
    "a key given as text is read as base64 everywhere: KVPushConfig(hmac_key=...), JSON, hmac_key_file and "
    "$KVPUSH_HMAC_KEY (`openssl rand -base64 32`); pass bytes for a raw key"
)
_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def _named(exc: msgspec.ValidationError, origin: dict[tuple[str, str], str]) -> ConfigError:
    """msgspec's message with its `$.group.field` path replaced by the key the caller wrote."""
    text = str(exc)
    if isinstance(exc.__cause__, ConfigError) or isinstance(exc.__context__, ConfigError):
        return ConfigError(f"{PREFIX}{_AT.sub('', text).removeprefix(PREFIX)}")
    m = _AT.search(text)
    if not m:
        return ConfigError(f"invalid kvpush config: {text}")
    path = m.group(1)
    group, _, rest = path.partition(".")
    name = re.match(r"\w*", rest)
    field = name.group(0) if name else ""
    key = origin.get((group, field), path)
    tail = rest[len(field) :] if (group, field) in origin else ""
    why = f" ({KEY_ENCODING})" if "base64" in text and field == "hmac_key" else ""
    return ConfigError(f"invalid kvpush config: `{key}{tail}`: {text[: m.start()]}{why}")


def _type_named(group: msgspec.Struct, prefix: str, renamed: dict[tuple[str, str], str]) -> None:
    """A group built directly (`SideChannel(port="5600")`) is not type-checked by msgspec: check it here,
    naming the flat key, so a wrong type is not a bare TypeError (or worse, accepted)."""
    try:
        msgspec.convert(msgspec.structs.asdict(group), type(group), strict=True)
    except msgspec.ValidationError as exc:
        m = _AT.search(str(exc))
        field = m.group(1).split(".")[0].split("[")[0] if m else ""
        key = renamed.get((prefix, field), field)
        raise ConfigError(f"invalid kvpush config: `{key}`: {str(exc)[: m.start()] if m else exc}") from None
    except ConfigError:
        pass  # a value error the group's own check reports; its type was fine


def check_values(
    config: Any, groups: Iterable[str], renamed: dict[tuple[str, str], str], backends: tuple[str, ...]
) -> None:
    """Rules the groups do not hold themselves, checked when a KVPushConfig is built (not at start()):
    types, the metrics port's range and the NIXL backend names. Each error names the key."""
    for name in groups:
        _type_named(getattr(config, name), name, renamed)
    port = config.metrics.port
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"`metrics_port` {port} is not a TCP port (0..65535, or null: off)")
    unknown = [b for b in config.nixl.backends if b not in backends]
    if unknown:
        raise ConfigError(
            f"`backends` names {unknown}, which kvpush does not create; "
            f"choose from {list(backends)} (upper case, as NIXL names them)"
        )
