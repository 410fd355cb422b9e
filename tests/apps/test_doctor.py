"""kvpush doctor: its JSON here (IMDS mocked: never reached from a test), and its choices on described
machines (fake probes): UCX + host here, staging on trn2.3xlarge, device-direct on a complete trn2."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from kvpush.apps import doctor, doctor_probes
from kvpush.apps.install_hint import install_command


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

    monkeypatch.setattr(doctor_probes.urllib.request, "urlopen", refuse)
    assert doctor_probes.imds_instance_type() is None


def test_doctor_is_a_cli_command() -> None:
    from kvpush.cli import COMMANDS

    assert COMMANDS["doctor"][0] == "kvpush.apps.doctor"


# --- doctor as a gate: the exit status, each problem with its fix, the JSON schema ---------------------

UCX_OK = {"ok": True, "mem_types": ["DRAM_SEG"]}
LF_NO = {"ok": False, "error": "NIXL backend 'LIBFABRIC' failed to initialise"}


def _probes(**overrides: Any) -> doctor.Probes:
    """A described machine: no accelerator, no RDMA, NIXL with UCX, memlock unlimited, unless overridden."""
    base: dict[str, Any] = dict(
        instance_type=lambda: None,
        nixl=lambda: {
            "version": "1.5.1",
            "installed": True,
            "plugins": ["UCX"],
            "backends": {"UCX": UCX_OK, "LIBFABRIC": LF_NO},
        },
        cuda=lambda: {"available": False, "dev_nodes": 0},
        neuron=lambda: {"devices": 0},
        efa=lambda: {"devices": 0, "rdma": [], "fi_info": None},
        ucx=lambda: {"env": {}, "modules": ["ib"], "transports": None, "devices": None},
        memlock=lambda: {"soft": None, "hard": None},
        gpudirect=lambda: {"peermem": []},
        versions=lambda: {"kvpush": "0.1.0", "nixl": "1.5.1"},
    )
    base.update(overrides)
    return doctor.Probes(**base)


def _ids(report: dict[str, Any]) -> dict[str, str]:
    return {p["id"]: p["severity"] for p in report["problems"]}


def test_a_healthy_host_passes_the_gate(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.run(argparse.Namespace(json=False), _probes()) == 0
    out = capsys.readouterr().out
    assert "result        ready" in out


def test_the_chosen_transport_not_loading_fails_the_gate(capsys: pytest.CaptureFixture[str]) -> None:
    broken = {"ok": False, "error": "createBackend: unsupported backend 'UCX'"}
    probes = _probes(
        nixl=lambda: {
            "version": "1.5.1",
            "installed": True,
            "plugins": [],
            "backends": {"UCX": broken, "LIBFABRIC": LF_NO},
        }
    )
    assert doctor.run(argparse.Namespace(json=True), probes) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["choice"]["transport"] == "UCX"
    [problem] = [p for p in report["problems"] if p["id"] == "transport-unavailable"]
    assert problem["severity"] == "blocking" and "unsupported backend 'UCX'" in problem["what"]
    assert "reinstall NIXL" in problem["fix"]
    assert doctor.run(argparse.Namespace(json=False), probes) == 1
    assert "NOT READY: 1 blocking problem" in capsys.readouterr().out


def test_no_nixl_is_blocking_and_names_the_extra() -> None:
    report = doctor.collect(
        _probes(nixl=lambda: {"version": None, "installed": False, "plugins": [], "backends": {}})
    )
    assert _ids(report) == {"nixl-missing": "blocking"}
    assert install_command("nixl") in report["problems"][0]["fix"]


def test_memlock_blocks_only_where_rdma_registration_pins_memory() -> None:
    efa = {
        "devices": 2,
        "rdma": [{"name": "rdmap0", "driver": "efa"}] * 2,
        "fi_info": {"rc": 0, "efa_domains": ["rdmap0-rdm"]},
    }
    limited = lambda: {"soft": 8 << 20, "hard": 8 << 20}  # noqa: E731
    assert "memlock" not in _ids(doctor.collect(_probes(memlock=limited)))  # no RDMA: nothing is pinned
    report = doctor.collect(_probes(memlock=limited, efa=lambda: efa))
    assert _ids(report)["memlock"] == "blocking" and not report["ok"]
    assert "ulimit -l unlimited" in next(p["fix"] for p in report["problems"] if p["id"] == "memlock")
    assert "memlock" not in _ids(doctor.collect(_probes(efa=lambda: efa)))  # unlimited


def test_efa_is_counted_by_driver_not_by_any_rdma_device(tmp_path: Any) -> None:
    for name, driver in (("rdmap0", "efa"), ("rdmap1", "efa"), ("mlx5_0", "mlx5_core"), ("odd", None)):
        dev = tmp_path / "ib" / name / "device"
        dev.mkdir(parents=True)
        if driver:
            (tmp_path / "drivers" / driver).mkdir(parents=True, exist_ok=True)
            (dev / "driver").symlink_to(tmp_path / "drivers" / driver)
    rep = doctor_probes.efa_report(root=str(tmp_path / "ib"))
    assert rep["devices"] == 2
    assert {d["name"]: d["driver"] for d in rep["rdma"]} == {
        "rdmap0": "efa",
        "rdmap1": "efa",
        "mlx5_0": "mlx5_core",
        "odd": "",
    }


def test_efa_without_libfabric_and_loopback_ucx_are_warnings() -> None:
    efa = {"devices": 1, "rdma": [{"name": "rdmap0", "driver": "efa"}], "fi_info": None}
    report = doctor.collect(
        _probes(efa=lambda: efa, ucx=lambda: {"env": {"UCX_NET_DEVICES": "lo"}, "modules": []})
    )
    assert _ids(report) == {
        "efa-without-libfabric": "warning",
        "efa-fi-info": "warning",
        "ucx-loopback": "warning",
    }
    assert report["ok"] is True  # warnings do not fail the gate


def test_gpudirect_missing_is_named_when_cuda_stages_through_host() -> None:
    lf_dram = {"ok": True, "mem_types": ["DRAM_SEG"]}
    efa = {
        "devices": 1,
        "rdma": [{"name": "rdmap0", "driver": "efa"}],
        "fi_info": {"rc": 0, "efa_domains": ["x"]},
    }
    probes = _probes(
        cuda=lambda: {"available": True, "dev_nodes": 1},
        efa=lambda: efa,
        nixl=lambda: {
            "version": "1.5.1",
            "installed": True,
            "plugins": [],
            "backends": {"UCX": UCX_OK, "LIBFABRIC": lf_dram},
        },
    )
    report = doctor.collect(probes)
    assert report["choice"]["memory"] == "cuda, host staging"
    assert _ids(report) == {"gpudirect-rdma": "warning"}
    assert "nvidia_peermem" in report["problems"][0]["fix"]


def test_nixl_outside_the_supported_range_is_a_warning() -> None:
    probes = _probes(
        nixl=lambda: {"version": "1.3.2", "installed": True, "plugins": [], "backends": {"UCX": UCX_OK}}
    )
    assert _ids(doctor.collect(probes)) == {"nixl-version": "warning"}


def test_neuron_prerequisites_missing_is_named() -> None:
    report = _trn("trn2.48xlarge", 16, symbol=False)
    assert _ids(report)["neuron-staging"] == "warning"
    assert "2.31.24" in next(p["fix"] for p in report["problems"] if p["id"] == "neuron-staging")


def test_the_probe_does_not_force_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    doctor_probes.nixl_report()
    assert "UCX_NET_DEVICES" not in doctor_probes.os.environ


def test_every_json_field_is_documented_in_docs_doctor_md() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "doctor.md").read_text()
    report = doctor.collect(_probes())
    for key in report:
        assert f"`{key}`" in doc, f"top-level field {key!r} is not in docs/doctor.md"
    for key in report["problems"][0] if report["problems"] else ("id", "severity", "what", "fix"):
        assert f"`{key}`" in doc
    for pid in ("nixl-missing", "transport-unavailable", "memlock", "nixl-version", "efa-without-libfabric",
                "efa-fi-info", "ucx-loopback", "gpudirect-rdma", "cuda-not-visible", "neuron-staging"):  # fmt: skip
        assert f"`{pid}`" in doc, pid
    assert f"schema version {doctor.SCHEMA_VERSION}" in doc
