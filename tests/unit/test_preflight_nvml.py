"""NVML health checks. NVML is mocked (pytest-mock patches the real pynvml module's functions)
because this machine has no GPU; the exception classes and constants are pynvml's own."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from dslurm.preflight import nvml
from dslurm.preflight.nvml import NO_GPUS, add_xids, check_node
from dslurm.preflight.thresholds import Thresholds
from dslurm.preflight.xid import XidWatcher

TH = Thresholds(expected_gpus_per_node=2, min_pcie_gen=4)


def healthy() -> dict[str, Any]:
    """What a healthy H100 answers, per NVML function name."""
    return {
        "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUUID": "GPU-0000",
        "nvmlDeviceGetTotalEccErrors": {pynvml.NVML_VOLATILE_ECC: 0, pynvml.NVML_AGGREGATE_ECC: 0},
        "nvmlDeviceGetRetiredPagesPendingStatus": 0,
        "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
        "nvmlDeviceGetTemperature": 40,
        "nvmlDeviceGetEnforcedPowerLimit": 700_000,
        "nvmlDeviceGetPowerManagementDefaultLimit": 700_000,
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksThrottleReasonGpuIdle,
        "nvmlDeviceGetCurrPcieLinkGeneration": 5,
        "nvmlDeviceGetMaxPcieLinkGeneration": 5,
        "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkWidth": 16,
        "nvmlDeviceGetMemoryInfo": SimpleNamespace(free=79 << 30, total=80 << 30),
    }


def install(mocker: Any, gpus: list[dict[str, Any]]) -> None:
    """Patch pynvml so handle i answers from gpus[i]; exception values are raised."""
    mocker.patch.object(pynvml, "nvmlInit")
    mocker.patch.object(pynvml, "nvmlShutdown")
    mocker.patch.object(pynvml, "nvmlDeviceGetCount", return_value=len(gpus))
    mocker.patch.object(pynvml, "nvmlDeviceGetHandleByIndex", side_effect=lambda i: i)

    def answer(fn: str):
        def call(handle: int, *args: Any) -> Any:
            value = gpus[handle][fn]
            if isinstance(value, Exception):
                raise value
            if isinstance(value, dict):  # ECC: keyed by counter type
                value = value[args[1]]
                if isinstance(value, Exception):
                    raise value
            return value
        return call

    for fn in healthy():
        mocker.patch.object(pynvml, fn, side_effect=answer(fn))


def findings(node: nvml.NodeHealth, gpu: int) -> dict[str, nvml.Finding]:
    return {f.check: f for f in node.gpus[gpu].findings}


def test_healthy_node_passes_every_check(mocker):
    install(mocker, [healthy(), healthy()])
    node = check_node("n0", TH)
    assert node.nvml == "ok" and node.gpu_count == 2
    assert node.severity == "ok" and node.problems() == []
    checks = findings(node, 1)
    assert set(checks) == {"ecc", "retired_pages", "remapped_rows", "temperature", "power_limit",
                           "throttle", "pcie", "free_memory"}
    assert all(f.severity == "ok" for f in checks.values())
    assert node.gpus[0].name == "NVIDIA H100 80GB HBM3"
    json.dumps(node.to_dict())  # the report must serialise


@pytest.mark.parametrize("counter", [pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC])
def test_uncorrected_ecc_fails_only_that_gpu(mocker, counter):
    bad = healthy()
    bad["nvmlDeviceGetTotalEccErrors"] = {**bad["nvmlDeviceGetTotalEccErrors"], counter: 3}
    install(mocker, [healthy(), bad])
    node = check_node("n0", TH)
    assert findings(node, 0)["ecc"].severity == "ok"
    ecc = findings(node, 1)["ecc"]
    assert ecc.severity == "fail" and "3" in ecc.reason
    assert node.severity == "fail"
    assert any(p.startswith("fail: gpu1 uncorrected ECC") for p in node.problems())


def test_ecc_within_allowance_passes(mocker):
    bad = healthy()
    bad["nvmlDeviceGetTotalEccErrors"] = {pynvml.NVML_VOLATILE_ECC: 1, pynvml.NVML_AGGREGATE_ECC: 1}
    install(mocker, [bad, healthy()])
    node = check_node("n0", Thresholds(expected_gpus_per_node=2, max_ecc_uncorrected=1))
    assert findings(node, 0)["ecc"].severity == "ok"


def test_missing_gpu_is_a_count_mismatch(mocker):
    install(mocker, [healthy()])
    node = check_node("n0", Thresholds(expected_gpus_per_node=8))
    count = node.findings[0]
    assert count.check == "gpu_count" and count.severity == "fail"
    assert count.reason == "1 GPUs visible, expected 8"
    assert node.severity == "fail"


def test_gpu_count_not_judged_without_expectation(mocker):
    install(mocker, [healthy()])
    node = check_node("n0", Thresholds())
    assert node.findings[0].severity == "skip" and node.severity == "ok"


@pytest.mark.parametrize("bit, severity, text", [
    (pynvml.nvmlClocksThrottleReasonHwThermalSlowdown, "fail", "HW thermal slowdown"),
    (pynvml.nvmlClocksThrottleReasonHwSlowdown, "fail", "HW slowdown"),
    (pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown, "fail", "HW power brake"),
    (pynvml.nvmlClocksThrottleReasonSwThermalSlowdown, "warn", "SW thermal"),
    (pynvml.nvmlClocksThrottleReasonSwPowerCap, "ok", "reasons=0x4"),  # normal under load
])
def test_clock_throttle_reasons(mocker, bit, severity, text):
    gpu = healthy()
    gpu["nvmlDeviceGetCurrentClocksEventReasons"] = bit
    install(mocker, [gpu, healthy()])
    f = findings(check_node("n0", TH), 0)["throttle"]
    assert f.severity == severity and text in f.reason


def test_hot_gpu_fails_temperature(mocker):
    gpu = healthy()
    gpu["nvmlDeviceGetTemperature"] = 91
    install(mocker, [gpu, healthy()])
    f = findings(check_node("n0", TH), 0)["temperature"]
    assert f.severity == "fail" and "91 C > 85.0 C" in f.reason


@pytest.mark.parametrize("rows, text", [((0, 2, 0, 1), "remapping failed"),
                                        ((0, 1, 1, 0), "remapping pending")])
def test_remapped_rows_failure_or_pending_fails(mocker, rows, text):
    gpu = healthy()
    gpu["nvmlDeviceGetRemappedRows"] = rows
    install(mocker, [gpu, healthy()])
    f = findings(check_node("n0", TH), 0)["remapped_rows"]
    assert f.severity == "fail" and text in f.reason


def test_retired_pages_pending_fails(mocker):
    gpu = healthy()
    gpu["nvmlDeviceGetRetiredPagesPendingStatus"] = 1
    install(mocker, [gpu, healthy()])
    assert findings(check_node("n0", TH), 0)["retired_pages"].severity == "fail"


@pytest.mark.parametrize("exc", [pynvml.NVMLError_LibraryNotFound(),
                                 pynvml.NVMLError_DriverNotLoaded()])
def test_no_nvml_library_or_driver_skips_plainly(mocker, exc):
    mocker.patch.object(pynvml, "nvmlInit", side_effect=exc)
    node = check_node("cpu0", Thresholds())
    assert node.nvml == "skipped" and node.note == NO_GPUS == "no GPUs: NVML checks skipped"
    assert node.gpus == [] and node.findings == [] and node.severity == "ok"


def test_no_nvml_on_a_gpu_site_fails_the_count(mocker):
    mocker.patch.object(pynvml, "nvmlInit", side_effect=pynvml.NVMLError_DriverNotLoaded())
    node = check_node("gpu7", Thresholds(expected_gpus_per_node=8))
    assert node.nvml == "skipped" and node.severity == "fail"
    assert node.findings[0].reason == "0 GPUs visible, expected 8"


def test_pynvml_not_installed_skips(mocker):
    mocker.patch.dict(sys.modules, {"pynvml": None})  # import pynvml raises ImportError
    assert check_node("cpu0", Thresholds()).note == NO_GPUS


def test_zero_gpus_skips(mocker):
    install(mocker, [])
    assert check_node("cpu0", Thresholds()).nvml == "skipped"


def test_not_supported_fields_are_not_checked_not_failed(mocker):
    gpu = healthy()
    for fn in ("nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows",
               "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetTemperature",
               "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetCurrentClocksEventReasons",
               "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUUID"):
        gpu[fn] = pynvml.NVMLError_NotSupported()
    gpu["nvmlDeviceGetTotalEccErrors"] = {pynvml.NVML_VOLATILE_ECC: pynvml.NVMLError_NotSupported(),
                                          pynvml.NVML_AGGREGATE_ECC: pynvml.NVMLError_NotSupported()}
    install(mocker, [gpu, healthy()])
    node = check_node("n0", TH)
    got = findings(node, 0)
    assert {c for c, f in got.items() if f.severity == "skip"} == set(got)
    assert all("not checked" in f.reason for f in got.values())
    assert node.severity == "ok" and node.gpus[0].uuid == ""


def test_one_ecc_counter_not_supported_still_checks_the_other(mocker):
    gpu = healthy()
    gpu["nvmlDeviceGetTotalEccErrors"] = {pynvml.NVML_VOLATILE_ECC: pynvml.NVMLError_NotSupported(),
                                          pynvml.NVML_AGGREGATE_ECC: 5}
    install(mocker, [gpu, healthy()])
    f = findings(check_node("n0", TH), 0)["ecc"]
    assert f.severity == "fail" and "aggregate" in f.reason and "volatile" not in f.reason


def test_lost_gpu_error_fails_the_check(mocker):
    gpu = healthy()
    gpu["nvmlDeviceGetTemperature"] = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    install(mocker, [gpu, healthy()])
    f = findings(check_node("n0", TH), 0)["temperature"]
    assert f.severity == "fail" and "NVML error" in f.reason


def test_pcie_width_degraded_and_low_gen_warn(mocker):
    narrow, slow = healthy(), healthy()
    narrow["nvmlDeviceGetCurrPcieLinkWidth"] = 8
    slow["nvmlDeviceGetCurrPcieLinkGeneration"] = 3
    install(mocker, [narrow, slow])
    node = check_node("n0", TH)
    assert findings(node, 0)["pcie"].severity == "warn"
    assert "width degraded" in findings(node, 0)["pcie"].reason
    assert findings(node, 1)["pcie"].reason.endswith("below gen4")
    # min_pcie_gen=0 means the generation is not judged
    node = check_node("n0", Thresholds(expected_gpus_per_node=2))
    assert findings(node, 1)["pcie"].severity == "ok"


def test_memory_held_by_others_and_power_cap_warn(mocker):
    gpu = healthy()
    gpu["nvmlDeviceGetMemoryInfo"] = SimpleNamespace(free=10 << 30, total=80 << 30)
    gpu["nvmlDeviceGetEnforcedPowerLimit"] = 400_000
    install(mocker, [gpu, healthy()])
    got = findings(check_node("n0", TH), 0)
    assert got["free_memory"].severity == "warn" and "12%" in got["free_memory"].reason
    assert got["power_limit"].severity == "warn" and "400 W" in got["power_limit"].reason


def test_xids_hardware_fails_application_warns(mocker):
    install(mocker, [healthy(), healthy()])
    health = check_node("n0", TH).to_dict()
    add_xids(health, {0: [13], 1: [79]})
    assert health["gpus"][0]["findings"][-1]["severity"] == "warn"
    assert health["gpus"][1]["findings"][-1] == {
        "check": "xid", "severity": "fail", "reason": "hardware Xid [79] during burn-in"}
    assert health["severity"] == "fail"
    assert add_xids({"gpus": []}, None) == {"gpus": []}  # not watched: unchanged


def test_xid_watcher_drains_events_then_stops_at_timeout(mocker):
    install(mocker, [healthy(), healthy()])
    mocker.patch.object(pynvml, "nvmlEventSetCreate", return_value="set")
    mocker.patch.object(pynvml, "nvmlDeviceRegisterEvents")
    mocker.patch.object(pynvml, "nvmlEventSetFree")
    mocker.patch.object(pynvml, "nvmlDeviceGetIndex", side_effect=lambda d: d)
    events = [SimpleNamespace(device=1, eventData=79), pynvml.NVMLError_Timeout()]
    mocker.patch.object(pynvml, "nvmlEventSetWait_v2", side_effect=events)
    assert XidWatcher().drain() == {0: [], 1: [79]}


def test_xid_watcher_not_supported_is_not_checked(mocker):
    install(mocker, [healthy()])
    mocker.patch.object(pynvml, "nvmlEventSetCreate", side_effect=pynvml.NVMLError_NotSupported())
    assert XidWatcher().drain() is None


def test_gpu_that_cannot_be_opened_fails_others_still_checked(mocker):
    install(mocker, [healthy(), healthy()])

    def handle(i):
        if i == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return i
    mocker.patch.object(pynvml, "nvmlDeviceGetHandleByIndex", side_effect=handle)
    node = check_node("n0", TH)
    assert node.gpus[0].severity == "ok"
    assert node.gpus[1].findings[0].check == "handle" and node.gpus[1].severity == "fail"


def test_count_error_fails_the_node(mocker):
    install(mocker, [healthy()])
    mocker.patch.object(pynvml, "nvmlDeviceGetCount", side_effect=pynvml.NVMLError_Unknown())
    node = check_node("n0", TH)
    assert node.nvml == "error" and node.severity == "fail"
    assert node.findings[0].reason.startswith("NVML cannot count GPUs")
