"""Evaluation: every `train.eval_every` steps, forward only over the same `train.eval_batches`
global batches (train/data.py `EvalData`: `data.val` or the held-out fraction), loss all-reduced.

Why it cannot disturb training: it reads its own fixed batches (the training sampler's
position is untouched), runs under `torch.no_grad` (the model has no dropout, so no RNG
is drawn) and takes no optimizer step; a run with evaluation trains bit-identically to
one without (tests/integration/test_eval_sources.py).

Stops. A stop signal during evaluation is honoured at the next eval-batch boundary: each
batch's loss rides in one SUM all-reduce with the rank's stop flags (the agreement the
training step uses), so all ranks leave after the same batch; the caller then saves and
exits as for a stop at a step boundary. The interrupted evaluation is written to the ledger
with `interrupted: true` and not repeated on resume.

Time. The loop restarts its step clock after evaluation, so eval time is in no step's
wall time: the report shows it on its own line and goodput does not count it as
productive (docs/report.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dslurm import faults
from dslurm.observe import events
from train.data import EvalData
from train.model import cross_entropy
from train.packing import masked_sum, queue_docs

if TYPE_CHECKING:
    from train.step import Step


@dataclasses.dataclass(slots=True)
class EvalResult:
    event: events.Eval
    stop: bool
    """some rank asked to stop during evaluation: all ranks agree"""
    terminated: bool


def _local(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


class Evaluator:
    """Runs one evaluation on behalf of a `train.loop.Trainer` (its model, stop flags, watchdog)."""

    def __init__(self, trainer: Step, data: EvalData) -> None:
        self.t, self.data = trainer, data
        self._fault_stop = faults.step_fault("DSLURM_FAULT_STOP_IN_EVAL")  # dslurm/faults.py

    def due(self, step: int) -> bool:
        every = self.t.train.eval_every
        return bool(every) and step % every == 0

    def _batch_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                    docs: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's mean token loss of its share (0 on ranks without the last pipeline stage);
        `docs`: instruction data's examples (train/packing.py), whose loss is the completions'."""
        t, b = self.t, self.t.built
        total = torch.zeros((), device=t.device)
        accum = t.train.grad_accum
        chunks = docs.chunk(accum) if docs is not None else [None] * accum
        for mi, mt, md in zip(inputs.chunk(accum), targets.chunk(accum), chunks):
            if b.schedule is None:
                out = b.parts[0](mi, md)
                if t.token_weight is not None:  # instruction data: the batch's token mean (Trainer.weigh_tokens)
                    total += _local(masked_sum(out, mt) * t.token_weight).float()
                else:
                    total += _local(cross_entropy(out, mt)).float() / accum
                continue
            losses: list[torch.Tensor] = []  # the schedule's loss_fn is pre-scaled by 1/(accum x microbatches)
            kwargs: dict[str, Any] = {"target": mt, "losses": losses} if b.has_last_stage else {}
            queue_docs(b.parts, md, t.dims.layout.microbatches)
            b.schedule.eval(*((mi,) if b.has_first_stage else ()), **kwargs)
            for loss in losses:
                total += _local(loss.detach()).float()
        return total

    def run(self, step: int) -> EvalResult:
        """Evaluate after optimizer step `step` (1-based count of steps done)."""
        t, data = self.t, self.data
        t.watch.expect_long()  # not a step time; the ceiling bounds it
        t0, done, loss_sum, stop, term = time.monotonic(), 0, 0.0, False, False
        holders = t.dims.world_size // t.dims.layout.pp
        poison, t._poison = t._poison, False
        try:
            with torch.no_grad(), t._loss_context(), t.watch.collective("eval"):
                for i in range(data.batches):
                    inputs, targets, *docs = data.batch(i)
                    if docs:
                        t.weigh_tokens(targets)
                    inputs, targets = t.cp_local(inputs, targets)
                    local = self._batch_loss(inputs, targets, *docs)
                    if self._fault_stop == step and i == 0:
                        t.stop.stop_requested = True  # as if USR2 arrived during this batch
                    flags = t.stop.local(step)
                    vec = torch.stack([local if t.built.has_last_stage else torch.zeros((), device=t.device),
                                       torch.tensor(flags[0], device=t.device),
                                       torch.tensor(flags[1], device=t.device)])
                    dist.all_reduce(vec, op=dist.ReduceOp.SUM)
                    loss_sum += vec[0].item() / holders
                    done += 1
                    stop, term = vec[1].item() > 0, vec[2].item() > 0
                    if stop:
                        break
        finally:
            t._poison = poison
        interrupted = done < data.batches
        loss = None if interrupted else loss_sum / done
        ppl = math.exp(loss) if loss is not None and loss < 700 else None  # exp overflows past ~709
        ev = events.Eval(step=step, loss=loss, ppl=ppl, batches=done, eval_batches=data.batches,
                         tokens=done * data.ids.shape[1] * data.loader.seq_len, source=data.label,
                         duration_s=round(time.monotonic() - t0, 6), interrupted=interrupted)
        return EvalResult(ev, stop, term)
