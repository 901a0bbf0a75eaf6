"""The training loop: one optimizer step at a time, a stop flag agreed at step boundaries.

Exit codes of `Trainer.run` (and of each `python -m train` worker; torchrun itself exits 1
whenever a worker exits non-zero, so a launcher reads the workers' codes -- torchrun's
failure report or the ledger's last `exit` event -- not torchrun's):
  0  training complete (`train.steps` reached, final checkpoint committed)
  75 requeue me: a stop was requested (signal), all ranks agreed at a step boundary, a
     synchronous checkpoint was saved, unless the start took no step since its restore: then the
     pointer names this state already (`_stop_exit`) (EX_TEMPFAIL from sysexits.h: "try again later")
  143 stopped by TERM (scancel, preemption; `stop_terminated` set on any rank): saved like 75,
     but not to be requeued by us
  81 the loss diverged under train.nonfinite=stop (no save: the pointer names a finite generation)
  2  user error (bad config or layout), raised before any process-group work
  (80: the hang watchdog ended the process; train/watchdog.py, not this function)
Ledger events written (rank 0 only; typed in dslurm/observe/events/): TrainStart, Steps (every
log_every), Stragglers (every straggler_every), Eval (every eval_every; train/evaluate.py), Signal,
NonFinite, Sdc, Exit, Profile (train/profile.py); the checkpoint manager adds Ckpt*; the watchdog
adds Hang; local rank 0 of each node adds DeviceHealth (train/sdc.py); a rank that runs out of
memory adds its own Oom (train/oom.py).

Silent data corruption (train/sdc.py): the HSDP replicas compare parameter fingerprints every
health.sdc_every steps and before every save, so every generation was checked clean at its own
step; on a mismatch the named node is blocklisted and all ranks roll back to the pointer's.

Non-finite steps (dslurm/health/__init__.py): the loss and "is the gradient norm finite" ride in the one
all-reduce that carries the stop flag, taken before the optimizer step, so every rank sees the
same verdict and applies `train.nonfinite` together: skip the optimizer step, roll back to the
pointer's generation and never read the offending batch again, or stop.

The files: this one builds the trainer and runs it (plus evaluation); train/step.py takes one
step (and declares the trainer's state, typed); train/recovery.py saves, restores and leaves.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import TYPE_CHECKING

import torch

from dslurm import exitcodes, faults, trackers
from dslurm.checkpoint import init_from
from dslurm.endings.facts import ENV as FACTS_ENV
from dslurm.observe import ctl, events
from dslurm.observe.ledger import Ledger
from dslurm.run import RunDir
from dslurm.runtime.stop import StopFlags
from train import software, stepfaults
from train.data import make_data
from train.evaluate import Evaluator
from train.metrics import StepMetrics, gather_rank_steps, peak_for, straggler_event
from train.optim import build_optimizers
from train.parallel.build import build_parts
from train.parallel.dims import ParallelDims
from train.profile import make_profiler
from train.recovery import Recovery
from train.replicas import Context as ReplicaContext
from train.replicas import Replicas
from train.sdc import RunChecks
from train.startup import StartClock
from train.step import BatchReader, StepResult
from train.watchdog import NO_WATCHDOG, Watchdog

if TYPE_CHECKING:
    from dslurm.config.resolve import Resolved

EXIT_COMPLETED, EXIT_REQUEUE, EXIT_TERMINATED = exitcodes.OK, exitcodes.REQUEUE, exitcodes.TERMINATED


class Trainer(Recovery):
    """Builds this rank's model, optimizer, data and checkpoint manager; runs steps."""

    def __init__(self, resolved: Resolved, *, device: torch.device, rank: int, world_size: int,
                 fsdp: bool | None = None, checkpoint: bool = True, t_start: float | None = None,
                 clock: StartClock | None = None, watchdog: Watchdog | None = None,
                 replicas: ReplicaContext | None = None, data_resolved: Resolved | None = None) -> None:
        job, self.resolved = resolved.job, resolved
        self.run_dir = RunDir(resolved.run_dir)  # every consumer below gets its files from here
        self.train, self.rank, self.device = job.train, rank, device
        self.t_start = t_start if t_start is not None else time.time()
        self.clock = clock if clock is not None else StartClock(self.t_start)  # rank 0 writes its phases
        self.dims = ParallelDims.from_layout(resolved.layout, world_size, device.type)
        self.stop = StopFlags()  # set by the signal handler (dslurm/runtime/stop.py); read at step boundaries
        self._fault_crash = faults.step_fault("DSLURM_FAULT_CRASH")  # test knobs: dslurm/faults.py
        self._fault_kill9 = faults.step_fault("DSLURM_FAULT_KILL9")
        self._fault_hang = faults.step_fault("DSLURM_FAULT_HANG")
        self._fault_freeze = faults.step_fault("DSLURM_FAULT_FREEZE")
        self._fault_await = faults.await_step()
        self._fault_nan = faults.step_fault("DSLURM_FAULT_NAN")
        self._fault_stall = faults.step_fault("DSLURM_FAULT_DATA_STALL")
        self._reader = BatchReader()  # the batch is read there while this thread watches for a stop
        self._data_state = None  # set by an untaken step: what its stop saves
        self._slow_data = faults.seconds_fault("DSLURM_FAULT_SLOW_DATA")
        self._poison = False
        self.watch = watchdog if watchdog is not None else NO_WATCHDOG
        self.nonfinite_handled = 0  # non-finite steps skipped or rolled back in this start
        self.last_step = None  # (loss, grad norm) of the last step taken in this start: each save records it
        self.settled = None  # when and why the ending was decided (Outcome.settled)
        self.skip_positions = set()  # batches (stream positions) never to be read again
        self.step = 0
        # The batch rule (dslurm.config.layout): grad_accum x microbatches equal micro-batches per rank.
        self.loss_scale = 1.0 / (self.train.grad_accum * self.dims.layout.microbatches)
        # Instruction data (train/packing.py): each micro-batch's summed loss over its completion tokens
        # times dp / (the step's trained targets in the whole global batch), so every layout's
        # gradient is the global batch's token mean; set per batch by `weigh_tokens`.
        self.token_weight = None
        self.built = build_parts(resolved.shape, job, self.dims, device, loss_fn=self._scaled_loss, fsdp=fsdp)
        self.params = [p for part in self.built.parts for p in part.parameters()]
        self._fault_hooks = stepfaults.install(self.built.parts, lambda: self.step + 1)  # STALL, OOM, SLOW_COMPUTE
        self.optimizers, self.schedulers = build_optimizers(self.built.parts, self.train)
        self.pp_group = self.dims.get_mesh("pp").get_group() if self.dims.layout.pp_enabled else None
        self.clock.mark("build")
        dp_rank, dp_size = resolved.layout.dp_coords(rank)
        self.dp_size = dp_size
        if replicas is not None:  # one replica group: its slots of the whole job's batch (train/replicas.py)
            dp_rank, dp_size = replicas.data_slot(dp_rank, dp_size)
        self.loader, eval_data = make_data(data_resolved or resolved, dp_rank, dp_size, device=device, rank=rank)
        self.evaluator = Evaluator(self, eval_data) if eval_data is not None else None  # train/evaluate.py
        self.clock.mark("data")
        # A replica job's run-wide events (and checkpoints) are group 0's; every group records its own
        # replica events (train/replicas.py).
        lead = replicas is None or replicas.group == 0
        self.ledger = Ledger(self.run_dir.path) if rank == 0 and lead else None
        # TensorBoard / W&B / MLflow from the ledger's own numbers (dslurm/trackers/; rank 0, job.metrics)
        self.trackers = trackers.attach(self.ledger, self.run_dir.path, job.metrics, job.name)
        # `dslurm ctl save|stop|profile` requests; with replica groups group 0's to take, and agreed
        # with the others through the gradient all-reduce (train/replicas.py `average`)
        self.ctl = ctl.Poller(self.run_dir.path) if rank == 0 and lead else None
        self._profile_req = 0  # rank 0: steps a `dslurm ctl profile` asked for, sent in the next agreement
        self._ctl_stop = False
        self.profiler = make_profiler(resolved, self.run_dir, rank=rank, world=world_size, device=device,
                                      ledger=self.ledger)
        shape = resolved.shape
        self.metrics = StepMetrics(
            tokens_per_step=self.train.global_batch * shape.seq_len, flops_per_token=shape.flops_per_token(),
            peak=peak_for(resolved.site, procs_per_node=resolved.procs_per_node), n_devices=world_size,
            sync=torch.cuda.synchronize if device.type == "cuda" else None)
        self.ckpt = self._checkpoint_manager() if checkpoint and lead else None
        self.checks = RunChecks(resolved, self.dims, self.built.parts, device, rank)  # SDC, device poll
        self.sdc_handled, self.last_clean_step = 0, 0  # corruptions rolled back; the last check passed
        self.replicas = None if replicas is None else Replicas(
            replicas, self, rank=rank, world=world_size, facts_dir=os.environ.get(FACTS_ENV),
            ledger=self.ledger if self.ledger is not None or rank else Ledger(self.run_dir.path))
        self.clock.mark("checkpoint_setup")

    def run(self) -> int:
        """Train to `train.steps` or until a stop is agreed; returns the exit code."""
        res = self.restore()
        if self.replicas is not None:
            self.replicas.resume(self.step)
        if self.resolved.job.model.init_from:  # published weights, only on a fresh start (resume wins)
            self._event(init_from.start(self.resolved, self.built.parts, res))
        self.last_clean_step = self.step  # a generation is only saved after its step's check passed
        self.clock.mark("restore")
        if self.rank == 0:  # the software this start runs, before its train_start (dslurm/observe/software.py)
            self._event(software.start_env(self.resolved, self.step, self.run_dir.path))
        self._event(events.TrainStart(step=self.step, generation=res.generation if res else None,
                                      fell_back=bool(res and res.fell_back),
                                      startup_s=round(time.time() - self.t_start, 3),
                                      layout=self.resolved.layout.degrees()))
        self.metrics.start()
        self.watch.start()
        result = None
        # Until this start takes a step its state is the durable pointer's generation (or a fresh
        # start's): a stop then has nothing to save. A node-local or fallback restore is saved again.
        pristine = res is None or (res.tier == "durable" and not res.fell_back)
        if self.step < self.train.steps and self._stop_before_first_step():
            return self._stop_exit(self.stop.stop_terminated, pristine=pristine)
        while self.step < self.train.steps:
            if self.profiler.before_step(self.step + 1):  # the profiler's start (seconds on a busy host)
                self.watch.expect_long()  # is no step time, and no hang
            try:
                result = self.train_step()
            except torch.OutOfMemoryError as exc:
                self._out_of_memory(exc)
                raise
            if result.discarded and not result.stop:  # a replica step no group applied: trained again
                self.watch.beat(self.step)
                continue
            if not result.taken:  # a stop during a data stall: save what the last step left
                return self._stop_exit(result.terminated, pristine=pristine)
            pristine = False
            self.checks.maybe_flip(self.step, self.params)  # DSLURM_FAULT_BITFLIP
            if not self.clock.finished:
                self.clock.mark("first_step")
                self._event(self.clock.event(step=res.step if res else 0, generation=res.generation if res else None))
            if self.train.step_sleep_s:
                time.sleep(self.train.step_sleep_s)
            self.metrics.end_step(result.step, result.loss)
            if self.profiler.after_step(self.step, result.profile_steps):  # a trace written: no step time
                self.watch.expect_long()
                self.metrics.start()
            if result.nonfinite is not None and result.nonfinite.action != "train":
                if result.nonfinite.action == "stop":
                    return self._stop_nonfinite(result)
                if self._handle_nonfinite(result):  # rolled back: the step counter moved back
                    self.watch.beat(self.step)
                    continue
            if self.step % self.train.log_every == 0 or self.step == self.train.steps or result.stop:
                self._log_window(result)
            if self.replicas is not None:
                self.replicas.flush()
            if self.step % self.train.straggler_every == 0:
                with self.watch.collective("stragglers"):
                    times, hosts, steps = gather_rank_steps(self.metrics, self.rank)
                self._event(straggler_event(self.step, times, hosts, steps=steps))
            self.checks.poll_devices(self.step, self.run_dir)
            interval = self.resolved.job.checkpoint.interval
            periodic = (self.step % interval == 0 or result.save_now) and self.step < self.train.steps
            saving = result.stop or periodic or self.step == self.train.steps  # every save is checked first
            if self.checks.replicas_due(self.step, saving) and self._replicas_corrupt():
                self.watch.beat(self.step)  # rolled back to a checked generation: train on from there
                continue
            if not result.stop and self.evaluator is not None and self.evaluator.due(self.step):
                result = self._evaluate(result)
            if result.stop:
                return self._stop_exit(result.terminated)
            if periodic:
                self._save(blocking=False)
            self.watch.beat(self.step)
        if self.replicas is not None:  # every group to the final step (a group started again heals there)
            with self.watch.paused():
                self.replicas.gather()
        if result is not None:  # None: resumed at the end already
            self._save_final()
        if self.replicas is not None:
            self.replicas.end(EXIT_COMPLETED)
        self._event(events.Exit(reason="completed", step=self.step, code=EXIT_COMPLETED))
        return EXIT_COMPLETED

    def _evaluate(self, result: StepResult) -> StepResult:
        """Evaluate (train/evaluate.py); a stop agreed during it becomes this step's stop. The step
        clock restarts after it: eval time belongs to no step (the report shows it apart)."""
        assert self.evaluator is not None
        out = self.evaluator.run(self.step)
        self._event(out.event)
        if self.rank == 0:
            e = out.event
            what = (f"interrupted after {e.batches}/{e.eval_batches} batch(es)" if e.interrupted
                    else f"loss {e.loss:.4f} ppl {e.ppl or math.inf:.2f}")
            print(f"eval step {self.step}: {what} ({e.duration_s:.2f}s)", flush=True)
        self.metrics.start()
        if out.stop:
            return dataclasses.replace(result, stop=True, terminated=out.terminated)
        return result

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()
        self.profiler.close()
        if self.trackers is not None:  # closed at the exit event already, unless the start crashed
            self.trackers.close()
        self.checks.close()
        self.watch.close()
        if self.ckpt is not None:
            self.ckpt.close()
