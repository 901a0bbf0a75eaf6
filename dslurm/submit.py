"""`dslurm submit` and `dslurm status`: render into the run directory, submit with
`sbatch --parsable`, and report. All Slurm calls go through dslurm.slurm.run_cmd.

The site and job are frozen into the run directory at submit time (`site.yaml`,
`job.yaml`, overrides applied) and the script points at those copies: a requeued job
re-runs the same script, and must not pick up an edit made to the YAML since.
`dslurm submit --run-dir RUN` submits a run again from those frozen copies (it resumes from
the checkpoint pointer). A run that already completed at its train.steps is not submitted
again unless --force says so: the job would pay for an allocation and a start-up to do nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.config.resolve import Resolved
from dslurm.errors import UserError

if TYPE_CHECKING:
    from dslurm.remote.handle import Handle
    from dslurm.remote.proxy import Submitted
    from dslurm.sbatch_errors import Origin


@dataclass(frozen=True)
class Submission:
    job_ids: list[int]
    script: Path
    run_dir: Path
    log_dir: Path

    @property
    def job_id(self) -> int:
        return self.job_ids[-1]


def blocklist_path(run_dir: Path) -> Path:
    """Nodes the run's burn-in found bad; later submissions of the run --exclude them."""
    return run_dir / "blocklist.txt"


def read_blocklist(run_dir: Path) -> list[str]:
    try:
        lines = blocklist_path(run_dir).read_text().split()
    except FileNotFoundError:
        return []
    return sorted(set(lines))


def freeze_and_render(r: Resolved, overrides: list[str] | None = None,
                      site_overrides: list[str] | None = None, code_dir: Path | None = None) -> Path:
    """Write site.yaml, job.yaml and job.sbatch into the run directory; return the script. With
    `code_dir` (a snapshot, dslurm.remote.snapshot) the script runs the code there."""
    from dslurm.config import yaml12
    from dslurm.config.schema import to_dict
    from dslurm.render import RenderRefs, render_sbatch
    from dslurm.render.cli import write_atomic

    run_dir = r.run_dir
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create --output directories
    site_file, job_file = run_dir / "site.yaml", run_dir / "job.yaml"
    job_data = to_dict(r.job)
    job_data["checkpoint"]["run_dir"] = str(run_dir)  # absolute: the same on every node
    # yaml12.dump quotes what the loader would otherwise retype ('1e3', '12:00:00', 'yes').
    write_atomic(site_file, yaml12.dump(to_dict(r.site)))
    write_atomic(job_file, yaml12.dump(job_data))
    refs = RenderRefs(site=str(site_file), job=str(job_file), log_dir=str(log_dir),
                      code_dir=None if code_dir is None else str(code_dir))
    script = run_dir / "job.sbatch"
    write_atomic(script, render_sbatch(r, refs), 0o755)
    if code_dir is not None and code_dir.parent == run_dir / "code":
        write_atomic(run_dir / "code" / CODE_CURRENT, code_dir.name + "\n")
    return script


FROZEN = ("site.yaml", "job.yaml", "job.sbatch")
CODE_CURRENT = "CURRENT"
"""`<run_dir>/code/CURRENT`: the snapshot directory name the run's script runs (`--code`)"""


