"""A Hugging Face `Trainer` (and TRL's trainers built on it) on the whole chain (in-job).

    import dslurm.integrations.hf as dh
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    dh.run(trainer)                 # in place of trainer.train()

`run` adds one `TrainerCallback` and routes the Trainer's `checkpoint-N` folders:
- HF writes `checkpoint-N` (weights, optimizer, scheduler, `trainer_state.json`, every rank's
  `rng_state_<rank>.pth`) under the run's `generations/.incoming`, and the callback's `on_save`
  commits it inside a dslurm generation (dslurm.integrations.chain). Retention is the job's
  `checkpoint.keep`; `save_total_limit` and `output_dir` no longer place checkpoints.
- A start resumes from the verified pointer: `train(resume_from_checkpoint=<the generation's
  checkpoint-N>)`, so HF restores weights, optimizer, scheduler, RNG and skips the batches done.
- `on_step_end` asks the runtime whether a stop is agreed (USR2/TERM/`dslurm ctl stop`, all
  ranks at the same step), then saves and stops training; `run` exits 75 (requeue) or 143.
  `dslurm ctl save` saves at the next step. Periodic saves: the script's `save_strategy` when it
  saves within the run, else (`"no"`, or `save_steps` past `max_steps`) the job's
  `checkpoint.interval`. The last step saves.
- `on_log` writes the ledger's `steps` events (loss, lr, grad_norm, tokens/s).
Settings HF cannot resume exactly from, or that never save, are exit-2 errors (dslurm/integrations/rules.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import TrainerCallback

import dslurm.runtime as dr
from dslurm.errors import UserError
from dslurm.integrations.chain import Chain
from dslurm.integrations.rules import hf_problems, hf_saves_itself

log = logging.getLogger(__name__)
dr.catch_stops()  # on import: a USR2 that comes while the script builds its model is kept, not fatal

WORLD_WHY = ("its data position is counted in batches of the old world size and each rank's RNG file "
             "is its own")


class ChainCallback(TrainerCallback):
    """The Trainer's hooks into the chain: stops, periodic and `ctl` saves, commits, the ledger."""

    def __init__(self, chain: Chain, own_saves: bool) -> None:
        self.chain, self.own_saves = chain, own_saves
        self.stopped = False
        self._final = False
        self._tokens: tuple[float, float] | None = None  # (tokens seen, time) at the last log

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        step = int(state.global_step)
        if self.chain.stop_requested(step):  # collective: every rank, every optimizer step
            self.stopped = True
            control.should_training_stop = True
        last = state.max_steps > 0 and step >= state.max_steps
        periodic = not self.own_saves and step % self.chain.interval == 0
        if self.stopped or last or periodic or self.chain.save_asked(step):
            control.should_save = True
        self._final = self.stopped or last
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        step = int(state.global_step)
        self.chain.commit(step, f"checkpoint-{step}", final=self._final)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kw: Any) -> Any:
        logs = logs or {}
        if "loss" not in logs:  # an eval or the end-of-training summary: not a window of steps
            return control
        values = {"loss": float(logs["loss"])}
        if logs.get("learning_rate") is not None:
            values["lr"] = float(logs["learning_rate"])
        if logs.get("grad_norm") is not None:
            values["grad_norm"] = float(logs["grad_norm"])
        seen, now = float(getattr(state, "num_input_tokens_seen", 0) or 0), time.time()
        if seen and self._tokens is not None and now > self._tokens[1]:
            values["tokens_per_s"] = (seen - self._tokens[0]) / (now - self._tokens[1])
        self._tokens = (seen, now)
        self.chain.log(int(state.global_step), values)
        return control


def run(trainer: Any, **train_kwargs: Any) -> Any:
    """`trainer.train(**train_kwargs)` on the chain: resumed from the run's pointer, stopped and
    saved when all ranks agree, its checkpoints committed as generations. Returns what `train`
    returns when training completed; after a stop it exits 75 or 143 (does not return)."""
    problems = hf_problems(trainer.args, train_kwargs)
    if problems:
        raise UserError("dslurm.integrations.hf: " + "; ".join(problems))
    chain = Chain("transformers")
    if trainer.args.ddp_find_unused_parameters is False and chain.rt.world_size >= 3:
        log.warning("ddp_find_unused_parameters=False: DDP rebuilds its gradient buckets after each process's "
                    "first step, so a resumed run's first step rounds differently in the last bit (%d ranks); "
                    "leave it unset (HF then keeps the first layout) for bit-identical resumes", chain.rt.world_size)
    cb = ChainCallback(chain, own_saves=hf_saves_itself(trainer.args))
    trainer.add_callback(cb)
    if not cb.own_saves and chain.rank == 0:  # HF's _save_checkpoint runs when the callback asks
        log.warning("save_strategy=%r, save_steps=%s, max_steps=%s: HF saves nothing in this run, so dslurm saves "
                    "every %d steps (the job's checkpoint.interval)", str(trainer.args.save_strategy),
                    trainer.args.save_steps, trainer.args.max_steps, chain.interval)
    # Route checkpoint-N (and only it: save_model() and logs keep output_dir) into .incoming.
    trainer._get_output_dir = lambda trial=None: str(chain.incoming)
    resume = chain.restore(WORLD_WHY)
    out = trainer.train(resume_from_checkpoint=str(resume.folder) if resume.folder else None, **train_kwargs)
    chain.end(int(trainer.state.global_step), cb.stopped)
    return out
