"""Checkpoints for any training script, under the run's checkpoint settings.

`manager_for` builds the one `CheckpointManager` (dslurm/checkpoint/dcp.py: generations,
manifest, verification, pointer, retention; sync, async or two tiers) from the job's
`checkpoint` section; the built-in trainer and `Checkpoint` both use it. `final_failure` is
the rule both apply to a save the run's ending depends on: it must commit, whatever `on_error`
says for periodic saves, and `save_final` waits out a disk full for seconds before it gives up.
Torch is imported only when a checkpoint is built (in-job).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dslurm.errors import UserError

if TYPE_CHECKING:
    from dslurm.config import CheckpointSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerRank:
    """`per_rank(obj, reshard=fn)`: see `per_rank`."""

    obj: Any
    reshard: Callable[[Any, list[Any], int, int], Any] | None = None


@dataclass(frozen=True)
class Shared:
    """`shared(obj)`: see `shared`."""

    obj: Any


def per_rank(obj: Any, reshard: Callable[[Any, list[Any], int, int], Any] | None = None) -> PerRank:
    """Mark a Checkpoint entry as per-rank state (the default for everything but models,
    optimizers and `shared` entries) and give it a resharder for resumes with another world
    size: `reshard(obj, old_states, new_rank, new_world) -> this rank's state` (raise
    ValueError to refuse). Without one, states that differ between the saved ranks are
    refused on a world-size change, naming the entry."""
    return PerRank(obj, reshard)


def shared(obj: Any) -> Shared:
    """Mark a Checkpoint entry (an object with state_dict/load_state_dict) as one state for the
    whole job, saved through DCP: replicated values (one copy is kept) or DTensor shards
    (resharded to the new layout). Use it for big replicated state (an EMA copy) or a sharded
    object of your own; never for anything that differs between ranks."""
    return Shared(obj)


def manager_for(spec: CheckpointSpec, run_dir: str | Path, *, scratch: str | None, ledger: Any,
                site_partner: bool = False,
                config_hash: str | None = None, model_shape: dict[str, Any] | None = None,
                layout: dict[str, Any] | None = None, per_rank_state: list[Any] | None = None) -> Any:
    """The CheckpointManager of a run: `spec` is the job's `checkpoint` section, handed over as
    it is (CheckpointManager.from_spec); `scratch` the site's node-local storage (used with
    tiers: two_tier), `site_partner` the site's default for partner copies. Collective: call on every rank."""
    from dslurm.checkpoint.dcp import CheckpointManager

    return CheckpointManager.from_spec(run_dir, spec, scratch=scratch, ledger=ledger, config_hash=config_hash,
                                       model_shape=model_shape, layout=layout, per_rank_state=per_rank_state,
                                       site_partner=site_partner)


FINAL_SAVE_TRIES = 6
"""A save an ending needs that failed on a full disk is tried this many times, a second apart
(about 10 s with the saves): a disk full for seconds (a neighbour's file, a copy; `dslurm
selftest chaos` seed 4343: a 3 s full disk during a time-limit stop ended the run as a save
failure, exit 74, never requeued) otherwise ends a run that loses nothing by waiting. Counted in
tries, not seconds: the outcome is agreed by every rank, so every rank tries again, or gives up,
together (a clock would differ by a rank's delay and leave one rank in a collective save alone)."""


def save_final(mgr: Any, save: Callable[[], Any], step: int) -> Exception | None:
    """Run `save` (a blocking save at `step` on every rank) until it commits; on a full disk up
    to FINAL_SAVE_TRIES times. -> `final_failure`'s error when it never committed, else None."""
    from dslurm.checkpoint import full_disk

    for attempt in range(1, FINAL_SAVE_TRIES + 1):
        save()
        err = final_failure(mgr, step)
        out = mgr.last_outcome
        if err is None or out is None or not full_disk(out.reason) or attempt == FINAL_SAVE_TRIES:
            return err
        log.warning("the save at step %d the run's ending needs met a full disk (try %d of %d); trying again "
                    "in 1 s", step, attempt, FINAL_SAVE_TRIES)
        time.sleep(1.0)
    return None


def final_failure(mgr: Any, step: int) -> Exception | None:
    """The error to raise when the blocking save at `step` that an ending needs did not commit
    (the run then ends as a save failure, exit 74, never as a success); None when it did."""
    out = mgr.last_outcome
    if out is not None and out.step == step and not out.ok:
        return mgr.failure(out)  # type: ignore[no-any-return]
    return None


