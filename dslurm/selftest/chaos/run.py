"""The soak itself: mount the size-limited durable path, submit the job, inject the schedule from
its first training step on, wait for the end, run the reference, check the promises, write the
table (table.md, table.json, chaos.png) and the record of every fault (faults.jsonl) into the
soak's directory and the run dir.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.durable import atomic_write_text
from dslurm.errors import UserError
from dslurm.observe.ledger import read_events
from dslurm.observe.report import load, summarize
from dslurm.selftest.chaos import jobs, promises, table
from dslurm.selftest.chaos.inject import FILLER, Done, Target, inject, resume
from dslurm.selftest.chaos.schedule import Fault

log = logging.getLogger(__name__)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@dataclass(frozen=True, kw_only=True, slots=True)
class Soak:
    plan: jobs.Plan
    seed: int
    faults: list[Fault]
    kinds: tuple[str, ...]
    every_s: float
    out: Path
    site: Path
    disk_mb: int
    timeout_s: float | None = None
    started: float = 0.0
    """when the soak began (time.time()), for timeout_s"""
    """the job is cancelled (and the run judged as it stands) once the soak has run this long"""
    say: Callable[[str], None] = print


def mount_durable(root: Path, size_mb: int, kinds: tuple[str, ...]) -> Path | None:
    """A tmpfs of `size_mb` at root: the durable path a fill makes full for real; None when the
    schedule has no disk_full (nothing to fill). A schedule with disk_full on a machine that
    cannot mount (not root, no mount namespace) is refused before anything is submitted: a fault
    the soak says it covers is never skipped in silence."""
    if "disk_full" not in kinds:
        return None
    root.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(root)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        rest = ",".join(k for k in kinds if k != "disk_full")
        raise UserError(f"chaos: cannot mount a {size_mb} MB tmpfs at {root} for the disk_full faults "
                        f"({(res.stderr.strip() or f'mount exit {res.returncode}').splitlines()[0]}). Fix: run as "
                        f"root, or leave disk_full out: --kinds {rest}")
    return root


def unmount(root: Path) -> None:
    subprocess.run(["umount", "-l", str(root)], capture_output=True, check=False)


def submit(s: Soak, spec_path: Path, env: dict[str, str]) -> int:
    res = subprocess.run([sys.executable, "-m", "dslurm", "submit", "--site", str(s.site), "--job", str(spec_path)],
                         cwd=jobs.ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    m = re.search(r"submitted job (\d+)", res.stdout)
    if res.returncode != 0 or not m:
        raise UserError(f"chaos: dslurm submit failed (exit {res.returncode}): {res.stderr.strip()[-1500:]}")
    return int(m.group(1))


def job_state(job: int, env: dict[str, str], watch: PendingWatch | None = None) -> str:
    try:
        info = slurm.job_info(job, env=env)
    except Exception as exc:  # slurmctld restarting: ask again later  # noqa: BLE001
        log.debug("job state: %s", exc)
        return "UNKNOWN"
    if watch is not None:
        watch.see(str(info["state"]), str(info.get("reason") or ""), time.time())
    return str(info["state"])


NEVER_CLEARS = ("BadConstraints", "PartitionConfig", "PartitionNodeLimit", "InvalidAccount", "InvalidQOS")
"""pending reasons that no time in the queue clears: the job as it stands can never be placed"""


@dataclass(slots=True)
class PendingWatch:
    """Is the job stuck in the queue for good? `stuck` is set (the moment, in words) once it has
    pended for a reason in NEVER_CLEARS for `bound_s` without a break (a promise: a run is never
    left unplaceable; dslurm/requeue/exclude.py). slurmctld re-evaluates such a job at once, so the
    bound is for a reason seen in passing, not for a scheduler's pace."""

    bound_s: float = 60.0
    since: float | None = None
    stuck: tuple[float, str] | None = None

    def see(self, state: str, reason: str, t: float) -> None:
        if state != "PENDING" or not reason.startswith(NEVER_CLEARS):
            self.since = None
            return
        self.since = t if self.since is None else self.since
        if self.stuck is None and t - self.since >= self.bound_s:
            self.stuck = (t, f"the job has pended {t - self.since:.0f} s for a reason no wait clears "
                             f"({reason}): it can never be placed again")


def _hosts_of(run_dir: Path) -> Callable[[], list[str]]:
    def hosts() -> list[str]:
        starts = [e for e in read_events(run_dir) if e.get("event") == "job_start"]
        return list(starts[-1].get("hosts") or []) if starts else []
    return hosts


