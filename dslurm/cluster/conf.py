"""Pure rendering of the local cluster's config files (slurm.conf, gres.conf, slurmdbd.conf).

No I/O here: `dslurm.cluster` decides paths and writes the text. Everything a test wants
to check about the config (ports, node lines, GPU gres, requeue timing) is computable from
`ClusterSpec` alone.

GPU gres (`gpus` > 0): Slurm 22.05's slurmd drops a count-only `Name=gpu Count=N` gres.conf
line ("Removing file-less GPU") and the node goes INVAL, so every placeholder GPU is a `File=`
entry: a character device under the state dir, one set per node (`gpu_files`), numbered as a
real node's /dev/nvidiaK (major 195, minor K: `gpu_device_number`). No driver serves them, so
opening one fails with ENXIO, which proves the open got past the devices cgroup.

Device constraint (`constrain_devices`): TaskPlugin=task/cgroup with cgroup.conf's
ConstrainDevices=yes, as GPU sites run it. slurmd then puts every step's tasks into a devices
cgroup (v1, /sys/fs/cgroup/devices/slurm_NODE/...) that denies the GPUs the step was not given:
opening one fails with EPERM. Seen here: a step of a `--gpus-per-node=2` job that asks for
`--gpus-per-node=1` opens gpu0 (ENXIO) but not gpu1 (EPERM); `--gres=none` opens neither. Only
the devices are constrained (cores and memory are not: the nodes' CPUs are declared, not real).
Proctrack stays pgid: each slurmd's tini subreaper cleans up, as without the constraint.

Shapes (`shapes`): extra partitions of nodes shaped like a real site (GPUs, CPUs, memory,
partition name) for `sbatch --test-only` only. They are declared State=CLOUD, which Slurm
treats as powered down, so they are never started, never pinged and never marked down, yet
slurmctld checks a job against their declared resources exactly as it would at the site.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

CLUSTER_NAME = "dslurm"
PARTITION = "debug"
# Ports: slurmctld, slurmdbd, MariaDB, then one slurmd port per node. Chosen away from the
# Slurm defaults (6817-6819) so a site Slurm on the same host does not collide.
CTLD_PORT = 16817
DBD_PORT = 16818
MYSQL_PORT = 16819
SLURMD_PORT_BASE = 16820
# Job ids are capped by Slurm at MaxJobId <= 67,043,328 (0x03ff0000).
MAX_JOB_ID = 67_043_328
# Time-based FirstJobId: one id per 10 s since this epoch (2025-01-01 UTC), so a cluster whose
# state was wiped never reuses the ids of an earlier run (log folders are keyed by job id).
_JOBID_EPOCH = 1_735_689_600
_JOBID_SECONDS_PER_ID = 10
_Node = TypeVar("_Node", bound=Mapping[str, Any])  # a node as slurm.parse_sinfo_nodes gives it


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class NodeShape:
    """A partition of never-started nodes shaped like a site, for `sbatch --test-only`."""

    partition: str
    nodes: int
    cpus: int
    memory_mb: int
    gpus: int = 0
    gpu_type: str | None = None
    """gres type (`gpu:a100:4` in the node line) so `--gres=gpu:a100:N` matches; untyped
    requests (`--gpus-per-node=N`) match a typed gres too."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", self.partition) or self.partition == PARTITION:
            raise ValueError(f"partition={self.partition!r}: must be a plain name (letters, digits, _) "
                             f"other than {PARTITION!r}, the running nodes' partition")
        if self.nodes < 1 or self.cpus < 1 or self.memory_mb < 1 or self.gpus < 0:
            raise ValueError(f"shape {self.partition}: nodes={self.nodes}, cpus={self.cpus}, "
                             f"memory_mb={self.memory_mb} must be >= 1 and gpus={self.gpus} >= 0")
        if self.gpu_type is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.gpu_type):
            raise ValueError(f"shape {self.partition}: gpu_type={self.gpu_type!r} is not a gres type name")

    def names(self) -> list[str]:
        return [f"{self.partition}-n{k}" for k in range(1, self.nodes + 1)]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ClusterSpec:
    """Everything that shapes the local cluster's config."""

    state_dir: Path
    """Root of config, logs, spool, controller state, pid records."""
    nodes: int = 2
    """Number of slurmd daemons (node1..nodeN) on this host."""
    cpus: int = 4
    """Virtual CPUs per node (slurmd runs with config_overrides, so more than the host has is fine)."""
    memory_mb: int = 4096
    """RealMemory per node; memory is not a consumable resource here (CR_Core)."""
    gpus: int = 0
    """Placeholder GPUs (gres gpu) per running node; see the module docstring."""
    shapes: tuple[NodeShape, ...] = ()
    """Never-started partitions shaped like sites, for `sbatch --test-only`."""
    constrain_devices: bool = False
    """task/cgroup with ConstrainDevices=yes: a step's processes open only its GPUs (module docstring)."""
    accounting: bool = False
    """Run slurmdbd + MariaDB so sacct works."""
    controller_host: str = "localhost"
    """The host's real hostname: slurmctld/slurmdbd refuse to start under any other name."""
    first_job_id: int = 1
    ctld_port: int = CTLD_PORT
    """slurmctld's port (tests render a config for a controller that is not running)."""
    message_timeout: int = 10
    """Seconds a client waits for the controller; also how long an error takes when it is down."""
    job_requeue: bool = True
    """JobRequeue: batch jobs requeue by default. Not a setting: a test turns it off for a moment
    (`scontrol reconfigure`), and `up` renders it back on (daemons.restore_conf, RUNTIME_KEYS)."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ValueError(f"nodes={self.nodes}: must be between 1 and 64")
        if self.cpus < 1:
            raise ValueError(f"cpus={self.cpus}: must be >= 1")
        if not 1 <= self.first_job_id < MAX_JOB_ID:
            raise ValueError(f"first_job_id={self.first_job_id}: must be in [1, {MAX_JOB_ID})")
        if not 0 <= self.gpus <= 64:
            raise ValueError(f"gpus={self.gpus}: must be between 0 and 64 per node")
        parts = [s.partition for s in self.shapes]
        if len(set(parts)) != len(parts):
            raise ValueError(f"shapes: partition names {parts} must differ")

    @property
    def declares_gpus(self) -> bool:
        return self.gpus > 0 or any(s.gpus for s in self.shapes)

    def settings(self) -> dict[str, object]:
        """What makes two clusters 'the same' for idempotent `up` (job ids excluded)."""
        return {"nodes": self.nodes, "cpus": self.cpus, "memory_mb": self.memory_mb,
                "accounting": self.accounting, "gpus": self.gpus,
                "shapes": [s.as_dict() for s in self.shapes],
                # only when on: a cluster recorded before the mode existed is the same as one without it
                **({"constrain_devices": True} if self.constrain_devices else {})}


def shapes_from_settings(raw: object) -> tuple[NodeShape, ...]:
    """`settings()["shapes"]` (as stored in cluster.json) back into NodeShapes."""
    return tuple(NodeShape(**s) for s in raw) if isinstance(raw, list) else ()


def node_names(nodes: int) -> list[str]:
    return [f"node{k}" for k in range(1, nodes + 1)]


def running_nodes(sinfo_nodes: Iterable[_Node], nodes: int) -> list[_Node]:
    """The entries of `slurm.parse_sinfo_nodes` that are one of the `nodes` started slurmds
    (node1..nodeN), in sinfo's order. sinfo also lists the shaped partitions' never-started
    (CLOUD) nodes, which would never be idle or responding; matched by exact name, so node10
    is not node1."""
    started = set(node_names(nodes))
    return [n for n in sinfo_nodes if n["name"] in started]


def node_port(index: int) -> int:
    """Port of the slurmd of node `index` (1-based)."""
    return SLURMD_PORT_BASE + index - 1


def time_based_job_id(now: float) -> int:
    """A FirstJobId that grows with wall-clock time (see _JOBID_SECONDS_PER_ID)."""
    value = int((now - _JOBID_EPOCH) // _JOBID_SECONDS_PER_ID)
    return min(max(value, 1), MAX_JOB_ID - 1_000_000)


def max_job_id_in_log(text: str) -> int:
    """Highest JobId mentioned in a slurmctld log (0 if none): ids used by earlier runs."""
    ids = [int(m) for m in re.findall(r"JobId=(\d+)", text)]
    return max(ids, default=0)


def next_first_job_id(now: float, previous_max: int) -> int:
    """FirstJobId for a fresh controller state: after every id seen before, and time-based."""
    return min(max(time_based_job_id(now), previous_max + 1), MAX_JOB_ID - 1)


def hosts_line(nodes: int, state_dir: Path) -> str:
    """The /etc/hosts line `up` adds; the marker comment lets `down` remove exactly it."""
    return f"127.0.0.1 {' '.join(node_names(nodes))}  # dslurm-cluster {state_dir}"


def gpu_dev_root(state_dir: Path) -> Path:
    """The folder holding every node's placeholder GPU device files (devices.py makes them)."""
    return state_dir / "dev"


