"""Entry point: `torchrun --nproc-per-node N -m train --site S.yaml --job J.yaml [--set k=v]...`.

Also runs as one plain process (`python -m train ...`, world size 1, an in-memory store).
The layout is resolved and checked *before* any process-group work, so a bad layout
exits 2 with the numbers and no traceback. The world the launcher started wins over the
job file's node count: `nodes` and `procs_per_node` are taken from torchrun's environment
(WORLD_SIZE, LOCAL_WORLD_SIZE), so the parallel degrees are checked against the real world.
Exit codes: 0 complete, 75 requeue me (stopped on request, checkpoint saved), 143 stopped by
TERM (saved), 2 user error, 74 a save the ending needs failed, 79 refused (run dir locked),
80 the hang watchdog fired (train/watchdog.py), 81 the loss diverged under train.nonfinite=stop.
On its way out every process writes its own report (dslurm/endings/facts.py): what kind of ending,
its code, the step reached, the error, and the time the failure happened -- the facts from
which `dslurm requeue-me` classifies the step's ending.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from dslurm.endings.worker_exit import Outcome, leave, report, world_from_env

if TYPE_CHECKING:  # imported where they are used: the config error path stays torch-free
    import torch

    from dslurm.config.resolve import Resolved
    from train.replicas import Context as ReplicaContext
    from train.watchdog import HangVerdict, Watchdog

T_START = time.time()  # process start, for the ledger's startup_s
# What a warm pool (dslurm/launch/warm.py) imports once for the workers it forks: what `main`
# imports, the parallel wrappers every tiny-to-large layout uses, the checkpoint. Importing them
# starts no thread and no CUDA context (the pool checks).
WARM_PRELOAD = ("dslurm.config.resolve", "dslurm.runtime.stop", "dslurm.preflight.in_job", "dslurm.endings.facts",
                "train.startup", "train.loop", "train.watchdog", "train.parallel.build", "train.parallel.fsdp",
                "train.parallel.tp", "dslurm.checkpoint.dcp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m train", description=__doc__.splitlines()[0])
    p.add_argument("--site", required=True, help="site config YAML (site-configs/*.yaml)")
    p.add_argument("--job", required=True, help="job spec YAML (examples/jobs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job field, e.g. --set parallel.tp=2 (repeatable)")
    p.add_argument("--site-set", dest="site_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a site field (repeatable)")
    return p.parse_args(argv)


def resolve_for_world(args: argparse.Namespace, world: int, local_world: int,
                      extra: list[str] | None = None) -> Resolved:
    """Load site + job with the launcher's world; raises UserError with the numbers."""
    from dslurm.config.resolve import load
    from dslurm.errors import UserError

    if world % local_world:
        raise UserError(f"WORLD_SIZE({world}) is not a multiple of LOCAL_WORLD_SIZE({local_world})")
    env_overrides = [f"nodes={world // local_world}", f"procs_per_node={local_world}"]
    return load(args.site, args.job, args.overrides + (extra or []) + env_overrides, args.site_overrides)


def resolve_replicas(args: argparse.Namespace, world: int,
                     local_world: int) -> tuple[Resolved, Resolved, ReplicaContext] | None:
    """recovery.replicas (train/replicas.py): this world is one group. Returns the group's job (its
    own dp_replicate 1 and its share of the batch: what it builds and trains), the whole job's
    (the data: every group's slots of one global batch) and the group; None for any other job."""
    from dslurm.config.resolve import load
    from dslurm.launch.slurm_env import GROUP_ENV
    from train.replicas import Context, group_overrides

    if GROUP_ENV not in os.environ:  # dslurm supervise names the group of every replica job's step
        return None
    whole = load(args.site, args.job, args.overrides, args.site_overrides)
    ctx = Context.from_env(whole.job, os.environ)
    if ctx is None:
        return None
    group = resolve_for_world(args, world, local_world, group_overrides(whole.job))
    nodes = world // local_world * ctx.groups
    data = load(args.site, args.job, args.overrides + [f"nodes={nodes}", f"procs_per_node={local_world}"],
                args.site_overrides)
    return group, data, ctx


def init_distributed(resolved: Resolved, local_rank: int, world: int) -> torch.device:
    """Process group + device (dslurm.health.process_group: the one init every entry point uses).
    A CPU site on a machine with GPUs still trains on the CPU with its own backend."""
    from dslurm import health
    from dslurm.health.process_group import init_process_group

    gpus, spec = resolved.site.node.gpus > 0, resolved.job.health
    device: torch.device = init_process_group(
        resolved.site.network.backend, require_cuda=gpus, cpu_only=not gpus,
        where=f"{resolved.site_path}: site {resolved.site.name!r}",
        timeout_s=health.pg_timeout_s(spec.hang_ceiling_s) if spec.watchdog else None)
    return device


