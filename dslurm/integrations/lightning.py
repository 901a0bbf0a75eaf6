"""A Lightning `Trainer` (lightning.pytorch or pytorch_lightning) on the whole chain (in-job).

    import dslurm.integrations.lightning as dl
    dl.run(trainer, model, train_dataloaders=loader)   # in place of trainer.fit(model, ...)

`run` adds one `Callback` and takes the signals from Lightning:
- Signals have one owner: Lightning's own handlers (its SLURM auto-requeue on USR1, its SIGTERM
  handler that broadcasts inside the handler) are never installed, and a `SLURMEnvironment`
  gets `auto_requeue=False`; dslurm's handlers only set a flag.
- At each optimizer step (`on_train_batch_end`, once `global_step` moved) the ranks agree on a
  stop (USR2/TERM/`dslurm ctl stop`); a stop, a `dslurm ctl save`, the job's `checkpoint.interval`
  and the last step save: `trainer.save_checkpoint` writes `lightning.ckpt` under the run's
  `generations/.incoming`, committed inside a dslurm generation (dslurm.integrations.chain).
- A start resumes from the verified pointer: `fit(..., ckpt_path=<the generation's .ckpt>)`
  (weights, optimizers, schedulers, loop counters, callbacks). What Lightning's resume lacks for
  a plain DataLoader is added here: the batches of the epoch already trained are skipped (not
  trained again from the epoch's start) and every rank's RNG streams are set back to the saved
  ones just before the first batch trains (docs/integrations.md says when that is exact).
- Steps are logged to the ledger from `on_train_batch_end` (the loss the module returned, lr).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
except ImportError:  # pragma: no cover - only pytorch_lightning installed
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from lightning_fabric.plugins.environments.slurm import SLURMEnvironment  # type: ignore[assignment]

import dslurm.runtime as dr
from dslurm.errors import UserError
from dslurm.integrations.chain import Chain
from dslurm.integrations.rules import lightning_problems

log = logging.getLogger(__name__)
dr.catch_stops()  # on import: a USR2 that comes while the script builds its model is kept, not fatal

CKPT = "lightning.ckpt"
WORLD_WHY = "its loop position is counted in batches of the old world size and each rank's RNG is its own"


class _Resumed:
    """The train loader's iterator on a resumed epoch: the first `next` skips the `skip` batches
    that epoch already trained (after Lightning set the sampler's epoch) and sets this rank's RNG
    streams back to the saved ones, so the first batch trains as it would have uninterrupted."""

    def __init__(self, inner: Iterator[Any], skip: int, rng: dict[str, Any]) -> None:
        self.inner, self.skip, self.rng = inner, skip, rng

    def __iter__(self) -> _Resumed:
        return self

    def __next__(self) -> Any:
        if self.skip >= 0:
            from dslurm.checkpoint.rng import apply_rng

            for _ in range(self.skip):
                next(self.inner)
            self.skip = -1
            batch = next(self.inner)
            apply_rng(self.rng)
            return batch
        return next(self.inner)

    def __getattr__(self, name: str) -> Any:  # Lightning's CombinedLoader iterator's own attributes
        return getattr(self.inner, name)


class ChainCallback(pl.Callback):
    """Lightning's hooks into the chain: stops, saves, commits, the ledger, the resumed epoch."""

    def __init__(self, chain: Chain, resume_rng: dict[str, Any] | None) -> None:
        self.chain, self.resume_rng = chain, resume_rng
        self.stopped = False
        self._last = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last = int(trainer.global_step)
        if self.resume_rng is None:
            return
        from dslurm.checkpoint.rng import apply_rng

        skip = int(self.chain.marker.get("batches_in_epoch", 0))
        fetcher = trainer.fit_loop._data_fetcher  # the loader's iterator exists (FitLoop.setup_data)
        if skip >= trainer.num_training_batches:
            # Saved at an epoch's last batch: the next epoch's iterator is made again from the saved
            # streams (Lightning made it after other draws of its start-up), as it was uninterrupted.
            apply_rng(self.resume_rng)
            iter(fetcher)
            return
        fetcher.iterator = _Resumed(fetcher.iterator, skip, self.resume_rng)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step == self._last:  # no optimizer step in this batch (a skipped one): not a step boundary
            return
        self._last = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        values = {"loss": float(loss)} if loss is not None else {}
        if trainer.optimizers:
            values["lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        self.chain.log(step, values)
        if self.chain.stop_requested(step):  # collective: every rank at the same step
            self.stopped = True
            trainer.should_stop = True
        last = trainer.max_steps not in (None, -1) and step >= trainer.max_steps
        if self.stopped or last or step % self.chain.interval == 0 or self.chain.save_asked(step):
            self.chain.marker["batches_in_epoch"] = batch_idx + 1
            trainer.save_checkpoint(str(self.chain.incoming / "lightning" / CKPT))
            self.chain.commit(step, "lightning", final=self.stopped or last)


def _one_signal_owner(trainer: Any) -> None:
    """Lightning installs its SIGTERM (and SLURM requeue) handlers at the start of fit; dslurm's
    stay the only ones (docs/integrations.md: Lightning issues #13524, #21406, #15022)."""
    env = getattr(trainer._accelerator_connector, "cluster_environment", None)
    if isinstance(env, SLURMEnvironment):
        env.auto_requeue = False
    trainer._signal_connector.register_signal_handlers = lambda: None


def _exact_ddp(trainer: Any) -> None:
    """DDP rebuilds its gradient buckets after each process's first iteration, so a resumed process
    reduces its first step in another layout (with 3 or more ranks the sums round differently in
    the last bit; README, "DDP and bit-identical resumes"): unless the script chose, Lightning's
    DDP keeps its first layout for good (find_unused_parameters=True, a graph walk per step)."""
    kw = getattr(trainer.strategy, "_ddp_kwargs", None)
    if isinstance(kw, dict) and "find_unused_parameters" not in kw and "static_graph" not in kw:
        kw["find_unused_parameters"] = True


def run(trainer: Any, model: Any, *fit_args: Any, **fit_kwargs: Any) -> None:
    """`trainer.fit(model, *fit_args, **fit_kwargs)` on the chain: resumed from the run's pointer, stopped and
    saved when all ranks agree, its checkpoints committed as generations. Returns when training
    completed; after a stop it exits 75 or 143 (does not return)."""
    if len(fit_args) >= 4:  # fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        fit_kwargs["ckpt_path"] = fit_args[3]
        fit_args = fit_args[:3]
    problems = lightning_problems(trainer, fit_kwargs)
    if problems:
        raise UserError("dslurm.integrations.lightning: " + "; ".join(problems))
    fit_kwargs.pop("ckpt_path", None)  # None, or refused above
    _one_signal_owner(trainer)
    _exact_ddp(trainer)
    chain = Chain("lightning", batches_in_epoch=0)
    resume = chain.restore(WORLD_WHY)
    rng = None
    if resume.folder is not None:
        from dslurm.checkpoint.rng import capture_rng

        rng = capture_rng()  # the restore set every rank's streams to the saved ones: keep them for _Resumed
    cb = ChainCallback(chain, rng)
    trainer.callbacks.append(cb)
    ckpt = str(resume.folder / CKPT) if resume.folder is not None else None
    trainer.fit(model, *fit_args, ckpt_path=ckpt, **fit_kwargs)
    chain.end(int(trainer.global_step), cb.stopped)
