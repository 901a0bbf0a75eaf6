"""Per-node GPU health through NVML (nvidia-ml-py, imported lazily).

Every NVML query may raise NVMLError_NotSupported (a field the GPU or driver does not expose,
e.g. retired pages on A100+, which use row remapping instead): that is "not checked" (severity
"skip"), never a failure. A node without NVML (library absent, driver not loaded, no GPUs) is
reported as "no GPUs: NVML checks skipped" and the burn-in continues with its CPU parts.
Everything returned is plain dataclasses that `dataclasses.asdict` turns into JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dslurm.preflight.thresholds import Thresholds

log = logging.getLogger(__name__)

SEVERITY_RANK = {"ok": 0, "skip": 0, "warn": 1, "fail": 2}
NO_GPUS = "no GPUs: NVML checks skipped"
# Xids that mean broken hardware rather than a broken program (NVIDIA Xid catalogue):
# 48 DBE, 63/64 row remap, 74 NVLink, 79 fell off the bus, 92 high SBE rate, 94/95 contained/
# uncontained ECC, 119/120 GSP. Others (13, 31, 43: application faults) are only warnings.
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass(slots=True)
class Finding:
    check: str
    severity: str  # ok | skip (not supported / not checked) | warn | fail
    reason: str


@dataclass(slots=True)
class GpuHealth:
    index: int
    name: str = ""
    uuid: str = ""
    findings: list[Finding] = field(default_factory=list)

    @property
    def severity(self) -> str:
        return worst(f.severity for f in self.findings)


@dataclass(slots=True)
class NodeHealth:
    host: str
    nvml: str  # "ok" | "skipped" (no GPUs) | "error" (NVML up, GPUs not enumerable)
    note: str = ""
    gpu_count: int = 0
    findings: list[Finding] = field(default_factory=list)
    gpus: list[GpuHealth] = field(default_factory=list)

    @property
    def severity(self) -> str:
        return worst([f.severity for f in self.findings] + [g.severity for g in self.gpus])

    def problems(self) -> list[str]:
        """Human reasons for every warn/fail finding, prefixed with the GPU index."""
        out = [f"{f.severity}: {f.reason}" for f in self.findings if f.severity in ("warn", "fail")]
        for g in self.gpus:
            out += [f"{f.severity}: gpu{g.index} {f.reason}"
                    for f in g.findings if f.severity in ("warn", "fail")]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity
        return d


def worst(severities: Any) -> str:
    """Worst severity; "skip" (not checked) counts as "ok" for the GPU or node as a whole."""
    rank = max((SEVERITY_RANK[s] for s in severities), default=0)
    return ("ok", "warn", "fail")[rank]


class _Unsupported:
    """Marker for an NVML field the device does not expose."""


UNSUPPORTED = _Unsupported()


def _query(nv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Call NVML; NotSupported/NoPermission become UNSUPPORTED, other NVML errors propagate."""
    try:
        return fn(*args)
    except (nv.NVMLError_NotSupported, nv.NVMLError_NoPermission):
        return UNSUPPORTED


def _skip(check: str) -> Finding:
    return Finding(check, "skip", "not supported on this GPU/driver: not checked")


def check_ecc(nv: Any, h: Any, th: Thresholds) -> Finding:
    counts = {}
    for label, counter in (("volatile", nv.NVML_VOLATILE_ECC), ("aggregate", nv.NVML_AGGREGATE_ECC)):
        v = _query(nv, nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter)
        if v is not UNSUPPORTED:
            counts[label] = int(v)
    if not counts:
        return _skip("ecc")
    bad = {k: v for k, v in counts.items() if v > th.max_ecc_uncorrected}
    if bad:
        return Finding("ecc", "fail", f"uncorrected ECC errors {bad} > {th.max_ecc_uncorrected}")
    return Finding("ecc", "ok", f"uncorrected ECC {counts}")


