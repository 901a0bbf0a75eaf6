"""Submitting a run, the library half of `dslurm submit` (the command is dslurm/cli/submit.py; the
notebook API, sweeps, the site check and `dslurm burnin` submit through here too).

The site and job are frozen into the run directory at submit time (`site.yaml`,
`job.yaml`, overrides applied) and the script points at those copies: a requeued job
re-runs the same script, and must not pick up an edit made to the YAML since. All Slurm
calls go through dslurm.slurm.run_cmd. When sbatch refuses, nothing is left submitted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.run import CODE, CODE_CURRENT, FROZEN, SCRIPT, RunDir, read_blocklist
from dslurm.submission.warm_proof import choice_for

if TYPE_CHECKING:
    from dslurm.slurm.refusals import Origin


@dataclass(frozen=True)
class Submission:
    job_ids: list[int]
    script: Path
    run_dir: Path
    log_dir: Path

    @property
    def job_id(self) -> int:
        return self.job_ids[-1]



def freeze_and_render(r: Resolved, overrides: list[str] | None = None,
                      site_overrides: list[str] | None = None, code_dir: Path | None = None) -> Path:
    """Write site.yaml, job.yaml and job.sbatch into the run directory; return the script. With
    `code_dir` (a snapshot, dslurm.remote.snapshot) the script runs the code there."""
    from dslurm.config import yaml12
    from dslurm.config.schema import to_dict
    from dslurm.durable import atomic_write_text as write_atomic
    from dslurm.render import RenderRefs, render_sbatch

    run = RunDir(r.run_dir)
    log_dir = run.logs
    log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create --output directories
    site_file, job_file = run.site_yaml, run.job_yaml
    job_data = to_dict(r.job)
    job_data["checkpoint"]["run_dir"] = str(run.path)  # absolute: the same on every node
    # `recovery.warm: auto` decided now, from the site's word or its check's record (dslurm/submission/warm_proof.py):
    # every start of the run does what was decided at submit.
    job_data["recovery"]["warm"] = choice_for(r.job, r.site, r.site_path).warm
    # yaml12.dump quotes what the loader would otherwise retype ('1e3', '12:00:00', 'yes').
    write_atomic(site_file, yaml12.dump(to_dict(r.site)))
    write_atomic(job_file, yaml12.dump(job_data))
    refs = RenderRefs(site=str(site_file), job=str(job_file), log_dir=str(log_dir),
                      code_dir=None if code_dir is None else str(code_dir), frozen=True)
    script = run.script
    write_atomic(script, render_sbatch(r, refs), 0o755)
    if code_dir is not None and code_dir.parent == run.code:
        write_atomic(run.code_current, code_dir.name + "\n")
    return script


def current_code(run_dir: Path) -> Path | None:
    """The snapshot the run was last submitted with (`--code`), for `submit --run-dir` to reuse;
    None when the run runs the submit directory's code."""
    from dslurm.remote.snapshot import MARKER

    run = RunDir(run_dir)
    try:
        name = run.code_current.read_text().strip()
    except FileNotFoundError:
        return None
    d = run.code / name
    return d if name and (d / MARKER).is_file() else None