def _first_step_t(run_dir: Path, job: int, env: dict[str, str], timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = [e["t"] for e in read_events(run_dir) if e.get("event") == "steps"]
        if steps:
            return float(steps[0])
        if job_state(job, env) in ENDED:
            break
        time.sleep(1.0)
    raise UserError(f"chaos: job {job} trained no step within {timeout_s:.0f} s; its logs: {run_dir / 'logs'}")


def inject_all(s: Soak, tg: Target, t0: float, record: Path, watch: PendingWatch) -> list[dict[str, Any]]:
    """Each fault at its time (a held one delays the next); stops when the job has ended or is
    stuck in the queue for good (`watch`)."""
    done: list[dict[str, Any]] = []
    for f in s.faults:
        if s.timeout_s is not None and t0 + f.at_s > s.started + s.timeout_s:
            break
        while time.time() < t0 + f.at_s:
            time.sleep(min(1.0, t0 + f.at_s - time.time()))
        state = job_state(tg.job_id, dict(tg.env), watch)
        if watch.stuck is not None:
            s.say(f"chaos: job {tg.job_id} stuck at +{time.time() - t0:.0f} s: {watch.stuck[1]}; "
                  f"{len(s.faults) - f.index} fault(s) not injected")
            break
        if state in ENDED:
            s.say(f"chaos: job {tg.job_id} {state} at +{time.time() - t0:.0f} s; {len(s.faults) - f.index} "
                  "fault(s) not injected")
            break
        d: Done = inject(tg, f, wait_s=min(s.every_s, 30.0))
        done.append(d.to_dict())
        with record.open("a") as fh:  # append-only: read back by a person while the soak runs
            fh.write(json.dumps(d.to_dict()) + "\n")
        s.say(f"chaos: +{d.t - t0:6.1f} s #{f.index} {f.kind}: {'' if d.injected else 'SKIPPED '}{d.detail}")
    return done


def wait_end(job: int, env: dict[str, str], timeout_s: float, watch: PendingWatch) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and watch.stuck is None:
        state = job_state(job, env, watch)
        if state in ENDED:
            return state
        time.sleep(2.0)
    slurm.run_cmd(["scancel", str(job)], check=False, env=env)
    if watch.stuck is not None:
        return f"stuck in the queue ({watch.stuck[1]}; cancelled)"
    return f"not ended after {timeout_s:.0f} s (cancelled)"


def bad_generations(run_dir: Path) -> dict[str, list[str]]:
    from dslurm.checkpoint import list_generations, verify_generation

    return {g.name: probs for g in list_generations(run_dir) if g.committed
            for probs in [verify_generation(run_dir / "generations" / g.name)] if probs}


def cluster_env(spares: bool) -> dict[str, str]:
    """The running local cluster's client environment; a clear error when it is down or too small."""
    from dslurm.cluster.state import info_of, is_up, load, state_dir_of

    need = jobs.NODES + (1 if spares else 0)
    sdir = state_dir_of(None)
    rec = load(sdir)
    if not rec or not is_up():
        raise UserError(f"chaos: the local cluster is not up; start it: dslurm cluster up --nodes {need} --accounting")
    info = info_of(sdir, rec)
    if info.nodes < need or not info.accounting:
        raise UserError(f"chaos: the local cluster has {info.nodes} node(s), accounting "
                        f"{'on' if info.accounting else 'off'}; the soak needs {need} and accounting: "
                        f"dslurm cluster up --nodes {need} --accounting")
    return info.env()


def soak(s: Soak) -> int:
    """The whole soak; -> 0 when every promise held, 1 otherwise (each broken one printed)."""
    env = cluster_env(s.plan.spares)
    s.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(s.out / "schedule.json", json.dumps(
        {"seed": s.seed, "minutes": s.plan.minutes, "every_s": s.every_s, "mode": s.plan.mode,
         "steps": s.plan.steps, "spares": s.plan.spares, "faults": [f.to_dict() for f in s.faults]}, indent=1))
    root = mount_durable(s.out / "durable", s.disk_mb, s.kinds if any(f.kind == "disk_full" for f in s.faults) else ())
    run_dir = (root or s.out / "durable") / "run"
    out_pt = s.out / "final.pt" if s.plan.mode == "script" else None
    spec = jobs.write_job(jobs.job(s.plan, run_dir, out_pt, chaos=True), s.out / "chaos-spec.yaml")
    record = s.out / "faults.jsonl"
    record.unlink(missing_ok=True)
    t_submit = time.time()
    job = submit(s, spec, env)
    reference = jobs.start_reference(s.plan, s.site, s.out)
    s.say(f"chaos: seed {s.seed}; job {job}; {len(s.faults)} fault(s) over {s.plan.minutes:g} min, one every "
          f"~{s.every_s:g} s; run dir {run_dir}; faults recorded in {record}")
    tg = Target(job_id=job, marker=jobs.marker(s.plan, run_dir), run_dir=run_dir, fill_root=root, env=env,
                training_hosts=_hosts_of(run_dir))
    try:
        t0 = _first_step_t(run_dir, job, env, timeout_s=600 * slurm.load_factor())
        watch = PendingWatch(bound_s=60.0 * slurm.load_factor())
        done = inject_all(s, tg, t0, record, watch)
        wait_s = max(900.0, 3.0 * s.plan.steps * s.plan.step_sleep_s)
        if s.timeout_s is not None:
            wait_s = max(1.0, min(wait_s, t_submit + s.timeout_s - time.time()))
        state = wait_end(job, env, timeout_s=wait_s, watch=watch)
    except BaseException:  # an error, ^C, or TERM (run() turns it into SystemExit): leave nothing behind
        slurm.run_cmd(["scancel", str(job)], check=False, env=env)
        jobs.stop_reference(reference)
        if root is not None:
            unmount(root)
        raise
    finally:
        if root is not None:
            (root / FILLER).unlink(missing_ok=True)
        for node in _drained(env):
            resume(node, env)
    s.say(f"chaos: job {job} {state} {time.time() - t_submit:.0f} s after submit")
    ref = jobs.finish_reference(reference, timeout_s=1800)
    saved = s.out / "run"
    shutil.rmtree(saved, ignore_errors=True)
    shutil.copytree(run_dir, saved, symlinks=True)
    if root is not None:
        unmount(root)
    return judge(s, saved, ref, out_pt, done, t0, stuck=watch.stuck)


def _drained(env: dict[str, str]) -> list[str]:
    """Nodes this soak drained (its reason) and left so: a spare_off interrupted by an error."""
    proc = slurm.run_cmd(["sinfo", "-N", "-h", "-o", "%N|%E"], check=False, env=env)
    return sorted({ln.split("|")[0] for ln in proc.stdout.splitlines() if ln.endswith("|chaos-spare-off")})


def judge(s: Soak, run_dir: Path, ref: Path, out_pt: Path | None, done: list[dict[str, Any]], t0: float,
          stuck: tuple[float, str] | None = None) -> int:
    events, skipped = load(run_dir)
    sm = summarize(events, skipped_lines=skipped, target_steps=s.plan.steps, run_dir=run_dir)
    try:
        mine = jobs.final_params(s.plan, run_dir, out_pt, s.out)
        theirs = jobs.final_params(s.plan, ref, s.out / "ref.pt" if s.plan.mode == "script" else None, s.out)
        identical = jobs.differ(mine, theirs)
    except (OSError, ValueError, RuntimeError) as exc:
        identical = f"the final parameters could not be read: {exc}"
    broken = promises.check(sm, events, done, steps=s.plan.steps, identical=identical,
                            bad_generations=bad_generations(run_dir), t0=t0, stuck=stuck)
    rows = table.rows(sm, done, t0)
    head = [f"# Chaos soak: seed {s.seed}, {s.plan.mode}, {s.plan.minutes:g} min, a fault every ~{s.every_s:g} s",
            "", f"Replay: `{replay_command(s)}`. {sum(d['injected'] for d in done)} fault(s) injected, "
            f"{sum(not d['injected'] for d in done)} skipped; final parameters "
            f"{'bit-identical to' if identical is None else 'DIFFERENT from'} the uninterrupted run's; "
            f"{len(broken)} broken promise(s).", ""]
    head += [f"- BROKEN {b.promise}: {b.detail} (at {_at(b.at, t0)}; last fault before: {b.fault})" for b in broken]
    text = table.markdown(rows, sm, head)
    blob = json.dumps({"seed": s.seed, "broken": [b.to_dict() for b in broken], "rows": table.to_json(rows),
                       "by_kind": table.by_kind(rows), "goodput": sm.goodput, "lost_steps": sm.lost_steps,
                       "starts": len(sm.starts)}, indent=1)
    for where in (s.out, run_dir):
        atomic_write_text(where / "chaos-table.md", text)
        atomic_write_text(where / "chaos.json", blob)
    try:
        table.plot(rows, s.out / "chaos.png", head[0].lstrip("# "))
        shutil.copy(s.out / "chaos.png", run_dir / "chaos.png")
    except ImportError as exc:
        s.say(f"chaos: no PNG ({exc})")
    s.say(text)
    for b in broken:
        print(f"chaos: BROKEN PROMISE {b.promise} at {_at(b.at, t0)}: {b.detail}; last fault before: {b.fault}",
              file=sys.stderr)
    s.say(f"chaos: {'all promises held' if not broken else f'{len(broken)} broken promise(s)'}; seed {s.seed}; "
          f"table {s.out / 'chaos-table.md'}, {s.out / 'chaos.png'}")
    return 1 if broken else 0


def _at(t: float | None, t0: float) -> str:
    return "the end" if t is None else f"+{t - t0:.1f} s"


def replay_command(s: Soak) -> str:
    return (f"dslurm selftest chaos --seed {s.seed} --minutes {s.plan.minutes:g} --every {s.every_s:g} "
            f"--mode {s.plan.mode} --steps {s.plan.steps}" + ("" if s.plan.spares else " --no-spares")
            + f" --kinds {','.join(s.kinds)}")
