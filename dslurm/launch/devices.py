"""Which GPU device files this process can open: the devices cgroup's answer, not the environment's.

Under Slurm's ConstrainDevices (task/cgroup) a step's processes live in a devices cgroup that
denies every GPU the step was not given: opening such a device file fails with EPERM before any
driver is asked. CUDA_VISIBLE_DEVICES only says what the step was promised; a process forked by a
warm pool (dslurm/launch/warm.py) carries the new step's variables but lives in the pool step's
cgroup, so only opening the files tells what it can use. An open that reaches the device (it
succeeds, or the driver is absent: ENXIO/ENODEV, as for the local cluster's placeholder devices)
counts as reachable. Torch-free; no device is initialised (open, then close).

The files: `DSLURM_GPU_DEVICES` (a glob; `$VAR`s expanded, e.g. `$SLURMD_NODENAME` for a node's own
placeholder devices on the local cluster), by default NVIDIA's `/dev/nvidia[0-9]*`.
"""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Mapping
from typing import Any

from dslurm.launch.slurm_env import GPU_ENV

DEVICES_ENV = "DSLURM_GPU_DEVICES"
DEFAULT_DEVICES = "/dev/nvidia[0-9]*"
_REACHED = (errno.ENXIO, errno.ENODEV)  # past the cgroup's check, no driver behind the number


def device_files(env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    pattern = env.get(DEVICES_ENV) or DEFAULT_DEVICES
    for k, v in env.items():  # the given environment's variables, not only this process's
        pattern = pattern.replace(f"${{{k}}}", v).replace(f"${k}", v)
    return sorted(glob.glob(pattern))


def can_open(path: str) -> str:
    """'reachable', 'denied' (EPERM/EACCES: the devices cgroup), or the errno's name."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        return "reachable"
    except OSError as exc:
        if exc.errno in _REACHED:
            return "reachable"
        if exc.errno in (errno.EPERM, errno.EACCES):
            return "denied"
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def devices_cgroup() -> str | None:
    """This process's devices cgroup (v1), e.g. /slurm_node1/uid_0/job_7/step_2/task_0; None without one."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for ln in lines:
        _, ctrl, path = ln.split(":", 2)
        if "devices" in ctrl.split(","):
            return path
    return None


def device_view(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What this process can use: each device file's answer, the reachable ones, its devices
    cgroup, and the GPU variables Slurm set (what the step was promised)."""
    env = os.environ if env is None else env
    files = {p: can_open(p) for p in device_files(env)}
    return {"files": files, "reachable": [p for p, v in files.items() if v == "reachable"],
            "cgroup": devices_cgroup(), "gpu_env": {k: env.get(k) for k in GPU_ENV}}


def same_devices(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two views give the same devices: the same files reachable, the same CUDA_VISIBLE_DEVICES. Pure."""
    def visible(v: Mapping[str, Any]) -> object:
        return (v.get("gpu_env") or {}).get("CUDA_VISIBLE_DEVICES")

    return a.get("reachable") == b.get("reachable") and visible(a) == visible(b)
