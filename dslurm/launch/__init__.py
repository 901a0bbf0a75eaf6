"""`dslurm launch`: runs once per node (or once per process in srun mode) inside the
allocation, derives ranks from SLURM_* and starts the training processes.

torchrun mode: one task per node starts torchrun with a c10d rendezvous on node 0.
Signals: Slurm's USR2 (time limit) and TERM (preemption, scancel) are forwarded to the
training processes, which save at a step boundary and exit. torchrun itself would die
on USR2 (no handler), so it is started with USR2 ignored — an ignored disposition is
inherited across exec, and the trainer installs its own handler explicitly.

Exit code: torchrun reports any worker failure as 1, which would hide the trainer's
"requeue me" code (75). Workers write their exit code into a status directory the
launcher owns; the launcher returns the workers' agreed code. That code is only a summary:
the launcher also records its facts (dslurm/endings/facts.py) -- which signals *it* received and
when (srun's teardown after another node's crash reaches launchers, never the batch
shell), torchrun's code, the workers' codes, and which local ranks left no code at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm import exitcodes
from dslurm.durable import atomic_write_text
from dslurm.endings.worker_exit import STATUS_DIR_ENV
from dslurm.errors import UserError
from dslurm.launch.slurm_env import GROUP_ENV, PENDING_STOP_ENV, LaunchInfo, derive

if TYPE_CHECKING:  # imported where used: `python -m dslurm.launch.warm` runs it as __main__
    from dslurm.launch import warm

log = logging.getLogger(__name__)

FORWARDED = (signal.SIGUSR2, signal.SIGTERM)


def torchrun_argv(info: LaunchInfo, cmd: Sequence[str], rdzv: str = "c10d",
                  python: str = sys.executable) -> list[str]:
    """The torchrun command for this node. Pure.

    c10d: node 0 hosts the store (is_host given explicitly: on a cluster whose nodes
    share an IP, like the built-in one, torch's guess would make every node a host).
    torchrun orders nodes by --local-addr, i.e. by host name.
    """
    argv = [python, "-m", "dslurm.launch.torchrun",  # torchrun, without its ~0.45 s finalization
            f"--nnodes={info.nnodes}", f"--nproc-per-node={info.nproc_per_node}",
            f"--node-rank={info.node_rank}", "--max-restarts=0"]
    if rdzv == "c10d":
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={info.master_addr}:{info.master_port}",
                 f"--rdzv-id={info.job_id}-{info.restart_count}" + (f"-{info.step_index}" if info.step_index else ""),
                 f"--rdzv-conf=is_host={'true' if info.node_rank == 0 else 'false'}",
                 f"--local-addr={info.hostname}"]
    else:
        argv += ["--rdzv-backend=static", f"--master-addr={info.master_addr}",
                 f"--master-port={info.master_port}"]
    return [*argv, "--no-python", *cmd]


def agreed_exit_code(torchrun_rc: int, worker_codes: list[int]) -> int:
    """What the node reports: the workers' own code when they agree on one, so a
    requeue request (75) survives torchrun's generic failure code. Pure."""
    if worker_codes and len(set(worker_codes)) == 1:
        return worker_codes[0]
    nonzero = [c for c in worker_codes if c != 0]
    if torchrun_rc != 0 and nonzero:
        # Mixed: prefer a real failure over a requeue request so crashes are not retried as saves.
        failures = [c for c in nonzero if c != exitcodes.REQUEUE]
        return failures[0] if failures else nonzero[0]
    return torchrun_rc


def read_worker_code_map(status_dir: Path) -> dict[str, int]:
    """Local rank -> the code that worker reported."""
    codes = {}
    for p in sorted(status_dir.glob("*.code")):
        try:
            codes[p.stem] = int(p.read_text().strip())
        except (OSError, ValueError):
            continue
    return codes


# The first stop signal this launcher received (it may come before training started,
# e.g. during the burn-in): remembered for the rest of the process.
STOP_SIGNAL: str | None = None
SIGNALS: list[tuple[str, float]] = []  # every stop signal this launcher received, with its time


def reset_stop() -> None:
    """Forget an earlier stop request (a long-lived process, e.g. a notebook, that launches
    again after one run was stopped)."""
    global STOP_SIGNAL
    STOP_SIGNAL = None
    SIGNALS.clear()


def _note_stop(signame: str, status_dir: str | None) -> None:
    """Remember a stop request, and leave it where a trainer that has not installed its
    handlers yet will find it (train/stop.py reads the file after installing them)."""
    global STOP_SIGNAL
    if STOP_SIGNAL != "SIGTERM":
        STOP_SIGNAL = signame
    if status_dir:
        try:
            atomic_write_text(Path(status_dir) / "stop", STOP_SIGNAL or signame)
        except OSError:  # the status dir is gone: the run is ending anyway
            pass


def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc). torchrun starts each worker in a session
    of its own (start_new_session=True), so signalling torchrun's group misses them;
    each worker leads its own group, which also holds anything that worker started."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces: split after ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(entry))
    return out


