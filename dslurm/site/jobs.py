"""The shell of `dslurm site check`: Slurm's answers, `sbatch --test-only`, and the three small
jobs whose output the rows of dslurm.site.check are decided from.

- the node job (N whole nodes, the site's own #SBATCH lines from dslurm.render): the setup lines,
  then the probe on the first node (writes markers in scratch and the durable path) and on the
  last (reads them), and the container's `import torch` when the site has one;
- the requeue job (1 node, a 2-minute limit, `--signal=B:USR2@LEAD_S --requeue`): its batch shell
  waits for USR2, requeues itself, and the second start exits 0;
- the burn-in job (2 nodes): `dslurm burnin`'s own job, whose verdict is the all-reduce row;
- the warm job (1 node + 1 spare, `recovery.warm: true`, the connectivity probe as its entry): rank 0
  crashes in the cold step once both nodes' warm pools serve, `dslurm supervise` recovers on the
  same node, warm; each step's probe records which GPU device files its workers open. Its row is
  written beside the site file (dslurm/submission/warm_proof.py): `recovery.warm: auto` reads it at submit.
All four are submitted at once and waited for with one deadline; a job still running at the
deadline is cancelled. Every Slurm command goes through slurm.run_cmd.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.config import SiteConfig, load_job
from dslurm.config.resolve import Resolved, resolve
from dslurm.durable import atomic_write_text
from dslurm.errors import SlurmError
from dslurm.render import container, directives, q, words
from dslurm.site import check as C
from dslurm.site.probe import TAG
from dslurm.slurm import facts as F
from dslurm.submission import Submission

REQUEUE_TIME = "00:02:00"
# slurmctld sends the B: signal up to a PERIODIC_TIMEOUT (30 s) before LEAD and checks every 30 s, so
# USR2 comes 30-60 s into this 120 s job. A 60 s job with LEAD 40 drew it as soon as the job ran (the
# check adds 30 s): on a loaded machine that was before the batch shell set its trap, and it was lost.
LEAD_S = 60
_SETUP_FAILED = "DSLURM-SITE-SETUP-FAILED"


def resolved(site: SiteConfig, site_path: str, nodes: int, name: str, **job: Any) -> Resolved:
    data = {"name": name, "nodes": nodes, "time": "00:05:00", "preflight": {"enabled": False},
            "requeue": {"enabled": False}, "train": {"global_batch": nodes * site.procs_per_node}, **job}
    return resolve(site, load_job(data=data), site_path=site_path, job_path=name, base_dir=os.getcwd())


def sbatch_lines(r: Resolved, log_dir: str) -> list[str]:
    """The site's #SBATCH lines for this job, from dslurm.render (the training job's own)."""
    return [f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={q(v)}" for k, v in directives(r, log_dir)]


def _step(node: str, argv: Sequence[str], extra: Sequence[str] = ()) -> str:
    return f'srun --nodes=1 --ntasks=1 --nodelist="${node}" {words(list(extra))} {words(list(argv))}'.replace("  ", " ")


def node_script(r: Resolved, log_dir: str, token: str) -> str:
    """The node job: setup lines (each failure named), the site env, then the probe steps. Pure."""
    site = r.site
    probe = [*site.python_argv, "-m", "dslurm.site.probe", "--token", token, "--durable", site.storage.durable]
    if site.storage.scratch:
        probe += ["--scratch", site.storage.scratch]
    lines = ["#!/bin/bash", *sbatch_lines(r, log_dir), "# dslurm site check: the node job", ""]
    for i, line in enumerate(site.setup):
        lines.append(f'{{ {line}\n}} || echo "{_SETUP_FAILED} {i} rc=$?"')
    lines += [f"export {k}={q(v)}" for k, v in site.env.items()]
    lines += ['mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              'first="${nodes[0]}"', 'last="${nodes[${#nodes[@]}-1]}"',
              _step("first", [*probe, "--role", "write"]),
              _step("last", [*probe, "--role", "read"]),
              _step("first", [*probe, "--role", "cleanup"])]
    if site.container is not None:
        prefix = container.launcher_prefix(r)
        check = [*prefix, *site.python_argv, "-c",
                 "import torch, dslurm; print('DSLURM-SITE-CONTAINER torch', torch.__version__)"]
        lines.append(_step("first", check, container.srun_container_flags(r)))
    return "\n".join(lines) + "\n"


def requeue_script(r: Resolved, log_dir: str) -> str:
    """The requeue job: wait for USR2, requeue, start again, exit 0. Pure."""
    return "\n".join([
        "#!/bin/bash", *sbatch_lines(r, log_dir), "# dslurm site check: the requeue job", "",
        'n="${SLURM_RESTART_COUNT:-0}"',
        'echo "DSLURM-SITE-START $n $(date +%s)"',
        'if [ "$n" -ge 1 ]; then echo "DSLURM-SITE-RESTARTED $n"; exit 0; fi',
        "got=0",
        "trap 'got=1' USR2",
        'while [ "$got" -eq 0 ]; do sleep 1 & wait $!; done',
        'echo "DSLURM-SITE-SIGNAL USR2 $(date +%s)"',
        'scontrol requeue "$SLURM_JOB_ID"; echo "DSLURM-SITE-REQUEUE rc=$?"',
        "sleep 120",
        "",
    ])


@dataclass(slots=True)
class Static:
    config: dict[str, str]
    partitions: list[F.Partition]
    nodes: list[F.Node]
    assoc: F.Associations
    rows: list[C.Row] = field(default_factory=list)


def static_rows(site: SiteConfig, site_path: str, nodes: int, work: Path) -> Static:
    """Rows decided without running anything: Slurm's answers, and `sbatch --test-only`."""
    from dslurm.site.discover import associations, partition_nodes

    cfg = F.parse_config(slurm.run_cmd(["scontrol", "show", "config"]).stdout)
    parts = F.parse_partitions(slurm.run_cmd(["scontrol", "-o", "show", "partition"]).stdout)
    part = next((p for p in parts if p.name == site.slurm.partition), None)
    ns = partition_nodes(part) if part is not None else []
    assoc = associations(cfg)
    st = Static(config=cfg, partitions=parts, nodes=ns, assoc=assoc)
    st.rows += [C.row_partition(site, parts), C.row_account(site, assoc, part), C.row_matches_slurm(site, ns),
                C.row_requeue_config(site, cfg)]
    if part is None:
        st.rows.append(C.skip(C.P_TEST_ONLY, "not run: the partition does not exist"))
        return st
    r = resolved(site, site_path, nodes, "site-check-test-only", time=site.slurm.default_time)
    script = work / "test-only.sbatch"
    atomic_write_text(script, "#!/bin/bash\n" + "\n".join(sbatch_lines(r, str(work))) + "\ntrue\n")
    proc = slurm.run_cmd(["sbatch", "--test-only", str(script)], check=False)
    st.rows.append(C.row_test_only(nodes, proc.returncode, proc.stderr + proc.stdout))
    return st