def gpu_files(state_dir: Path, node: str, gpus: int) -> list[Path]:
    """The placeholder device files of one node's GPUs (made by `up`, removed by `down`)."""
    return [gpu_dev_root(state_dir) / node / f"gpu{i}" for i in range(gpus)]


# The character-device major of NVIDIA's /dev/nvidiaK (minor K): the placeholders carry a real GPU
# node's numbers, distinct per GPU, because the devices cgroup allows and denies by number (the null
# device's 1:3, used before the constraint mode, would have denied /dev/null to every step).
GPU_MAJOR = 195


def gpu_device_number(index: int) -> tuple[int, int]:
    """(major, minor) of a node's placeholder GPU `index`."""
    return GPU_MAJOR, index


def render_cgroup_conf(spec: ClusterSpec) -> str:
    """cgroup.conf beside slurm.conf: read by task/cgroup (`constrain_devices`) only."""
    return "\n".join([
        "# Generated by `dslurm cluster up`. Do not edit. Read only with TaskPlugin=task/cgroup.",
        "CgroupPlugin=cgroup/v1",  # this machine mounts v1 controllers (devices among them) + a v2 tree
        "CgroupMountpoint=/sys/fs/cgroup",
        f"ConstrainDevices={'yes' if spec.constrain_devices else 'no'}",
        "ConstrainCores=no",
        "ConstrainRAMSpace=no",
        "ConstrainSwapSpace=no",
    ]) + "\n"


