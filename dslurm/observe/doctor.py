"""`dslurm doctor RUN_DIR`: symptoms of a sick run, each tied to evidence, a cause and a fix.

The symptom table of seed 000 (table 2.3) turned into checks over the ledger and the job
logs (`<run_dir>/logs/*.out|*.err`). `diagnose(events, log_lines)` is pure; each check
returns zero or more `Finding`s. Exit code: 0 nothing found, 1 findings, 2 user error.
The table with thresholds is in docs/report.md. A run that ended short of its steps is said
first (`dslurm.observe.completion`), and exits 1 even without another finding.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dslurm import exitcodes as X
from dslurm.observe import events as E
from dslurm.observe import perfdoctor, software
from dslurm.observe.events import Event
from dslurm.observe.report import DIED, Start, summarize, suspect_hosts
from dslurm.run import LEDGER, LOGS

HANG_S = 600.0  # a start this long without a first step is a hang, not a slow startup
STALL_FRACTION = 0.05  # periodic save stalls (not the save at a stop) above this share of training time
DATA_FRACTION = 0.2  # data wait above this share of the step time: input-bound
SCALING_MIN = 0.8  # per-rank tokens/s at more ranks, relative to the fewest ranks
SPIKE = 1.25  # loss above SPIKE x the median of the previous windows
MAX_EVIDENCE = 6

RDZV = re.compile(r"rendezvous|DistNetworkError|DistStoreError|TCPStore|connection refused|"
                  r"connect\(\) timed out|Watchdog caught collective|NCCL.*timeout", re.I)
CKPT = re.compile(r"REJECTED|CheckpointError|crc32|manifest.*(missing|mismatch)", re.I)
CRASH = re.compile(r"Traceback|out of memory|OOM|Killed|Xid|ECC error|DUE TO (TIME LIMIT|PREEMPTION)|"
                   r"NODE FAIL|Segmentation fault|ChildFailedError", re.I)
LOG_TIME = re.compile(r"\b[EWIF](\d{4} \d\d:\d\d:\d\d)|\b(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)")


@dataclass(slots=True)
class LogLine:
    """One line of a job log; `where` names it as file:line, with its own time when it has one."""

    path: str
    lineno: int
    text: str

    def where(self) -> str:
        m = LOG_TIME.search(self.text)
        stamp = f" [{m.group(1) or m.group(2)}]" if m else ""
        return f"{Path(self.path).name}:{self.lineno}{stamp}: {self.text.strip()[:160]}"


@dataclass(slots=True)
class Finding:
    symptom: str
    evidence: list[str]
    cause: str
    action: str


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def _ev(e: Event, *keys: str) -> str:
    """An event as one evidence line: time, name, the fields that matter (those it has)."""
    fields = " ".join(f"{k}={getattr(e, k)}" for k in keys if getattr(e, k, None) not in (None, [], {}))
    return f"{_when(e.t)} restart {e.restart} {e.NAME} {fields}".rstrip()


def _grep(logs: Iterable[LogLine], pattern: re.Pattern[str]) -> list[str]:
    return [ln.where() for ln in logs if pattern.search(ln.text)][:MAX_EVIDENCE]


def _pct(share: float) -> float:
    """A share in percent as the doctor prints it (one decimal). Thresholds are compared with
    what is shown, so a value printed as 5.0% is never "over" a 5.0% threshold."""
    return round(100 * share, 1)


def _in_time_order(timed: Iterable[tuple[float, str]]) -> list[str]:
    """Evidence lines from ledger events, oldest first (stable for equal times)."""
    return [line for _, line in sorted(timed, key=lambda tl: tl[0])]


def _trained(s: Start) -> bool:
    """The start did a step: a steps window, the phase table rank 0 writes after its first step,
    or a later step reached (exit, agreed stop, save) than the one it resumed from."""
    moved = s.reached is not None and s.resumed_from is not None and s.reached > s.resumed_from
    return bool(s.windows) or bool(s.all(E.StartPhases)) or moved


def _no_first_step(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """Starts that never did a step, from the ledger. Rendezvous lines in the logs are evidence
    only when such a start exists: torchrun prints the same errors when it tears down a start
    that trained and then hung or was stopped, and that is not a start-up hang."""
    ev, never = [], []
    for s in starts:
        ts = s.first(E.TrainStart)
        clean = s.exit_reason in ("preflight_failed", "user_error") or s.exit_reason.startswith("completed")
        if _trained(s) or clean:
            continue
        waited = s.end - (ts.t if ts else s.begin)
        last = s.events[-1]
        what = "train_start but no steps" if ts else "no train_start"
        line = (f"start {s.index} ({s.job_id}.{s.restart}) from {_when(s.begin)}: {what} after {waited:.0f} s; "
                f"last event {last.NAME} at {_when(last.t)}; exit: {s.exit_reason}")
        never.append(line)
        # A quick, recorded failure is a crash (see _crashes); long or killed without a word is a hang.
        if waited >= HANG_S or s.exit_reason == DIED:
            ev.append(line)
    rdzv = _grep(logs, RDZV) if never else []
    if rdzv:
        ev = never  # a start that never stepped, and the rendezvous said why
    if not ev:
        return []
    return [Finding("hang before the first step", ev + rdzv,
                    "launcher or scheduler: ranks never all joined the rendezvous (wrong master address/port, "
                    "a node missing from the allocation, a firewall) or a rank died during setup",
                    "read the rendezvous lines in the .err log (world size, master_addr, port of each node); "
                    "check `squeue`/`scontrol show job` that all nodes started; run `dslurm burnin` on the nodes")]


def _tps(s: Start) -> float | None:
    """Steady tokens/s of a start: the median window, the first (warm-up) window left out."""
    vals = [e.tokens_per_s for e in s.all(E.Steps) if e.tokens_per_s is not None]
    vals = vals[1:] if len(vals) > 1 else vals
    return statistics.median(vals) if vals else None


def _scaling(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    per_rank = [(s, t / s.world_size) for s in starts if s.world_size and (t := _tps(s)) is not None]
    sizes = {s.index: int(s.world_size or 0) for s, _ in per_rank}
    if len(set(sizes.values())) < 2:
        return []
    small = min(sizes.values())
    base = max(r for s, r in per_rank if sizes[s.index] == small)
    bad = [(s, r) for s, r in per_rank if sizes[s.index] > small and _pct(r / base) < _pct(SCALING_MIN)]
    if not bad:
        return []
    ev = [f"start {s.index}: {s.world_size} ranks, {r:,.0f} tokens/s per rank" for s, r in per_rank]
    ev.append(f"efficiency at {bad[0][0].world_size} ranks: {_pct(bad[0][1] / base):.1f}% of {small} ranks "
              f"(threshold {_pct(SCALING_MIN):.1f}%)")
    return [Finding("throughput stops scaling", ev,
                    "communication topology or parallelism: collectives cross a slower link as nodes are "
                    "added (tp across nodes, FSDP all-gathers not hidden behind compute)",
                    "compare inter-node busbw in the burn-in report; `dslurm plan` a layout with tp inside "
                    "the NVLink domain; check NCCL env (IB HCAs, NCCL_SOCKET_IFNAME)")]


def _stop_steps(s: Start) -> set[int]:
    """Steps at which the start stopped (its exit, an agreed stop): a save there is the one that
    makes the stop durable. It blocks the exit, not training, and is synchronous by design."""
    return {e.step for e in s.all(E.Exit) if e.step is not None} | {
        e.step for e in s.all(E.Signal) if e.step is not None}


def _idle_stages(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    out = []
    saves = [e for s in starts for e in s.all(E.CkptSave) if e.step not in _stop_steps(s)]
    at_stop = sum(len(s.all(E.CkptSave)) for s in starts) - len(saves)
    stall = sum(e.stall_s for e in saves)
    training = sum(w.step_s * (w.last - w.first + 1) for s in starts for w in s.windows)
    share = _pct(stall / training) if training > 0 else 0.0
    if share > _pct(STALL_FRACTION):
        sync = sum(1 for e in saves if e.total_s <= 2 * e.stall_s)
        spikes = [e for s in starts for e in s.all(E.Steps) if e.phase_s("checkpoint") > 0]
        head = (f"periodic save stalls {stall:.1f} s = {share:.1f}% of {training:.1f} s of training "
                f"(threshold {_pct(STALL_FRACTION):.1f}%); {sync} of {len(saves)} saves blocked for their "
                "whole write")
        if at_stop:
            head += f"; {at_stop} save(s) at a stop or the end not counted (they delay the exit, not training)"
        timed = [(e.t, _ev(e, "step", "stall_s", "total_s")) for e in saves]
        timed += [(e.t, _ev(e, "first", "last", "step_time_s") + " (window holding a save)") for e in spikes]
        fix = ("set checkpoint.async_save: true (the step waits only for the copy to host memory)" if sync
               else "saves are already async: raise checkpoint.interval or check the storage bandwidth")
        out.append(Finding("periodic idle stages (step time spikes at checkpoint intervals)",
                           [head] + _in_time_order(timed)[:MAX_EVIDENCE],
                           "synchronous checkpoint saves stall every rank", fix))
    data = [(e, e.phase_s("data") / e.step_time_s) for s in starts for e in s.all(E.Steps)
            if e.phase_s("data") and e.step_time_s]
    median = _pct(statistics.median(f for _, f in data)) if data else 0.0
    if median > _pct(DATA_FRACTION):
        ev = [f"median data wait {median:.1f}% of the step time (threshold {_pct(DATA_FRACTION):.1f}%)"]
        ev += [_ev(e, "first", "last", "step_time_s") + f" data wait {_pct(f):.1f}%" for e, f in data[:MAX_EVIDENCE]]
        out.append(Finding("steps wait for input data", ev, "input path: the loader cannot keep up",
                           "more loader workers, data on local scratch, pre-tokenized shards"))
    return out


def _loss(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    out, spikes, nans = [], [], []
    history: list[float] = []
    for s in starts:
        for i, e in enumerate(s.all(E.Steps)):
            loss = e.loss
            if loss is None:
                continue
            if not math.isfinite(loss):
                nans.append(_ev(e, "first", "last", "loss", "grad_norm"))
                continue
            if len(history) >= 3 and loss > SPIKE * statistics.median(history[-5:]):
                after = " (first window after a resume)" if i == 0 and s.index > 0 else ""
                spikes.append(_ev(e, "first", "last", "loss", "grad_norm") +
                              f" vs median {statistics.median(history[-5:]):.3f}{after}")
            history.append(loss)
    hw = _grep(logs, re.compile(r"Xid|ECC", re.I))
    handled = [e for s in starts for e in s.all(E.NonFinite)]
    if nans or handled:
        acted = [_ev(e, "step", "loss", "grad_norm", "action", "handled", "generation", "resumed_step",
                     "skipped_position") for e in handled]
        stopped = any(e.action == "stop" for e in handled)
        what = ("the run stopped on it (train.nonfinite); the pointer names a finite generation: resubmit "
                "after the fix" if stopped else "the run skipped or rolled back past it (train.nonfinite)"
                if handled else "nothing acted on it (train.nonfinite: off)")
        out.append(Finding("loss is NaN or inf", (acted + nans)[:MAX_EVIDENCE] + hw,
                           "numerics (learning rate, bf16/fp8 overflow, a bad batch) or hardware (XID/ECC); "
                           f"{what}",
                           "compare grad_norm before the NaN; lower lr or add warm-up; a repeat at the same data "
                           "position after a rollback points at the batch, at varying ones at numerics or a "
                           "node: run `dslurm burnin` on the nodes"))
    if spikes:
        resumed = any("after a resume" in x for x in spikes)
        out.append(Finding("loss spikes", spikes[:MAX_EVIDENCE] + hw,
                           "a resume that did not restore all state (optimizer, data position, lr)" if resumed
                           else "numerics (lr too high, bad batch) or hardware errors",
                           "compare grad_norm around the spike; after a resume: check the generation's extra "
                           "state (data position, scheduler); `dslurm ckpt verify`"))
    return out


def _resume(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    kinds = (E.CkptFallback, E.CkptRestoreFailed, E.CkptSaveFailed)
    timed = [(e.t, _ev(e, "step", "generation", "reason", "rejected")) for s in starts for e in s.all(*kinds)]
    timed += [(e.t, _ev(e, "decision", "reason")) for s in starts for e in s.all(E.Requeue)
              if e.exit_code == X.NO_PROGRESS]
    ev = _in_time_order(timed) + _grep(logs, CKPT)
    if not ev:
        return []
    return [Finding("resume fails or falls back", ev[:2 * MAX_EVIDENCE],
                    "checkpoint writer or artifact lineage: a generation failed verification (torn write, "
                    "altered file, other config), or the same crash repeats at the same step",
                    "`dslurm ckpt ls RUN_DIR` and `dslurm ckpt verify`; read the logs of the starts that "
                    "began at the same step; fix the crash before resubmitting")]


def _rng_not_restored(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """Resumes at another world size: the per-rank RNG streams were not restored (a decision, not
    a fault: docs/checkpoint.md, "RNG streams and world-size changes"), named so nobody expects
    the run to match an uninterrupted one."""
    hits = [(s, e) for s in starts for e in s.all(E.CkptRestore) if e.rng_restored is False]
    if not hits:
        return []
    ev = [f"start {s.index} ({s.job_id}.{s.restart}) resumed step {e.step} with world size {s.world_size} "
          f"(saved with {e.saved_world_size}): RNG streams not restored" for s, e in hits]
    return [Finding("RNG streams not restored after a world-size change", ev[:MAX_EVIDENCE],
                    "each rank's saved RNG streams (Python, numpy, torch, CUDA) belong to that set of ranks; at "
                    "another world size dropout and sampling continue from the script's own seeds, so the run "
                    "is not the one an uninterrupted run would have been (the model, optimizer and data "
                    "position are restored)", "expected after a shrink or a resubmission with other nodes; "
                    "resume with the saved world size for the saved streams")]


def _stragglers(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    out = []
    sm_hosts: dict[str, list[str]] = {}
    for s in starts:
        for e in s.all(E.Stragglers):
            for slow in e.slow:
                if isinstance(slow, dict):
                    sm_hosts.setdefault(str(slow.get("host")), []).append(
                        f"{_when(e.t)} step {e.step}: rank {slow.get('rank')} x{slow.get('ratio')}")
    for host, ev in sorted(sm_hosts.items()):
        if len(ev) >= 2:  # once can be noise (a GC pause); twice on the same host is a pattern
            out.append(Finding(f"straggler: {host} slow in {len(ev)} checks", ev[:MAX_EVIDENCE],
                               "one slow host delays every synchronized rank (thermal throttling, a bad "
                               "link, a noisy neighbour, input work on that host)",
                               f"run `dslurm burnin` on {host}; add it to the run's blocklist to exclude it"))
    bad = [e for s in starts for e in s.all(E.Preflight) if e.bad_nodes]
    if bad:
        out.append(Finding("burn-in found bad nodes", [_ev(e, "bad_nodes", "report") for e in bad],
                           "hardware or fabric below the site thresholds",
                           "the nodes were excluded (blocklist); read the burn-in report and tell the admins"))
    waived = [e for s in starts for e in s.all(E.BlocklistWaived)]
    if waived:
        out.append(Finding("blocklisted nodes readmitted on requeue", [e.reason for e in waived][:MAX_EVIDENCE],
                           "excluding the run's whole blocklist would have left the job fewer nodes than it needs: "
                           "in its partition (Slurm keeps it pending for ever, BadConstraints), or among those "
                           "Slurm schedules now",
                           "if those nodes are bad, have them drained (Slurm skips them; the job waits for good "
                           "ones) or submit fewer nodes or spares; else empty the run's blocklist"))
    return out


def _hangs(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """Hangs the watchdog caught during training (train/watchdog.py): suspects, bound, stacks."""
    out = []
    for s in starts:
        for e in s.all(E.Hang):
            hosts = ", ".join(suspect_hosts(e, s)) or "?"
            ev = [_ev(e, "step", "idle_s", "bound_s", "median_step_s", "suspects", "suspect_hosts"),
                  f"why: {e.why}",
                  f"cost: {e.idle_s:.0f} s without progress before the watchdog fired (bound {e.bound_s:.0f} s), "
                  f"then this start's steps since its last save and the restart",
                  f"stacks of every rank: {e.stacks_dir}/hang-rank-*.txt"]
            ev += [f"rank {r}: last collective {c.get('name') or '-'} #{c.get('seq')} "
                   f"({'inside' if c.get('inside') else 'left'}) on {c.get('host')}"
                   for r, c in list(e.collectives.items())[:MAX_EVIDENCE] if isinstance(c, dict)]
            ev[1:1] = perfdoctor.hang_evidence(e)  # the c10d collective each rank is in, first
            out.append(Finding(
                f"hang during training at step {e.step} (suspect rank(s) {e.suspects or 'none'} on {hosts})", ev,
                "synchronization (seed table: collective wait): the suspect rank stopped outside the "
                "collectives the others wait in (a deadlock, a stalled input read, a device fault), or, "
                "with no suspect, the fabric itself hangs",
                f"read the suspects' stacks; run `dslurm burnin` on {hosts}; if it repeats on the same host, "
                "blocklist it; the start ended as a crash and the requeue resumed from the pointer"))
    return out


def _corruption(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """Silent data corruption the replica check caught (train/sdc.py): who disagreed, what was done."""
    out = []
    for s in starts:
        for e in s.all(E.Sdc):
            hosts = ", ".join(suspect_hosts(e, s)) or "?"
            ev = [_ev(e, "step", "last_clean_step", "suspects", "suspect_hosts", "named", "action"), f"why: {e.why}",
                  f"parameters that differ: {', '.join(e.params) or '?'}"]
            if e.action == "rollback":
                ev.append(f"rolled back to {e.generation} (step {e.resumed_step}), saved at or before the last "
                          f"clean check (step {e.last_clean_step})")
            who = (f"{hosts} disagreed with the majority of its replicas" if e.named else
                   f"no majority among the replicas: every one of {hosts} is a suspect")
            out.append(Finding(
                f"silent data corruption at step {e.step}: {who}", ev,
                "silent data corruption (seed table: wrong numbers with no error): a flaky core, memory or "
                "link on the suspect node changed parameter bits without an ECC or Xid report",
                (f"blocklisted {', '.join(e.blocklisted)}: later starts exclude it; " if e.blocklisted else
                 "with 2 replicas no node can be named: use 3 or more (parallel.dp_replicate); ") +
                f"run `dslurm burnin` on {hosts} and tell the admins"))
    return out


def _device_health(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """What the periodic NVML poll found during training (train/sdc.py DevicePoll), per host."""
    by_host: dict[str, list[str]] = {}
    for s in starts:
        for e in s.all(E.DeviceHealth):
            by_host.setdefault(e.host or "?", []).extend(f"step {e.step}: {f}" for f in e.findings)
    out = []
    for host, lines in sorted(by_host.items()):
        xid = any("Xid" in x or "ECC" in x for x in lines)
        out.append(Finding(
            f"device health on {host} during training", lines[:MAX_EVIDENCE],
            "hardware (seed table: " + ("Xid / ECC errors: a failing GPU or its memory" if xid else
                                        "thermal or power throttling: a slow GPU, a straggler") + ")",
            f"run `dslurm burnin` on {host}; " + ("drain it and tell the admins" if xid else
                                                   "check its cooling; blocklist it if it keeps throttling")))
    return out

def _crashes(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    dead = [s for s in starts if s.exit_reason == DIED or s.exit_reason.startswith("failed")
            or s.exit_reason == "budget"]
    if not dead:
        return []
    ev = [f"start {s.index} ({s.job_id}.{s.restart}): {s.exit_reason}; last event {s.events[-1].NAME} "
          f"at {_when(s.events[-1].t)}, step {s.reached}" for s in dead]
    return [Finding("starts that died", ev + _grep(logs, CRASH),
                    "a crash, an OOM kill, a node failure or a time limit without the signal lead time",
                    "read the .err log of that start; `sacct -j JOB` for the state; raise the signal lead "
                    "time if it hit the limit")]


_ENDING_HELP = {
    "crash": ("a rank failed of its own accord (the first one named; the others were victims)",
              "read that rank's traceback in the .err log; `dslurm report` shows whether the retry resumed"),
    "node_failure": ("Slurm lost a node", "check the node (`sinfo -R`); the job requeues on healthy nodes"),
    "save_failed": ("a checkpoint save the ending needed did not commit: the state is not durable",
                    "free disk space or fix the divergence named in the evidence, then resubmit"),
    "refused": ("another job held the run directory's lock", "wait for or cancel that job; or use --chain"),
    "burnin_rejected": ("the burn-in rejected a node", "see the preflight report; the job requeues without it"),
    "oom": ("a rank ran out of memory; not retried: the same layout and batch would again",
            "the requeue decision names the planner's fix (see the out-of-memory finding); resubmit with it"),
    "diverged": ("the loss was not finite and train.nonfinite said stop (or its bound was spent); not retried",
                 "lower train.lr or add warm-up, or set train.nonfinite: rollback, then resubmit: it resumes "
                 "from the pointer's finite generation"),
    "operator_stop": ("an operator asked the run to save and end (`dslurm ctl stop`): saved, not requeued, the job "
                      "cancelled on purpose", "nothing is wrong; `dslurm submit` again continues from the checkpoint"),
}


def _endings(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """Starts whose classified ending (dslurm/endings/__init__.py) was a failure, with its evidence."""
    out = []
    for cls, (cause, fix) in _ENDING_HELP.items():
        hits = [s for s in starts if s.ending == cls]
        if hits:
            ev = [f"start {s.index} ({s.job_id}.{s.restart}): {s.ending_reason}" for s in hits]
            ev += [str(x) for s in hits for e in s.all(E.Ending)[-1:] for x in e.evidence]
            out.append(Finding(f"ended by {cls.replace('_', ' ')}", ev[:MAX_EVIDENCE], cause, fix))
    return out


def _perf(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """A slow rank's cause and memory at an OOM (dslurm/observe/perfdoctor.py)."""
    return [Finding(*row) for row in perfdoctor.checks(starts)]


