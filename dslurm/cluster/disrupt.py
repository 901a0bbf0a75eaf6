"""What the outside world does to jobs on the local cluster: kill or freeze a job's processes (all
of them, one node's job steps, one worker), lose a node for real (its slurmd and everything under
it), stop slurmctld for a while. Shared by the cluster tests (tests/cluster/) and
`dslurm selftest chaos` (dslurm/selftest/chaos/); none of it touches a knob inside the trainer.

Every process of a job carries SLURM_JOB_ID in its environment (slurmstepd itself does not); the
processes of a job step also carry SLURM_STEP_ID, which the batch shell (and the srun and
`dslurm supervise` it runs) does not. /proc/PID/environ is the environment a process was exec'ed
with: a warm pool's forked workers show the pool's, so workers are told apart by their place in
the process tree, not by RANK.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm.cluster.proc import descendants


@dataclass(frozen=True, slots=True)
class JobProc:
    pid: int
    ppid: int
    node: str | None
    """SLURMD_NODENAME: the node whose slurmd started it"""
    step: str | None
    """SLURM_STEP_ID; None for the batch shell and what it runs (srun, supervise)"""
    cmdline: str


def _read_proc(pid: int) -> tuple[dict[str, str], int, str] | None:
    base = Path(f"/proc/{pid}")
    try:
        raw = (base / "environ").read_bytes()
        ppid = int((base / "stat").read_text().rpartition(")")[2].split()[1])
        cmd = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError, IndexError):
        return None
    env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    return env, ppid, cmd


def job_processes(job_id: int | str) -> list[JobProc]:
    """Every live process of the job (batch shell, srun, launchers, torchrun, pools, workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        got = _read_proc(int(entry))
        if got is None or got[0].get("SLURM_JOB_ID") != str(job_id):
            continue
        env, ppid, cmd = got
        out.append(JobProc(int(entry), ppid, env.get("SLURMD_NODENAME"), env.get("SLURM_STEP_ID"), cmd))
    return out


def job_pids(job_id: int | str) -> list[int]:
    return [p.pid for p in job_processes(job_id)]


def workers(job_id: int | str, marker: str) -> list[JobProc]:
    """The job's training processes: those whose command line holds `marker` (the run's job.yaml,
    which the trainer's --job names, or an own script's path), whose parent's does too (torchrun,
    or the warm pool that forked it) and none of whose children does (the launcher and torchrun
    name it as well). A warm pool's parent is slurmstepd: idle or serving, it is never a worker."""
    procs = [p for p in job_processes(job_id) if p.step is not None and marker in p.cmdline]
    pids = {p.pid for p in procs}
    parents = {p.ppid for p in procs}
    return [p for p in procs if p.pid not in parents and p.ppid in pids]


def step_processes(job_id: int | str, node: str) -> list[JobProc]:
    """Every process of the job's steps on `node` (training step, warm pool, probes), not the batch
    shell: what a node's loss takes from a job that keeps its batch shell elsewhere."""
    return [p for p in job_processes(job_id) if p.step is not None and p.node == node]


def signal_pids(pids: list[int], sig: int) -> list[int]:
    """Send `sig` to each; -> the pids it reached."""
    hit = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except ProcessLookupError:
            pass
    return hit


def kill_node(name: str, state_dir: str | os.PathLike[str] | None = None) -> None:
    """Node loss for real: SIGKILL the node's slurmd (with its tini) and every process under it
    (slurmstepd, launchers, workers). Slurm marks the node down after SlurmdTimeout; bring it
    back with `dslurm cluster up` (`cluster.up(nodes=3, accounting=True)`)."""
    from dslurm.cluster.state import load, state_dir_of

    rec = load(state_dir_of(state_dir)) or {}
    proc: dict[str, Any] = next(p for p in rec.get("procs", []) if p["name"] == name)
    signal_pids([p["pid"] for p in [*descendants(proc["pid"]), proc]], signal.SIGKILL)