def current_code(run_dir: Path) -> Path | None:
    """The snapshot the run was last submitted with (`--code`), for `submit --run-dir` to reuse;
    None when the run runs the submit directory's code."""
    from dslurm.remote.snapshot import MARKER

    try:
        name = (run_dir / "code" / CODE_CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    d = run_dir / "code" / name
    return d if name and (d / MARKER).is_file() else None


def _frozen_before(run_dir: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for name in (*FROZEN, f"code/{CODE_CURRENT}"):
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
            atomic_write_bytes(path, data, 0o755 if name == "job.sbatch" else 0o644)


def submit(r: Resolved, *, chain: int = 1, dry_run: bool = False,
           env: dict[str, str] | None = None, code: str | None = None, origin: Origin | None = None) -> Submission:
    """Freeze, render and submit; with chain=K, K jobs linked by afterany dependencies. With
    `code` (`git` or a directory: `--code`) the job runs a snapshot of that code, copied into
    `<run_dir>/code/<digest>`, on every start; without it, the snapshot the run was last
    submitted with (`current_code`), if any. When sbatch refuses, nothing is left submitted:
    the frozen files are put back, links already queued are cancelled, no submit event is
    written, and the UserError names the field and its fix (dslurm.sbatch_errors)."""
    from dslurm import slurm
    from dslurm.errors import SlurmError

    if chain < 1:
        raise UserError(f"--chain {chain}: must be at least 1")
    before = _frozen_before(r.run_dir)
    code_dir = None
    if code is not None:
        from dslurm.remote.snapshot import materialize, take

        code_dir = materialize(take(code), r.run_dir / "code")
    else:
        code_dir = current_code(r.run_dir)
    script = freeze_and_render(r, code_dir=code_dir)
    log_dir = r.run_dir / "logs"
    if dry_run:
        return Submission([], script, r.run_dir, log_dir)
    extra = []
    blocked = read_blocklist(r.run_dir)
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
    """sbatch's refusal as a field and its fix (dslurm.sbatch_errors), else sbatch's own words."""
    from dslurm.errors import SlurmError
    from dslurm.sbatch_errors import Origin, cluster_facts, explain

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
    from dslurm.observe.ledger import FILENAME
    from dslurm.observe.report import summarize

    if not (r.run_dir / FILENAME).is_file():
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
    the checkpoint interval (so the report can tell whether the lead was long enough), and the
    log files when they live outside <run_dir>/logs (`logs`: a sweep's array task)."""
    from dslurm.observe import events
    from dslurm.observe.ledger import Ledger

    p = r.policy
    Ledger(r.run_dir).append(events.Submit(
        job_ids=ids, signal_lead_s=p.lead_s if p.enabled else None, signal_lead_setting=p.lead_setting,
        signal_lead_reason=p.lead_reason, checkpoint_interval=r.job.checkpoint.interval, via=via,
        logs=list(logs or [])))


# ------------------------------------------------------------------------------ CLI


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", help="render into the run directory and submit with sbatch")
    p.add_argument("--site", help="site config YAML (with --job; or use --run-dir)")
    p.add_argument("--job", help="job spec YAML (with --site; or use --run-dir)")
    p.add_argument("--run-dir", type=Path, default=None, metavar="RUN_DIR",
                   help="submit an existing run again from its frozen site.yaml and job.yaml (--set applies "
                        "on top); it resumes from the checkpoint pointer and runs the code snapshot it was "
                        "submitted with (unless --code). Run it from the directory of the first submit: relative "
                        "paths in the job resolve there. The local handle of a remote run works too")
    p.add_argument("--force", action="store_true",
                   help="submit even when the run directory's run already completed at train.steps")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--site-set", dest="site_overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--chain", type=int, default=1, help="submit K jobs linked by afterany dependencies")
    p.add_argument("--dry-run", action="store_true", help="write the script, do not submit")
    p.add_argument("--strict", action="store_true", help="refuse when the plan says the job will not fit")
    p.add_argument("--sweep", metavar="SWEEP.yaml", default=None,
                   help="submit a sweep (docs/sweeps.md): one job array, a run directory per task; tasks whose "
                        "run completed are skipped, the rest resume")
    p.add_argument("--code", metavar="git|DIR", default=None,
                   help="run a snapshot of this code on every start (requeues too), copied into RUN_DIR/code: "
                        "git = the git working copy you are in (HEAD + uncommitted + untracked files), or a "
                        "directory. Default with a site that has `login:`: git (docs/remote.md)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (for scripts)")
    p.add_argument("--origin", default=None, help=argparse.SUPPRESS)  # JSON file: the laptop's names (remote)
    p.set_defaults(func=run_submit)

    s = sub.add_parser("status", help="state, nodes, restarts and exit code of a job (or each task of a sweep)")
    s.add_argument("job_id", help="Slurm job id, a sweep directory, or the local handle of a remote run")
    s.add_argument("--json", action="store_true")
    s.add_argument("--sort", default=None, help="sweep directory: sort the tasks by this column")
    s.add_argument("--desc", action="store_true", help="sweep directory: sort descending")
    s.set_defaults(func=run_status)


def inputs_of(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """(site, job, overrides) to load: the files given, or a run directory's frozen copies with
    the run directory itself as checkpoint.run_dir (the copy names where it was frozen; a moved
    run continues where it is now)."""
    run_dir = getattr(args, "run_dir", None)
    if run_dir is None:
        if not (args.site and args.job):
            raise UserError("dslurm submit: give --site and --job (a new run), or --run-dir RUN_DIR (continue "
                            "a run from its frozen config)")
        return args.site, args.job, list(args.overrides)
    if args.site or args.job:
        raise UserError(f"dslurm submit --run-dir {run_dir}: --site/--job cannot go with it (the run's frozen "
                        "site.yaml and job.yaml are used). Fix: drop them, and change a field with --set")
    site, job = Path(run_dir) / "site.yaml", Path(run_dir) / "job.yaml"
    for path in (site, job):
        if not path.is_file():
            raise UserError(f"{path}: missing; --run-dir needs a run directory `dslurm submit` wrote (it holds "
                            "site.yaml and job.yaml). Fix: give that directory, or submit with --site and --job")
    return str(site), str(job), [f"checkpoint.run_dir={Path(run_dir).resolve()}", *args.overrides]


def origin_of(args: argparse.Namespace, site: str, job: str) -> Origin:
    """Where the fields came from: the files and overrides given here, or (`--origin`, a remote
    submit) the names on the machine the user typed them on."""
    from dslurm.sbatch_errors import Origin

    given = getattr(args, "origin", None)
    if given:
        try:
            d = json.loads(Path(given).read_text())
            return Origin(site_file=str(d["site"]), job_file=str(d["job"]),
                          site_sets=tuple(d.get("site_sets") or ()), sets=tuple(d.get("sets") or ()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # the names here are still right, if less helpful
    sets = [o for o in getattr(args, "overrides", []) or []]
    return Origin(site_file=site, job_file=job, site_sets=tuple(getattr(args, "site_overrides", []) or []),
                  sets=tuple(sets))


def run_submit(args: argparse.Namespace) -> int:
    from dslurm.config.resolve import load
    from dslurm.remote import handle

    if getattr(args, "sweep", None):
        from dslurm.sweep.submit import run_submit as run_sweep

        return run_sweep(args)
    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None and (h := handle.read(run_dir)) is not None:  # a run on a cluster: submit it there
        if args.site or args.job:
            raise UserError(f"dslurm submit --run-dir {run_dir}: --site/--job cannot go with it (the run's frozen "
                            "site.yaml and job.yaml on the cluster are used). Fix: drop them, and change a field "
                            "with --set or --site-set")
        return _resubmit_remote(h, args)
    site, job, overrides = inputs_of(args)
    r = load(site, job, overrides, args.site_overrides, base_dir=os.getcwd())
    as_json = getattr(args, "json", False)
    if r.site.login is not None:
        return _submit_remote(r, args, site, job)
    if not args.dry_run and not getattr(args, "force", False):
        note = completed_note(r)
        if note:
            print(json.dumps({"job_ids": [], "note": note}) if as_json else note)
            return 0
    _plan_check(r, strict=args.strict)
    if not args.dry_run:
        busy = active_jobs_of_run(r.run_dir)
        if busy:
            which = ", ".join(f"{j['job_id']} ({j['state']})" for j in busy)
            print(f"warning: run directory {r.run_dir} already has job {which}. While that job holds the run "
                  "lock, this one is refused (exit 79, not retried). Fix: wait for it, cancel it, use --chain "
                  "to queue links behind it, or give this job its own checkpoint.run_dir", file=sys.stderr)
    sub = submit(r, chain=args.chain, dry_run=args.dry_run, code=getattr(args, "code", None),
                 origin=origin_of(args, site, job))
    if as_json:
        print(json.dumps({"job_ids": sub.job_ids, "run_dir": str(sub.run_dir), "script": str(sub.script)}))
        return 0
    if args.dry_run:
        print(f"dry run: wrote {sub.script} (not submitted)")
        return 0
    ids = ",".join(str(i) for i in sub.job_ids)
    print(f"submitted job {ids}")
    print(f"  script : {sub.script}")
    print(f"  run dir: {sub.run_dir}")
    print(f"  logs   : {sub.log_dir}/{r.job.name}-<jobid>.out|.err")
    return 0


def _submit_remote(r: Resolved, args: argparse.Namespace, site: str = "", job: str = "") -> int:
    """A site with `login:`: ship the code snapshot and submit on the cluster (docs/remote.md)."""
    from dslurm.remote import proxy
    from dslurm.remote.snapshot import take

    snap = take(getattr(args, "code", None) or "git")
    o = origin_of(args, site or r.site_path, job or r.job_path)
    origin = {"site": o.site_file, "job": o.job_file, "site_sets": list(o.site_sets), "sets": list(o.sets)}
    got = proxy.submit(r, snap, cwd=os.getcwd(), chain=args.chain, force=getattr(args, "force", False),
                       strict=args.strict, dry_run=args.dry_run, origin=origin)
    return _print_remote(got, args, snap.source, len(snap.files))


def _resubmit_remote(h: Handle, args: argparse.Namespace) -> int:
    """`dslurm submit --run-dir HANDLE`: continue the run on its cluster, from its frozen config there."""
    from dslurm.remote import proxy
    from dslurm.remote.snapshot import take

    code = getattr(args, "code", None)
    snap = take(code) if code else None
    got = proxy.resubmit(h, snap, chain=args.chain, force=getattr(args, "force", False), strict=args.strict,
                         dry_run=args.dry_run, overrides=list(args.overrides), site_overrides=list(args.site_overrides))
    return _print_remote(got, args, snap.source if snap else f"the run's snapshot {got.handle.code}",
                         len(snap.files) if snap else None)


def _print_remote(got: Submitted, args: argparse.Namespace, source: str, nfiles: int | None) -> int:
    h = got.handle
    if getattr(args, "json", False):
        print(json.dumps({"job_ids": list(got.job_ids), "run_dir": h.run_dir, "handle": str(h.path),
                          "login": h.login.host, "code": h.code, "note": got.note}))
    elif got.note:
        print(f"{h.login.host}: {got.note}")
    elif args.dry_run:
        print(f"dry run on {h.login.host}: wrote {got.script} (not submitted)")
    else:
        files = f", {nfiles} files" if nfiles is not None else ""
        print(f"submitted job {','.join(str(i) for i in got.job_ids)} on {h.login.host}")
        print(f"  code   : {h.code} ({source}{files})")
        print(f"  run dir: {h.run_dir} (on {h.login.host})")
        print(f"  handle : {h.path} (dslurm status|watch|report|doctor|ctl|cancel {h.path})")
    return 0


def _plan_check(r: Resolved, strict: bool) -> None:
    """Warn (or refuse with --strict) when the planner says the layout will not fit."""
    from dslurm.plan.choose import validate_layout
    from dslurm.plan.inputs import from_resolved

    if r.site.node.gpus == 0:
        return  # CPU sites (the local cluster): no GPU memory to plan against
    inputs = from_resolved(r)
    plan = validate_layout(inputs.model, inputs.cluster, inputs.layout, inputs.work)
    if plan.fits:
        return
    why = "; ".join(plan.problems)
    if strict:
        raise UserError(f"{r.job_path}: the plan says this job will not fit: {why}. Fix: see `dslurm plan`")
    print(f"warning: the plan says this job will not fit: {why} (see `dslurm plan`)", file=sys.stderr)


def run_status(args: argparse.Namespace) -> int:
    from dslurm import slurm
    from dslurm.remote import handle

    if not args.job_id.isdigit() and (h := handle.read(args.job_id)) is not None:
        from dslurm.remote.proxy import passthrough

        if h.job_id is None:
            raise UserError(f"{h.path}: the handle names no job. Fix: submit again")
        return passthrough(h, ["status", str(h.job_id), *(["--json"] if args.json else [])])
    if not args.job_id.isdigit() and Path(args.job_id).is_dir():
        from dslurm.sweep.report import run_status as sweep_status

        return sweep_status(args)
    info = slurm.job_info(args.job_id)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_status(info))
    return 0


_SOURCES = {"scontrol": "slurmctld (scontrol)",
            "sacct": "accounting (sacct; slurmctld no longer has the job)"}


def format_status(info: dict[str, object]) -> str:
    """`dslurm status` for a person: one `key: value` line each; an empty value shows as `-`."""
    lines = []
    for k, v in info.items():
        shown = _SOURCES.get(str(v), v) if k == "source" else v
        lines.append(f"{k:>10}: {'-' if shown in ('', None) else shown}")
    return "\n".join(lines)
