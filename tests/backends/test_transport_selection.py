"""Transport selection: the configured NIXL backends, the KVPUSH_BACKENDS override, init parameters, and
the refusals when a backend did not load or lacks a memory type (fake agents for every message, the real
agent for UCX, which loads here, and LIBFABRIC, which does not)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.config import KVPushConfig
from kvpush.errors import ConfigError, TransportError
from kvpush.transport.nixl import NixlTransport, check_backend, selected_backends


class FakeAgent:
    """Answers the three queries `check_backend` makes, like nixl._api.nixl_agent does."""

    def __init__(self, plugins: list[str], backends: dict[str, list[str]]) -> None:
        self.plugins = plugins
        self.backends: dict[str, Any] = {b: object() for b in backends}
        self.mems = backends

    def get_plugin_list(self) -> list[str]:
        return self.plugins

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self.mems.get(backend, [])


def test_env_overrides_the_configured_backends() -> None:
    assert selected_backends(("UCX",), {}) == ("UCX",)
    assert selected_backends(("UCX",), {"KVPUSH_BACKENDS": " libfabric , UCX"}) == ("LIBFABRIC", "UCX")
    assert selected_backends(("LIBFABRIC",), {"KVPUSH_BACKENDS": ""}) == ("LIBFABRIC",)
    with pytest.raises(TransportError, match="no NIXL backend selected"):
        selected_backends((), {})


def test_missing_plugin_is_named_with_what_it_needs() -> None:
    agent = FakeAgent(["POSIX", "UCX"], {"UCX": ["DRAM_SEG", "VRAM_SEG"]})
    with pytest.raises(
        TransportError, match=r"'LIBFABRIC' did not load.*\['POSIX', 'UCX'\].*libfabric >= 1.21"
    ):
        check_backend(agent, "LIBFABRIC", ["VRAM"])


def test_plugin_present_but_not_instantiated() -> None:
    agent = FakeAgent(["LIBFABRIC", "UCX"], {"UCX": ["DRAM_SEG"]})
    with pytest.raises(TransportError, match="'LIBFABRIC' was not instantiated"):
        check_backend(agent, "LIBFABRIC", [])


def test_libfabric_without_vram_is_refused_with_the_neuron_explanation() -> None:
    agent = FakeAgent(["LIBFABRIC"], {"LIBFABRIC": ["DRAM_SEG"]})
    with pytest.raises(
        TransportError, match=r"supports memory types \['DRAM_SEG'\], not \['VRAM'\].*Neuron runtime"
    ):
        check_backend(agent, "LIBFABRIC", ["VRAM"])
    check_backend(agent, "LIBFABRIC", ["DRAM"])  # host memory is fine
    check_backend(FakeAgent(["LIBFABRIC"], {"LIBFABRIC": ["DRAM_SEG", "VRAM_SEG"]}), "LIBFABRIC", ["VRAM"])


def test_backend_params_must_name_selected_backends() -> None:
    cfg = KVPushConfig.from_mapping(
        {"backends": ["LIBFABRIC"], "backend_params": {"LIBFABRIC": {"num_threads": 4}}}
    )
    assert cfg.nixl.backend_params == {"LIBFABRIC": {"num_threads": 4}}
    with pytest.raises(ConfigError, match="backend_params names backends"):
        KVPushConfig.from_mapping({"backend_params": {"LIBFABRIC": {"num_threads": 4}}})
    with pytest.raises(TransportError, match="not selected"):
        NixlTransport("sel-params", ("UCX",), backend_params={"LIBFABRIC": {"num_threads": 4}}, environ={})


def test_real_agent_ucx_loads_with_both_memory_types() -> None:
    t = NixlTransport("sel-ucx", ("UCX",), mem_types=("DRAM", "VRAM"), environ={})
    try:
        assert t.backends == ("UCX",)
        assert "UCX" in t._agent.backends
    finally:
        t.close()


def test_real_agent_libfabric_here_is_a_clear_error() -> None:
    """No libfabric >= 1.21 / EFA on this machine: LIBFABRIC must not come up silently absent."""
    with pytest.raises(TransportError, match="LIBFABRIC") as info:
        NixlTransport("sel-lf", ("UCX",), mem_types=("DRAM",), environ={"KVPUSH_BACKENDS": "LIBFABRIC"})
    assert "libfabric >= 1.21" in str(info.value)
