"""What happened in one start of a run, recorded by each participant as it happens.

Decisions about how a job step ended (dslurm/endings/__init__.py) read these records, never srun's
or torchrun's return code alone: those fold a crash, a preemption and a teardown by srun
into the same numbers. Each start of a run gets a directory of its own:

  <run_dir>/starts/<job_id>.<restart>[.<step>]/   (.<step>: the job steps an in-allocation
                                                   recovery starts, dslurm/recover/supervise.py)
    batch.signals        one line per signal the batch shell received: `SIGNAME UNIXTIME`
                         (appended by the trap in the rendered script: only Slurm signals it)
    launcher-<host>.json each node's launcher: the signals *it* received (srun's teardown
                         reaches launchers, not the batch shell), torchrun's code, the
                         workers' own codes, which local ranks left no report
    rank-<rank>.json     each training process on its way out: kind, code, step reached,
                         error, and the time of the failure itself (not of the cleanup)
    ending.json          the classified ending, written once by `dslurm requeue-me` (or, for
                         a start that died with its batch shell, by the next start)
    cancel.json          `dslurm cancel` was asked to stop the run (who, when, --save), written
                         before it signals: a TERM that follows is the user's, not a stray one
    srun-refused.json    srun's own words when slurmctld would not create the job step for a
                         reason that says nothing about the nodes (recover/srun.py): the step ran
                         nothing, so its silence is no node's loss

Writers are torch-free and never raise into the caller's exit path: a fact that cannot be
written (disk full) is logged and the run goes on ending the way it would have.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.run import STARTS as STARTS  # the run directory's names live in dslurm/run.py

log = logging.getLogger(__name__)

ENV = "DSLURM_FACTS_DIR"  # set by the batch script; derived the same way when absent
ENDING = "ending.json"
CANCEL = "cancel.json"
REFUSED = "srun-refused.json"

# Kinds a training process reports about itself. The "victim" kinds (peer_lost, killed_by_teardown:
# victim_kind below) say a peer went away: they mark who was hurt, never where the failure began.
OWN_FAILURES = ("crash", "save_failed", "user_error", "refused", "burnin_rejected", "diverged", "oom")

# gloo/NCCL/c10d messages of a process whose peer went away first.
_PEER = re.compile(r"connection (closed|reset)|broken pipe|ECONNRESET|EPIPE|peer .* (closed|died|gone)|"
                   r"Socket Timeout|recvBytes|sendBytes|NCCL communicator was aborted|store.*(closed|refused)|"
                   r"DistNetworkError|DistStoreError", re.I)


def is_peer_error(error: str) -> bool:
    """True when an exception text says a peer process went away (this rank is a victim)."""
    return bool(_PEER.search(error or ""))


def is_term(signal: str | None) -> bool:
    """TERM is what tears a step down (srun, torchrun, Slurm); USR2 is only a warning. Pure."""
    return signal in ("SIGTERM", "TERM")


def victim_kind(kind: str, error: str, signal: str | None) -> str:
    """The kind a rank reports: a crash whose error says a peer went away is `peer_lost`; one
    that came after a TERM (torchrun or srun tearing the step down) is `killed_by_teardown`;
    anything else keeps its kind -- a crash after the time-limit warning (USR2) included: that
    signal tears nothing down. Pure; the one home of this rule."""
    if kind != "crash":
        return kind
    if is_peer_error(error):
        return "peer_lost"
    return "killed_by_teardown" if is_term(signal) else kind


def start_name(job_id: str, restart: int, step: int = 0) -> str:
    """`job.restart` for a start's first job step; `job.restart.step` for the steps an
    in-allocation recovery launches after it (so their facts never mix)."""
    return f"{job_id}.{restart}" + (f".{step}" if step else "")


def parse_start_name(name: str) -> tuple[str, int, int]:
    """(job id, restart, step) of a start directory's name; -1 for a part that is not a number."""
    parts = name.split(".")
    job = parts[0]
    nums = [int(p) if p.isdigit() else -1 for p in parts[1:3]]
    restart = nums[0] if nums else -1
    step = nums[1] if len(nums) > 1 else 0
    return job, restart, step


