"""One optimizer step of the trainer (`train.loop.Trainer` is a `Step`): the batch read beside a
stop flag, forward/backward, the grad norm, and one all-reduce that agrees on the logged loss,
the stop, a finite step and an operator's request before the optimizer acts.

The step's state is declared here, typed, and set by `Trainer.__init__` (train/loop.py); the
ways a run leaves the plain step (saves, rollbacks, stops) are train/recovery.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dslurm import faults, health
from dslurm.observe import ctl, events
from dslurm.sidecall import Box, Caller
from train.metrics import format_log_line
from train.model import cross_entropy
from train.optim import clip_grad_norm_
from train.packing import IGNORE, masked_sum, queue_docs
from train.parallel.cp import shard

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR

    from dslurm.config import TrainSpec
    from dslurm.config.resolve import Resolved
    from dslurm.observe.ledger import Ledger
    from dslurm.run import RunDir
    from dslurm.runtime.stop import StopFlags
    from train.data import TokenLoader
    from train.metrics import StepMetrics
    from train.parallel.build import Parts
    from train.parallel.dims import ParallelDims
    from train.replicas import Replicas
    from train.watchdog import Watch

log = logging.getLogger(__name__)


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
    discarded: bool = False
    """replica groups: torchft's commit vote said no (a peer failed inside the step): no rank applied
    it, every loader is back where the step began, and the step is trained again (train/replicas.py)"""


class BatchReader:
    """A daemon thread that reads one batch at a time (`submit`), so the training thread can wait
    for it and still see a stop (`Step._next_batch`). A reader stuck in a stalled read is
    abandoned, never joined: the process ends after the stop's save (dslurm/sidecall.py)."""

    def __init__(self) -> None:
        self._caller = Caller("dslurm-batch-reader")

    def submit(self, fn: Callable[[], Any], *, stall: bool = False) -> Box:
        if not stall:
            return self._caller.submit(fn)

        def stalled() -> Any:
            faults.data_stall()
            return fn()
        return self._caller.submit(stalled)


