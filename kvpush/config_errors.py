"""Config errors that name the key as the caller wrote it (flat, nested or a typo of either)."""

from __future__ import annotations

import difflib
import re

import msgspec

from .errors import ConfigError


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ConfigError(f"invalid kvpush config: unknown field `{key}`{hint}")


_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def _named(exc: msgspec.ValidationError, origin: dict[tuple[str, str], str]) -> ConfigError:
    """msgspec's message with its `$.group.field` path replaced by the key the caller wrote."""
    text = str(exc)
    if isinstance(exc.__cause__, ConfigError) or isinstance(exc.__context__, ConfigError):
        return ConfigError(f"invalid kvpush config: {_AT.sub('', text)}")
    m = _AT.search(text)
    if not m:
        return ConfigError(f"invalid kvpush config: {text}")
    path = m.group(1)
    group, _, rest = path.partition(".")
    name = re.match(r"\w*", rest)
    field = name.group(0) if name else ""
    key = origin.get((group, field), path)
    tail = rest[len(field) :] if (group, field) in origin else ""
    return ConfigError(f"invalid kvpush config: `{key}{tail}`: {text[: m.start()]}")
