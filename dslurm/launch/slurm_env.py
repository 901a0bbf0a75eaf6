"""SLURM_* environment -> who am I in the job: node rank, nodes, processes, master.

Pure: `derive(env)` takes a mapping (os.environ inside a job) and returns a
`LaunchInfo`, or raises `UserError` naming the variable that is missing or wrong.
Host lists are expanded by `dslurm.slurm.hosts` (python-hostlist, not a home-made parser).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import hostlist

from dslurm.errors import UserError
from dslurm.slurm.hosts import expand_hosts

# Rendezvous ports are derived from the job id, so every node computes the same port
# without talking. The range stays below Linux's ephemeral range (32768+) and above
# the Slurm daemons' ports (6817-6900 locally); the restart count moves the port so a
# requeued job never trips over its previous incarnation's sockets in TIME_WAIT.
PORT_BASE = 20000
PORT_SPAN = 12000


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchInfo:
    job_id: str
    restart_count: int
    hosts: list[str]
    nnodes: int
    node_rank: int
    hostname: str
    nproc_per_node: int
    master_addr: str
    master_port: int
    world_size: int
    mode: Literal["torchrun", "srun"]
    step_index: int = 0
    """which job step of this start (in-allocation recovery, dslurm/recover/supervise.py); 0 otherwise"""
    # srun mode only (one task per process): this task's global and local rank.
    rank: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def worker_env(self) -> dict[str, str]:
        """Environment for the training processes (torch.distributed env:// + ours)."""
        env = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "DSLURM_NODE_RANK": str(self.node_rank),
            "DSLURM_NNODES": str(self.nnodes),
            "DSLURM_NPROC_PER_NODE": str(self.nproc_per_node),
            "DSLURM_RESTART_COUNT": str(self.restart_count),
            "DSLURM_HOSTNAME": self.hostname,
        }
        if self.mode == "srun":
            env.update(RANK=str(self.rank), LOCAL_RANK=str(self.local_rank),
                       WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.local_world_size),
                       GROUP_RANK=str(self.node_rank))
        return env


# `dslurm.api.run_local` runs one "node" on this machine without Slurm under this job id prefix.
LOCAL_JOB_PREFIX = "local-"


def local_job_id(pid: int) -> str:
    return f"{LOCAL_JOB_PREFIX}{pid}"


STEP_INDEX_ENV = "DSLURM_STEP_INDEX"  # set by `dslurm supervise` for each job step it starts
# Set by `dslurm supervise` on a step it starts after Slurm asked to stop (SIGUSR2 / SIGTERM): the
# launchers leave it for the trainer as if the signal had come during its start-up.
PENDING_STOP_ENV = "DSLURM_PENDING_STOP"
# recovery.replicas: the replica group a job step runs (set by `dslurm supervise`, read by the trainer,
# train/replicas.py; the launcher of a group other than 0 writes no job_start: a group is not a start).
GROUP_ENV = "DSLURM_REPLICA_GROUP"
# A restarted replica group's: the step it was lost at (its heal counts the samples it missed from there).
LOST_STEP_ENV = "DSLURM_REPLICA_LOST_STEP"


def master_port(job_id: str, restart_count: int = 0, step_index: int = 0) -> int:
    """Same value on every node of a job; differs between jobs, between restarts and between
    the job steps of one start (in-allocation recovery)."""
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return PORT_BASE + (int(digits) + 4099 * restart_count + 7919 * step_index) % PORT_SPAN


LIGHTHOUSE_STEP = 1000
"""The step index the Lighthouse's port is derived with (`lighthouse_port`): no job step of a
start reaches it, and 7919 is prime to PORT_SPAN, so no step's master port equals it."""


def lighthouse_port(job_id: str, restart_count: int = 0) -> int:
    """The port of a replica-group job's torchft Lighthouse (recovery.replicas): the batch script
    starts it there (dslurm.recover.lighthouse), `dslurm supervise` hands its address to every group."""
    return master_port(job_id, restart_count, LIGHTHOUSE_STEP)


