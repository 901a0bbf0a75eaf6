"""The burn-in as the first step of a training job: run it on every node of the
allocation, read the verdict, record it, and turn bad nodes into an exclusion.

Called by `dslurm launch --preflight` on every node before the trainer starts. The
burn-in runs under the same launcher as training (torchrun or one task per process) on
a port of its own; rank 0 writes the report into the run directory, every node reads it.
Bad nodes go into the run's blocklist (later submissions `--exclude` them) and the step
exits PREFLIGHT_FAILED, on which `dslurm requeue-me` requeues the job without them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from dslurm import exitcodes as X
from dslurm.errors import UserError

log = logging.getLogger(__name__)

REPORT_WAIT_S = 120.0


def report_path(run_dir: Path, job_id: str, restart: int) -> Path:
    return run_dir / "preflight" / f"burnin-{job_id}-r{restart}.json"


def add_to_blocklist(run_dir: Path, hosts: list[str]) -> list[str]:
    """Merge hosts into the run's blocklist atomically; return the whole list."""
    from dslurm.sbatch_cli import write_atomic
    from dslurm.submit import blocklist_path, read_blocklist

    merged = sorted(set(read_blocklist(run_dir)) | set(hosts))
    write_atomic(blocklist_path(run_dir), "\n".join(merged) + "\n")
    return merged


def _wait_for(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def gate_in_job(*, mode: str, nproc_per_node: int | None, site_path: str | None,
                rdzv: str = "c10d", env: dict[str, str] | None = None) -> int:
    """Run the burn-in on this node's processes; 0 = train, PREFLIGHT_FAILED = requeue."""
    from dslurm.launch import launch
    from dslurm.ledger import Ledger
    from dslurm.preflight.gate import bad_nodes, load_report
    from dslurm.slurm_env import derive

    env = dict(os.environ if env is None else env)
    if not site_path:
        raise UserError("dslurm launch --preflight needs --site FILE (the thresholds live in the site config)")
    info = derive(env, nproc_per_node=nproc_per_node, mode=mode)  # type: ignore[arg-type]
    run_dir = Path(env.get("DSLURM_RUN_DIR", "."))
    report = report_path(run_dir, info.job_id, info.restart_count)
    cmd = [sys.executable, "-m", "dslurm.preflight.run", "--report", str(report), "--site", site_path,
           "--exit-zero"]
    t0 = time.time()
    # Its own port: the burn-in's store must not be the one training rendezvouses on next.
    burn_env = {**env, "DSLURM_MASTER_PORT": str(info.master_port + 1)}
    rc = launch(cmd, mode=mode, nproc_per_node=nproc_per_node, rdzv=rdzv, env=burn_env)
    if not _wait_for(report, REPORT_WAIT_S):
        log.error("burn-in wrote no report (exit %s) within %.0f s: %s", rc, REPORT_WAIT_S, report)
        if info.node_rank == 0:
            Ledger(run_dir).append("preflight", passed=False, bad_nodes=[], report=str(report),
                                   duration_s=round(time.time() - t0, 2), reason=f"no report (exit {rc})")
        return rc or 1
    verdict = load_report(report)["verdict"]
    bad = bad_nodes(load_report(report))
    if info.node_rank == 0:
        Ledger(run_dir).append("preflight", passed=not bad, bad_nodes=bad, problems=verdict.get("problems", []),
                               warnings=verdict.get("warnings", []), report=str(report),
                               duration_s=round(time.time() - t0, 2), nodes=info.hosts)
        if bad:
            blocked = add_to_blocklist(run_dir, bad)
            log.error("burn-in failed on %s; blocklist now %s", ", ".join(bad), ", ".join(blocked))
    if bad:
        return X.PREFLIGHT_FAILED
    if verdict.get("problems"):
        # A cluster-wide shortfall no node can be blamed for: train, but say so loudly.
        log.warning("burn-in: %s (no single node to blame; training anyway)", "; ".join(verdict["problems"]))
    return 0
