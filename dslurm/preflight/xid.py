"""Xid events seen during the burn-in, through NVML's event set.

NVML only reports Xids that happen after registration (older ones live in the kernel log),
so the runner starts the watcher first and drains it after the GEMM and all-reduce load.
"""

from __future__ import annotations

import logging
from typing import Any

from dslurm.preflight.nvml import _load_nvml

log = logging.getLogger(__name__)


class XidWatcher:
    """Collects Xid events while the burn-in runs; a node without NVML watches nothing."""

    def __init__(self) -> None:
        self._nv = _load_nvml()
        self._set: Any = None
        self._gpus: list[int] = []
        if self._nv is None:
            return
        nv = self._nv
        try:
            self._set = nv.nvmlEventSetCreate()
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._set)
                self._gpus.append(i)
        except nv.NVMLError as exc:  # NotSupported on some GPUs / containers: not checked
            log.info("Xid events not available: %s", exc)
            self._set = None

    def drain(self) -> dict[int, list[int]] | None:
        """GPU index -> Xid codes seen; None when Xids could not be watched."""
        if self._set is None:
            return None
        nv: Any = self._nv
        seen: dict[int, list[int]] = {i: [] for i in self._gpus}
        try:
            while True:
                data = nv.nvmlEventSetWait_v2(self._set, 0)
                idx = int(nv.nvmlDeviceGetIndex(data.device))
                seen.setdefault(idx, []).append(int(data.eventData))
        except nv.NVMLError:  # Timeout: no more events queued
            pass
        finally:
            nv.nvmlEventSetFree(self._set)
            nv.nvmlShutdown()
        return seen
