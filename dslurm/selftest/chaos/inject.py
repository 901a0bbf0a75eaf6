"""One fault of the schedule, done to the running job from outside (dslurm/cluster/disrupt.py for
processes and the controller, Slurm's own commands for the rest). Each returns what it did, or why
it could not (nothing of that kind runs now: the fault is recorded as skipped, never faked).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.cluster import disrupt
from dslurm.errors import SlurmError
from dslurm.selftest.chaos.schedule import Fault, pick
from dslurm.slurm.hosts import expand_hosts

log = logging.getLogger(__name__)
FILLER = ".chaos-fill"  # the file that fills the durable filesystem, at its root (never in the run dir)


@dataclass(kw_only=True, slots=True)
class Target:
    """The job as the soak sees it."""

    job_id: int
    marker: str
    """a string on every training process's command line (the run's job.yaml, or the own script)"""
    run_dir: Path
    fill_root: Path | None
    """the durable filesystem's mount point (disk_full), None when it could not be mounted"""
    env: Mapping[str, str] = field(default_factory=dict)
    training_hosts: Callable[[], list[str]] = list
    """the hosts of the running job step (its latest job_start)"""


@dataclass(kw_only=True, slots=True)
class Done:
    fault: Fault
    t: float
    """wall clock when it was done (or found impossible)"""
    injected: bool
    detail: str
    t_end: float | None = None
    """when a held condition ended (slurmctld back, disk freed, spare resumed)"""

    def to_dict(self) -> dict[str, Any]:
        return {**self.fault.to_dict(), "t": self.t, "injected": self.injected, "detail": self.detail,
                "t_end": self.t_end}


def _job_state(tg: Target) -> tuple[str | None, list[str]]:
    proc = slurm.run_cmd(["scontrol", "-o", "show", "job", str(tg.job_id)], check=False, timeout=20, env=tg.env)
    recs = slurm.parse_scontrol_records(proc.stdout) if proc.returncode == 0 else []
    if not recs:
        return None, []
    nodes = recs[0].get("NodeList", "")
    return recs[0].get("JobState"), (expand_hosts(nodes) if nodes and nodes != "(null)" else [])


def _signal_workers(tg: Target, f: Fault, sig: int, what: str, wait_s: float) -> Done:
    deadline = time.monotonic() + wait_s
    while True:
        live = sorted(disrupt.workers(tg.job_id, tg.marker), key=lambda p: (p.node or "", p.pid))
        if live or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not live:
        return Done(fault=f, t=time.time(), injected=False, detail=f"no training process alive within {wait_s:.0f} s")
    p = pick(live, f.target)
    hit = disrupt.signal_pids([p.pid], sig)
    return Done(fault=f, t=time.time(), injected=bool(hit),
                detail=f"{what} pid {p.pid} on {p.node} ({len(live)} training processes)" if hit else
                f"pid {p.pid} on {p.node} was gone before the signal")


def _kill_node_step(tg: Target, f: Fault, wait_s: float) -> Done:
    deadline = time.monotonic() + wait_s
    hosts: list[str] = []
    while time.monotonic() <= deadline:
        hosts = [h for h in tg.training_hosts()
                 if any(tg.marker in p.cmdline for p in disrupt.step_processes(tg.job_id, h))]
        if hosts:
            break
        time.sleep(0.2)
    if not hosts:
        return Done(fault=f, t=time.time(), injected=False, detail=f"no training node within {wait_s:.0f} s")
    node = pick(sorted(hosts), f.target)
    procs = disrupt.step_processes(tg.job_id, node)
    hit = disrupt.signal_pids([p.pid for p in procs], signal.SIGKILL)
    return Done(fault=f, t=time.time(), injected=bool(hit),
                detail=f"kill -9 of {len(hit)} job-step process(es) on {node}")


