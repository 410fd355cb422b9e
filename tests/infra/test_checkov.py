"""checkov with terraform/policies/checkov.yaml: green on terraform/, red on the broken fixture."""

from __future__ import annotations

import pytest

from tests.infra.infra_tools import FIXTURES, POLICY_DIR, TERRAFORM_DIR, run_checkov

CUSTOM = {f"CKV2_KVPUSH_{n}" for n in range(1, 6)}


def test_policies_have_unique_ids() -> None:
    ids = [
        line.split('"')[1]
        for path in POLICY_DIR.glob("*.yaml")
        if path.name != "checkov.yaml"
        for line in path.read_text().splitlines()
        if line.strip().startswith("id:")
    ]
    assert sorted(ids) == sorted(CUSTOM)


def test_checkov_passes_on_terraform() -> None:
    report = run_checkov(TERRAFORM_DIR)
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert failed == []
    passed = {c["check_id"] for c in report["results"]["passed_checks"]}
    assert passed >= CUSTOM, f"custom policies that never ran: {CUSTOM - passed}"


def test_checkov_fails_the_broken_fixture() -> None:
    report = run_checkov(FIXTURES / "broken")
    failed = {c["check_id"] for c in report["results"]["failed_checks"]}
    assert failed >= CUSTOM
    assert "CKV_AWS_24" in failed  # SSH from 0.0.0.0/0


def test_checkov_wrapper_turns_parse_errors_into_failures() -> None:
    with pytest.raises(AssertionError, match="could not parse|no Terraform"):
        run_checkov(FIXTURES / "syntax_error")