def _sbatch(script: Path) -> int:
    return slurm.sbatch(script, cwd=os.getcwd())


def _wait(job_id: int | None, deadline: float) -> str | None:
    if job_id is None:
        return None
    try:
        return slurm.wait_job(job_id, timeout=max(1.0, deadline - time.monotonic()), poll=1.0)
    except SlurmError:
        slurm.run_cmd(["scancel", str(job_id)], check=False)
        return None


def _out(log_dir: Path, prefix: str, job_id: int | None) -> str:
    if job_id is None:
        return ""
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob(f"{prefix}-{job_id}.*")))


def live_rows(site: SiteConfig, site_path: str, nodes: int, work: Path, timeout: float) -> list[C.Row]:
    """Submit the node, requeue and burn-in jobs at once; decide their rows by the deadline."""
    from dslurm.observe import events
    from dslurm.submission import submit

    token = secrets.token_hex(4)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rn = resolved(site, site_path, nodes, "site-check-nodes")
    node_sh, rq_sh = work / "nodes.sbatch", work / "requeue.sbatch"
    atomic_write_text(node_sh, node_script(rn, str(logs), token))
    node_id = _sbatch(node_sh)
    rq_id = None
    if site.requeue.enabled:
        rr = resolved(site, site_path, 1, "site-check-requeue", time=REQUEUE_TIME,
                      requeue={"enabled": True, "signal_lead": LEAD_S})
        atomic_write_text(rq_sh, requeue_script(rr, str(logs)))
        rq_id = _sbatch(rq_sh)
    burn = None
    if nodes >= 2:
        rb = resolved(site, site_path, 2, "site-check-burnin", entry="dslurm.preflight.job",
                      preflight={"enabled": True}, checkpoint={"run_dir": str(work / "burnin")}, time="00:10:00")
        burn = submit(rb)
    warm = None
    if nodes >= 2 and site.container is None:
        rw = warm_job(site, site_path, work)
        warm = submit(rw)
    deadline = time.monotonic() + timeout
    node_state = _wait(node_id, deadline)
    out = _out(logs, "site-check-nodes", node_id)
    recs = [json.loads(ln[len(TAG):]) for ln in out.splitlines() if ln.startswith(TAG)]
    first = next((x for x in recs if x.get("role") == "write"), None)
    second = next((x for x in recs if x.get("role") == "read"), None)
    failed = [ln.split()[1] for ln in out.splitlines() if ln.startswith(_SETUP_FAILED)]
    note = f"job {node_id} {node_state or 'not finished in time'}; log {logs}/site-check-nodes-{node_id}.out"
    setup = C.row_setup(site, recs, failed, note)
    rows = [setup, C.row_gpus(site, recs), C.row_scratch(site, first, second),
            C.row_durable(site, first, second if nodes >= 2 else None)]
    if burn is not None and not setup.holds:  # no torch after the setup lines: the burn-in cannot run
        slurm.run_cmd(["scancel", str(burn.job_ids[0])], check=False)
        rows.append(C.row_allreduce(nodes, None, f"job {burn.job_ids[0]} cancelled; {burn.run_dir}",
                                    setup_holds=False))
    elif burn is not None:
        bstate = _wait(burn.job_ids[0], deadline)
        pre = [e for e in events.of(events.read(burn.run_dir), events.Preflight) if e.report]
        report = json.loads(Path(str(pre[-1].report)).read_text()) if pre else None
        rows.append(C.row_allreduce(nodes, report, f"job {burn.job_ids[0]} {bstate or 'not finished in time'}; "
                                    f"{burn.run_dir}"))
    else:
        rows.append(C.row_allreduce(nodes, None, ""))
    rq_state = _wait(rq_id, deadline)
    restarts = int(str(slurm.job_info(rq_id)["restarts"])) if rq_id is not None and rq_state else 0
    rows.append(C.row_requeue(site, rq_state, restarts, _out(logs, "site-check-requeue", rq_id), LEAD_S))
    rows.append(C.row_container(site, out, note))
    rows.append(_warm_row(site, site_path, nodes, warm, deadline, setup.holds))
    return rows