def _software(starts: list[Start], logs: list[LogLine]) -> list[Finding]:
    """A start that ran other software than the one before it (dslurm/observe/software.py)."""
    lines = software.change_lines([e for s in starts for e in s.events])
    changed = [x for x in lines if x.startswith("software changed")]
    if not changed:
        return []
    return [Finding("software changed between starts", changed[:MAX_EVIDENCE],
                    "a requeued start ran another NCCL, driver, image, code or packages (its `start_env` event)",
                    "compare the curves at the step named; pin the image (site.container.image with @sha256) or "
                    "refuse a bad version (site.refuse.nccl, docs/site.md)")]


CHECKS: list[Callable[[list[Start], list[LogLine]], list[Finding]]] = [
    _no_first_step, _scaling, _idle_stages, _hangs, _corruption, _device_health, _loss, _resume, _stragglers,
    _perf, _endings, _crashes, _rng_not_restored, _software]


def diagnose(events: Iterable[Event], log_lines: Iterable[LogLine] = ()) -> list[Finding]:
    """Every finding of every check, in the order of the symptom table (pure)."""
    starts, logs = summarize(events).starts, list(log_lines)
    return [f for check in CHECKS for f in check(starts, logs)]


def read_logs(run_dir: Path, events: Iterable[Event] = ()) -> list[LogLine]:
    """Lines of `<run_dir>/logs/*.out` and `*.err`, and of the log files the ledger's submit
    events name elsewhere (a sweep task's array logs live in `<sweep dir>/logs`); unreadable
    bytes replaced, a file gone is skipped, neither is fatal."""
    paths = sorted((Path(run_dir) / "logs").glob("*.[oe][ur][tr]"))
    paths += [p for p in dict.fromkeys(Path(x) for e in E.of(events, E.Submit) for x in e.logs) if p not in paths]
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                out += [LogLine(str(path), i, line) for i, line in enumerate(fh, 1)]
        except OSError:
            continue
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="symptoms of a run, with evidence, cause and fix (exit 1 if any)",
                       description="Diagnose a run from its ledger and job logs (see docs/report.md).")
    p.add_argument("run_dir", type=Path, help=f"run directory holding {LEDGER} and {LOGS}/, or the local handle "
                                              "of a remote run (docs/remote.md: the doctor runs there)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from dslurm.observe.completion import COMPLETED, target_steps
    from dslurm.observe.report import load
    from dslurm.remote import handle

    if (h := handle.read(args.run_dir)) is not None:  # a run on a cluster: the doctor reads its ledger and logs there
        from dslurm.remote.proxy import passthrough

        return passthrough(h, ["doctor", h.run_dir])
    events, _ = load(args.run_dir)
    done = summarize(events, target_steps=target_steps(args.run_dir), run_dir=args.run_dir).completion
    findings = diagnose(events, read_logs(args.run_dir, events))
    findings += [Finding(*row) for row in perfdoctor.dump_rows(Path(args.run_dir), events)]  # own scripts' dumps
    console = Console()
    if done.status != COMPLETED:  # first: whether the run finished, and how to continue one that ended short
        style = "bold red" if done.complete is False else "bold"
        for i, line in enumerate(done.lines()):
            console.print(f"[{style}]{escape(line)}[/{style}]" if i == 0 else escape(line),
                          highlight=False, soft_wrap=True)
        console.print()
    if not findings:
        console.print(f"{args.run_dir}: no symptom found ({len(events)} events)")
        return 1 if done.complete is False else 0
    for f in findings:
        console.print(f"[bold red]{escape(f.symptom)}[/bold red]")
        for line in f.evidence:
            console.print(f"  - {escape(line)}", highlight=False, soft_wrap=True)
        console.print(f"  likely cause: {escape(f.cause)}\n  what to do: {escape(f.action)}\n")
    return 1
