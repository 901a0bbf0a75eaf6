"""Fault injection: every test hook of dslurm in one place, all off unless a variable is set.

Timing races (one node crashing while another is killed, a save cut in half) are made
deterministic by these knobs, read from the environment of the training processes (a
job's `env:` block sets them for every rank). Nothing in production code reads a test
variable anywhere else.

  DSLURM_FAULT_STOP=STEP[:RANKS][@RESTART]   RANKS request a stop after optimizer step STEP
                                             (1-based), as a USR2 handler would
  DSLURM_FAULT_CRASH=STEP[:RANKS][@RESTART]  RANKS raise before optimizer step STEP
  DSLURM_FAULT_KILL9=STEP[:RANKS][@RESTART]  RANKS SIGKILL themselves before step STEP (no report)
  DSLURM_FAULT_HANG=STEP[:RANKS][@RESTART]   RANKS hang (sleep in Python, outside any collective)
                                             before step STEP: for the hang watchdog
  DSLURM_FAULT_STALL=STEP[:RANKS][@RESTART]  RANKS stall (sleep in Python) inside the forward pass of step
                                             STEP, in the middle transformer block, after FSDP gathered its
                                             parameters: between the collectives of one forward_backward,
                                             for the collective-level hang forensics (train/stepfaults.py)
  DSLURM_FAULT_OOM=STEP[:RANKS][@RESTART]    RANKS raise torch.OutOfMemoryError in that same place at step
                                             STEP: an out-of-memory error where a CPU has none
  DSLURM_FAULT_SLOW_DATA=SECONDS[:RANKS][@RESTART]     every batch read on RANKS takes SECONDS longer
  DSLURM_FAULT_SLOW_COMPUTE=SECONDS[:RANKS][@RESTART]  every forward pass on RANKS takes SECONDS longer
                                             (in the middle block): a straggler slow in its data or its
                                             compute, for the straggler split (dslurm/observe/slowrank.py)
  DSLURM_FAULT_FREEZE=STEP[:RANKS][@RESTART] RANKS ignore TERM and stop themselves (SIGSTOP) before step
                                             STEP: frozen where neither their own watchdog nor a TERM can
                                             end them (a process stuck in a driver call); only SIGKILL does
  DSLURM_FAULT_DATA_STALL=STEP[:RANKS][@RESTART]  RANKS stall reading the batch of step STEP (1-based)
                                             for an hour: a hung file system under the loader; only a
                                             stop (or the hang watchdog) ends the wait (train/loop.py)
  DSLURM_FAULT_NAN=STEP[:RANKS][@RESTART]    the batch that step STEP reads in an uninterrupted run is
                                             poisoned on RANKS: its loss is NaN whenever it is read,
                                             so a rollback that does not skip it meets it again
  DSLURM_FAULT_STOP_IN_EVAL=STEP[:RANKS][@RESTART]  RANKS request a stop while the first batch of the
                                             evaluation after step STEP runs (train/evaluate.py), as a
                                             USR2 arriving mid-evaluation would
  DSLURM_FAULT_BITFLIP=STEP[:RANKS][@RESTART] RANKS flip one bit of one parameter element after optimizer
                                             step STEP (once per process): silent data corruption in one
                                             HSDP replica, for the replica check (train/sdc.py)
  DSLURM_FAULT_AWAIT=GLOB:COUNT[:TIMEOUT_S]  before the first step at which a CRASH, KILL9 or FREEZE of this
                                             job step fires (on any rank), every rank waits until COUNT
                                             files match GLOB (at most TIMEOUT_S, default 90), logging it,
                                             outside any collective and with the hang bound at its ceiling
                                             for that step: e.g. until every node's warm pool is ready
                                             (RUN/warm/*.ready)
  DSLURM_FAULT_EXIT_DELAY=SECONDS[:RANKS][@RESTART]  RANKS wait SECONDS after their exit report,
                                             before exiting: forces which node's processes exit first
  DSLURM_FAULT_CKPT_KILL=RANK:PHASE:NTH      RANK SIGKILLs itself at PHASE of its NTH save
                                             (before_write, after_write, before_pointer; two
                                             tiers: after_local_commit, mid_copy; partner copies:
                                             mid_partner, once the first piece it receives landed)
  DSLURM_FAULT_SAVE_SLEEP=SECONDS            every background (async) save sleeps SECONDS after
                                             staging: a window in which to kill the whole job
  DSLURM_FAULT_STAGE_DELAY=SECONDS           an overlapped host copy (dslurm/checkpoint/staging.py) starts
                                             SECONDS late: it ends after the next step's backward, so
                                             the optimizer step must wait for it
  DSLURM_FAULT_DURABLE_MBPS=MB_PER_S         each rank's copy to the durable run dir (two tiers) and
                                             each rank's checked load from it are capped at MB_PER_S
                                             (a loaded shared file system)
  DSLURM_FAULT_TOKENIZE_KILL=TASK           the tokenization array task TASK (SLURM_ARRAY_TASK_ID, or
                                             the shard index when run locally) SIGKILLs itself after
                                             its first chunk is in its temp file: a task killed mid-shard
  DSLURM_FAULT_SLOW_NODE=HOST:SECONDS[,...]  the burn-in's timed exchanges on HOST sleep SECONDS
                                             each: a slow link for the localization to find

RANKS is a comma list of global ranks (default 0; with replica groups the job's: group g's rank r
is g * the group's world + r, `DSLURM_JOB_RANK` set by the trainer); @RESTART limits the knob to one start
(SLURM_RESTART_COUNT), e.g. crash only on the first start and run clean after the requeue;
@RESTART.STEP to one job step of that start (DSLURM_STEP_INDEX: the steps an in-allocation
recovery launches, dslurm/recover/supervise.py), e.g. @0.0 fires in the first step only.
A scoped knob may list several `;`-separated values, the first that aims at this process applies:
DSLURM_FAULT_CRASH='9:1@0.0;13:1@0.2' crashes rank 1 in job steps 0 and 2 (at different steps).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

SLOW_NODE = "DSLURM_FAULT_SLOW_NODE"
RANK_ENV = "DSLURM_JOB_RANK"
"""the rank the knobs aim at where RANK is not the job's (a replica group's world: train/replicas.py)"""
# Every knob; a test checks that no other DSLURM_FAULT_* name appears in the code.
KNOBS = ("DSLURM_FAULT_STOP", "DSLURM_FAULT_STOP_IN_EVAL", "DSLURM_FAULT_CRASH", "DSLURM_FAULT_KILL9",
         "DSLURM_FAULT_HANG", "DSLURM_FAULT_FREEZE", "DSLURM_FAULT_STALL", "DSLURM_FAULT_OOM",
         "DSLURM_FAULT_SLOW_DATA", "DSLURM_FAULT_SLOW_COMPUTE", "DSLURM_FAULT_NAN", "DSLURM_FAULT_BITFLIP",
         "DSLURM_FAULT_DATA_STALL",
         "DSLURM_FAULT_EXIT_DELAY", "DSLURM_FAULT_AWAIT",
         "DSLURM_FAULT_CKPT_KILL",
         "DSLURM_FAULT_SAVE_SLEEP", "DSLURM_FAULT_STAGE_DELAY", "DSLURM_FAULT_DURABLE_MBPS", SLOW_NODE,
         "DSLURM_FAULT_TOKENIZE_KILL")


@dataclass(frozen=True)
class ScopedKnob:
    """A knob value `VALUE[:RANKS][@RESTART]`: what, for which ranks, on which start."""

    value: str
    ranks: frozenset[int]
    restart: int | None
    step: int | None = None

    def applies(self, env: Mapping[str, str], *, any_rank: bool = False) -> bool:
        rank = int(env.get(RANK_ENV) or env.get("RANK", "0") or 0)
        restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        step = int(env.get("DSLURM_STEP_INDEX", "0") or 0)
        return (any_rank or rank in self.ranks) and self.restart in (None, restart) and self.step in (None, step)


def parse_scoped(raw: str) -> ScopedKnob:
    """`VALUE[:RANKS][@RESTART[.STEP]]` -> ScopedKnob; RANKS defaults to rank 0. Pure."""
    body, _, when = raw.partition("@")
    value, _, ranks = body.partition(":")
    restart, _, step = when.partition(".")
    return ScopedKnob(value, frozenset(int(r) for r in (ranks or "0").split(",")), int(restart) if restart else None,
                      int(step) if step else None)


def _scoped(name: str, env: Mapping[str, str] | None) -> str | None:
    """The knob's value when it is set and aims at this process (rank, start), else None."""
    env = os.environ if env is None else env
    for raw in (env.get(name) or "").split(";"):
        knob = parse_scoped(raw) if raw.strip() else None
        if knob is not None and knob.applies(env):
            return knob.value
    return None