class _Forwarder:
    """Forwards USR2/TERM to the current child and all its workers; remembers the first
    stop request. Installed once per launcher process, before anything is started, so a
    signal that comes early (during start-up or the burn-in) is recorded, not fatal."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.attempt: warm.Attempt | None = None  # workers forked by this node's warm pool
        self.sent = 0  # SIGNALS[:sent] reached the current attempt's workers (or came before it)
        self.status_dir: str | None = None

    def install(self) -> None:
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def take_recorded(self, env: Mapping[str, str]) -> None:
        """The stops this step's batch.signals holds, as if this launcher had received them (once
        its handlers are set). It starts with USR2 ignored (dslurm.render.LAUNCHER_WRAP): a
        warning forwarded before its handler existed was dropped, never fatal, and the batch
        shell's trap and supervise record each stop there before they forward it. A stop the
        handler already took is not taken twice."""
        from dslurm.endings import facts

        if not env.get(facts.ENV):  # set by the rendered script (and supervise, per step): else none
            return
        try:
            recorded = facts.parse_signal_lines((Path(env[facts.ENV]) / "batch.signals").read_text())
        except OSError:
            return
        for name, t in recorded:
            sig = f"SIG{name}"
            if sig in ("SIGUSR2", "SIGTERM") and sig not in (n for n, _ in SIGNALS):
                log.warning("dslurm launch: %s was recorded for this step at %.3f (before this launcher "
                            "could take it)", sig, t)
                SIGNALS.append((sig, t))
                _note_stop(sig, self.status_dir)

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        SIGNALS.append((name, time.time()))
        log.warning("dslurm launch: got %s, forwarding to the training processes", name)
        _note_stop(name, self.status_dir)  # before the kill: see _note_stop
        # A TERM goes with a SIGCONT, as slurmstepd sends its own process group: torchrun and
        # each worker lead sessions of their own, out of stepd's reach. A worker frozen by SIGSTOP
        # then never saw the TERM, kept the step's output open past stepd's KILL (which reaches
        # only this launcher's group), and Slurm drained the node "Kill task failed" (chaos seed
        # 4444: a 3-node job then pended for ever). Woken, it acts on the TERM pending for it.
        sigs = with_cont(signum)
        if self.attempt is not None:
            for sig in sigs:
                self.attempt.signal_all(sig)
            self.sent = len(SIGNALS)
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for pgid in [proc.pid, *_child_pids(proc.pid)]:
            for sig in sigs:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


FORWARDER = _Forwarder()


def with_cont(signum: int) -> tuple[int, ...]:
    """The signals a forwarded `signum` is: a TERM with a SIGCONT after it (see `_on_signal`)."""
    return (signum, signal.SIGCONT) if signum == signal.SIGTERM else (signum,)


def _run_forwarding(argv: list[str], env: dict[str, str]) -> int:
    """Start argv in its own process group, forward USR2/TERM to it, wait."""
    FORWARDER.install()
    FORWARDER.status_dir = env.get(STATUS_DIR_ENV)
    if STOP_SIGNAL:
        _note_stop(STOP_SIGNAL, FORWARDER.status_dir)
    # USR2 ignored across exec: torchrun has no handler and would die of it; the trainer
    # installs its own handler explicitly.
    old_usr2 = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        FORWARDER.proc = subprocess.Popen(argv, env=env, start_new_session=True)
    finally:
        signal.signal(signal.SIGUSR2, old_usr2)
    try:
        rc = FORWARDER.proc.wait()  # PEP 475: retried after each handled signal
    finally:
        FORWARDER.proc = None
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, like a shell


# A failed worker's peers: TERM, then KILL after this. torchrun's agent waits 30 s too; the first
# nonzero code may be a stop's own 75/143, and its peers are then saving.
TEARDOWN_GRACE_S = 30.0


def _run_warm(path: Path, info: LaunchInfo, cmd: Sequence[str], env: dict[str, str]) -> int | None:
    """The workers from this node's warm pool (dslurm/launch/warm.py) instead of torchrun; their
    codes as torchrun would fold them (0 all fine, else 1). None: the pool could not start them
    (nothing was started)."""
    import threading

    from dslurm.launch import warm

    FORWARDER.install()
    FORWARDER.status_dir = env.get(STATUS_DIR_ENV)
    if STOP_SIGNAL:
        _note_stop(STOP_SIGNAL, FORWARDER.status_dir)
    envs = warm.worker_envs(env, info.nproc_per_node, info.node_rank, info.world_size)
    FORWARDER.sent = len(SIGNALS)  # every signal from here on must reach the workers
    try:
        attempt = warm.Attempt(path, cmd, envs, os.getcwd())
    except warm.PoolUnavailable as exc:
        log.error("dslurm launch: warm pool unavailable (%s)", exc)
        return None
    log.warning("dslurm launch: warm start: workers %s forked by the pool (%d task(s) in it)",
                attempt.pids, attempt.tasks)
    FORWARDER.attempt = attempt
    # Signals that came while the pool forked (before the pids were known): recorded, not yet
    # forwarded. One statement each, the handler's own forwarding in between is never repeated.
    missed, FORWARDER.sent = SIGNALS[FORWARDER.sent:], len(SIGNALS)
    for name, _t in missed:
        log.warning("dslurm launch: forwarding %s, which came while the pool forked the workers", name)
        for sig in with_cont(signal.Signals[name]):
            attempt.signal_all(sig)

    timer = threading.Timer(TEARDOWN_GRACE_S, attempt.signal_all, (signal.SIGKILL,))
    timer.daemon = True  # never keeps the launcher from exiting

    def teardown(local_rank: int) -> None:
        log.warning("dslurm launch: local rank %d failed; stopping the others", local_rank)
        attempt.signal_all(signal.SIGTERM)
        timer.start()

    try:
        codes = attempt.wait(teardown)
    finally:
        timer.cancel()
        FORWARDER.attempt = None
    return 0 if all(c == 0 for c in codes.values()) else 1


def launch(cmd: Sequence[str], *, mode: str = "torchrun", nproc_per_node: int | None = None,
           rdzv: str = "c10d", env: dict[str, str] | None = None) -> int:
    """Launch `cmd` for this node/task. Returns the exit code to report to Slurm."""
    if not cmd:
        raise UserError("nothing to launch: give the training command after `--`, e.g. "
                        "dslurm launch -- python -m train --site S --job J")
    base_env = dict(os.environ if env is None else env)
    info = derive(base_env, nproc_per_node=nproc_per_node, mode=mode)  # type: ignore[arg-type]
    child_env = {**base_env, **info.worker_env()}
    log.info("dslurm launch: %s", json.dumps(info.as_dict()))
    # `dslurm supervise` offers a step its nodes' warm pools (recovery.warm: true, after a failure).
    from dslurm.launch import warm

    warm_path = (warm.socket_path(info.job_id, info.hostname)
                 if mode == "torchrun" and base_env.get(warm.WARM_ENV) == "1" else None)
    first_group = base_env.get(GROUP_ENV, "0") == "0"  # replica groups: the start is group 0's
    if info.node_rank == 0 and (mode != "srun" or info.rank == 0) and base_env.get("DSLURM_RUN_DIR") and first_group:
        from dslurm.observe import events
        from dslurm.observe.ledger import Ledger

        # The start's first event, before any worker imports torch: `dslurm report` measures
        # start-up from here.
        Ledger(base_env["DSLURM_RUN_DIR"]).append(events.JobStart(
            job_id=info.job_id, restart=info.restart_count, hosts=list(info.hosts),
            mode="warm" if warm_path is not None else mode, nproc_per_node=info.nproc_per_node))
    # The local ranks this launcher starts: its own task (srun mode) or torchrun's workers.
    local = [child_env.get("LOCAL_RANK", "0")] if mode == "srun" else [str(i) for i in range(info.nproc_per_node)]
    with tempfile.TemporaryDirectory(prefix="dslurm-status-") as status_dir:
        child_env[STATUS_DIR_ENV] = status_dir
        pending = base_env.get(PENDING_STOP_ENV)
        if pending in ("SIGUSR2", "SIGTERM"):  # a stop that came before this step began (supervise)
            _note_stop(pending, status_dir)
        argv = list(cmd) if mode == "srun" else torchrun_argv(info, cmd, rdzv)
        rc = _run_warm(warm_path, info, cmd, child_env) if warm_path is not None else None
        if rc is None and warm_path is not None and info.nnodes > 1:
            # The other nodes' workers are warm: a torchrun here would wait for a rendezvous nobody
            # hosts. Fail the step now; supervise runs the next one cold.
            log.error("dslurm launch: no warm workers on %s; failing this step (the next one starts cold)",
                      info.hostname)
            rc = 1
        elif rc is None:
            if warm_path is not None:
                log.warning("dslurm launch: starting cold (torchrun) instead")
            rc = _run_forwarding(argv, child_env)
        codes = read_worker_code_map(Path(status_dir))
        code = agreed_exit_code(rc, list(codes.values()))
        if code == exitcodes.TERMINATED and STOP_SIGNAL != "SIGTERM":
            # Our workers saw TERM but this launcher never did: torchrun tore them down because
            # a peer failed. That is a crash of the job, not a preemption.
            code = 1
        record(info.node_rank, rc, codes, [int(r) for r in local if r not in codes], code, base_env)
        return code


def record(node_rank: int | None, rc: int | None, codes: dict[str, int], silent: list[int], code: int,
           env: dict[str, str]) -> None:
    """This launcher's facts for requeue-me (dslurm/endings/facts.py)."""
    import socket

    from dslurm.endings import facts

    facts.write_launcher_report(facts.LauncherReport(
        host=socket.gethostname(), node_rank=node_rank, signals=list(SIGNALS), torchrun_rc=rc,
        worker_codes=codes, silent_local_ranks=silent, code=code), env)


