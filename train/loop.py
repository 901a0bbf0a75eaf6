"""The training loop: one optimizer step at a time, a stop flag agreed at step boundaries.

Exit codes of `Trainer.run` (and of each `python -m train` worker; torchrun itself exits 1
whenever a worker exits non-zero, so a launcher reads the workers' codes -- torchrun's
failure report or the ledger's last `exit` event -- not torchrun's):
  0  training complete (`train.steps` reached, final checkpoint committed)
  75 requeue me: a stop was requested (signal), all ranks agreed at a step boundary, a
     synchronous checkpoint was saved (EX_TEMPFAIL from sysexits.h: "try again later")
  143 stopped by TERM (scancel, preemption; `stop_terminated` set on any rank): saved like 75,
     but not to be requeued by us
  81 the loss diverged under train.nonfinite=stop (no save: the pointer names a finite generation)
  2  user error (bad config or layout), raised before any process-group work
  (80: the hang watchdog ended the process; train/watchdog.py, not this function)
Ledger events written (rank 0 only; typed in dslurm/observe/events.py): TrainStart, Steps (every
log_every), Stragglers (every straggler_every), Eval (every eval_every; train/evaluate.py), Signal,
NonFinite, Sdc, Exit, Profile (train/profile.py); the checkpoint manager adds Ckpt*; the watchdog
adds Hang; local rank 0 of each node adds DeviceHealth (train/sdc.py); a rank that runs out of
memory adds its own Oom (train/oom.py).

Silent data corruption (train/sdc.py): the HSDP replicas compare parameter fingerprints every
health.sdc_every steps and before every save, so every generation was checked clean at its own
step; on a mismatch the named node is blocklisted and all ranks roll back to the pointer's.

Non-finite steps (dslurm/health.py): the loss and "is the gradient norm finite" ride in the one
all-reduce that carries the stop flag, taken before the optimizer step, so every rank sees the
same verdict and applies `train.nonfinite` together: skip the optimizer step, roll back to the
pointer's generation and never read the offending batch again, or stop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import sys
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dslurm import exitcodes, faults, health, trackers
from dslurm.checkpoint import init_from
from dslurm.observe import ctl, events
from dslurm.observe.ledger import Ledger
from dslurm.run import RunDir
from dslurm.runtime.checkpoint import final_failure, manager_for
from dslurm.runtime.state import train_state
from dslurm.runtime.stop import StopFlags
from train import oom, stepfaults
from train.data import make_data
from train.evaluate import Evaluator
from train.metrics import StepMetrics, format_log_line, gather_rank_steps, peak_for, straggler_event
from train.model import cross_entropy
from train.optim import build_optimizers, clip_grad_norm_
from train.packing import IGNORE, masked_sum, queue_docs
from train.parallel.build import build_parts
from train.parallel.dims import ParallelDims
from train.profile import make_profiler
from train.sdc import RunChecks
from train.startup import StartClock
from train.watchdog import NO_WATCHDOG, Watchdog

log = logging.getLogger(__name__)
EXIT_COMPLETED, EXIT_REQUEUE, EXIT_TERMINATED = exitcodes.OK, exitcodes.REQUEUE, exitcodes.TERMINATED


def _local(x: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


@dataclasses.dataclass(slots=True)
class StepResult:
    step: int
    """0-based optimizer step just taken"""
    loss: float
    """mean token loss over the global batch"""
    grad_norm: float
    """global gradient norm before clipping"""
    lr: float
    """learning rate used by this step"""
    stop: bool
    """some rank asked to stop: all ranks agree"""
    terminated: bool = False
    """some rank's stop came from TERM: all ranks exit 143 instead of 75"""
    nonfinite: health.NonfiniteDecision | None = None
    """the loss or grad norm was not finite on some rank: what all ranks do"""
    position: int = 0
    """the data stream position (samples) of this step's batch"""
    save_now: bool = False
    """an operator asked for a checkpoint (`dslurm ctl save`, taken by rank 0): all ranks agree"""
    taken: bool = True
    """False: a stop came while some rank waited for its batch (a data stall): no rank took this
    step (no optimizer or scheduler step, every loader back where the step began)"""

    profile_steps: int = 0
    """an operator asked for a profile of this many steps (`dslurm ctl profile`): all ranks agree"""

