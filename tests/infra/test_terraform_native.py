"""`terraform validate` and `terraform test` (plan with a mocked AWS provider), when this machine has a
Terraform >= 1.7 and a local copy of the hashicorp/aws provider.

These go further than the tfparse checks: the AWS provider's own schema validates every argument, the
variables' validation blocks run, and the plan is computed by Terraform itself. They need no
credentials and no network, but the provider cannot be downloaded here (no registry access), so they
run only where a filesystem mirror exists: $KVPUSH_TF_PLUGIN_DIR, or /opt/tf-plugins. Otherwise they
skip, saying why. `terraform plan` against real AWS and `apply` are never run by the tests.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.infra.infra_tools import STACKS, TERRAFORM_DIR, run


def _terraform() -> str | None:
    candidates = [os.environ.get("KVPUSH_TERRAFORM"), shutil.which("terraform"), "/usr/local/bin/terraform"]
    for candidate in candidates:
        if not candidate or not Path(candidate).exists() or ".venv-infra" in candidate:
            continue
        version = re.search(r"Terraform v(\d+)\.(\d+)", run([candidate, "version"]).stdout)
        if version and (int(version[1]), int(version[2])) >= (1, 7):
            return candidate
    return None


def _plugin_dir() -> Path | None:
    root = Path(os.environ.get("KVPUSH_TF_PLUGIN_DIR", "/opt/tf-plugins"))
    aws = root / "registry.terraform.io" / "hashicorp" / "aws"
    if not aws.is_dir():
        return None
    for version in aws.iterdir():
        parts = tuple(int(p) for p in re.findall(r"\d+", version.name)[:2])
        if parts >= (5, 74) and parts < (7, 0):
            return root
    return None


TERRAFORM = _terraform()
PLUGINS = _plugin_dir()
pytestmark = pytest.mark.skipif(
    TERRAFORM is None or PLUGINS is None,
    reason="needs Terraform >= 1.7 and a local hashicorp/aws provider (>= 5.74) mirror "
    "($KVPUSH_TF_PLUGIN_DIR or /opt/tf-plugins); the registry is not reachable from here",
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    root = tmp_path_factory.mktemp("tf")
    shutil.copytree(TERRAFORM_DIR, root / "terraform", ignore=shutil.ignore_patterns(".terraform*"))
    env = {"TF_PLUGIN_CACHE_DIR": str(root / "plugin-cache"), "TF_IN_AUTOMATION": "1"}
    (root / "plugin-cache").mkdir()
    yield root / "terraform", env


def _init(folder: Path, env: dict[str, str]) -> None:
    assert TERRAFORM and PLUGINS
    proc = run(
        [TERRAFORM, "init", "-backend=false", "-input=false", "-no-color", f"-plugin-dir={PLUGINS}"],
        cwd=folder,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("stack", STACKS)
def test_terraform_validate(workdir: tuple[Path, dict[str, str]], stack: str) -> None:
    root, env = workdir
    folder = root / "stacks" / stack
    _init(folder, env)
    proc = run([TERRAFORM or "terraform", "validate", "-no-color"], cwd=folder, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_terraform_test_on_the_module(workdir: tuple[Path, dict[str, str]]) -> None:
    root, env = workdir
    folder = root / "modules" / "efa-cluster"
    _init(folder, env)
    proc = run([TERRAFORM or "terraform", "test", "-no-color"], cwd=folder, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = re.search(r"(\d+) passed, (\d+) failed", proc.stdout)
    assert summary and int(summary[1]) >= 7 and summary[2] == "0", proc.stdout