def _job_id(env: Mapping[str, str]) -> str:
    """Slurm's job ids are decimal numbers (array tasks and het components too: their own
    numeric SLURM_JOB_ID); the master port and the facts paths are derived from it."""
    var = "SLURM_JOB_ID" if env.get("SLURM_JOB_ID") else "SLURM_JOBID"
    job_id = _need(env, "SLURM_JOB_ID", "SLURM_JOBID")
    number = job_id.removeprefix(LOCAL_JOB_PREFIX)
    if not (number.isascii() and number.isdigit()):
        raise UserError(f"environment variable {var}={job_id!r} is not a Slurm job id (a number like 4242). "
                        "Fix: run inside a Slurm allocation, or set it to a number when testing by hand")
    return job_id


def _need(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    alts = " or ".join(names)
    raise UserError(f"environment variable {alts} is not set. This command runs inside a Slurm "
                    "allocation (sbatch/srun); outside one, set it by hand to test")


def _int(env: Mapping[str, str], name: str, value: str, minimum: int = 0, maximum: int | None = None,
         fix: str = "") -> int:
    fix = f". Fix: {fix}" if fix else ""
    try:
        n = int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer{fix}") from None
    if n < minimum or (maximum is not None and n > maximum):
        span = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise UserError(f"environment variable {name}={n} must be {span}{fix}")
    return n


# The GPU variables Slurm sets in a job step that asked for GPUs (--gpus-per-node, --gres=gpu:N).
# `dslurm launch` passes them to the workers unchanged: CUDA_VISIBLE_DEVICES renumbers the node's
# GPUs from 0, so a worker's device is cuda:LOCAL_RANK; a CPU run ignores them (no device is set).
# A CPU job on a node with GPUs sees only SLURM_JOB_GPUS (--exclusive gives it the node's gres)
# and in its steps none of the others, so gpus_on_node() is None there.
GPU_ENV = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
           "CUDA_VISIBLE_DEVICES")


def gpus_on_node(env: Mapping[str, str]) -> int | None:
    """GPUs Slurm gave this node: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, which repeats
    `--gpus-per-node=[type:]count[,[type:]count...]` ('8', 'h100:8', 'a100:2,v100:2' = 4)."""
    if env.get("SLURM_GPUS_ON_NODE"):
        return _int(env, "SLURM_GPUS_ON_NODE", env["SLURM_GPUS_ON_NODE"])
    per_node = env.get("SLURM_GPUS_PER_NODE")
    if not per_node:
        return None
    total = 0
    for item in per_node.split(","):
        count = item.rsplit(":", 1)[-1].strip()
        if not (count.isascii() and count.isdigit()):
            raise UserError(f"environment variable SLURM_GPUS_PER_NODE={per_node!r}: {item!r} is not "
                            "[type:]count. Fix: ask Slurm like --gpus-per-node=8 or --gpus-per-node=h100:8")
        total += int(count)
    return total


