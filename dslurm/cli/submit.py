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
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.config.resolve import Resolved, warnings
from dslurm.errors import UserError
from dslurm.run import JOB, SITE, RunDir
from dslurm.submission import active_jobs_of_run, completed_note, submit

if TYPE_CHECKING:
    from dslurm.remote.handle import Handle
    from dslurm.remote.proxy import Submitted
    from dslurm.slurm.refusals import Origin



class PlanCheckFailed(UserError):
    """`submit --plan-check`: the real layout is more than 10% from the plan (exit 1, as `plan check`)."""

    exit_code = 1

# ------------------------------------------------------------------------------ CLI


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("submit", help="render into the run directory and submit with sbatch")
    p.add_argument("--site", help="site config YAML (with --job; or use --run-dir)")
    p.add_argument("--job", help="job spec YAML (with --site; or use --run-dir)")
    p.add_argument("--run-dir", type=Path, default=None, metavar="RUN_DIR",
                   help=f"submit an existing run again from its frozen {SITE} and {JOB} (--set applies "
                        "on top); it resumes from the checkpoint pointer and runs the code snapshot it was "
                        "submitted with (unless --code). Run it from the directory of the first submit: relative "
                        "paths in the job resolve there. The local handle of a remote run works too")
    p.add_argument("--force", action="store_true",
                   help="submit even when the run directory's run already completed at train.steps")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job field, e.g. --set train.steps=200 (repeatable; YAML 1.2 values)")
    p.add_argument("--site-set", dest="site_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a site field, e.g. --site-set slurm.partition=debug (repeatable)")
    p.add_argument("--chain", type=int, default=1, help="submit K jobs linked by afterany dependencies")
    p.add_argument("--dry-run", action="store_true", help="write the script, do not submit")
    p.add_argument("--use-node", action="append", default=[], metavar="NODE",
                   help="use NODE although the site's memory of its nodes leaves it out (repeatable; "
                        "`dslurm site nodes`)")
    p.add_argument("--strict", action="store_true", help="refuse when the plan says the job will not fit")
    p.add_argument("--plan-check", action="store_true",
                   help="first run `dslurm plan check` (the real layout built at full size on a fake process group, "
                   "held against the planner); refuse to submit when it fails")
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
    s.add_argument("--json", action="store_true",
                   help="print the fields as one JSON object (a sweep directory: its rows) for scripts")
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
                        f"{SITE} and {JOB} are used). Fix: drop them, and change a field with --set")
    site, job = RunDir(run_dir).site_yaml, RunDir(run_dir).job_yaml
    for path in (site, job):
        if not path.is_file():
            raise UserError(f"{path}: missing; --run-dir needs a run directory `dslurm submit` wrote (it holds "
                            f"{SITE} and {JOB}). Fix: give that directory, or submit with --site and --job")
    return str(site), str(job), [f"checkpoint.run_dir={Path(run_dir).resolve()}", *args.overrides]


def origin_of(args: argparse.Namespace, site: str, job: str) -> Origin:
    """Where the fields came from: the files and overrides given here, or (`--origin`, a remote
    submit) the names on the machine the user typed them on."""
    from dslurm.slurm.refusals import Origin

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
    from dslurm.observe.lead import load
    from dslurm.remote import handle

    if getattr(args, "sweep", None):
        from dslurm.sweep.submit import run_submit as run_sweep

        return run_sweep(args)
    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None and (h := handle.read(run_dir)) is not None:  # a run on a cluster: submit it there
        if args.site or args.job:
            raise UserError(f"dslurm submit --run-dir {run_dir}: --site/--job cannot go with it (the run's frozen "
                            f"{SITE} and {JOB} on the cluster are used). Fix: drop them, and change a field "
                            "with --set or --site-set")
        return _resubmit_remote(h, args)
    site, job, overrides = inputs_of(args)
    r = load(site, job, overrides, args.site_overrides, base_dir=os.getcwd())
    for line in warnings(r):
        print(line, file=sys.stderr)
    as_json = getattr(args, "json", False)
    if r.site.login is not None:
        return _submit_remote(r, args, site, job)
    if not args.dry_run and not getattr(args, "force", False):
        note = completed_note(r)
        if note:
            print(json.dumps({"job_ids": [], "note": note}) if as_json else note)
            return 0
    _plan_check(r, strict=args.strict)
    if getattr(args, "plan_check", False):
        from dslurm.plan.check import run_check

        if run_check(site, job, overrides, args.site_overrides, None) != 0:
            raise PlanCheckFailed(f"{job}: `dslurm plan check` found the real layout more than 10% from the plan "
                                  "(above). Fix: the job's layout, or the planner where it is wrong; nothing "
                                  "was submitted")
    if not args.dry_run:
        busy = active_jobs_of_run(r.run_dir)
        if busy:
            which = ", ".join(f"{j['job_id']} ({j['state']})" for j in busy)
            print(f"warning: run directory {r.run_dir} already has job {which}. While that job holds the run "
                  "lock, this one is refused (exit 79, not retried). Fix: wait for it, cancel it, use --chain "
                  "to queue links behind it, or give this job its own checkpoint.run_dir", file=sys.stderr)
    sub = submit(r, chain=args.chain, dry_run=args.dry_run, code=getattr(args, "code", None),
                 origin=origin_of(args, site, job), use_nodes=getattr(args, "use_node", None) or ())
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
    if r.spares:  # what recovery.warm (auto by default) chose, as the submit event records it
        from dslurm.submission.warm_proof import choice_for

        warm = choice_for(r.job, r.site, r.site_path)
        print(f"  restart: {'warm' if warm.warm else 'cold'} after a failure ({warm.reason})")
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