def _slurm_cmd(tg: Target, f: Fault, argv: list[str], what: str) -> Done:
    state, _ = _job_state(tg)
    if state != "RUNNING":
        return Done(fault=f, t=time.time(), injected=False, detail=f"job {state or 'unknown'}, not running")
    proc = slurm.run_cmd(argv, check=False, timeout=30, env=tg.env)
    ok = proc.returncode == 0
    return Done(fault=f, t=time.time(), injected=ok,
                detail=what if ok else f"`{' '.join(argv)}` refused: {(proc.stderr or proc.stdout).strip()}")


def _ctld_restart(tg: Target, f: Fault) -> Done:
    from dslurm import cluster

    t = time.time()
    try:
        gone = cluster.restart_slurmctld(f.hold_s)
    except SlurmError as exc:
        return Done(fault=f, t=t, injected=False, detail=str(exc))
    return Done(fault=f, t=t, injected=True, t_end=time.time(),
                detail=f"slurmctld down {f.hold_s:.1f} s, answering again after {gone:.1f} s")


def fill(root: Path) -> int:
    """Fill the filesystem at `root` to the last block; -> bytes taken."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    fd = os.open(root / FILLER, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, free)
        except OSError:  # a filesystem without fallocate: write until it is full
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _disk_full(tg: Target, f: Fault) -> Done:
    if tg.fill_root is None:
        return Done(fault=f, t=time.time(), injected=False, detail="no size-limited durable path (not mounted)")
    t = time.time()
    taken = fill(tg.fill_root)
    left = os.statvfs(tg.fill_root).f_bavail * os.statvfs(tg.fill_root).f_frsize
    time.sleep(f.hold_s)
    (tg.fill_root / FILLER).unlink(missing_ok=True)
    return Done(fault=f, t=t, injected=True, t_end=time.time(),
                detail=f"durable path full for {f.hold_s:.1f} s ({taken / 2**20:.0f} MiB filler, {left} B left)")


def _spare_off(tg: Target, f: Fault) -> Done:
    state, alloc = _job_state(tg)
    spares = sorted(set(alloc) - set(tg.training_hosts())) if state == "RUNNING" else []
    if not spares:
        return Done(fault=f, t=time.time(), injected=False, detail=f"no idle spare (job {state or 'unknown'})")
    node = pick(spares, f.target)
    t = time.time()
    slurm.run_cmd(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=chaos-spare-off"],
                  timeout=30, env=tg.env)
    try:
        time.sleep(f.hold_s)
    finally:
        resume(node, tg.env)
    return Done(fault=f, t=t, injected=True, t_end=time.time(), detail=f"spare {node} drained {f.hold_s:.1f} s")


def resume(node: str, env: Mapping[str, str]) -> None:
    slurm.run_cmd(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False, timeout=30, env=env)


def inject(tg: Target, f: Fault, wait_s: float) -> Done:
    """Do `f` to the job now; a process fault waits up to `wait_s` for a process to hit."""
    job = str(tg.job_id)
    if f.kind == "kill_worker":
        return _signal_workers(tg, f, signal.SIGKILL, "kill -9 of", wait_s)
    if f.kind == "stop_worker":
        return _signal_workers(tg, f, signal.SIGSTOP, "SIGSTOP of", wait_s)
    if f.kind == "kill_node_step":
        return _kill_node_step(tg, f, wait_s)
    if f.kind == "requeue":
        return _slurm_cmd(tg, f, ["scontrol", "requeue", job], "scontrol requeue")
    if f.kind == "usr2":
        return _slurm_cmd(tg, f, ["scancel", "--signal=USR2", job], "scancel --signal=USR2")
    if f.kind == "time_limit":
        return _slurm_cmd(tg, f, ["scancel", "--batch", "--signal=USR2", job], "USR2 to the batch shell")
    if f.kind == "ctld_restart":
        return _ctld_restart(tg, f)
    if f.kind == "disk_full":
        return _disk_full(tg, f)
    if f.kind == "spare_off":
        return _spare_off(tg, f)
    raise ValueError(f"unknown fault kind {f.kind!r}")
