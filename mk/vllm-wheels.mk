# vLLM 0.33.0 and 0.34.0 (issue 41): the CUDA builds users deploy, with no CPU build to run here. Their
# wheels are downloaded without dependencies into .cache/vllm-wheels/ (git ignores .cache/) and read, never
# installed: tests/vllm/test_connector_contract.py and test_connector_api.py parse the connector base class
# from them. A failed download fails `make test`; KVPUSH_OFFLINE=1 lets it go on (those tests then skip).

VLLM_WHEELS_DIR := .cache/vllm-wheels
VLLM_WHEEL_VERSIONS := 0.33.0 0.34.0
VLLM_WHEEL_STAMPS := $(foreach v,$(VLLM_WHEEL_VERSIONS),$(VLLM_WHEELS_DIR)/.vllm-$(v))

TEST_DEPS += vllm-wheels

.PHONY: vllm-wheels vllm-wheels-clean

vllm-wheels: $(VLLM_WHEEL_STAMPS)

$(VLLM_WHEELS_DIR)/.vllm-%: | $(STAMP)
	mkdir -p $(VLLM_WHEELS_DIR)
	if $(BIN)/pip download -q --no-deps --only-binary=:all: "vllm==$*" -d $(VLLM_WHEELS_DIR); then \
	  ls $(VLLM_WHEELS_DIR)/vllm-$*-*.whl && touch $@; \
	elif [ "$$KVPUSH_OFFLINE" = 1 ]; then \
	  echo "vllm==$* not downloaded; KVPUSH_OFFLINE=1: the wheel checks will skip"; \
	else \
	  echo "pip download vllm==$* failed (set KVPUSH_OFFLINE=1 to go on without it)"; exit 1; \
	fi

vllm-wheels-clean:
	rm -rf $(VLLM_WHEELS_DIR)
