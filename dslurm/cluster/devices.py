"""The placeholder GPU device files of `--gpus-per-node N`: made by `up`, removed by `down`.

Apart from `dslurm.cluster` because it is the one place that touches device nodes (mknod needs
root) and the one place that knows they must exist before slurmd starts: Slurm 22.05 counts a GPU
only if its gres.conf `File=` exists (conf.py says why a count-only line is not enough). The paths
come from `conf.gpu_files`, which gres.conf is rendered from too.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from dslurm.cluster import conf as cc


def make_gpu_devices(state_dir: Path, nodes: int, gpus: int) -> None:
    """Create `gpus` placeholder devices for each of the `nodes` running nodes."""
    for name in cc.node_names(nodes):
        for dev in cc.gpu_files(state_dir, name, gpus):
            dev.parent.mkdir(parents=True, exist_ok=True)
            # slurmd counts a GPU only if its File exists; the devices cgroup tells GPUs apart by number.
            os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(*cc.gpu_device_number(int(dev.name.removeprefix("gpu")))))


def remove_gpu_devices(state_dir: Path) -> None:
    """Remove every node's placeholder devices (none there: nothing to do)."""
    shutil.rmtree(cc.gpu_dev_root(state_dir), ignore_errors=True)
