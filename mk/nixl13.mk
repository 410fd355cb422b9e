# NIXL 1.3.2 (the Neuron DLAMI 2.32 vLLM venv's NIXL, issue 18): a second virtualenv with the same kvpush
# (editable, test extras, no vLLM) and nixl 1.3.2 in place of 1.5.1, running the tests that use real NIXL.
# nixl 1.3.x takes no strided (N x 5) descriptor lists; kvpush probes that at agent creation and expands
# prepared lists to one descriptor per unit there (kvpush/transport/nixl.py strided_lists_supported). Order:
# torch first (the CPU build, as in the main venv: Makefile torch_first; nixl-cu13 requires a torch), kvpush
# with its pinned NIXL, then nixl and nixl-cu13 1.3.2 without dependencies (the pin in pyproject.toml would
# refuse them), and nixl-cu12 removed (the 1.5.1 meta package pulls it; a CPU torch would otherwise load
# either). About 3 minutes of tests on a 2-core machine (e2e endpoint tests, the demo and the 128k-token
# prompt).

NIXL13_VENV := .venv-nixl13
NIXL13_BIN := $(NIXL13_VENV)/bin
NIXL13_STAMP := $(NIXL13_VENV)/.installed-v1
NIXL13_TESTS := tests/endpoint tests/e2e/test_demo_nixl.py tests/e2e/test_long_prompt_nixl.py

TEST_DEPS += nixl13-test
TEST_VENVS += $(NIXL13_STAMP)

.PHONY: nixl13-venv nixl13-test nixl13-clean

nixl13-venv: $(NIXL13_STAMP)

$(NIXL13_STAMP): mk/nixl13.mk pyproject.toml
	test -d $(NIXL13_VENV) || $(PY) -m venv $(NIXL13_VENV)
	$(NIXL13_BIN)/pip install -q --upgrade pip
	$(call torch_first,$(NIXL13_BIN))
	$(NIXL13_BIN)/$(PIP_INSTALL) -e ".[test]" $(call torch_pin,$(NIXL13_BIN))
	$(NIXL13_BIN)/$(PIP_INSTALL) --no-deps nixl==1.3.2 nixl-cu13==1.3.2
	-$(NIXL13_BIN)/pip uninstall -y -q nixl-cu12
	$(NIXL13_BIN)/python -c "import importlib.metadata as m, nixl._api; assert m.version('nixl-cu13') == '1.3.2'"
	touch $(NIXL13_STAMP)

# The endpoint tests that use real NIXL (-m e2e) and the demo tests, on nixl 1.3.2.
nixl13-test: nixl13-venv
	$(NIXL13_BIN)/python -m pytest -q -m e2e -p no:cacheprovider $(NIXL13_TESTS)

nixl13-clean:
	rm -rf $(NIXL13_VENV)