def step_fault(name: str, env: Mapping[str, str] | None = None) -> int | None:
    """The step at which knob `name` fires for this process (this rank, this start), or None."""
    value = _scoped(name, env)
    return int(value) if value is not None else None


AWAIT_DEFAULT_S = 90.0
AWAITED = ("DSLURM_FAULT_CRASH", "DSLURM_FAULT_KILL9", "DSLURM_FAULT_FREEZE")


def await_step(env: Mapping[str, str] | None = None) -> int | None:
    """With DSLURM_FAULT_AWAIT set: the first step at which a CRASH, KILL9 or FREEZE of this start
    and job step fires on any rank (every rank waits before it: one waiting alone would leave its
    peers in a collective, where their hang watchdogs see no progress); else None."""
    env = os.environ if env is None else env
    if not env.get("DSLURM_FAULT_AWAIT"):
        return None
    steps = []
    for name in AWAITED:
        claimed: set[int] = set()  # a rank takes the first value aimed at it (`_scoped`), so only that one fires
        for raw in (env.get(name) or "").split(";"):
            knob = parse_scoped(raw) if raw.strip() else None
            if knob is not None and knob.applies(env, any_rank=True) and not knob.ranks <= claimed:
                steps.append(int(knob.value))
                claimed |= knob.ranks
    return min(steps, default=None)