def _frozen_before(run_dir: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for name in (*FROZEN, f"{CODE}/{CODE_CURRENT}"):
        try:
            out[name] = (run_dir / name).read_bytes()
        except FileNotFoundError:
            out[name] = None
    return out


def _restore_frozen(run_dir: Path, before: dict[str, bytes | None]) -> None:
    """Put the run directory's frozen files back as they were before a submit sbatch refused:
    a fresh run dir keeps no site.yaml/job.yaml (nothing for `--run-dir` to mistake for a run),
    an existing run keeps the config its queued or requeued jobs run."""
    from dslurm.durable import atomic_write_bytes

    for name, data in before.items():
        path = run_dir / name
        if data is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_bytes(path, data, 0o755 if name == SCRIPT else 0o644)


def remembered_bad(r: Resolved, use_nodes: Sequence[str] = ()) -> list[str]:
    """Nodes the site's memory leaves out of new jobs (site.nodes policy; dslurm/observe/nodes.py),
    said on stderr with the override; `use_nodes`: the ones the user takes back."""
    import sys

    from dslurm.observe import nodes

    policy = r.site.nodes
    try:
        store = nodes.read(r.site.storage.durable)
    except OSError:
        return []
    bad = nodes.excluded(store, exclude_after=policy.exclude_after, half_life_h=policy.half_life_h, use=use_nodes)
    if bad:
        named = ", ".join(f"{n} (weight {w})" for n, w in bad.items())
        print(f"dslurm submit: leaving out {named}: recent evidence against them in the site's memory "
              f"(`dslurm site nodes --site ...`); to use one anyway: --use-node NODE", file=sys.stderr)
    return sorted(bad)


def submit(r: Resolved, *, chain: int = 1, dry_run: bool = False,
           env: dict[str, str] | None = None, code: str | None = None, origin: Origin | None = None,
           use_nodes: Sequence[str] = ()) -> Submission:
    """Freeze, render and submit; with chain=K, K jobs linked by afterany dependencies. With
    `code` (`git` or a directory: `--code`) the job runs a snapshot of that code, copied into
    `<run_dir>/code/<digest>`, on every start; without it, the snapshot the run was last
    submitted with (`current_code`), if any. When sbatch refuses, nothing is left submitted:
    the frozen files are put back, links already queued are cancelled, no submit event is
    written, and the UserError names the field and its fix (dslurm.slurm.refusals)."""
    from dslurm import slurm
    from dslurm.errors import SlurmError

    if chain < 1:
        raise UserError(f"--chain {chain}: must be at least 1")
    before = _frozen_before(r.run_dir)
    code_dir = None
    if code is not None:
        from dslurm.remote.snapshot import materialize, take

        code_dir = materialize(take(code), RunDir(r.run_dir).code)
    else:
        code_dir = current_code(r.run_dir)
    script = freeze_and_render(r, code_dir=code_dir)
    log_dir = RunDir(r.run_dir).logs
    if dry_run:
        return Submission([], script, r.run_dir, log_dir)
    extra = []
    blocked = sorted(set(read_blocklist(r.run_dir)) | set(remembered_bad(r, use_nodes)))
    if blocked:
        extra.append(f"--exclude={','.join(blocked)}")
    ids: list[int] = []
    try:
        for _ in range(chain):
            dep = [f"--dependency=afterany:{ids[-1]}"] if ids else []
            ids.append(slurm.sbatch(script, [*extra, *dep], cwd=os.getcwd(), env=env))
    except SlurmError as exc:
        for i in ids:  # earlier links of a chain: cancelled, so that nothing is left submitted
            try:
                slurm.cancel(i, env=env)
            except SlurmError:
                pass
        _restore_frozen(r.run_dir, before)
        raise refused(exc, r, origin, env) from None
    record_submission(r, ids)
    return Submission(ids, script, r.run_dir, log_dir)


def refused(exc: Exception, r: Resolved, origin: Origin | None, env: dict[str, str] | None) -> UserError:
    """sbatch's refusal as a field and its fix (dslurm.slurm.refusals), else sbatch's own words."""
    from dslurm.errors import SlurmError
    from dslurm.slurm.refusals import Origin, cluster_facts, explain

    text = str(exc)
    origin = origin or Origin(site_file=r.site_path, job_file=r.job_path)
    said = re.search(r"`sbatch[^`]*` failed \(exit -?\d+\): (.*)", text, re.S)
    if said:  # sbatch answered: a refusal, not a missing client or a controller that did not answer
        msg = explain(said.group(1), r, origin, cluster_facts(r.site.slurm.partition, env))
        if msg is not None:
            return UserError(msg)
    return SlurmError(f"{text}\n  nothing was submitted (site {origin.site_file}, job {origin.job_file})")


def completed_note(r: Resolved) -> str | None:
    """What to tell the user instead of submitting `r`, when its run directory already holds a
    run that completed at r's train.steps: the ledger's last start ended `completed` and the
    pointer (else, without checkpoints, the ledger) is at train.steps or past it. None when
    there is training left: a fresh run dir, a run that ended short, or train.steps raised."""
    from dslurm.checkpoint import CheckpointError, read_pointer
    from dslurm.observe import events
    from dslurm.observe.completion import ended_completed
    from dslurm.observe.report import summarize

    if not RunDir(r.run_dir).ledger.is_file():
        return None
    starts = summarize(events.read(r.run_dir)).starts
    if not starts or not ended_completed(starts[-1]):
        return None
    try:
        ptr = read_pointer(r.run_dir)
    except CheckpointError:
        return None  # a garbage pointer: let the job's restore say what it finds
    done = ptr.step if ptr is not None else starts[-1].reached
    steps = r.job.train.steps
    if done is None or done < steps:
        return None
    return (f"run {r.run_dir} already completed at step {done} of {steps}; nothing submitted (a job would "
            f"allocate the nodes, restore step {done} and end). To train further raise the target "
            f"(--set train.steps=N, N > {done}); to submit anyway use --force")


def active_jobs_of_run(run_dir: Path, env: dict[str, str] | None = None) -> list[dict[str, object]]:
    """Jobs submitted for this run directory (its ledger's submit events) that the controller
    still has pending or running."""
    from dslurm import slurm
    from dslurm.errors import SlurmError
    from dslurm.observe import events

    ids = sorted({i for e in events.of(events.read(run_dir), events.Submit) for i in e.job_ids})
    if not ids:
        return []
    try:
        return [j for j in slurm.squeue(job_ids=ids, env=env) if j["state"] in ("PENDING", "RUNNING",
                                                                                 "CONFIGURING", "REQUEUED")]
    except SlurmError:  # squeue refuses ids it has forgotten: none of them is active
        return []


def record_submission(r: Resolved, ids: list[int], via: str | None = None, logs: list[str] | None = None) -> None:
    """The ledger's submit event: job ids, the effective signal lead and how it was derived,
    the checkpoint interval (so the report can tell whether the lead was long enough), the log
    files when they live outside <run_dir>/logs (`logs`: a sweep's array task), and whether
    recoveries inside the allocation start warm, and why."""
    from dslurm.observe import events
    from dslurm.observe.ledger import Ledger

    p = r.policy
    warm = choice_for(r.job, r.site, r.site_path)
    Ledger(r.run_dir).append(events.Submit(
        job_ids=ids, signal_lead_s=p.lead_s if p.enabled else None, signal_lead_setting=p.lead_setting,
        signal_lead_reason=p.lead_reason, checkpoint_interval=r.job.checkpoint.interval, via=via,
        logs=list(logs or []),
        warm=warm.warm if r.spares else None, warm_reason=warm.reason if r.spares else None))
