"""One release identity everywhere: pyproject's version, the code's `__version__`, CHANGELOG's newest
release (and the wire version it names), `kvpush --version` and the tag Terraform's examples pin agree;
the NIXL pin admits only tested versions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

import kvpush
from kvpush.apps import versions
from kvpush.protocol.wire import WIRE_VERSION

ROOT = Path(__file__).resolve().parents[1]
TESTED_NIXL = ("1.3.2", "1.5.1")


def _pyproject() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _newest_release() -> tuple[str, int]:
    """The first `## X.Y.Z ... wire protocol vN` heading (an `Unreleased` section above it is skipped)."""
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        m = re.match(r"^## (\d+\.\d+\.\d+)\b.*wire protocol v(\d+)", line)
        if m:
            return m.group(1), int(m.group(2))
    raise AssertionError("CHANGELOG.md has no '## X.Y.Z - ... - wire protocol vN' heading")


def test_version_changelog_cli_and_terraform_agree() -> None:
    version = _pyproject()["project"]["version"]
    assert kvpush.__version__ == version
    released, wire = _newest_release()
    assert released == version, f"CHANGELOG's newest release is {released}, pyproject says {version}"
    low, high = versions.wire_versions()
    assert wire == high == WIRE_VERSION, f"CHANGELOG {version} names wire v{wire}; the code speaks v{high}"
    out = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith(f"kvpush {version} (wire protocol v"), out
    assert f"v{WIRE_VERSION}" in out and "NIXL " in out and "vLLM " in out, out
    pins = {
        path.relative_to(ROOT).as_posix(): m.group(1)
        for path in sorted((ROOT / "terraform").rglob("*"))
        if path.suffix in (".example", ".hcl", ".tfvars")
        # the first pin in a file is its example (a .tftest.hcl's later runs try refused values)
        for m in [re.search(r'kvpush_ref\s*=\s*"([^"]+)"', path.read_text())]
        if m
    }
    assert pins, "no kvpush_ref pin in terraform's examples"
    assert set(pins.values()) == {f"v{version}"}, pins


def test_version_imports_neither_nixl_nor_vllm() -> None:
    code = (
        "import sys; from kvpush import cli; cli.version_text(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nixl', 'vllm', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_nixl_pin_admits_only_tested_versions() -> None:
    from packaging.requirements import Requirement

    [nixl] = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["nixl"]]
    assert nixl.name == "nixl"
    admitted = {
        v for v in ("1.3.2", "1.5.0", "1.5.1", "1.5.2", "1.6.0", "2.0.0") if nixl.specifier.contains(v)
    }
    assert admitted and admitted <= set(TESTED_NIXL), f"{nixl} admits untested {admitted - set(TESTED_NIXL)}"


def test_the_release_check_runs_in_ci() -> None:
    text = (ROOT / "mk" / "release.mk").read_text()
    assert "TEST_DEPS += release-check" in text
    assert "python -m build" in text and "twine check" in text