def warm_job(site: SiteConfig, site_path: str, work: Path) -> Resolved:
    """The warm job: 1 node + 1 spare, the probe, rank 0 crashing in the cold step once both pools
    serve (DSLURM_FAULT_AWAIT on their ready files), requeue on so that supervise may retry."""
    run = work / "warm"
    return resolved(site, site_path, 1, "site-check-warm", spares=1, launch="torchrun", entry="dslurm.launch.probe",
                    recovery={"warm": True}, requeue={"enabled": True}, checkpoint={"run_dir": str(run)},
                    env={"DSLURM_FAULT_CRASH": "1:0@0.0", "DSLURM_FAULT_AWAIT": f"{run}/warm/*.ready:2:180"})


def _warm_row(site: SiteConfig, site_path: str, nodes: int, warm: Submission | None, deadline: float,
              setup_holds: bool) -> C.Row:
    """The warm row from the warm job's ledger and probe records; a decided row (ok or fail) is
    recorded beside the site file for `recovery.warm: auto`."""
    from dslurm.observe import events
    from dslurm.submission.warm_proof import write_record

    if warm is None:
        return C.row_warm(site, nodes, [], [], {}, "", setup_holds)
    job = warm.job_ids[0]
    if not setup_holds:
        slurm.run_cmd(["scancel", str(job)], check=False)
    state = _wait(job, deadline) if setup_holds else "CANCELLED"
    evs = events.read(warm.run_dir)
    endings = [e.cls for e in events.of(evs, events.Ending)]
    modes = [str(e.mode) for e in events.of(evs, events.JobStart)]
    records = {}
    for p in sorted((warm.run_dir / "probe").glob("step-*-rank-*.json")):
        try:
            records[p.name] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    row = C.row_warm(site, nodes, endings, modes, records, f"job {job} {state or 'not finished in time'}; "
                     f"{warm.run_dir}", setup_holds)
    if row.status != "skip":
        try:
            write_record(site_path, site, row.status, row.detail, str(job))
        except OSError as exc:  # a site file in a read-only place: the row stands, auto cannot read it
            return C.Row(row.promise, row.status, f"{row.detail}; not recorded: {exc}",
                         row.fix or "copy the site file where you may write, and check that copy")
    return row


def run_check(site: SiteConfig, site_path: str, nodes: int, timeout: float, work: str | None) -> list[C.Row]:
    base = Path(work) if work else Path(tempfile.mkdtemp(prefix="site-check-", dir=_work_root(site)))
    base.mkdir(parents=True, exist_ok=True)
    st = static_rows(site, site_path, nodes, base)
    if not all(r.holds for r in st.rows):
        return st.rows + C.not_run(C.LIVE, "fix the rows above first; nothing was submitted")
    return st.rows + live_rows(site, site_path, nodes, base, timeout)


def _work_root(site: SiteConfig) -> str:
    """Beside the training jobs' logs (slurm.log_dir, relative to the submit dir): where a job's
    output is sure to reach the submitting host."""
    root = Path(site.slurm.log_dir)
    root.mkdir(parents=True, exist_ok=True)
    return str(root.resolve())