class BatchReader:
    """A daemon thread that reads one batch at a time (`submit`), so the training thread can wait
    for it and still see a stop (train/loop.py `_next_batch`). A reader stuck in a stalled read is
    abandoned, never joined: the process ends after the stop's save."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Any, bool, _Box]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="dslurm-batch-reader", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, stall, box = self._calls.get()
            try:
                if stall:
                    faults.data_stall()
                box.value = fn()
            except BaseException as exc:  # raised again in the training thread
                box.error = exc
            box.done.set()

    def submit(self, fn: Any, *, stall: bool = False) -> _Box:
        box = _Box()
        self._calls.put((fn, stall, box))
        return box


class _Box:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class Trainer:
    """Builds this rank's model, optimizer, data and checkpoint manager; runs steps."""

    def __init__(self, resolved: Any, *, device: torch.device, rank: int, world_size: int,
                 fsdp: bool | None = None, checkpoint: bool = True, t_start: float | None = None,
                 clock: StartClock | None = None, watchdog: Watchdog | None = None) -> None:
        job, self.resolved = resolved.job, resolved
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
        self._data_state: dict[str, Any] | None = None  # set by an untaken step: what its stop saves
        self._slow_data = faults.seconds_fault("DSLURM_FAULT_SLOW_DATA")
        self._poison = False
        self.watch: Any = watchdog if watchdog is not None else NO_WATCHDOG
        self.nonfinite_handled = 0  # non-finite steps skipped or rolled back in this start
        self.settled: tuple[float, str] | None = None  # when and why the ending was decided (Outcome.settled)
        self.skip_positions: set[int] = set()  # batches (stream positions) never to be read again
        self.step = 0
        # The batch rule (dslurm.config.layout): grad_accum x microbatches equal micro-batches per rank.
        self.loss_scale = 1.0 / (self.train.grad_accum * self.dims.layout.microbatches)
        # Instruction data (train/packing.py): each micro-batch's summed loss over its completion tokens
        # times dp / (the step's trained targets in the whole global batch), so every layout's
        # gradient is the global batch's token mean; set per batch by `weigh_tokens`.
        self.token_weight: float | None = None
        self.built = build_parts(resolved.shape, job, self.dims, device, loss_fn=self._scaled_loss, fsdp=fsdp)
        self.params = [p for part in self.built.parts for p in part.parameters()]
        self._fault_hooks = stepfaults.install(self.built.parts, lambda: self.step + 1)  # STALL, OOM, SLOW_COMPUTE
        self.optimizers, self.schedulers = build_optimizers(self.built.parts, self.train)
        self.pp_group = self.dims.get_mesh("pp").get_group() if self.dims.layout.pp_enabled else None
        self.clock.mark("build")
        dp_rank, dp_size = resolved.layout.dp_coords(rank)
        self.loader, eval_data = make_data(resolved, dp_rank, dp_size, device=device, rank=rank)
        self.dp_size = dp_size
        self.evaluator = Evaluator(self, eval_data) if eval_data is not None else None  # train/evaluate.py
        self.clock.mark("data")
        self.ledger = Ledger(resolved.run_dir) if rank == 0 else None
        # TensorBoard / W&B / MLflow from the ledger's own numbers (dslurm/trackers/; rank 0, job.metrics)
        self.trackers = trackers.attach(self.ledger, resolved.run_dir, job.metrics, job.name)
        self.ctl = ctl.Poller(resolved.run_dir) if rank == 0 else None  # `dslurm ctl save|stop|profile` requests
        self._profile_req = 0  # rank 0: steps a `dslurm ctl profile` asked for, sent in the next agreement
        self.profiler = make_profiler(resolved, rank=rank, world=world_size, device=device, ledger=self.ledger)
        shape = resolved.shape
        self.metrics = StepMetrics(
            tokens_per_step=self.train.global_batch * shape.seq_len, flops_per_token=shape.flops_per_token(),
            peak=peak_for(resolved.site, procs_per_node=resolved.procs_per_node), n_devices=world_size,
            sync=torch.cuda.synchronize if device.type == "cuda" else None)
        self.ckpt = self._checkpoint_manager() if checkpoint else None
        self.checks = RunChecks(resolved, self.dims, self.built.parts, device, rank)  # SDC, device poll
        self.sdc_handled, self.last_clean_step = 0, 0  # corruptions rolled back; the last check passed
        self.clock.mark("checkpoint_setup")

    # ------------------------------------------------------------------ one step

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-microbatch loss pre-divided so the summed gradients are the global mean's."""
        if self.token_weight is not None:
            loss = masked_sum(logits, targets) * self.token_weight
        else:
            loss = cross_entropy(logits, targets) * self.loss_scale
        return loss * float("nan") if self._poison else loss  # DSLURM_FAULT_NAN

    def weigh_tokens(self, targets: torch.Tensor) -> None:
        """Instruction data: token_weight = dp / the trained targets of this global batch (one
        all-reduce of this rank's count; ranks of one dp coordinate read the same batch)."""
        n = (targets != IGNORE).sum().float()
        dist.all_reduce(n)
        total = n.item() / (self.dims.world_size // self.dp_size)
        self.token_weight = self.dp_size / max(total, 1.0)

    def _loss_context(self) -> Any:
        """Vocab-sharded logits (loss parallel, tp > 1): cross-entropy must run in this context."""
        if not self.dims.layout.loss_parallel_enabled:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel  # DTensor styles: only with tp

        return loss_parallel()

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                          docs: torch.Tensor | None = None) -> torch.Tensor:
        """Gradients of the mean loss of this rank's batch; returns the summed scaled losses.
        `docs`: the examples of packed instruction data (train/packing.py)."""
        total = torch.zeros((), device=self.device)
        b = self.built
        n = self.train.grad_accum
        chunks = docs.chunk(n) if docs is not None else [None] * n
        for mi, mt, md in zip(inputs.chunk(n), targets.chunk(n), chunks):
            if b.schedule is None:
                loss = self._scaled_loss(b.parts[0](mi, md), mt)
                loss.backward()
                total += _local(loss.detach())
                continue
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {"target": mt, "losses": losses} if b.has_last_stage else {}
            queue_docs(b.parts, md, self.dims.layout.microbatches)
            b.schedule.step(*((mi,) if b.has_first_stage else ()), **kwargs)
            for loss in losses:
                total += _local(loss.detach())
        return total

    def _position(self) -> int:
        return int(self.loader.sampler.stream_position)

    def train_step(self) -> StepResult:
        """One optimizer step. Before the optimizer acts, one all-reduce agrees on the logged loss,
        the stop flag and whether the step is finite (dslurm/health.py decides what to do then)."""
        if self._fault_await is not None and self.step + 1 >= self._fault_await:  # every rank, once,
            self._fault_await = None                                                # outside any collective
            with self.watch.paused():  # the wait is no step time, and no hang
                faults.await_files()
        faults.before_step(self.step + 1, self._fault_crash, self._fault_kill9, self._fault_hang,
                           self._fault_freeze)
        with self.metrics.phase("data"):
            while self._position() in self.skip_positions:  # a batch a rollback left behind
                self.loader.sampler.next_global()
            position = self._position()
            self._poison = faults.poisoned(position, self.train.global_batch, self._fault_nan)
            snapshot = self.loader.state_dict()
            batch = self._next_batch()
            abandoned = batch is None
            inputs, targets, *docs = batch if batch is not None else self._stand_in()
            if self._slow_data:
                time.sleep(self._slow_data)  # DSLURM_FAULT_SLOW_DATA
            if self.loader.instruct:  # every rank, a stand-in too: the count is an all-reduce
                self.weigh_tokens(targets)
        with self.metrics.phase("compute"), self._loss_context(), self.watch.collective("forward_backward"):
            local_loss = self._forward_backward(inputs, targets, *docs)
        with self.metrics.phase("optimizer"), self.watch.collective("grad_norm"):
            norm = clip_grad_norm_(self.params, self.train.grad_clip, self.pp_group)
        # Only the ranks holding the last stage contribute a loss (world/pp of them, each a
        # dp-rank mean); a non-finite norm on any rank is counted too, so all ranks agree.
        holder = self.built.has_last_stage
        save_now = self._operator_request()  # rank 0 only: a stop sets the flags read next
        stop, term = self.stop.local(self.step + 1)  # this rank's stop flags, agreed in the same all-reduce
        vec = torch.stack([local_loss.float() if holder else torch.zeros((), device=self.device),
                           torch.tensor(stop, device=self.device), torch.tensor(term, device=self.device),
                           (~torch.isfinite(norm)).float().to(self.device),
                           torch.tensor(float(save_now), device=self.device),
                           torch.tensor(float(abandoned), device=self.device),
                           torch.tensor(float(self._profile_req), device=self.device)])
        self._profile_req = 0
        with self.watch.collective("step_agree"):
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        loss = vec[0].item() / (self.dims.world_size // self.dims.layout.pp)
        if vec[5].item() > 0:  # a stop during some rank's data stall: nobody takes this step
            return self._untaken(snapshot, position, terminated=vec[2].item() > 0, save_now=vec[4].item() > 0)
        decision = None
        if vec[3].item() > 0 or not math.isfinite(loss):
            decision = health.nonfinite_action(self.train.nonfinite, self.nonfinite_handled,
                                               self.train.nonfinite_max)
        with self.metrics.phase("optimizer"):
            lr = self.optimizers[0].param_groups[0]["lr"]
            for opt in self.optimizers:
                if decision is None or decision.action == "train":
                    opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in self.schedulers:
                sched.step()
        result = StepResult(step=self.step, loss=loss, grad_norm=norm.item(), lr=lr, stop=vec[1].item() > 0,
                            terminated=vec[2].item() > 0, nonfinite=decision, position=position,
                            save_now=vec[4].item() > 0, profile_steps=int(vec[6].item()))
        self.step += 1
        return result

    def _next_batch(self) -> tuple[torch.Tensor, ...] | None:
        """This step's batch, read in the reader thread while this thread watches the stop flags:
        a read that stalls (a hung file system, DSLURM_FAULT_DATA_STALL) cannot hold a stop signal
        back. None: a stop came first (the stalled reader is left behind, a new one takes over)."""
        stall = self._fault_stall is not None and self.step + 1 == self._fault_stall
        box = self._reader.submit(self.loader.next_batch, stall=stall)
        while not box.done.wait(0.05):
            if self.stop.stop_requested:
                log.warning("[rank %d] a stop arrived while the batch of step %d was still being read: the "
                            "step is not taken, the run saves at step %d", self.rank, self.step + 1, self.step)
                self._reader = BatchReader()
                return None
        if box.error is not None:
            raise box.error
        return box.value  # type: ignore[no-any-return]

    def _stand_in(self) -> tuple[torch.Tensor, ...]:
        """Token ids of a batch's shape: this rank still takes part in the step's collectives (its
        peers may be inside them), whose result no rank applies. Instruction data: one document."""
        z = torch.zeros((self.loader.local_batch, self.resolved.shape.seq_len), dtype=torch.long,
                        device=self.device)
        return (z, z, z) if self.loader.instruct else (z, z)

    def _untaken(self, snapshot: dict[str, Any], position: int, *, terminated: bool, save_now: bool) -> StepResult:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.loader.load_state_dict(snapshot)  # every rank: the batch is read again on resume
        # The stop's save records this state, not the loader's: an abandoned reader still inside
        # its read may advance the loader after this point (its result is never used).
        self._data_state = snapshot
        lr = self.optimizers[0].param_groups[0]["lr"]
        return StepResult(step=self.step - 1, loss=math.nan, grad_norm=math.nan, lr=lr, stop=True,
                          terminated=terminated, position=position, save_now=save_now, taken=False)

    def _stop_before_first_step(self) -> bool:
        """A stop that came during start-up (build, restore): agreed before the first step, so no
        rank starts the first step's compile and warm-up after it. One small collective per start."""
        vec = torch.tensor([float(self.stop.stop_requested), float(self.stop.stop_terminated)], device=self.device)
        with self.watch.collective("start_agree"):
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        if vec[0].item() > 0:
            self.stop.stop_requested, self.stop.stop_terminated = True, vec[1].item() > 0
        return vec[0].item() > 0

    # ------------------------------------------------------------------ the run

    def _checkpoint_manager(self) -> Any:
        from dslurm import checkpoint as ck
        job = self.resolved.job
        return manager_for(job.checkpoint, self.resolved.run_dir, scratch=self.resolved.site.storage.scratch,
                           ledger=self.ledger, layout=self.resolved.layout.degrees(),
                           config_hash=ck.config_digest({"model": dataclasses.asdict(job.model),
                                                         "train": dataclasses.asdict(job.train)}),
                           model_shape=self.resolved.shape.record())

    def _save(self, blocking: bool) -> None:
        if self.ckpt is not None:
            self.watch.expect_long()
            with self.metrics.phase("checkpoint"), self.watch.collective("checkpoint"):
                self.ckpt.save(self.step, train_state(self.built.parts, self.optimizers),
                               {"data": self._data_state if self._data_state is not None else self.loader.state_dict(),
                                "skip_positions": sorted(self.skip_positions)},
                               blocking=blocking)

    def _save_final(self) -> None:
        """A save the run's ending depends on (the last step, a stop): it must commit, whatever
        `on_error` says for periodic saves, or the run ends as a save failure, never as a success."""
        if self.ckpt is None:
            return
        self._save(blocking=True)
        if (err := final_failure(self.ckpt, self.step)) is not None:
            self._event(events.Exit(reason="save_failed", step=self.step, code=exitcodes.SAVE_FAILED))
            raise err

    def restore(self) -> Any:
        """Resume from the run directory's pointer (if any); the LR follows the restored step."""
        if self.ckpt is None:
            return None
        extra: dict[str, Any] = {}
        res = self.ckpt.restore(train_state(self.built.parts, self.optimizers), extra)
        if res is not None:
            self.step = res.step
            self.loader.load_state_dict(extra["data"])
            self.skip_positions |= {int(p) for p in extra.get("skip_positions", [])}
            for sched in self.schedulers:  # LambdaLR: lr = base * factor(last_epoch)
                sched.last_epoch = self.step
                for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                    group["lr"] = base * fn(self.step)
        return res

    def _operator_request(self) -> bool:
        """`dslurm ctl` (dslurm/observe/ctl.py), rank 0 at a step boundary: a stop sets the flags a
        TERM sets, on record for requeue-me first (saved, not requeued); True: save at this step."""
        req = self.ctl.take() if self.ctl is not None else None
        for old, why in self.ctl.dropped if self.ctl is not None else []:  # stale: for another start
            self._event(events.OperatorRequest(action=old.action, request_id=old.id, user=old.user,
                                               step=self.step + 1, dropped=why))
        if self.ctl is not None:
            self.ctl.dropped.clear()
        if req is None:
            return False
        recorded = req.action == "stop" and ctl.record_stop(req, self.resolved.run_dir)
        self._event(events.OperatorRequest(action=req.action, request_id=req.id, user=req.user,
                                           step=self.step + 1, recorded=recorded))
        if req.action == "stop":
            self.stop.stop_requested = self.stop.stop_terminated = True
        if req.action == "profile":
            self._profile_req = req.steps or self.resolved.job.health.profile_steps
        return req.action == "save"

    def _event(self, ev: events.Event) -> None:
        if self.ledger is not None:
            self.ledger.append(ev)

    def _log_window(self, last: StepResult) -> None:
        win = self.metrics.summary()
        if win is not None and self.rank == 0:
            self._event(win.event(grad_norm=last.grad_norm, lr=last.lr))
            print(format_log_line(win, total_steps=self.train.steps, lr=last.lr), flush=True)

    def run(self) -> int:
        """Train to `train.steps` or until a stop is agreed; returns the exit code."""
        res = self.restore()
        if self.resolved.job.model.init_from:  # published weights, only on a fresh start (resume wins)
            self._event(init_from.start(self.resolved, self.built.parts, res))
        self.last_clean_step = self.step  # a generation is only saved after its step's check passed
        self.clock.mark("restore")
        self._event(events.TrainStart(step=self.step, generation=res.generation if res else None,
                                      fell_back=bool(res and res.fell_back),
                                      startup_s=round(time.time() - self.t_start, 3),
                                      layout=self.resolved.layout.degrees()))
        self.metrics.start()
        self.watch.start()
        result = None
        if self.step < self.train.steps and self._stop_before_first_step():
            return self._stop_exit(self.stop.stop_terminated)
        while self.step < self.train.steps:
            if self.profiler.before_step(self.step + 1):  # the profiler's start (seconds on a busy host)
                self.watch.expect_long()  # is no step time, and no hang
            try:
                result = self.train_step()
            except torch.OutOfMemoryError as exc:
                self._out_of_memory(exc)
                raise
            if not result.taken:  # a stop during a data stall: save what the last step left
                return self._stop_exit(result.terminated)
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
            if self.step % self.train.straggler_every == 0:
                with self.watch.collective("stragglers"):
                    times, hosts, steps = gather_rank_steps(self.metrics, self.rank)
                self._event(straggler_event(self.step, times, hosts, steps=steps))
            self.checks.poll_devices(self.step, RunDir(self.resolved.run_dir))
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
        if result is not None:  # None: resumed at the end already
            self._save_final()
        self._event(events.Exit(reason="completed", step=self.step, code=EXIT_COMPLETED))
        return EXIT_COMPLETED

    def _stop_exit(self, terminated: bool) -> int:
        """The agreed stop: save at this step, the exit event, leave together."""
        self._event(events.Signal(signal="stop_requested", step=self.step))
        self._save_final()
        self.settled = (time.time(), "")  # the stop's save committed: the ending is decided
        code = EXIT_TERMINATED if terminated else EXIT_REQUEUE
        self._event(events.Exit(reason=exitcodes.NAMES[code], step=self.step, code=code))
        # torchrun kills the other workers as soon as one exits non-zero: nobody leaves
        # before rank 0 has written the exit event (the save itself is collective).
        with self.watch.collective("exit_barrier"):
            dist.barrier()
        return code

    def _out_of_memory(self, exc: BaseException) -> None:
        """This rank ran out of memory (train/oom.py): snapshot, note, ledger event; the error
        then ends the process and the start ends as `oom` (not retried blindly)."""
        from dslurm.facts import start_dir

        phase, coll = oom.phase_of(self.metrics, self.watch)
        oom.record(exc, rank=self.rank, step=self.step + 1, phase=phase, collective=coll, device=self.device,
                   start_dir=start_dir(run_dir=self.resolved.run_dir), run_dir=self.resolved.run_dir)

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

    # ------------------------------------------------------------------ non-finite steps

    def _nonfinite_event(self, r: StepResult, **kw: Any) -> None:
        assert r.nonfinite is not None
        self._event(events.NonFinite(step=r.step, loss=r.loss, grad_norm=r.grad_norm, action=r.nonfinite.action,
                                     reason=r.nonfinite.reason, handled=self.nonfinite_handled, **kw))

    def _handle_nonfinite(self, r: StepResult) -> bool:
        """skip (the optimizer step was not taken) or rollback; True when the step moved back."""
        assert r.nonfinite is not None
        self.nonfinite_handled += 1
        self.skip_positions.add(r.position)
        if r.nonfinite.action != "rollback":
            self._nonfinite_event(r, skipped_position=r.position)
            log.warning("[rank %d] step %d: non-finite loss %s / grad norm %s: optimizer step skipped (%s)",
                        self.rank, r.step, r.loss, r.grad_norm, r.nonfinite.reason)
            return False
        self._log_window(r)  # the failed step's own window, before the step counter moves back
        self.watch.expect_long()
        with self.watch.collective("rollback"):
            res = self.restore()  # the pointer's generation: the checkpoint layer committed it finite
        log.warning("[rank %d] step %d: non-finite loss %s: rolled back to step %d (%s); batch at %d skipped",
                    self.rank, r.step, r.loss, self.step, res.generation if res else "nothing saved yet",
                    r.position)
        self._nonfinite_event(r, generation=res.generation if res else None, resumed_step=self.step,
                              skipped_position=r.position)
        return res is not None

    def _stop_nonfinite(self, r: StepResult) -> int:
        """train.nonfinite=stop (or the bound was reached): no save, the pointer stays finite."""
        from dslurm.checkpoint import CheckpointError, read_pointer

        try:
            ptr = read_pointer(self.resolved.run_dir) if self.ckpt is not None else None
        except CheckpointError:
            ptr = None
        where = f"the pointer still names {ptr.generation} (step {ptr.step})" if ptr else "nothing was saved"
        self.settled = (time.time(), f"non-finite loss at step {r.step} (loss {r.loss}, grad norm {r.grad_norm})")
        self._nonfinite_event(r, generation=ptr.generation if ptr else None)
        code = exitcodes.NONFINITE
        if self.rank == 0:
            print(f"error: step {r.step}: the loss is not finite (loss {r.loss}, grad norm {r.grad_norm}); "
                  f"{r.nonfinite.reason if r.nonfinite else ''}: stopping without a save (exit {code}); {where}. "
                  "Fix: lower train.lr or add warm-up, or set train.nonfinite: rollback | skip; a resubmit "
                  "resumes from the pointer", file=sys.stderr, flush=True)
        self._event(events.Exit(reason=exitcodes.NAMES[code], step=self.step, code=code))
        with self.watch.collective("exit_barrier"):
            dist.barrier()
        return code

    # ------------------------------------------------------------------ corruption, device health

    def _replicas_corrupt(self) -> bool:
        """The replica check (train/sdc.py). On a mismatch: the ledger's `sdc` event, the named node
        into the run's blocklist, and a rollback to the pointer's generation -- every save is checked
        at its own step first, so it predates the corruption. True when rolled back; raises (the start
        ends as a crash, the requeue excludes the node) past health.sdc_max or with nothing saved."""
        assert self.checks.replicas is not None
        with self.watch.collective("sdc_check"):
            bad = self.checks.replicas.check()
        if bad is None:
            self.last_clean_step = self.step
            return False
        self.sdc_handled += 1
        blocked = bad.blocklist
        if self.rank == 0 and blocked:
            from dslurm.preflight.in_job import add_to_blocklist

            add_to_blocklist(self.resolved.run_dir, blocked)
        ev = events.Sdc(step=self.step, last_clean_step=self.last_clean_step, suspects=bad.suspects,
                        suspect_hosts=bad.hosts, named=bad.named, why=bad.why, params=bad.params,
                        blocklisted=blocked)
        log.error("[rank %d] SILENT DATA CORRUPTION after step %d (last clean check at step %d): %s; suspect "
                  "rank(s) %s on %s%s", self.rank, self.step, self.last_clean_step, bad.why, bad.suspects,
                  bad.hosts, f"; blocklisted {blocked}" if blocked else "")
        if self.sdc_handled > self.resolved.job.health.sdc_max or self.ckpt is None:
            self._event(dataclasses.replace(ev, action="stop"))
            raise RuntimeError(f"silent data corruption after step {self.step} on {bad.hosts} "
                               f"({self.sdc_handled} this start, health.sdc_max={self.resolved.job.health.sdc_max})")
        self.watch.expect_long()
        with self.watch.collective("rollback"):
            res = self.restore()  # the pointer: saved right after a check that passed
        if res is None:  # corrupted before the first save: a fresh start elsewhere is the only clean state
            self._event(dataclasses.replace(ev, action="stop"))
            raise RuntimeError(f"silent data corruption after step {self.step} before any save: restart fresh")
        self._event(dataclasses.replace(ev, action="rollback", generation=res.generation, resumed_step=self.step))
        return True

    def close(self) -> None:
        self.profiler.close()
        if self.trackers is not None:  # closed at the exit event already, unless the start crashed
            self.trackers.close()
        self.checks.close()
        self.watch.close()
        if self.ckpt is not None:
            self.ckpt.close()
