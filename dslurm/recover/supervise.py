"""`dslurm supervise -- LAUNCH...`: the in-allocation recovery loop of a job with spares.

The batch script of a job with `spares: k` runs this once, on the first node, instead of one
srun plus `dslurm requeue-me`: the frozen config of the run, the allocation's nodes, the stop
signals Slurm sends, and the loop (dslurm/recover/supervisor.py says what it decides and how).
The parts: supervisor.py (the loop, Step, the Runner/Pools protocols), srun.py (SrunRunner: the
real runner), warm_pools.py (WarmPools: recovery.warm's pool steps).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.launch.slurm_env import GROUP_ENV
from dslurm.recover.replicas import ReplicaSupervisor
from dslurm.recover.srun import SrunRunner
from dslurm.recover.supervisor import Supervisor
from dslurm.recover.warm_pools import WarmPools
from dslurm.run import RunDir
from dslurm.submission.warm_proof import choice_for


def supervise(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Inside the batch script: the frozen config of the run, the allocation's nodes, the loop."""
    from dslurm.slurm.hosts import expand_hosts

    env = dict(os.environ if env is None else env)
    if not cmd:
        raise UserError("dslurm supervise: give the launch command after `--` (the rendered script does)")
    rd = RunDir(env["DSLURM_RUN_DIR"])
    r = rd.resolved()
    alloc = expand_hosts(env.get("SLURM_JOB_NODELIST", ""))
    if r.job.recovery.replicas:
        return _replicas(r, cmd, env, alloc)
    runner = SrunRunner(r, cmd, env)
    # The frozen job.yaml holds the choice made at submit (dslurm/submission/warm_proof.py); auto there means
    # a run frozen otherwise: then the site's own word, else cold.
    pools = WarmPools(r, cmd, env, alloc) if choice_for(r.job, r.site, str(rd.site_yaml)).warm else None
    sup = Supervisor(r, runner, env, alloc, pools)

    take_stops(sup.on_signal, runner.signal, env)
    try:
        return sup.loop()
    finally:
        if pools is not None:
            pools.stop()


def _replicas(r: Resolved, cmd: Sequence[str], env: dict[str, str], alloc: list[str]) -> int:
    """recovery.replicas: a runner per group, each step told its group and the Lighthouse the batch
    script started on this node (dslurm/recover/replicas.py)."""
    from dslurm.recover.lighthouse import address

    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    lighthouse = address(host, env.get("SLURM_JOB_ID", "0"), int(env.get("SLURM_RESTART_COUNT") or 0))
    runners = [SrunRunner(r, cmd, {**env, GROUP_ENV: str(g), "TORCHFT_LIGHTHOUSE": lighthouse})
               for g in range(r.job.parallel.dp_replicate)]
    sup = ReplicaSupervisor(r, runners, env, alloc)

    take_stops(sup.on_signal, sup.signal, env)
    return sup.loop()


def take_stops(record: Callable[[str], None], forward: Callable[[int], None], env: Mapping[str, str]) -> None:
    """USR2 and TERM recorded (by name) and forwarded to the steps. The batch shell starts this process
    with USR2 ignored (a handler is not inherited across exec, and the default action would end the
    job: seen under `dslurm selftest chaos`); what it forwarded before these handlers existed is in the
    start's batch.signals: taken from there."""
    def handler(signum: int, _frame: object) -> None:
        record(signal.Signals(signum).name.removeprefix("SIG"))
        forward(signum)

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, handler)
    for name in early_signals(env):
        record(name)


def early_signals(env: Mapping[str, str]) -> list[str]:
    """The stop signals the batch shell recorded for this start before supervise could handle them."""
    from dslurm.endings.facts import ENV

    try:
        text = (Path(env[ENV]) / "batch.signals").read_text()
    except (KeyError, OSError):
        return []
    return [ln.split()[0] for ln in text.splitlines() if ln.split()[:1] in (["USR2"], ["TERM"])]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("supervise", help="(in the batch script of a job with spares) run the job steps and "
                       "recover from failures inside the allocation")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the launch command, run by srun on the training nodes")
    p.set_defaults(func=lambda args: supervise(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd))
