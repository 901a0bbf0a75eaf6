"""Saves, restores and the ways a run leaves the plain step (`train.loop.Trainer` is a `Recovery`):
the agreed stop (save, exit event, leave together), a non-finite loss (skip, roll back or stop:
dslurm/health/__init__.py decides), silent data corruption between replicas (blocklist the node, roll
back: train/sdc.py checks), and this rank running out of memory (train/oom.py records).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dslurm import exitcodes
from dslurm.observe import events
from dslurm.runtime.checkpoint import manager_for, save_final
from dslurm.runtime.state import train_state
from train import oom
from train.model import cross_entropy
from train.step import Step, StepResult, _local

if TYPE_CHECKING:
    from dslurm.checkpoint.dcp import CheckpointManager, RestoreResult
    from train.sdc import RunChecks

log = logging.getLogger(__name__)


class Recovery(Step):
    """The checkpoint and the endings of the trainer, on the step's state."""

    ckpt: CheckpointManager | None
    """None: a trainer built without checkpointing (benchmarks, the self-check)"""
    checks: RunChecks
    settled: tuple[float, str] | None
    """when and why the ending was decided (Outcome.settled)"""
    sdc_handled: int
    """corruptions rolled back in this start"""
    last_clean_step: int
    """the step of the last replica check that passed"""

    def _checkpoint_manager(self) -> CheckpointManager:
        from dslurm import checkpoint as ck
        job = self.resolved.job
        mgr: CheckpointManager = manager_for(
            job.checkpoint, self.run_dir.path, scratch=self.resolved.site.storage.scratch,
            site_partner=self.resolved.site.storage.partner,
            ledger=self.ledger, layout=self.resolved.layout.degrees(),
            config_hash=ck.config_digest({"model": dataclasses.asdict(job.model),
                                          "train": dataclasses.asdict(job.train)}),
            model_shape=self.resolved.shape.record())
        return mgr

    def _save(self, blocking: bool) -> None:
        if self.ckpt is not None:
            self.watch.expect_long()
            with self.metrics.phase("checkpoint"), self.watch.collective("checkpoint"):
                extra = {"data": self._data_state if self._data_state is not None else self.loader.state_dict(),
                         "skip_positions": sorted(self.skip_positions)}
                loss, norm = self.last_step if self.last_step is not None else (None, None)
                self.ckpt.save(self.step, train_state(self.built.parts, self.optimizers), extra,
                               blocking=blocking, loss=loss, grad_norm=norm,
                               probe=self.probe_loss(extra) if self._replay() else None)

    def _replay(self) -> bool:
        return self.resolved.job.checkpoint.verify_resume == "replay"

    def probe_loss(self, saved_extra: dict[str, Any]) -> float:
        """checkpoint.verify_resume: replay: the forward-only loss of the state held now on the
        batch that the data position `saved_extra["data"]` reads next (the step after the save),
        the mean over all ranks: recorded with each save, recomputed after a restore
        (dslurm/checkpoint/replay.py). Eval mode (no dropout, no RNG drawn), no gradients; the
        loader is put back where it was. Collective (the model's own and one all-reduce);
        pipeline parallel is refused by the config (no whole forward on one rank)."""
        snapshot = self.loader.state_dict()
        self.loader.load_state_dict(saved_extra["data"])
        try:
            inputs, targets, *docs = self.loader.next_batch()
        finally:
            self.loader.load_state_dict(snapshot)
        inputs, targets = self.cp_local(inputs, targets)
        model, was = self.built.parts[0], self.built.parts[0].training
        model.eval()
        try:
            with torch.no_grad(), self._loss_context():
                loss = _local(cross_entropy(model(inputs, docs[0] if docs else None), targets)).float()
        finally:
            model.train(was)
        vec = loss.detach().reshape(1).to(self.device)
        dist.all_reduce(vec)
        return float(vec.item()) / self.dims.world_size

    def _save_final(self) -> None:
        """A save the run's ending depends on (the last step, a stop): it must commit, whatever
        `on_error` says for periodic saves, or the run ends as a save failure, never as a success;
        a disk full for seconds is waited out (`save_final`)."""
        if self.ckpt is None:
            return
        if (err := save_final(self.ckpt, lambda: self._save(blocking=True), self.step)) is not None:
            self._event(events.Exit(reason="save_failed", step=self.step, code=exitcodes.SAVE_FAILED))
            raise err

    def restore(self) -> RestoreResult | None:
        """Resume from the run directory's pointer (if any); the LR follows the restored step."""
        if self.ckpt is None:
            return None
        extra: dict[str, Any] = {}
        res = self.ckpt.restore(train_state(self.built.parts, self.optimizers), extra,
                                probe=self.probe_loss if self._replay() else None)
        if res is not None:
            self.step = res.step
            self.loader.load_state_dict(extra["data"])
            self.skip_positions |= {int(p) for p in extra.get("skip_positions", [])}
            for sched in self.schedulers:  # LambdaLR: lr = base * factor(last_epoch)
                sched.last_epoch = self.step
                for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                    group["lr"] = base * fn(self.step)
        return res

    def _stop_exit(self, terminated: bool, *, pristine: bool = False) -> int:
        """The agreed stop: save at this step, the exit event, leave together. `pristine`: no step
        taken since the restore (see `Trainer.run`): no save, the next start restores the same state."""
        self._event(events.Signal(signal="stop_requested", step=self.step))
        if not pristine:
            self._save_final()
        elif self.rank == 0 and self.ckpt is not None:
            print(f"stopped before this start took a step: nothing new to save; the next start begins at "
                  f"step {self.step}, as this one did", flush=True)
        self.settled = (time.time(), "")  # the stop's save committed: the ending is decided
        code = exitcodes.TERMINATED if terminated else exitcodes.REQUEUE
        self._event(events.Exit(reason=exitcodes.NAMES[code], step=self.step, code=code))
        # torchrun kills the other workers as soon as one exits non-zero: nobody leaves
        # before rank 0 has written the exit event (the save itself is collective).
        with self.watch.collective("exit_barrier"):
            dist.barrier()
        return code

    def _out_of_memory(self, exc: BaseException) -> None:
        """This rank ran out of memory (train/oom.py): snapshot, note, ledger event; the error
        then ends the process and the start ends as `oom` (not retried blindly)."""
        from dslurm.endings.facts import start_dir

        phase, coll = oom.phase_of(self.metrics, self.watch)
        oom.record(exc, rank=self.rank, step=self.step + 1, phase=phase, collective=coll, device=self.device,
                   start_dir=start_dir(run_dir=self.run_dir.path), run=self.run_dir)

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
            ptr = read_pointer(self.run_dir.path) if self.ckpt is not None else None
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
            self.run_dir.add_to_blocklist(blocked)
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

