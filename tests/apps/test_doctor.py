"""kvpush doctor: its JSON here (IMDS mocked: never reached from a test), and its choices on described
machines (fake probes): UCX + host here, staging on trn2.3xlarge, device-direct on a complete trn2."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from kvpush.apps import doctor


def _here() -> doctor.Probes:
    return doctor.Probes(instance_type=lambda: None)


def test_json_here_says_ucx_and_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.run(argparse.Namespace(json=True), _here()) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"platform", "instance_type", "nixl", "cuda", "neuron", "efa", "choice"}
    assert report["nixl"]["version"] == "1.5.1"
    assert report["nixl"]["backends"]["UCX"]["ok"] is True
    assert report["nixl"]["backends"]["LIBFABRIC"]["ok"] is False
    assert "LIBFABRIC" in report["nixl"]["backends"]["LIBFABRIC"]["error"]
    assert report["choice"]["memory"] == "host DRAM" and report["choice"]["transport"] == "UCX"
    assert report["instance_type"] is None


def _trn(itype: str, efa: int, symbol: bool = True) -> dict[str, Any]:
    return doctor.collect(
        doctor.Probes(
            instance_type=lambda: itype,
            nixl=lambda: {
                "version": "1.3.2",
                "plugins": ["LIBFABRIC", "UCX"],
                "backends": {
                    "UCX": {"ok": True, "mem_types": ["DRAM_SEG"]},
                    "LIBFABRIC": {"ok": True, "mem_types": ["DRAM_SEG", "VRAM_SEG"]},
                },
            },
            cuda=lambda: {"available": False},
            neuron=lambda: {
                "devices": 16 if itype != "trn2.3xlarge" else 1,
                "runtime": {"version": "2.31.24.0", "nrt_get_attached_efa_bdf": symbol},
            },
            efa=lambda: {"devices": efa},
        )
    )


def test_trn2_3xlarge_is_refused_for_device_direct_and_staging_named() -> None:
    c = _trn("trn2.3xlarge", 1)["choice"]
    assert (
        c["memory"] == "neuron, host staging" and "trn2.3xlarge" in c["reason"] and "staging" in c["reason"]
    )


def test_complete_trn2_goes_device_direct_and_gaps_fall_back_to_staging() -> None:
    assert _trn("trn2.48xlarge", 16)["choice"] == {
        "memory": "neuron HBM as VRAM (device-direct)",
        "transport": "LIBFABRIC",
        "reason": "16 Neuron devices, 16 EFA, LIBFABRIC lists VRAM",
    }
    assert "8 EFA" in _trn("trn2.48xlarge", 8)["choice"]["reason"]
    assert _trn("trn1.32xlarge", 8)["choice"]["memory"].startswith("neuron HBM")  # 2 devices per EFA
    assert "2.31.24" in _trn("trn2.48xlarge", 16, symbol=False)["choice"]["reason"]


def test_imds_unreachable_is_none_quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> None:
        raise OSError("unreachable")

    monkeypatch.setattr(doctor.urllib.request, "urlopen", refuse)
    assert doctor.imds_instance_type() is None


def test_doctor_is_a_cli_command() -> None:
    from kvpush.cli import COMMANDS

    assert COMMANDS["doctor"][0] == "kvpush.apps.doctor"
