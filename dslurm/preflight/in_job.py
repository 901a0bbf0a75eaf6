"""The burn-in as the first thing every training job does, inside its own processes.

`dslurm launch --preflight` does not start a second torchrun (that would cost a whole
process start-up per job start, ~10 s of every restart here); it tells the training
processes where the report goes (DSLURM_PREFLIGHT_REPORT, DSLURM_PREFLIGHT_SITE) and the
trainer (or `dslurm.launch.probe`) calls `gate_in_process` right after its process group exists,
before building the model. Every rank measures; rank 0 writes the report into the run
directory, records a ledger event and, when nodes are bad, adds them to the run's
blocklist; every rank gets the same verdict and exits PREFLIGHT_FAILED (78) on a bad one,
on which `dslurm requeue-me` requeues the job without those nodes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dslurm import exitcodes as X
from dslurm.run import RunDir
from dslurm.run import add_to_blocklist as add_to_blocklist  # the gate's; train/loop.py imports it here

log = logging.getLogger(__name__)

REPORT_ENV = "DSLURM_PREFLIGHT_REPORT"
SITE_ENV = "DSLURM_PREFLIGHT_SITE"


def report_path(run_dir: Path, job_id: str, restart: int) -> Path:
    return RunDir(run_dir).burnin_report(job_id, restart)


def preflight_env(env: Mapping[str, str], site_path: str, job_id: str, restart: int) -> dict[str, str]:
    """What `dslurm launch --preflight` adds to the training processes' environment."""
    run_dir = Path(env.get("DSLURM_RUN_DIR", "."))
    return {REPORT_ENV: str(report_path(run_dir, job_id, restart)), SITE_ENV: site_path}


def gate_in_process(device: Any, env: Mapping[str, str] | None = None, outcome: Any = None) -> int:
    """Run the burn-in on the default process group if the launcher asked for it.
    0: train; PREFLIGHT_FAILED: every rank returns it, the node list is in the blocklist, and
    `outcome` (a dslurm.endings.worker_exit.Outcome) holds the verdict for this rank's report: the
    ending is read from that report, since srun may return 143 for it (it TERMs the other
    nodes' launchers when the first one exits 78)."""
    env = os.environ if env is None else env
    report = env.get(REPORT_ENV)
    if not report:
        return 0
    import torch.distributed as dist

    from dslurm.config import load_site
    from dslurm.observe import events
    from dslurm.observe.ledger import Ledger
    from dslurm.preflight.run import parse_args, run_in_group
    from dslurm.preflight.thresholds import Thresholds

    t0 = time.time()
    site = load_site(env[SITE_ENV])
    th = Thresholds.from_site(site)
    verdict = run_in_group(parse_args(["--report", report]), th, device)
    bad = sorted(verdict["bad_nodes"])
    if dist.get_rank() == 0:
        run_dir = Path(env.get("DSLURM_RUN_DIR", "."))
        nodes = _nodes(report)
        Ledger(run_dir).append(events.Preflight(
            passed=not bad, bad_nodes=bad, problems=list(verdict.get("problems", [])),
            warnings=dict(verdict.get("warnings", {})), report=report, duration_s=round(time.time() - t0, 2),
            nodes=nodes))
        if bad:
            blocked = add_to_blocklist(run_dir, bad)
            if site.burnin.allow_drain:
                drain(verdict["bad_nodes"])
            log.error("burn-in failed on %s (%s); blocklist now %s", ", ".join(bad),
                      "; ".join(f"{h}: {', '.join(w)}" for h, w in verdict["bad_nodes"].items()),
                      ", ".join(blocked))
        elif verdict.get("problems"):
            # A cluster-wide shortfall no node can be blamed for: train, but say so loudly.
            log.warning("burn-in: %s (no single node to blame; training anyway)", "; ".join(verdict["problems"]))
    if bad and outcome is not None:
        outcome.settled(time.time(), "burn-in rejected " + "; ".join(
            f"{h} ({', '.join(w)})" for h, w in sorted(verdict["bad_nodes"].items())))
    return X.PREFLIGHT_FAILED if bad else 0


def drain_reason(why: list[str]) -> str:
    """Slurm's Reason field: one line, short, says who drained it and why."""
    text = "dslurm burn-in: " + "; ".join(why)
    return " ".join(text.split())[:120]


def drain(bad: dict[str, list[str]]) -> None:
    """Take bad nodes out of service (only where the site allows: it needs operator rights
    and affects every user). Failure to drain is logged, never fatal: the blocklist and the
    requeue already keep this run off them."""
    from dslurm import slurm

    for host, why in bad.items():
        res = slurm.run_cmd(["scontrol", "update", f"NodeName={host}", "State=DRAIN",
                             f"Reason={drain_reason(why)}"], check=False)
        if res.returncode:
            log.error("could not drain %s: %s", host, res.stderr.strip())
        else:
            log.warning("drained %s (%s)", host, drain_reason(why))


def _nodes(report: str) -> list[str]:
    from dslurm.preflight.gate import load_report

    return [n["host"] for n in load_report(report)["nodes"]]

