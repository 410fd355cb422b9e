"""Finding the offline infrastructure tools, and running them.

The tools live in .venv-infra (built by `make infra-tools`, see mk/infra.mk) because checkov's pins clash
with the main virtualenv. A missing tool fails the test that needs it, with the command that installs it;
KVPUSH_SKIP_INFRA=1 turns that failure into a skip (for a machine that cannot build .venv-infra).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = ROOT / "terraform"
STACKS = ("p5en", "trn2", "trn1")
MODULE_DIR = TERRAFORM_DIR / "modules" / "efa-cluster"
POLICY_DIR = TERRAFORM_DIR / "policies"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
INFRA_BIN = Path(os.environ.get("KVPUSH_INFRA_VENV", ROOT / ".venv-infra")) / "bin"
SCRIPTS = ("serve_pd.sh", "run_sweep.sh", "cleanup.sh", "plot_push_vs_pull.sh")


def _missing(what: str) -> None:
    message = f"{what} is missing: run `make infra-tools` (or `make test`, which does)"
    if os.environ.get("KVPUSH_SKIP_INFRA") == "1":
        pytest.skip(f"{message}; skipped because KVPUSH_SKIP_INFRA=1")
    pytest.fail(message, pytrace=False)


def infra_tool(name: str) -> str:
    path = INFRA_BIN / name
    if not path.exists():
        _missing(str(path))
    return str(path)


# Terraform versions the stacks accept (their required_version), and the oldest that fmt should be
# run with for the formatting to be what `terraform fmt` gives an operator on an accepted version.
TERRAFORM_MIN = (1, 3, 0)


def terraform_version(path: str) -> tuple[int, ...] | None:
    found = re.search(r"Terraform v(\d+)\.(\d+)\.(\d+)", run([path, "version"]).stdout)
    return tuple(int(x) for x in found.groups()) if found else None


def fmt_terraform() -> tuple[str, tuple[int, ...] | None]:
    """The Terraform to run `fmt` with: the first of $KVPUSH_TERRAFORM, `terraform` on PATH and
    /usr/local/bin/terraform that is >= 1.3.0; otherwise the PyPI 1.0.3 of .venv-infra (then
    test_fmt_terraform_is_one_the_stacks_accept skips, saying so)."""
    for candidate in (
        os.environ.get("KVPUSH_TERRAFORM"),
        shutil.which("terraform"),
        "/usr/local/bin/terraform",
    ):
        if candidate and Path(candidate).exists() and ".venv-infra" not in candidate:
            version = terraform_version(candidate)
            if version and version >= TERRAFORM_MIN:
                return candidate, version
    fallback = infra_tool("terraform")
    return fallback, terraform_version(fallback)


def python_dep(name: str) -> ModuleType:
    """A Python dependency of the infra extra (boto3, moto, tfparse) from the main virtualenv."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"python package {name} is missing: pip install -e '.[infra]'"
        if os.environ.get("KVPUSH_SKIP_INFRA") == "1":
            pytest.skip(f"{message}; skipped because KVPUSH_SKIP_INFRA=1")
        pytest.fail(message, pytrace=False)


def run(
    cmd: list[str],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "TF_CLI_CONFIG_FILE": "/dev/null", "CHECKPOINT_DISABLE": "1", **(env or {})}
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        input=input_text,
    )


def load_config(path: Path, tfvars: Path | None = None) -> dict[str, Any]:
    """tfparse's evaluation of a Terraform root module; any HCL error raises tfparse.ParseError."""
    tfparse = python_dep("tfparse")
    vars_paths = [os.path.relpath(tfvars, path)] if tfvars else None
    result: dict[str, Any] = tfparse.load_from_path(str(path), stop_on_hcl_error=True, vars_paths=vars_paths)
    return result


def load_stack(name: str) -> dict[str, Any]:
    stack = TERRAFORM_DIR / "stacks" / name
    return load_config(stack, stack / "terraform.tfvars.example")


def module_locals(config: dict[str, Any], module: str = "module.cluster") -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for block in config.get("locals", []):
        if block["__tfmeta"]["path"] == f"{module}.locals":
            merged.update({k: v for k, v in block.items() if k not in ("__tfmeta", "id")})
    return merged


def render_template(template: Path, variables: dict[str, Any]) -> str:
    """Render a Terraform template with terraform's own templatefile() (terraform console: no provider,
    no network)."""
    terraform = infra_tool("terraform")
    expression = f"base64encode(templatefile({json.dumps(str(template))}, {json.dumps(variables)}))\n"
    with tempfile.TemporaryDirectory() as workdir:
        proc = run([terraform, "console"], cwd=Path(workdir), input_text=expression, timeout=60)
    assert proc.returncode == 0, f"terraform console failed: {proc.stderr}"
    return base64.b64decode(proc.stdout.strip().strip('"')).decode()


def run_checkov(directory: Path) -> dict[str, Any]:
    """checkov with terraform/policies/checkov.yaml on one folder, as JSON. checkov exits 0 when it
    cannot parse a file, so a parsing error is turned into a failure here."""
    checkov = infra_tool("checkov")
    proc = run(
        [
            checkov,
            "--config-file",
            str(POLICY_DIR / "checkov.yaml"),
            "-d",
            str(directory),
            "--external-checks-dir",
            str(POLICY_DIR),
            "-o",
            "json",
        ],
        cwd=ROOT,
        env={"BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "ERROR"},
        timeout=300,
    )
    if not proc.stdout.strip().startswith(("{", "[")):
        raise AssertionError(f"checkov printed no JSON (exit {proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    terraform_reports = [r for r in reports if r.get("check_type") == "terraform"]
    if not terraform_reports:
        raise AssertionError(f"checkov found no Terraform to check in {directory}")
    result: dict[str, Any] = terraform_reports[0]
    parsing_errors = result.get("summary", {}).get("parsing_errors", 0)
    if parsing_errors:
        raise AssertionError(
            f"checkov could not parse {parsing_errors} file(s) in {directory}: "
            f"{result['results'].get('parsing_errors')}"
        )
    return result