def render_gres_conf(spec: ClusterSpec) -> str:
    """One line per running node naming its placeholder GPUs; empty without GPUs. Shaped nodes
    need none: slurmctld takes their counts from the node lines, and no slurmd reads this for them."""
    lines = ["# Generated by `dslurm cluster up --gpus-per-node N`. Do not edit."]
    for name in node_names(spec.nodes) if spec.gpus else []:
        first = gpu_files(spec.state_dir, name, 1)[0]  # gpu0; gres.conf's range form names the rest
        files = str(first) if spec.gpus == 1 else f"{first.parent}/gpu[0-{spec.gpus - 1}]"
        lines.append(f"NodeName={name} Name=gpu File={files}")
    return "\n".join(lines) + "\n"


def _shape_lines(shape: NodeShape) -> list[str]:
    gres = ""
    if shape.gpus:
        gres = f" Gres=gpu:{shape.gpu_type + ':' if shape.gpu_type else ''}{shape.gpus}"
    names = shape.names()
    return [
        f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={n} CPUs={shape.cpus} Boards=1 SocketsPerBoard=1 "
        f"CoresPerSocket={shape.cpus} ThreadsPerCore=1 RealMemory={shape.memory_mb}{gres} State=CLOUD"
        for n in names
    ] + [f"PartitionName={shape.partition} Nodes={','.join(names)} MaxTime=INFINITE State=UP"]


