"""`kvpush cluster key`: copy the cluster's shared HMAC key from AWS Secrets Manager into a 0600 file.

terraform/ generates the key into a secret that only the cluster's node role may read; each node's
set-up runs this once, and scripts/serve_pd.sh hands the file's path (never the key) to the engines and
the proxy. The key is checked by the connector's own rules (base64, >= 16 bytes) before anything is
written, and the file is replaced in one rename, so a reader never sees half a key or a looser mode.
"""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path
from typing import Any

from kvpush.errors import ConfigError
from kvpush.keyfile import check_key_length, key_from_file

from .cluster_aws import ClusterError, aws_call

DEFAULT_KEY_FILE = "/etc/kvpush/hmac.key"  # scripts/serve_pd.sh's HMAC_KEY_FILE default
SECRET_ENV = "KVPUSH_HMAC_KEY_SECRET"  # node.env: the secret's ARN (the node set-up writes it)


def fetch_key(session: Any, secret_id: str) -> bytes:
    """The key in the secret's SecretString (base64), checked; the error never shows the value."""
    client = session.client("secretsmanager")
    answer = aws_call(session.region_name, client.get_secret_value, SecretId=secret_id)
    text = answer.get("SecretString")
    if not isinstance(text, str):
        raise ClusterError(f"secret {secret_id} has no SecretString (kvpush keeps the key as base64 text)")
    source = f"secret {secret_id}"
    try:
        key = base64.b64decode(text.strip(), validate=True)
        check_key_length(key, f"the key in {source}")
    except ConfigError as exc:
        raise ClusterError(str(exc)) from None
    except ValueError:
        raise ClusterError(f"{source} does not hold a base64 key") from None
    return key


def write_key_file(path: Path, key: bytes, owner: str | None = None) -> None:
    """Write `key` (base64) to `path`, mode 0600 (owned by `owner`, a user name, when given), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd, tmp = tempfile.mkstemp(prefix=".hmac-", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64encode(key) + b"\n")
            f.flush()
            os.fsync(f.fileno())
            if owner:
                import pwd

                entry = pwd.getpwnam(owner)
                os.fchown(f.fileno(), entry.pw_uid, entry.pw_gid)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if key_from_file(str(path)) != key:  # what the connector will read: the same rules, the same key
        raise ClusterError(f"{path} does not read back as the key just written")


def copy_key(session: Any, secret_id: str | None, output: Path, owner: str | None) -> str:
    """The whole action; returns the line to print (the path, never the key)."""
    if not secret_id:
        raise ClusterError(
            f"no secret: pass --secret-id (the stack's hmac_key_secret_arn output) or set {SECRET_ENV}"
        )
    try:
        write_key_file(output, fetch_key(session, secret_id), owner)
    except KeyError:
        raise ClusterError(f"no user {owner!r} to own {output}") from None
    except OSError as exc:
        raise ClusterError(f"cannot write {output}: {exc.strerror}") from None
    return f"wrote the shared key from {secret_id} to {output} (mode 600)"