class Step:
    """The step's half of the trainer: its state (set by `Trainer.__init__`) and `train_step`."""

    resolved: Resolved
    train: TrainSpec
    rank: int
    device: torch.device
    dims: ParallelDims
    dp_size: int
    """data-parallel ranks (ranks of one dp coordinate read the same batch)"""
    run_dir: RunDir
    stop: StopFlags
    watch: Watch
    built: Parts
    params: list[nn.Parameter]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[LambdaLR]
    pp_group: dist.ProcessGroup | None
    loader: TokenLoader
    metrics: StepMetrics
    ledger: Ledger | None
    """rank 0's; None on the other ranks"""
    replicas: Replicas | None
    """recovery.replicas: torchft's Manager around the gradient average across groups"""
    ctl: ctl.Poller | None
    """rank 0's `dslurm ctl save|stop|profile` requests"""
    step: int
    """optimizer steps taken (the 1-based number of the last one)"""
    loss_scale: float
    token_weight: float | None
    skip_positions: set[int]
    """batches (stream positions) never to be read again"""
    nonfinite_handled: int
    last_step: tuple[float, float] | None
    """(loss, grad norm) of the last step taken in this start (None before one): a save records it"""
    _poison: bool
    _profile_req: int
    _ctl_stop: bool
    """a `dslurm ctl stop` taken here, or agreed from replica group 0's (sent in every agreement after)"""
    _data_state: dict[str, Any] | None
    _reader: BatchReader
    _fault_crash: int | None
    _fault_kill9: int | None
    _fault_hang: int | None
    _fault_freeze: int | None
    _fault_await: int | None
    _fault_nan: int | None
    _fault_stall: int | None
    _slow_data: float

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-microbatch loss pre-divided so the summed gradients are the global mean's."""
        if self.token_weight is not None:
            loss = masked_sum(logits, targets) * self.token_weight
        else:
            loss = cross_entropy(logits, targets) * self.loss_scale
        return loss * float("nan") if self._poison else loss  # DSLURM_FAULT_NAN

    def weigh_tokens(self, targets: torch.Tensor) -> None:
        """Instruction data: token_weight = dp x cp (the ranks FSDP averages the gradients over) / the
        trained targets of this global batch (one all-reduce of this rank's count of its whole
        sequences, before any cp split; ranks of one dp coordinate read the same batch)."""
        n = (targets != IGNORE).sum().float()
        dist.all_reduce(n)
        total = n.item() / (self.dims.world_size // self.dp_size)
        self.token_weight = self.dp_size * self.dims.layout.cp / max(total, 1.0)

    def cp_local(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This cp rank's chunks of each sequence of `batch` (train/parallel/cp.py); unchanged without cp.
        The documents of instruction data stay whole: attention masks keys of the whole sequence."""
        lay = self.dims.layout
        if not lay.cp_enabled:
            return batch
        rank = lay.coords(self.rank)["cp"]
        return tuple(shard(t, rank, lay.cp) for t in batch)

    def _loss_context(self) -> AbstractContextManager[None]:
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
        the stop flag and whether the step is finite (dslurm/health/__init__.py decides what to do then)."""
        if self._fault_await is not None and self.step + 1 >= self._fault_await:  # every rank, once,
            self._fault_await = None                                                # outside any collective
            with self.watch.paused():  # the wait is no step time, and no hang
                faults.await_files()
        faults.before_step(self.step + 1, self._fault_crash, self._fault_kill9, self._fault_hang,
                           self._fault_freeze)
        if self.replicas is not None:  # the quorum of this step; a group behind heals here
            with self.watch.collective("replica_quorum"):
                self.replicas.quorum()
                if self.step >= self.train.steps:  # healed to the end: the peers wait in `gather`
                    self.replicas.barrier()
                    lr = self.optimizers[0].param_groups[0]["lr"]
                    return StepResult(step=self.step - 1, loss=math.nan, grad_norm=math.nan, lr=lr, stop=False,
                                      taken=False, discarded=True)
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
            inputs, targets = self.cp_local(inputs, targets)
        with self.metrics.phase("compute"), self._loss_context(), self.watch.collective("forward_backward"):
            local_loss = self._forward_backward(inputs, targets, *docs)
        save_now = self._operator_request()  # rank 0 only: a stop sets the flags read next
        stop, term = self.stop.local(self.step + 1)  # this rank's stop flags, agreed in the same all-reduce
        if self.replicas is not None:  # the requests ride with the gradients: every group acts in the same step
            with self.metrics.phase("compute"), self.watch.collective("replica_allreduce"):
                stop, term, saves, profile, ctl_stop = self.replicas.average(
                    self.params, [stop, term, float(save_now), float(self._profile_req), float(self._ctl_stop)])
            save_now, self._profile_req = saves > 0, int(profile)
            if ctl_stop > 0 and not self._ctl_stop:
                self._peer_ctl_stop()
        with self.metrics.phase("optimizer"), self.watch.collective("grad_norm"):
            norm = clip_grad_norm_(self.params, self.train.grad_clip, self.pp_group)
        # Only the ranks holding the last stage contribute a loss (world/pp of them, each a
        # dp-rank mean); a non-finite norm on any rank is counted too, so all ranks agree.
        holder = self.built.has_last_stage
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
        if self.replicas is not None and not self.replicas.commit():
            return self._discarded(snapshot, position, stop=vec[1].item() > 0, terminated=vec[2].item() > 0)
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
        self.last_step = (result.loss, result.grad_norm)
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

    def _discarded(self, snapshot: dict[str, Any], position: int, *, stop: bool, terminated: bool) -> StepResult:
        """A replica step torchft's vote discarded: nothing applied, the batch read again."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.loader.load_state_dict(snapshot)
        self._data_state = snapshot
        lr = self.optimizers[0].param_groups[0]["lr"]
        log.warning("[rank %d] step %d discarded by the replica groups' commit vote", self.rank, self.step + 1)
        return StepResult(step=self.step - 1, loss=math.nan, grad_norm=math.nan, lr=lr, stop=stop,
                          terminated=terminated, position=position, taken=False, discarded=True)

    def _stop_before_first_step(self) -> bool:
        """A stop that came during start-up (build, restore): agreed before the first step, so no
        rank starts the first step's compile and warm-up after it. One small collective per start."""
        vec = torch.tensor([float(self.stop.stop_requested), float(self.stop.stop_terminated)], device=self.device)
        with self.watch.collective("start_agree"):
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        if vec[0].item() > 0:
            self.stop.stop_requested, self.stop.stop_terminated = True, vec[1].item() > 0
        return vec[0].item() > 0

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
        recorded = req.action == "stop" and ctl.record_stop(req, self.run_dir.path)
        self._event(events.OperatorRequest(action=req.action, request_id=req.id, user=req.user,
                                           step=self.step + 1, recorded=recorded))
        if req.action == "stop":
            self.stop.stop_requested = self.stop.stop_terminated = True
            self._ctl_stop = True
        if req.action == "profile":
            self._profile_req = req.steps or self.resolved.job.health.profile_steps
        return req.action == "save"

    def _peer_ctl_stop(self) -> None:
        """Replica groups: group 0 took a `dslurm ctl stop`; this group stops in the same step, and
        its rank 0 puts it on record in this group's facts, as group 0 did in its own (the group's
        ending is then the operator's stop, not an unexplained exit 143)."""
        self._ctl_stop = True
        if self.rank == 0:
            ctl.record_stop(ctl.Request(action="stop", id="replica-peer", user="replica group 0's request"),
                            self.run_dir.path)

    def _event(self, ev: events.Event) -> None:
        if self.ledger is not None:
            self.ledger.append(ev)

    def _log_window(self, last: StepResult) -> None:
        win = self.metrics.summary()
        if win is not None and self.rank == 0:
            self._event(win.event(grad_norm=last.grad_norm, lr=last.lr))
            print(format_log_line(win, total_steps=self.train.steps, lr=last.lr), flush=True)