def check_retired_pages(nv: Any, h: Any, th: Thresholds) -> Finding:
    pending = _query(nv, nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
    if pending is UNSUPPORTED:
        return _skip("retired_pages")
    if pending:
        return Finding("retired_pages", "fail", "retired pages pending: GPU needs a reset")
    return Finding("retired_pages", "ok", "no retired pages pending")


def check_remapped_rows(nv: Any, h: Any, th: Thresholds) -> Finding:
    rows = _query(nv, nv.nvmlDeviceGetRemappedRows, h)
    if rows is UNSUPPORTED:
        return _skip("remapped_rows")
    corr, unc, pending, failure = rows
    if failure:
        return Finding("remapped_rows", "fail", "row remapping failed: replace the GPU")
    if pending:
        return Finding("remapped_rows", "fail", "row remapping pending: GPU needs a reset")
    return Finding("remapped_rows", "ok", f"remapped rows corr={corr} unc={unc}")


def check_temperature(nv: Any, h: Any, th: Thresholds) -> Finding:
    t = _query(nv, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
    if t is UNSUPPORTED:
        return _skip("temperature")
    if t > th.max_temp_c:
        return Finding("temperature", "fail", f"temperature {t} C > {th.max_temp_c} C")
    return Finding("temperature", "ok", f"{t} C")


def check_power_limit(nv: Any, h: Any, th: Thresholds) -> Finding:
    enforced = _query(nv, nv.nvmlDeviceGetEnforcedPowerLimit, h)
    default = _query(nv, nv.nvmlDeviceGetPowerManagementDefaultLimit, h)
    if enforced is UNSUPPORTED or default is UNSUPPORTED or not default:
        return _skip("power_limit")
    frac = enforced / default
    if frac < th.min_power_limit_fraction:
        return Finding("power_limit", "warn",
                       f"power capped at {enforced / 1000:.0f} W = {frac:.0%} of default "
                       f"{default / 1000:.0f} W")
    return Finding("power_limit", "ok", f"{enforced / 1000:.0f} W")


def throttle_reasons_fn(nv: Any) -> Any:
    """The NVML call for the clock throttle reasons: the "ClocksEvent" name replaced "ClocksThrottle"
    in newer bindings; same bit values."""
    return getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons


def hard_throttle(nv: Any, reasons: int) -> list[str]:
    """The hardware slowdowns among NVML's clock throttle reasons (the burn-in fails on them)."""
    hard = {"HW slowdown": nv.nvmlClocksThrottleReasonHwSlowdown,
            "HW thermal slowdown": nv.nvmlClocksThrottleReasonHwThermalSlowdown,
            "HW power brake": nv.nvmlClocksThrottleReasonHwPowerBrakeSlowdown}
    return [name for name, bit in hard.items() if reasons & bit]


def check_throttle(nv: Any, h: Any, th: Thresholds) -> Finding:
    reasons = _query(nv, throttle_reasons_fn(nv), h)
    if reasons is UNSUPPORTED:
        return _skip("throttle")
    hit = hard_throttle(nv, reasons)
    if hit:
        return Finding("throttle", "fail", "clock throttled: " + ", ".join(hit))
    # Power capping under load is normal; software thermal slowdown is a cooling warning.
    if reasons & nv.nvmlClocksThrottleReasonSwThermalSlowdown:
        return Finding("throttle", "warn", "clock throttled: SW thermal slowdown")
    return Finding("throttle", "ok", f"reasons=0x{reasons:x}")


def check_pcie(nv: Any, h: Any, th: Thresholds) -> Finding:
    gen = _query(nv, nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
    max_gen = _query(nv, nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
    width = _query(nv, nv.nvmlDeviceGetCurrPcieLinkWidth, h)
    max_width = _query(nv, nv.nvmlDeviceGetMaxPcieLinkWidth, h)
    if UNSUPPORTED in (gen, max_gen, width, max_width):
        return _skip("pcie")
    text = f"PCIe gen{gen}/{max_gen} x{width}/{max_width}"
    # Warnings only: idle GPUs downshift the link generation to save power.
    if width < max_width:
        return Finding("pcie", "warn", f"{text}: link width degraded")
    if th.min_pcie_gen and gen < th.min_pcie_gen:
        return Finding("pcie", "warn", f"{text}: below gen{th.min_pcie_gen}")
    return Finding("pcie", "ok", text)


def check_memory(nv: Any, h: Any, th: Thresholds) -> Finding:
    mem = _query(nv, nv.nvmlDeviceGetMemoryInfo, h)
    if mem is UNSUPPORTED or not mem.total:
        return _skip("free_memory")
    frac = mem.free / mem.total
    if frac < th.min_free_mem_fraction:
        return Finding("free_memory", "warn",
                       f"only {frac:.0%} memory free: another process holds the GPU")
    return Finding("free_memory", "ok", f"{frac:.0%} free")


GPU_CHECKS = (check_ecc, check_retired_pages, check_remapped_rows, check_temperature,
              check_power_limit, check_throttle, check_pcie, check_memory)


def _load_nvml() -> Any | None:
    """Import and initialise NVML; None when this node has no usable NVML (no GPUs)."""
    try:
        import pynvml as nv
    except ImportError:
        return None
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, NoPermission, ...
        log.info("NVML unavailable: %s", exc)
        return None
    return nv


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def check_gpu(nv: Any, index: int, th: Thresholds) -> GpuHealth:
    gpu = GpuHealth(index=index)
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:  # e.g. GPU_IS_LOST after an Xid 79
        gpu.findings.append(Finding("handle", "fail", f"NVML cannot open the GPU: {exc}"))
        return gpu
    name = _query(nv, nv.nvmlDeviceGetName, h)
    uuid = _query(nv, nv.nvmlDeviceGetUUID, h)
    gpu.name = "" if name is UNSUPPORTED else _text(name)
    gpu.uuid = "" if uuid is UNSUPPORTED else _text(uuid)
    for check in GPU_CHECKS:
        try:
            gpu.findings.append(check(nv, h, th))
        except nv.NVMLError as exc:  # e.g. GPU_IS_LOST: the GPU does not answer
            gpu.findings.append(Finding(check.__name__.removeprefix("check_"), "fail",
                                        f"NVML error: {exc}"))
    return gpu


def check_node(host: str, th: Thresholds) -> NodeHealth:
    """All NVML checks of this node (Xids are added at the end with `add_xids`)."""
    nv = _load_nvml()
    if nv is None:
        return _no_gpus(host, th)
    try:
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:  # NVML loaded but the driver cannot enumerate: broken node
            return NodeHealth(host=host, nvml="error", findings=[
                Finding("gpu_count", "fail", f"NVML cannot count GPUs: {exc}")])
        if count == 0:
            return _no_gpus(host, th)
        node = NodeHealth(host=host, nvml="ok", gpu_count=count)
        node.findings.append(_count_finding(count, th))
        for i in range(count):
            node.gpus.append(check_gpu(nv, i, th))
        return node
    finally:
        nv.nvmlShutdown()


def _count_finding(count: int, th: Thresholds) -> Finding:
    expected = th.expected_gpus_per_node
    if expected is None:
        return Finding("gpu_count", "skip", f"{count} GPUs (no expected count configured)")
    if count != expected:
        return Finding("gpu_count", "fail", f"{count} GPUs visible, expected {expected}")
    return Finding("gpu_count", "ok", f"{count} GPUs")


def _no_gpus(host: str, th: Thresholds) -> NodeHealth:
    node = NodeHealth(host=host, nvml="skipped", note=NO_GPUS)
    if th.expected_gpus_per_node:  # a GPU site where a node lost its driver or all its GPUs
        node.findings.append(Finding("gpu_count", "fail",
                                     f"0 GPUs visible, expected {th.expected_gpus_per_node}"))
    return node


def xid_finding(codes: list[int]) -> Finding:
    if not codes:
        return Finding("xid", "ok", "no Xid events during burn-in")
    hw = sorted(set(codes) & HARDWARE_XIDS)
    if hw:
        return Finding("xid", "fail", f"hardware Xid {hw} during burn-in")
    return Finding("xid", "warn", f"Xid {sorted(set(codes))} during burn-in")


def add_xids(health: dict[str, Any], xids: dict[int, list[int]] | None) -> dict[str, Any]:
    """Append Xid findings (drained at the end of the burn-in) to a NodeHealth.to_dict()."""
    if xids is None:
        return health
    for gpu in health["gpus"]:
        gpu["findings"].append(asdict(xid_finding(xids.get(gpu["index"], []))))
    sev = [f["severity"] for f in health["findings"]]
    sev += [f["severity"] for g in health["gpus"] for f in g["findings"]]
    health["severity"] = worst(sev)
    return health