OUTCOME = Outcome()  # this process's ending, reported on its way out (dslurm/endings/worker_exit.py)


def on_hang(verdict: HangVerdict) -> None:
    """The watchdog fired (its thread; the main thread is stuck): report, then end the process
    now -- the finally blocks of a stuck thread would never run."""
    from dslurm import exitcodes

    OUTCOME.t, OUTCOME.error, OUTCOME.step, OUTCOME.kind = verdict.t, verdict.error, verdict.step, verdict.kind
    try:
        report(OUTCOME, exitcodes.HANG, verdict.rank)
    finally:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(exitcodes.HANG)


def make_watchdog(resolved: Resolved, rank: int, world: int) -> Watchdog | None:
    """The hang watchdog of this process (None when health.watchdog is off)."""
    if not resolved.job.health.watchdog:
        return None
    from dslurm.endings import facts
    from dslurm.run import RunDir
    from train.watchdog import Watchdog

    return Watchdog(resolved.job.health, rank=rank, world=world, run=RunDir(resolved.run_dir),
                    start_dir=facts.start_dir(run_dir=resolved.run_dir), on_hang=on_hang)


def main(argv: list[str] | None = None) -> int:
    from dslurm.errors import UserError
    from train.startup import StartClock, process_start_time

    clock = StartClock(T_START, born=process_start_time())  # phases of this start, for the ledger
    args = parse_args(argv)
    rank, local_rank, world, local_world = world_from_env()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        replicas = resolve_replicas(args, world, local_world)
        resolved = replicas[0] if replicas else resolve_for_world(args, world, local_world)
        from train.software import refuse

        refuse(resolved)  # site.refuse: a named NCCL is refused before any process-group work
    except UserError as exc:
        OUTCOME.failed(exc)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    clock.mark("config")
    if replicas:  # the fault knobs aim at the job's ranks, not the group's (dslurm/faults.py)
        from dslurm.faults import RANK_ENV

        os.environ[RANK_ENV] = str(replicas[2].job_rank(rank, world))
    import torch.distributed as dist

    from dslurm.runtime.stop import StopRequest
    from train.loop import Trainer

    clock.mark("imports")
    device = init_distributed(resolved, local_rank, world)
    clock.mark("rendezvous")
    trainer = None
    try:
        from dslurm.preflight.in_job import gate_in_process

        code = gate_in_process(device, outcome=OUTCOME)  # the burn-in, when the launcher asked for one
        if code:
            return code
        clock.mark("burnin")
        OUTCOME.stop = StopRequest().install(None)  # a TERM during the build is recorded too
        trainer = OUTCOME.progress = Trainer(resolved, device=device, rank=rank, world_size=world,
                                            t_start=T_START, clock=clock,
                                            watchdog=make_watchdog(resolved, rank, world),
                                            replicas=replicas[2] if replicas else None,
                                            data_resolved=replicas[1] if replicas else None)
        OUTCOME.run_dir = resolved.run_dir
        OUTCOME.stop.install(trainer.stop)  # USR2 -> save, exit 75; TERM -> save, exit 143
        code = trainer.run()
        OUTCOME.step = trainer.step
        if trainer.settled is not None:  # before close() and leaving the group: see Outcome.settled
            OUTCOME.settled(*trainer.settled)
        return code
    except UserError as exc:  # e.g. data file too small, run dir locked, a final save failed
        OUTCOME.failed(exc)
        print(f"error: [rank {rank}] {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseException as exc:
        OUTCOME.failed(exc)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        dist.destroy_process_group()


def _main_reporting() -> int:
    """Run, then report this process's own exit code and ending (torchrun reports any worker
    failure as 1, which would hide a requeue request)."""
    from dslurm import faults

    code = 1
    try:
        code = main()
    except BaseException as exc:  # raised before main's own handlers (e.g. rendezvous)
        OUTCOME.failed(exc)
        raise
    finally:
        report(OUTCOME, code, world_from_env()[0])
        faults.delay_exit()
    return code


def _entry() -> None:
    """Run and leave, also after an exception (already reported): a crashed rank that went through
    the interpreter's finalization kept its peers waiting for its sockets to close, and a warm
    worker (dslurm/launch/warm.py) ends the same way."""
    try:
        code = _main_reporting()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    leave(code)  # not sys.exit: see dslurm.endings.worker_exit.leave


if __name__ == "__main__":  # guard: async checkpoint processes re-import the main module
    _entry()