def start_dir(env: Mapping[str, str] | None = None, run_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """This start's facts directory: $DSLURM_FACTS_DIR, else <run_dir>/starts/<job>.<restart>
    (a run outside Slurm uses pid@host as its job id). None when there is no run dir."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return Path(env[ENV])
    run_dir = run_dir or env.get("DSLURM_RUN_DIR")
    if not run_dir:
        return None
    job = env.get("SLURM_JOB_ID") or f"local-{os.getppid()}"
    return Path(run_dir) / STARTS / start_name(job, int(env.get("SLURM_RESTART_COUNT") or 0))


# A fact that meets a full disk is tried again for this long: a disk full for seconds (a neighbour's
# file, a copy) otherwise loses exactly the reports its ending is decided from (`dslurm selftest
# chaos`, seed 1: a hang read as a stray stop). Only ENOSPC waits; the wait is on a failure's path.
ENOSPC_RETRY_S = 10.0


def _write_json(path: Path, obj: Any) -> bool:
    deadline = time.monotonic() + ENOSPC_RETRY_S
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(obj, indent=1, default=str) + "\n")
            return True
        except OSError as exc:  # ENOSPC etc.: the ending is decided from what could be written
            if exc.errno == errno.ENOSPC and time.monotonic() < deadline:
                time.sleep(0.25)
                continue
            log.error("could not record %s: %s", path, exc)
            return False


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- records


@dataclass
class RankReport:
    """One training process's own account of how it ended."""

    rank: int
    kind: str  # completed | stop_saved | terminated_saved | crash | save_failed | user_error |
    #            refused | burnin_rejected | diverged | peer_lost | killed_by_teardown
    #            (a hang: crash for the suspect, peer_lost for a rank that waited on it; error "hang: ...")
    code: int
    step: int | None = None
    error: str = ""
    t: float = field(default_factory=time.time)  # when the failure happened
    signal: str | None = None  # a stop signal this process received, if any
    host: str = field(default_factory=socket.gethostname)


@dataclass
class LauncherReport:
    host: str
    node_rank: int | None
    signals: list[tuple[str, float]]  # what this launcher itself received, with times
    torchrun_rc: int | None
    worker_codes: dict[str, int]  # local rank -> code the worker reported
    silent_local_ranks: list[int]  # started but left no code: killed (-9) or died in C
    code: int  # what the launcher exited with
    t: float = field(default_factory=time.time)


def write_rank_report(rep: RankReport, env: Mapping[str, str] | None = None,
                      run_dir: str | os.PathLike[str] | None = None) -> None:
    d = start_dir(env, run_dir)
    if d is not None:
        _write_json(d / f"rank-{rep.rank:05d}.json", asdict(rep))


def write_launcher_report(rep: LauncherReport, env: Mapping[str, str] | None = None) -> None:
    d = start_dir(env)
    if d is not None:
        _write_json(d / f"launcher-{rep.host}.json", asdict(rep))


def write_ending(d: Path, ending: dict[str, Any]) -> bool:
    return _write_json(d / ENDING, ending)


def write_cancel_request(d: Path, *, save: bool, user: str, via: str = "cancel") -> bool:
    """`dslurm cancel`'s record, in the facts dir of the start it stops, before it signals;
    `via="ctl"`: `dslurm ctl stop`'s, written by the rank that took it (an operator's stop,
    its own ending: dslurm/endings/__init__.py)."""
    return _write_json(d / CANCEL, {"t": time.time(), "save": save, "user": user, "via": via})


def write_refusal(d: Path, said: str) -> bool:
    """srun's words when slurmctld would not create the job step (dslurm/recover/srun.py)."""
    return _write_json(d / REFUSED, {"t": time.time(), "said": said})


@dataclass
class StartFacts:
    """Everything recorded for one start, as read back."""

    name: str
    batch_signals: list[tuple[str, float]]
    launchers: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    ending: dict[str, Any] | None
    cancel: dict[str, Any] | None = None  # `dslurm cancel`'s request (cancel.json), if any
    refused: str | None = None  # srun's words: slurmctld would not create the step (srun-refused.json)


def parse_signal_lines(text: str) -> list[tuple[str, float]]:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((parts[0], float(parts[1])))
            except ValueError:
                continue
    return out


def read_start(d: Path) -> StartFacts:
    try:
        sigs = parse_signal_lines((d / "batch.signals").read_text())
    except OSError:
        sigs = []
    launchers = [x for p in sorted(d.glob("launcher-*.json")) if isinstance(x := _read_json(p), dict)]
    ranks = [x for p in sorted(d.glob("rank-*.json")) if isinstance(x := _read_json(p), dict)]
    ending = _read_json(d / ENDING)
    # A cancel is asked of the start (job.restart); a recovery's later job steps read it there too.
    job, restart, _step = parse_start_name(d.name)
    cancel = _read_json(d / CANCEL) or _read_json(d.parent / start_name(job, restart) / CANCEL)
    said = _read_json(d / REFUSED)
    refused = str(said.get("said") or "?") if isinstance(said, dict) else None
    return StartFacts(d.name, sigs, launchers, ranks, ending if isinstance(ending, dict) else None,
                      cancel if isinstance(cancel, dict) else None, refused)


def list_starts(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Start directories in start order (job id, then restart count)."""
    def key(p: Path) -> tuple[int, str, int, int]:
        job, restart, step = parse_start_name(p.name)
        return (int(job) if job.isdigit() else 0, job, restart, step)
    root = Path(run_dir) / STARTS
    return sorted((p for p in root.iterdir() if p.is_dir()), key=key) if root.is_dir() else []
