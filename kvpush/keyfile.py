"""Where a shared key comes from when it is not in the config itself: a file (base64, not readable by every
user) or the environment variable KVPUSH_HMAC_KEY (base64), never both; the same rules for every holder of
the key (the endpoints' config, the vLLM connector, `kvpush proxy --hmac-key-file`).

The environment is read only where a caller hands it in (`KVPushConfig.from_mapping`, the proxy's flags),
never by a constructor: a config built in code holds exactly what it was given.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

KEY_ENV = "KVPUSH_HMAC_KEY"  # the environment variable that may hold the shared key (base64)
MIN_KEY_BYTES = 16  # as kvpush.protocol.handshake.MIN_KEY_BYTES (config must not import the protocol)


def _decode_key(text: str, source: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(
            f"{source} does not hold a base64 key (write one with `openssl rand -base64 32`)"
        ) from None


def check_key_length(key: bytes, source: str) -> None:
    """Refuse an empty or short key, naming where it came from (the key itself is never shown)."""
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{source} is {len(key)} bytes; a shared key needs at least {MIN_KEY_BYTES} (e.g. 32 random "
            "bytes: `openssl rand -base64 32`); an empty or short key is refused"
        )


def key_from_env(environ: Mapping[str, str]) -> bytes | None:
    """The key in environ[$KVPUSH_HMAC_KEY], checked, or None when the variable is not set."""
    text = environ.get(KEY_ENV)
    if text is None:
        return None
    key = _decode_key(text, f"${KEY_ENV}")
    check_key_length(key, f"the key in ${KEY_ENV}")
    return key


def key_from_file(path: str) -> bytes:
    """The key in the file at `path`, refused by name if unreadable, readable by every user or not base64."""
    source = f"hmac_key_file {path!r}"
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(4096)
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read: {exc.strerror}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(
            f"{source} is readable or writable by every user (mode {stat.S_IMODE(mode):o}): "
            f"`chmod 600 {path}` (or 640 for a group)"
        )
    try:
        return _decode_key(text.decode("ascii"), source)
    except UnicodeDecodeError:
        raise ConfigError(
            f"{source} does not hold a base64 key (write one with `openssl rand -base64 32`)"
        ) from None


def key_from_file_or_env(path: str | None, environ: Mapping[str, str]) -> tuple[bytes | None, str]:
    """The key from hmac_key_file or $KVPUSH_HMAC_KEY in `environ` (never both) and where it came from
    (`kvpush proxy --hmac-key-file`)."""
    if path is not None and KEY_ENV in environ:
        raise ConfigError(f"hmac_key_file and ${KEY_ENV} both give a key; give it once")
    if path is None:
        key = key_from_env(environ)
        return key, (f"${KEY_ENV}" if key is not None else "")
    key = key_from_file(path)
    check_key_length(key, f"the key in hmac_key_file {path!r}")
    return key, f"hmac_key_file {path!r}"


def resolve_key(key: bytes | None, path: str | None) -> bytes | None:
    """A Security group's key: `key`, or the one in the file at `path` (both only if the same), checked."""
    source = "hmac_key"
    if path is not None:
        loaded = key_from_file(path)
        if key is not None and key != loaded:
            raise ConfigError(f"hmac_key and hmac_key_file {path!r} both give a key; give it once")
        key, source = loaded, f"the key in hmac_key_file {path!r}"
    if key is not None:
        check_key_length(key, source)
    return key


def merge_env_key(security: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Put $KVPUSH_HMAC_KEY from `environ` into a config's nested security fields, refusing a second
    source (hmac_key or hmac_key_file) by name."""
    key = key_from_env(environ)
    if key is None:
        return
    for field in ("hmac_key_file", "hmac_key"):
        if security.get(field) is not None:
            raise ConfigError(f"{field} and ${KEY_ENV} both give a key; give it once")
    security["hmac_key"] = key