def derive(env: Mapping[str, str], *, nproc_per_node: int | None = None,
           mode: Literal["torchrun", "srun"] = "torchrun") -> LaunchInfo:
    """Derive the launch layout from the SLURM_* variables of one task.

    A job step's own variables (SLURM_STEP_NODELIST, SLURM_STEP_NUM_NODES) win over
    the job's, because a step may run on a subset of the allocation.
    """
    job_id = _job_id(env)
    node_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    hosts = expand_hosts(_need(env, node_var, "SLURM_NODELIST"), node_var)
    nn_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    nnodes = _int(env, nn_var, _need(env, nn_var, "SLURM_JOB_NUM_NODES"), 1)
    if nnodes != len(hosts):
        raise UserError(f"inconsistent Slurm environment: {nn_var}={nnodes} but {node_var} expands to "
                        f"{len(hosts)} hosts ({', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''})")
    node_rank = _int(env, "SLURM_NODEID", _need(env, "SLURM_NODEID"))
    if node_rank >= nnodes:
        raise UserError(f"inconsistent Slurm environment: SLURM_NODEID={node_rank} but only {nnodes} nodes")
    me = env.get("SLURMD_NODENAME")
    if me and me in hosts and hosts.index(me) != node_rank:
        raise UserError(f"inconsistent Slurm environment: SLURMD_NODENAME={me} is host "
                        f"#{hosts.index(me)} of {node_var}, but SLURM_NODEID={node_rank}")
    restart = _int(env, "SLURM_RESTART_COUNT", env.get("SLURM_RESTART_COUNT") or "0")
    step_index = _int(env, STEP_INDEX_ENV, env.get(STEP_INDEX_ENV) or "0")
    gpus = gpus_on_node(env)
    port = master_port(job_id, restart, step_index)
    if env.get("DSLURM_MASTER_PORT"):
        port = _int(env, "DSLURM_MASTER_PORT", env["DSLURM_MASTER_PORT"], 1, 65535,
                    fix="use a free TCP port, e.g. 29500, or unset it to derive one from the job id")
    common = dict(job_id=job_id, restart_count=restart, hosts=hosts, nnodes=nnodes, node_rank=node_rank,
                  hostname=hosts[node_rank], master_addr=hosts[0], master_port=port, mode=mode,
                  step_index=step_index)
    if mode == "srun":
        return _derive_srun(env, common, gpus)
    if nproc_per_node is not None:
        nproc = nproc_per_node
    elif gpus:
        nproc = gpus
    else:
        if gpus == 0:
            var = "SLURM_GPUS_ON_NODE" if env.get("SLURM_GPUS_ON_NODE") else "SLURM_GPUS_PER_NODE"
            raise UserError(f"Slurm allocated no GPUs on this node ({var}={env.get(var)!r}), so there is no "
                            "process per GPU to start. Fix: ask for GPUs (sbatch --gpus-per-node=N or "
                            "--gres=gpu:N), or for a CPU run pass --nproc-per-node N")
        raise UserError("cannot tell processes per node: Slurm reports no GPUs for this node (SLURM_GPUS_ON_NODE "
                        "is not set). Fix: ask for GPUs (sbatch --gpus-per-node=N), or pass --nproc-per-node N")
    if nproc < 1:
        raise UserError(f"--nproc-per-node={nproc} must be at least 1")
    if gpus and nproc > gpus:
        raise UserError(f"--nproc-per-node={nproc} but Slurm gave this node {gpus} GPUs "
                        "(SLURM_GPUS_ON_NODE). Fix: ask for whole nodes or lower --nproc-per-node")
    return LaunchInfo(**common, nproc_per_node=nproc, world_size=nproc * nnodes)  # type: ignore[arg-type]


def _derive_srun(env: Mapping[str, str], common: dict[str, Any], gpus: int | None) -> LaunchInfo:
    """One srun task per process: ranks come straight from Slurm."""
    rank = _int(env, "SLURM_PROCID", _need(env, "SLURM_PROCID"))
    local_rank = _int(env, "SLURM_LOCALID", _need(env, "SLURM_LOCALID"))
    world = _int(env, "SLURM_NTASKS", _need(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), 1)
    tpn_var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    raw = _need(env, tpn_var)
    try:
        per_node = hostlist.parse_slurm_tasks_per_node(raw)
    except Exception:  # the library raises bare errors on junk
        raise UserError(f"environment variable {tpn_var}={raw!r} is not like '2(x3),1'") from None
    if len(per_node) != common["nnodes"] or sum(per_node) != world:
        raise UserError(f"inconsistent Slurm environment: {tpn_var}={raw!r} gives {per_node}, but there are "
                        f"{common['nnodes']} nodes and SLURM_NTASKS={world}")
    local_world = per_node[common["node_rank"]]  # uneven nodes: not ntasks // nnodes
    if rank >= world or local_rank >= local_world:
        raise UserError(f"inconsistent Slurm environment: SLURM_PROCID={rank}, SLURM_LOCALID={local_rank} "
                        f"outside {world} tasks / {local_world} on this node")
    return LaunchInfo(**common, nproc_per_node=local_world, world_size=world, rank=rank,
                      local_rank=local_rank, local_world_size=local_world)
