"""Checkpoints for any training script, under the run's checkpoint settings.

`manager_for` builds the one `CheckpointManager` (dslurm/checkpoint/dcp.py: generations,
manifest, verification, pointer, retention; sync, async or two tiers) from the job's
`checkpoint` section; the built-in trainer and `Checkpoint` both use it. `final_failure` is
the rule both apply to a save the run's ending depends on: it must commit, whatever `on_error`
says for periodic saves. Torch is imported only when a checkpoint is built (in-job).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from dslurm.errors import UserError

log = logging.getLogger(__name__)


def manager_for(spec: Any, run_dir: str | Path, *, scratch: str | None, ledger: Any,
                config_hash: str | None = None, model_shape: dict[str, Any] | None = None,
                layout: dict[str, Any] | None = None) -> Any:
    """The CheckpointManager of a run: `spec` is the job's `checkpoint` section
    (dslurm.config.CheckpointSpec); `scratch` the site's node-local storage (used with
    tiers: two_tier). Collective: call on every rank."""
    from dslurm.checkpoint.dcp import CheckpointManager

    return CheckpointManager(
        run_dir, keep=spec.keep, keep_every=spec.keep_every, async_mode=spec.async_save,
        on_inflight=spec.on_inflight, on_error=spec.on_error, config_hash=config_hash,
        model_shape=model_shape, layout=layout, ledger=ledger,
        scratch=scratch if spec.tiers == "two_tier" else None, keep_local=spec.keep_local, on_lag=spec.on_lag)


def final_failure(mgr: Any, step: int) -> Exception | None:
    """The error to raise when the blocking save at `step` that an ending needs did not commit
    (the run then ends as a save failure, exit 74, never as a success); None when it did."""
    out = mgr.last_outcome
    if out is not None and out.step == step and not out.ok:
        return mgr.failure(out)  # type: ignore[no-any-return]
    return None


class Checkpoint:
    """Save and restore any named state of a script: `Checkpoint(rt, model=m, optim=o, sched=s,
    data={"epoch": 0, "batch": 0})`. RNG streams (Python, numpy, torch, CUDA) of every rank are
    saved with each generation and restored when the world size is unchanged. A plain dict must
    hold JSON values, the same on every rank (rank 0 writes it), and is restored in place.
    Every method is collective: call it on every rank at the same step."""

    def __init__(self, rt: Any, **state: Any) -> None:
        from dslurm.config import CheckpointSpec
        from dslurm.runtime.state import split_state

        if rt.run_dir is None:
            raise UserError("dslurm.runtime.Checkpoint needs a run directory: run the script under dslurm "
                            "(it sets DSLURM_RUN_DIR) or pass init(run_dir=...)")
        try:
            self._tensors, self._dicts = split_state(state)
        except ValueError as exc:
            raise UserError(f"dslurm.runtime.Checkpoint: {exc}") from None
        self.rt = rt
        self.spec = rt.job.checkpoint if rt.job is not None else CheckpointSpec()
        scratch = rt.site.storage.scratch if rt.site is not None else None
        self.manager = manager_for(self.spec, rt.run_dir, scratch=scratch, ledger=rt.ledger,
                                   layout={"world_size": rt.world_size})

    @property
    def interval(self) -> int:
        """The job's `checkpoint.interval` (steps between periodic saves)."""
        return int(self.spec.interval)

    def due(self, step: int) -> bool:
        """Is a periodic save due after `step` completed steps?"""
        return step > 0 and step % self.interval == 0

    def restore(self) -> int:
        """Load the pointer's generation (or a verified fallback) into the state; returns the
        number of completed steps to resume after (0: nothing saved yet). Writes the start's
        `train_start` event, from which `dslurm report` counts this start."""
        from dslurm.observe import events

        extra: dict[str, Any] = {}
        res = self.manager.restore(self._tensors, extra)
        for name, d in self._dicts.items():
            if name in extra:
                d.clear()
                d.update(extra[name])
        step = res.step if res is not None else 0
        self.rt.event(events.TrainStart(step=step, generation=res.generation if res else None,
                                        fell_back=bool(res and res.fell_back),
                                        startup_s=round(time.time() - self.rt.t_start, 3),
                                        layout={"world_size": self.rt.world_size}))
        self.rt.started(step)
        return step

    def save(self, step: int, *, final: bool = False) -> bool:
        """Save the state as of `step` completed steps: in the background when the job's
        checkpoint.async_save says so, unless `final` (before an exit: blocking, and it must
        commit, or this raises and the script exits 74 through `dslurm.runtime`)."""
        ok = self.manager.save(step, self._tensors, {k: dict(v) for k, v in self._dicts.items()}, blocking=final)
        if final and (err := final_failure(self.manager, step)) is not None:
            from dslurm import exitcodes
            from dslurm.observe import events

            self.rt.event(events.Exit(reason="save_failed", step=step, code=exitcodes.SAVE_FAILED))
            raise err
        return bool(ok)

    def close(self) -> None:
        """Wait for an in-flight save and release the run directory's lock."""
        self.manager.close()