def parse_await(raw: str) -> tuple[str, int, float]:
    """`GLOB:COUNT[:TIMEOUT_S]` -> (glob, count, timeout_s). Pure."""
    head, _, last = raw.rpartition(":")
    try:
        glob2, _, count2 = head.rpartition(":")
        if glob2 and count2.isdigit():
            return glob2, int(count2), float(last)
        if head and last.isdigit():
            return head, int(last), AWAIT_DEFAULT_S
    except ValueError:
        pass
    from dslurm.errors import UserError

    raise UserError(f"DSLURM_FAULT_AWAIT={raw!r}: must be GLOB:COUNT[:TIMEOUT_S], e.g. /run/warm/*.ready:2")


def await_files(env: Mapping[str, str] | None = None, sleep_s: float = 0.2) -> bool:
    """DSLURM_FAULT_AWAIT: wait (bounded) until COUNT files match GLOB. True: they do (or no knob)."""
    import glob

    raw = (os.environ if env is None else env).get("DSLURM_FAULT_AWAIT")
    if not raw:
        return True
    pattern, count, timeout_s = parse_await(raw)
    t0 = time.monotonic()
    while len(glob.glob(pattern)) < count:
        if time.monotonic() - t0 > timeout_s:
            log.warning("DSLURM_FAULT_AWAIT: %d of %d files match %s after %.0f s; firing anyway",
                        len(glob.glob(pattern)), count, pattern, timeout_s)
            return False
        time.sleep(sleep_s)
    log.warning("DSLURM_FAULT_AWAIT: %d files match %s after %.1f s", count, pattern, time.monotonic() - t0)
    return True


def before_step(next_step: int, crash_at: int | None, kill_at: int | None, hang_at: int | None = None,
                freeze_at: int | None = None) -> None:
    """Called by the trainer before optimizer step `next_step` (1-based), after `await_files` at
    `await_step`."""
    if freeze_at is not None and next_step >= freeze_at:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.warning("DSLURM_FAULT_FREEZE: pid %d ignores TERM and stops itself before step %d", os.getpid(),
                    next_step)
        while True:  # a SIGCONT (slurmstepd's teardown sends one) only stops it again, before its
            os.kill(os.getpid(), signal.SIGSTOP)  # watchdog could end it: still frozen, still deaf to TERM
    if hang_at is not None and next_step == hang_at:
        log.warning("DSLURM_FAULT_HANG: hanging before step %d", next_step)
        while True:  # outside any collective, interpreter free: the watchdog thread still runs
            time.sleep(3600)
    if kill_at is not None and next_step >= kill_at:
        log.warning("DSLURM_FAULT_KILL9: SIGKILL before step %d", next_step)
        os.kill(os.getpid(), signal.SIGKILL)
    if crash_at is not None and next_step >= crash_at:
        raise RuntimeError(f"injected crash before step {next_step} (DSLURM_FAULT_CRASH)")


