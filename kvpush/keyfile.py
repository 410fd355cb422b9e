"""Where a shared key comes from when it is not in the config itself: a file (base64, not readable by every
user) or the environment variable KVPUSH_HMAC_KEY (base64), never both; the same rules for every holder of
the key (the endpoints' config, the vLLM connector, `kvpush proxy --hmac-key-file`)."""

from __future__ import annotations

import base64
import binascii
import os
import stat

from .errors import ConfigError

KEY_ENV = "KVPUSH_HMAC_KEY"  # the environment variable that may hold the shared key (base64)


def _decode_key(text: str, source: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(
            f"{source} does not hold a base64 key (write one with `openssl rand -base64 32`)"
        ) from None


def key_from_file_or_env(path: str | None) -> tuple[bytes | None, str]:
    """The key from hmac_key_file or $KVPUSH_HMAC_KEY (never both) and where it came from; the same rules
    for every holder of the key (the connector's config, `kvpush proxy --hmac-key-file`)."""
    env = os.environ.get(KEY_ENV)
    if path is not None and env is not None:
        raise ConfigError(f"hmac_key_file and ${KEY_ENV} both give a key; give it once")
    if env is not None:
        return _decode_key(env, f"${KEY_ENV}"), f"${KEY_ENV}"
    if path is None:
        return None, ""
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
        return _decode_key(text.decode("ascii"), source), source
    except UnicodeDecodeError:
        raise ConfigError(
            f"{source} does not hold a base64 key (write one with `openssl rand -base64 32`)"
        ) from None