# ------------------------------------------------------------------------------ CLI


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("launch", help="inside an allocation: derive ranks from SLURM_* and start torchrun",
                       description="Run once per node (torchrun mode) or once per process (srun mode).")
    p.add_argument("--mode", choices=("torchrun", "srun"), default="torchrun",
                   help="torchrun: one launcher per node starts the workers; srun: each task is a worker")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default: GPUs on the node)")
    p.add_argument("--rdzv", choices=("c10d", "static"), default="c10d", help="torchrun rendezvous")
    p.add_argument("--preflight", action="store_true", help="run the burn-in gate before training")
    p.add_argument("--site", help="site config (burn-in thresholds), with --preflight")
    p.add_argument("cmd", nargs=__import__("argparse").REMAINDER, help="-- the training command")
    p.set_defaults(func=_run_launch)

    e = sub.add_parser("env", help="print what dslurm derives from the SLURM_* environment")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.add_argument("--mode", choices=("torchrun", "srun"), default="torchrun",
                   help="derive as `dslurm launch --mode` would: one launcher per node, or one task per worker")
    e.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node (default: GPUs on the node)")
    e.set_defaults(func=_run_env)


def _run_launch(args: argparse.Namespace) -> int:
    FORWARDER.install()  # first thing: a signal during start-up must not kill the launcher
    FORWARDER.take_recorded(os.environ)  # and one forwarded before it (ignored meanwhile) is not lost
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    env = dict(os.environ)
    if args.preflight:  # the training processes run it first thing (dslurm/preflight/in_job.py)
        from dslurm.preflight.in_job import preflight_env

        if not args.site:
            raise UserError("dslurm launch --preflight needs --site FILE (the thresholds live in the site config)")
        info = derive(env, nproc_per_node=args.nproc_per_node, mode=args.mode)
        env.update(preflight_env(env, args.site, info.job_id, info.restart_count))
    if STOP_SIGNAL:  # stopped before training started: nothing trained, nothing to save
        log.warning("dslurm launch: %s arrived before training started; not starting it", STOP_SIGNAL)
        code = exitcodes.TERMINATED if STOP_SIGNAL == "SIGTERM" else exitcodes.REQUEUE
        record(None, None, {}, [], code, env)
        return code
    return launch(cmd, mode=args.mode, nproc_per_node=args.nproc_per_node, rdzv=args.rdzv, env=env)


def _run_env(args: argparse.Namespace) -> int:
    info = derive(os.environ, nproc_per_node=args.nproc_per_node, mode=args.mode)
    if args.json:
        print(json.dumps(info.as_dict(), indent=2))
    else:
        for k, v in info.as_dict().items():
            print(f"{k:>16}: {v}")
    return 0