def render_slurm_conf(spec: ClusterSpec) -> str:
    d = spec.state_dir
    names = node_names(spec.nodes)
    lines = [
        "# Generated by `dslurm cluster up`; rewritten on every start. Do not edit.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={spec.controller_host}(127.0.0.1)",
        f"SlurmctldPort={spec.ctld_port}",
        f"SlurmdPort={SLURMD_PORT_BASE}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire bounds how long a requeued job waits before it may start again
        # (default 120 s, minimum 5): 10 s gives ~11 s requeue cycles.
        f"AuthInfo=socket={d}/munge/munge.socket.2,cred_expire=10",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={d}/ctld",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # pgid: a tini subreaper around each slurmd cleans up. task/cgroup only for the devices
        # cgroup of `constrain_devices` (the module docstring).
        "ProctrackType=proctrack/pgid",
        f"TaskPlugin={'task/cgroup' if spec.constrain_devices else 'task/none'}",
        "JobAcctGatherType=jobacct_gather/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # Declared CPUs/memory win over what slurmd detects (2 real cores here).
        "SlurmdParameters=config_overrides",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1,sched_interval=1",
        "ReturnToService=2",
        f"JobRequeue={int(spec.job_requeue)}",
        "KillWait=15",  # grace between TERM and KILL: time for the save-on-TERM (sites use 30-120)
        "MinJobAge=300",
        "InactiveLimit=0",
        "Waittime=0",
        "SlurmctldTimeout=10",
        # A node whose slurmd stopped answering is marked down after this long (pinged every third
        # of it): seconds, so tests lose a node for real in-allocation (issue 17), not minutes.
        "SlurmdTimeout=10",
        f"MessageTimeout={spec.message_timeout}",
        "PropagateResourceLimits=NONE",
        "MailProg=/bin/true",
        f"FirstJobId={spec.first_job_id}",
        f"MaxJobId={MAX_JOB_ID}",
        "JobCompType=jobcomp/none",
    ]
    if spec.declares_gpus:
        lines.append("GresTypes=gpu")
        if spec.accounting:  # slurmctld refuses to start with a gres TRES but no slurmdbd
            # Tracked as a TRES, as GPU sites do: a job's TRES (scontrol, sacct) shows gres/gpu=N.
            lines.append("AccountingStorageTRES=gres/gpu")
    if spec.shapes:
        # Power saving only so CLOUD nodes count as powered down (never started, never pinged):
        # nothing is ever resumed (a job on them is only ever --test-only), and the running
        # nodes are excluded from suspension.
        lines += ["ResumeProgram=/bin/false", "SuspendProgram=/bin/true", "SuspendTime=INFINITE",
                  f"SuspendExcNodes={','.join(names)}", "ResumeTimeout=60"]
    if spec.accounting:
        lines += [
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={DBD_PORT}",
            # The slurmdbd connection authenticates through this munge socket, not AuthInfo's.
            f"AccountingStoragePass={d}/munge/munge.socket.2",
        ]
    else:
        lines.append("AccountingStorageType=accounting_storage/none")
    for k, name in enumerate(names, start=1):
        lines.append(
            f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={node_port(k)} "
            f"CPUs={spec.cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={spec.cpus} "
            f"ThreadsPerCore=1 RealMemory={spec.memory_mb}"
            f"{f' Gres=gpu:{spec.gpus}' if spec.gpus else ''} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName={PARTITION} Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP"
    )
    for shape in spec.shapes:
        lines += _shape_lines(shape)
    return "\n".join(lines) + "\n"


# slurm.conf keys a running cluster may have changed for a moment and `scontrol reconfigure`d (a test of
# `dslurm site check` turns JobRequeue off): `up` renders them back when they are all that differs.
RUNTIME_KEYS = frozenset({"JobRequeue"})


def changed_keys(on_disk: str, rendered: str) -> set[str]:
    """The keys of the slurm.conf lines in which two texts differ (a node or partition line by its name)."""
    differ = set(on_disk.splitlines()) ^ set(rendered.splitlines())
    return {ln.split("=", 1)[0] if not ln.startswith(("NodeName=", "PartitionName=")) else ln.split()[0]
            for ln in differ if ln.strip()}


def first_job_id_of(text: str) -> int | None:
    """The FirstJobId a rendered slurm.conf holds (each start picks its own: next_first_job_id)."""
    m = re.search(r"^FirstJobId=(\d+)$", text, re.M)
    return int(m.group(1)) if m else None


def render_slurmdbd_conf(spec: ClusterSpec) -> str:
    d = spec.state_dir
    return "\n".join([
        "# Generated by `dslurm cluster up --accounting`. Do not edit.",
        "AuthType=auth/munge",
        f"AuthInfo=socket={d}/munge/munge.socket.2",
        f"DbdHost={spec.controller_host}",
        "DbdAddr=127.0.0.1",
        f"DbdPort={DBD_PORT}",
        "SlurmUser=root",
        f"PidFile={d}/run/slurmdbd.pid",
        f"LogFile={d}/log/slurmdbd.log",
        "DebugLevel=info",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={MYSQL_PORT}",
        "StorageUser=root",
        "StorageLoc=slurm_acct_db",
    ]) + "\n"


def mariadb_args(spec: ClusterSpec) -> list[str]:
    """mariadbd flags: private datadir and port, small buffers, no durability (a test cluster)."""
    d = spec.state_dir
    return [
        "--no-defaults",
        f"--datadir={d}/mysql",
        f"--socket={d}/run/mysqld.sock",
        f"--pid-file={d}/run/mysqld.pid",
        f"--log-error={d}/log/mariadb.log",
        f"--port={MYSQL_PORT}",
        "--bind-address=127.0.0.1",
        "--user=root",
        "--skip-name-resolve",
        "--skip-log-bin",
        "--innodb-buffer-pool-size=64M",
        "--innodb-flush-log-at-trx-commit=0",
        "--innodb-doublewrite=0",
    ]
