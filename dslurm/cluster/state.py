"""The local cluster's state dir and its record (`cluster.json`): where it is, what it holds,
the machine lock, and whether the daemons it records answer as a healthy cluster.

Apart from `dslurm.cluster` (up/down/status) because the daemon and host-change modules
(daemons.py, host.py) read and write the same record and ask the same health question.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.cluster import conf as cc
from dslurm.cluster.proc import alive, atomic_write
from dslurm.errors import SlurmError, UserError

ENV_DIR = "DSLURM_CLUSTER_DIR"
DEFAULT_DIR = Path("/tmp/dslurm-cluster")
# One lock for the whole machine: clusters share ports, /etc/hosts and /etc/slurm.
LOCK_PATH = Path(tempfile.gettempdir()) / "dslurm-cluster.lock"
RECORD = "cluster.json"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ClusterInfo:
    """A running local cluster, as `up` returns it."""

    state_dir: Path
    nodes: int
    accounting: bool
    node_names: tuple[str, ...]
    partition: str = cc.PARTITION
    gpus: int = 0
    """placeholder GPUs per node"""
    shapes: tuple[cc.NodeShape, ...] = ()
    constrain_devices: bool = False
    """task/cgroup ConstrainDevices=yes: a step opens only its GPUs (dslurm/cluster/conf.py)"""

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """Environment for client commands (also found via /etc/slurm/slurm.conf)."""
        return {"SLURM_CONF": str(self.slurm_conf)}


def state_dir_of(state_dir: str | os.PathLike[str] | None) -> Path:
    return Path(state_dir or os.environ.get(ENV_DIR) or DEFAULT_DIR).absolute()


def info_of(sdir: Path, rec: dict[str, Any]) -> ClusterInfo:
    s = rec["settings"]
    return ClusterInfo(state_dir=sdir, nodes=s["nodes"], accounting=s["accounting"],
                       node_names=tuple(cc.node_names(s["nodes"])), gpus=int(s.get("gpus", 0)),
                       shapes=cc.shapes_from_settings(s.get("shapes")),
                       constrain_devices=bool(s.get("constrain_devices")))


def is_up(state_dir: str | os.PathLike[str] | None = None) -> bool:
    sdir = state_dir_of(state_dir)
    rec = load(sdir)
    return rec is not None and bool(rec) and healthy(sdir, rec)


def healthy(sdir: Path, rec: dict[str, Any]) -> bool:
    if not rec.get("procs") or not all(alive(p) for p in rec["procs"]):
        return False
    env = {"SLURM_CONF": str(sdir / "etc" / "slurm.conf")}
    try:  # generous timeout: a loaded 2-core machine must not get its cluster restarted
        proc = slurm.run_cmd(["sinfo", "-N", "-h", "-o", "%N|%T|%c|%m|%P"], check=False,
                             timeout=20, env=env)
    except SlurmError:
        return False
    if proc.returncode != 0:
        return False
    nodes = cc.running_nodes(slurm.parse_sinfo_nodes(proc.stdout), rec["settings"]["nodes"])
    ok = {"idle", "allocated", "mixed", "completing"}
    return len(nodes) == rec["settings"]["nodes"] and all(
        n["responding"] and n["state"] in ok for n in nodes)


def load(sdir: Path) -> dict[str, Any] | None:
    try:
        rec: dict[str, Any] = json.loads((sdir / RECORD).read_text())
        return rec
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, OSError) as exc:
        raise UserError(f"{sdir / RECORD} is unreadable ({exc}); stop any dslurm daemons "
                        f"by hand and delete the file") from exc


def save(sdir: Path, rec: dict[str, Any]) -> None:
    atomic_write(sdir / RECORD, (json.dumps(rec, indent=1) + "\n").encode())


class machine_lock:  # lower case: used as `with machine_lock():`, like a function
    def __enter__(self) -> None:
        self._fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # releases the flock