class Checkpoint:
    """Save and restore any named state of a script: `Checkpoint(rt, model=m, optim=o, sched=s,
    data=loader, gen=torch_generator, pos={"epoch": 0})`.

    Which state is shared and which per rank (docs/checkpoint.md, "Per-rank state"):
    models, optimizers, LR schedulers and GradScalers (and entries marked `shared(obj)`) are
    one state for the job, saved through DCP and resharded to any layout; everything else --
    data loaders and samplers, generators, plain dicts, your own objects -- is per-rank: each
    rank saves its own and gets its own back. On a resume with another world size, a
    DataLoader over a DistributedSampler (torchdata's StatefulDataLoader) is resharded, an
    entry with `per_rank(obj, reshard=fn)` is resharded by `fn`, and any other per-rank entry
    is refused by name. RNG streams (Python, numpy, torch, CUDA) of every rank are saved too
    and restored when the world size is unchanged. Every method is collective: call it on
    every rank at the same step."""

    def __init__(self, rt: Any, **state: Any) -> None:
        from dslurm.config import CheckpointSpec
        from dslurm.runtime.state import inexact_resumes, split_state

        if rt.run_dir is None:
            raise UserError("dslurm.runtime.Checkpoint needs a run directory: run the script under dslurm "
                            "(it sets DSLURM_RUN_DIR) or pass init(run_dir=...)")
        try:
            self._shared, self._per_rank = split_state(state)
        except ValueError as exc:
            raise UserError(f"dslurm.runtime.Checkpoint: {exc}") from None
        if rt.rank == 0:
            for why in inexact_resumes(state, rt.world_size):
                log.warning("dslurm.runtime: resumes are not bit-identical: %s", why)
        self.rt = rt
        self.spec = rt.job.checkpoint if rt.job is not None else CheckpointSpec()
        scratch = rt.site.storage.scratch if rt.site is not None else None
        self.manager = manager_for(self.spec, rt.run_dir, scratch=scratch, ledger=rt.ledger,
                                   site_partner=rt.site is not None and rt.site.storage.partner,
                                   layout={"world_size": rt.world_size}, per_rank_state=self._per_rank)
        self._saved_step: int | None = None  # the step of the last save started or done
        self.restored: Any = None  # restore()'s RestoreResult (generation, path, saved world size); None: fresh

    @property
    def interval(self) -> int:
        """The job's `checkpoint.interval` (steps between periodic saves)."""
        return int(self.spec.interval)

    def due(self, step: int) -> bool:
        """Is a save due after `step` completed steps: a periodic one, or the `dslurm ctl save`
        that `stop_requested(step)` agreed on at this step boundary?"""
        return step > 0 and (step % self.interval == 0 or self.rt.save_asked == step)

    def restore(self) -> int:
        """Load the pointer's generation (or a verified fallback) into the state; returns the
        number of completed steps to resume after (0: nothing saved yet). Writes the start's
        `train_start` event, from which `dslurm report` counts this start."""
        from dslurm.observe import events

        res = self.restored = self.manager.restore(self._shared)
        step = res.step if res is not None else 0
        self._saved_step = step if res is not None else None
        self.rt.event(events.TrainStart(step=step, generation=res.generation if res else None,
                                        fell_back=bool(res and res.fell_back),
                                        startup_s=round(time.time() - self.rt.t_start, 3),
                                        layout={"world_size": self.rt.world_size}))
        self.rt.started(step)
        return step

    def save(self, step: int, *, final: bool = False, files: Path | None = None) -> bool:
        """Save the state as of `step` completed steps: in the background when the job's
        checkpoint.async_save says so, unless `final` (before an exit: blocking, and it must
        commit, or this raises and the script exits 74 through `dslurm.runtime`). A step already
        saved is not saved again (a loop whose last periodic save is its final step): a final
        save then waits for that one and checks it committed durably. `files`: a library's own
        finished checkpoint folder, committed inside the generation (CheckpointManager.save)."""
        if step == self._saved_step and files is None and self._already_saved(step, final):
            return True
        if not final:
            ok = self.manager.save(step, self._shared, blocking=False, files=files)
        elif (err := save_final(self.manager,
                                lambda: self.manager.save(step, self._shared, blocking=True, files=files),
                                step)) is None:
            ok = True
        else:
            from dslurm import exitcodes
            from dslurm.observe import events

            self.rt.event(events.Exit(reason="save_failed", step=step, code=exitcodes.SAVE_FAILED))
            raise err
        if ok:
            self._saved_step = step
        return bool(ok)

    def _already_saved(self, step: int, final: bool) -> bool:
        if not final:
            return True  # committed, or in flight: the state has not changed since
        self.manager.wait()
        out = self.manager.last_outcome
        if out is None:  # restored at this step and nothing trained since: the pointer holds it
            return True
        return bool(out.step == step and out.ok and out.durable)

    def close(self) -> None:
        """Wait for an in-flight save and release the run directory's lock."""
        self.manager.close()