def data_stall() -> None:
    """DSLURM_FAULT_DATA_STALL: the batch read (in the trainer's reader thread) stalls for an hour."""
    log.warning("DSLURM_FAULT_DATA_STALL: the batch read stalls")
    time.sleep(3600)


def seconds_fault(name: str, env: Mapping[str, str] | None = None) -> float:
    """SECONDS of a SLOW knob for this process (0: none)."""
    value = _scoped(name, env)
    return float(value) if value is not None else 0.0


def stall(step: int) -> None:
    """DSLURM_FAULT_STALL: sleep forever, interpreter free (the watchdog thread still runs)."""
    log.warning("DSLURM_FAULT_STALL: stalling inside the forward pass of step %d", step)
    while True:
        time.sleep(3600)


def poisoned(position: int, global_batch: int, nan_at: int | None) -> bool:
    """Is the batch at data stream `position` (samples) the one DSLURM_FAULT_NAN poisons? Pure."""
    return nan_at is not None and position == (nan_at - 1) * global_batch


def exit_delay(env: Mapping[str, str] | None = None) -> float:
    value = _scoped("DSLURM_FAULT_EXIT_DELAY", env)
    return float(value) if value is not None else 0.0


def delay_exit() -> None:
    secs = exit_delay()
    if secs:
        log.warning("DSLURM_FAULT_EXIT_DELAY: exiting %.1f s late", secs)
        time.sleep(secs)


def ckpt_kill(phase: str, rank: int, nth: int) -> None:
    """Make 'killed in the middle of a save' deterministic (see the module docstring)."""
    if os.environ.get("DSLURM_FAULT_CKPT_KILL") == f"{rank}:{phase}:{nth}":
        log.warning("[rank %d] DSLURM_FAULT_CKPT_KILL: killing myself at %s of save %d", rank, phase, nth)
        os.kill(os.getpid(), signal.SIGKILL)


def save_sleep() -> None:
    secs = float(os.environ.get("DSLURM_FAULT_SAVE_SLEEP") or 0)
    if secs:
        time.sleep(secs)


def stage_delay() -> None:
    secs = float(os.environ.get("DSLURM_FAULT_STAGE_DELAY") or 0)
    if secs:
        time.sleep(secs)


def durable_mbps() -> float:
    """The durable writer's cap in MB/s per rank (0: none)."""
    return float(os.environ.get("DSLURM_FAULT_DURABLE_MBPS") or 0)


def tokenize_kill_task() -> int | None:
    """The tokenization task that kills itself mid-shard (DSLURM_FAULT_TOKENIZE_KILL), or None."""
    value = os.environ.get("DSLURM_FAULT_TOKENIZE_KILL")
    return int(value) if value else None


def parse_slow_nodes(value: str | None) -> dict[str, float]:
    """'node2:0.05,node5:0.1' -> {'node2': 0.05, 'node5': 0.1}. Pure."""
    from dslurm.errors import UserError

    if not value:
        return {}
    out: dict[str, float] = {}
    for item in value.split(","):
        host, sep, secs = item.strip().rpartition(":")
        try:
            delay = float(secs)
        except ValueError:
            delay = -1.0
        if not sep or not host or delay < 0:
            raise UserError(f"{SLOW_NODE}={value!r}: item {item!r} must be HOST:SECONDS, e.g. node2:0.05")
        out[host] = delay
    return out


def slow_node_delay(host: str, env: Mapping[str, str] | None = None) -> float:
    """Seconds this host sleeps per timed burn-in exchange (0 unless the knob names it)."""
    source = os.environ if env is None else env
    return parse_slow_nodes(source.get(SLOW_NODE)).get(host, 0.0)
