"""Replica groups in the trainer (`recovery.replicas`, docs/recovery.md): torchft's Manager
around the gradient average across groups.

Each `parallel.dp_replicate` group is its own torchrun world (FSDP/TP/PP inside it as always);
`dslurm supervise` (dslurm/recover/replicas.py) starts one job step per group and tells each
its group (`GROUP_ENV`). Across groups, torchft does what a quorum needs, not us:

- every step begins with `Manager.start_quorum` (synchronous): the Lighthouse answers with the
  groups alive now, the cross-group gloo group is rebuilt when that set changed, and a group
  behind the others (restarted, or fresh) takes the state of a live peer through torchft's HTTP
  transport before the step (`_state` / `_load`: the local shards of the parameters and the
  optimizer, the schedulers, the step, the data position);
- the gradients are averaged over the groups of the quorum (`Manager.allreduce`, one flat
  buffer per step: the loss is the live groups' mean);
- `Manager.should_commit` before the optimizer: a step a peer failed inside is discarded by
  every group (no optimizer or scheduler step, the data position back), and trained again.

Pure parts first (`Context`, `data_slot`, `group_overrides`); the Manager lives in `Replicas`.
The names this shares with the supervisor: the group's variables (dslurm/launch/slurm_env.py), the
progress file (dslurm/recover/replicas.py).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dslurm.launch.slurm_env import GROUP_ENV, LOST_STEP_ENV
from dslurm.recover.replicas import PROGRESS

if TYPE_CHECKING:
    import torch

    from dslurm.config import JobSpec
    from dslurm.observe.ledger import Ledger
    from train.step import Step

log = logging.getLogger(__name__)

QUORUM_TIMEOUT = timedelta(seconds=120)
"""how long a step waits for a quorum (fewer than replicas_min groups alive: none forms)"""
GATHER_S = 60.0
"""At the final step, how long the groups wait for a missing group to come back and heal (`gather`)"""
OP_TIMEOUT = timedelta(seconds=60)
"""the Manager's bound on a commit vote (inside the group) and a heal's transfer; the cross-group
all-reduce has the job's recovery.replica_timeout_s (`Context.timeout_s`)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """Which group this process trains in. Pure."""

    group: int
    groups: int
    replicas_min: int
    timeout_s: float = 2.0
    """recovery.replica_timeout_s: the bound of every wait in the cross-group all-reduce"""
    lost_step: int | None = None

    @classmethod
    def from_env(cls, job: JobSpec, env: Mapping[str, str]) -> Context | None:
        if not job.recovery.replicas:
            return None
        group = int(env.get(GROUP_ENV) or 0)
        lost = env.get(LOST_STEP_ENV)
        return cls(group=group, groups=job.parallel.dp_replicate, replicas_min=job.recovery.replicas_min,
                   timeout_s=job.recovery.replica_timeout_s, lost_step=int(lost) if lost else None)

    @property
    def replica_id(self) -> str:
        """torchft's replica id: sorted by group (the quorum's replica ranks follow it), ending in
        the group's number (torchft reads the trailing digits as the group's index)."""
        return f"dslurm_g{self.group:04d}"

    def job_rank(self, rank: int, world: int) -> int:
        """This process's rank in the whole job (the fault knobs' RANKS): group g's rank r is g*world + r."""
        return self.group * world + rank

    def data_slot(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """The group's data-parallel rank within the whole job's: group g's ranks take the slots
        g*dp..(g+1)*dp-1 of the job's G*dp, so a sample's owner depends only on (step, group,
        rank) and a group that rejoins at step s reads step s's samples."""
        return self.group * dp_size + dp_rank, self.groups * dp_size


def group_overrides(job: JobSpec) -> list[str]:
    """The `--set`s that turn the job into one group's: its own dp_replicate 1 and its share of
    the global batch (the job's layout rule already made the batch divide by dp_replicate). Pure."""
    groups = job.parallel.dp_replicate
    return ["parallel.dp_replicate=1", f"train.global_batch={job.train.global_batch // groups}",
            "recovery.replicas=false", "recovery.replicas_min=1"]


def agreed_flags(mine: Sequence[float], averaged: Sequence[float], n: int, *, failed: bool) -> list[float]:
    """The step's requests as every group takes them: the groups' sum (the all-reduce averaged them
    over its `n` groups), never below this rank's own; a failed all-reduce agrees nothing (the
    step is discarded; this rank's own go again with the next). Pure."""
    if failed:
        return [float(v) for v in mine]
    return [max(float(m), float(round(v * n))) for m, v in zip(mine, averaged, strict=True)]


def params_crc(params: list[torch.nn.Parameter]) -> str:
    """A digest of this rank's parameter shards (the groups' must match)."""
    from torch.distributed.tensor import DTensor

    crc = 0
    for p in params:
        t = p.detach()
        t = t.to_local() if isinstance(t, DTensor) else t
        crc = zlib.crc32(t.float().cpu().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


class Replicas:
    """torchft's Manager for one rank of one group, and the records of the group's steps."""

    def __init__(self, ctx: Context, trainer: Step, *, rank: int, world: int, ledger: Ledger | None,
                 facts_dir: str | None) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.ctx, self.t, self.rank = ctx, trainer, rank
        self.ledger, self.facts_dir = ledger, facts_dir
        self.transport = _transport()
        # The cross-group gloo group's timeout bounds each wait inside the gradient all-reduce: a
        # SIGSTOPped group keeps its sockets open (no reset, unlike a kill), so without it the
        # survivors would wait the whole OP_TIMEOUT; torchft then discards the step everywhere and the
        # Lighthouse (same timeout on heartbeats) has left the silent group out of the next quorum.
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=ctx.timeout_s)), load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ctx.replicas_min, use_async_quorum=False, timeout=OP_TIMEOUT,
            quorum_timeout=QUORUM_TIMEOUT, rank=rank, world_size=world, replica_id=ctx.replica_id,
            checkpoint_transport=self.transport)
        self.first = 0  # the first step of the window not yet written
        # A group other than 0 restores nothing (group 0 owns the checkpoints): until a quorum has
        # healed it to at least the pointer's step, it commits nothing. Without this floor, groups
        # that started before group 0 on a resumed run would train from step 0 among themselves.
        self.floor = 0 if ctx.group == 0 else _pointer_step(trainer.run_dir.path)
        self.participants: list[int] = []
        self.discarded = 0
        self.gathered = False  # a quorum barrier passed at the final step (`barrier`)

    def resume(self, step: int) -> None:
        """After the restore: the Manager counts from the trainer's step (the quorum heals the
        groups behind the one furthest on)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.first = step + 1

    def quorum(self) -> None:
        """The step's quorum; a group behind is healed here (before its batch is read)."""
        t0 = time.monotonic()
        before = self.t.step
        self.transport.received = None
        self.manager.start_quorum()
        got = self.transport.received
        if got is not None:
            self._healed(before, time.monotonic() - t0, got)
        if self.facts_dir is not None and self.rank == 0:
            # The supervisor's replica_lost reads it: whole or not at all (a kill -9 between a truncate and
            # its write left an empty file, read as no step), hence dslurm.durable's write.
            from dslurm.durable import atomic_write_text

            try:
                # (healed to the end, a group begins no step past the last: never "ahead" of the peers
                # waiting in `gather`, which the supervisor would take for stalled behind it)
                atomic_write_text(os.path.join(self.facts_dir, PROGRESS),
                                  f"{min(self.t.step + 1, self.t.train.steps)}\n")
            except OSError:
                pass

    def barrier(self) -> None:
        """One all-reduce of the quorum's groups: past it, every heal of this quorum is complete
        (a healing group joins it only after its transfer), so a peer may close its server."""
        import torch

        self.manager.allreduce(torch.zeros(1)).wait()
        self.gathered = True

    def gather(self, wait_s: float = GATHER_S) -> None:
        """At the final step: quorums without training, until every group is in one (a group started
        again heals there to the final step) or `wait_s` passed, so all groups end at the final step
        with the same parameters. A group that ended by such a heal has gathered already."""
        if self.gathered:
            return
        deadline = time.monotonic() + wait_s
        while True:
            self.manager.start_quorum()
            n = self.manager.num_participants()
            self.barrier()
            if n >= self.ctx.groups or time.monotonic() > deadline:
                if n < self.ctx.groups:
                    log.warning("replica group %d ends with %d of %d groups in the last quorum", self.ctx.group, n,
                                self.ctx.groups)
                return
            time.sleep(1.0)

    def average(self, params: list[torch.nn.Parameter], flags: Sequence[float] = ()) -> list[float]:
        """The gradients averaged over the quorum's groups: one flat buffer of this rank's shards
        (the same shards in every group: the same layout). `flags` ride at its end (the step's stop,
        TERM, save and profile requests): what any group's rank saw, every group acts on in the
        same step (a `dslurm ctl` request is group 0's to take). Returns them agreed: summed over
        the groups, never below this rank's own (a failed all-reduce agrees nothing: the step is
        discarded and this rank's flags go again with the next one)."""
        import torch
        from torch.distributed.tensor import DTensor

        grads = []
        for p in params:
            g = p.grad
            if g is None:
                g = p.grad = torch.zeros_like(p)
            grads.append(g.to_local() if isinstance(g, DTensor) else g)
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), torch.tensor(list(flags), dtype=torch.float32)])
        n = self.manager.num_participants()  # the AVG's divisor, undone for the flags
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            k = g.numel()
            g.copy_(flat[offset:offset + k].view_as(g))
            offset += k
        return agreed_flags(flags, flat[offset:].tolist(), n, failed=self.manager.errored() is not None)

    def commit(self) -> bool:
        """torchft's vote: every rank of the group applies the step, or none does (a step a peer
        failed inside errors every group's all-reduce: all discard it)."""
        behind = self.t.step < self.floor
        if behind:  # not yet healed to the pointer's step: this group's vote is no
            self.manager.report_error(RuntimeError(f"group {self.ctx.group} at step {self.t.step} is behind "
                                                   f"the checkpoint pointer's step {self.floor}: waiting to heal"))
        few = self.manager.num_participants() < self.ctx.replicas_min  # torchft's Manager votes no then
        ok = bool(self.manager.should_commit())
        if behind or few:
            # the peers it waits for are starting, or the supervisor's stop is on its way (below
            # replicas_min, dslurm/recover/replicas.py): no busy loop of discarded steps
            time.sleep(0.5)
        if ok:
            self.participants.append(self.manager.num_participants())
        else:
            self.discarded += 1
        return ok

    def flush(self, force: bool = False) -> None:
        """The window's participants per step to the ledger (every log_every steps, and at the end)."""
        from dslurm.observe import events

        if self.ledger is not None and (self.participants or self.discarded) \
                and (force or len(self.participants) >= self.t.train.log_every):
            self.ledger.append(events.ReplicaSteps(group=self.ctx.group, first=self.first,
                                                   participants=list(self.participants), discarded=self.discarded))
        if force or len(self.participants) >= self.t.train.log_every:
            self.first += len(self.participants)
            self.participants.clear()
            self.discarded = 0

    def end(self, code: int) -> None:
        from dslurm.observe import events

        self.flush(force=True)
        crc = params_crc(self.t.params)
        if self.ledger is not None:
            self.ledger.append(events.ReplicaEnd(group=self.ctx.group, step=self.t.step, params_crc=crc, code=code))

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _healed(self, before: int, seconds: float, got: dict[str, Any]) -> None:
        from dslurm.observe import events

        step = self.t.step
        lost = self.ctx.lost_step if self.ctx.lost_step is not None else before
        missed = max(0, step - lost)
        group_batch = self.t.train.global_batch  # the group's share (group_overrides)
        log.warning("replica group %d healed at step %d from %s in %.2f s (%d bytes)", self.ctx.group, step,
                    got["peer"], seconds, got["bytes"])
        if self.ledger is not None:
            self.ledger.append(events.ReplicaHealed(
                group=self.ctx.group, step=step, heal_s=round(seconds, 3), bytes=int(got["bytes"]),
                peer=str(got["peer"]), peer_replica_rank=got["src"], missed_steps=missed,
                missed_samples=missed * group_batch))
        self.first = step + 1
        self.participants.clear()

    # ------------------------------------------------------------------ the state a heal copies

    def _state(self) -> dict[str, Any]:
        """This rank's state as a peer takes it: its own shards (every group has the same layout),
        the schedulers, the step and the data position (global: the same in every group)."""
        from torch.distributed.tensor import DTensor

        def local(v: Any) -> Any:
            return v.to_local().detach() if isinstance(v, DTensor) else v

        t = self.t
        return {
            "params": [local(p) for p in t.params],
            "optim": [[{k: local(v) for k, v in opt.state.get(p, {}).items()} for g in opt.param_groups
                       for p in g["params"]] for opt in t.optimizers],
            # the groups' hyperparameters as the schedulers last set them (LambdaLR's load sets no lr)
            "groups": [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                       for opt in t.optimizers],
            "sched": [s.state_dict() for s in t.schedulers],
            "step": t.step,
            "data": t.loader.state_dict(),
        }

    def _load(self, sd: dict[str, Any]) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        t = self.t
        with torch.no_grad():
            for p, v in zip(t.params, sd["params"], strict=True):
                (p.to_local() if isinstance(p, DTensor) else p).copy_(v)
            for opt, states in zip(t.optimizers, sd["optim"], strict=True):
                ps = [p for g in opt.param_groups for p in g["params"]]
                for p, st in zip(ps, states, strict=True):
                    opt.state[p] = {k: _like(p, v) for k, v in st.items()}
        for opt, groups in zip(t.optimizers, sd["groups"], strict=True):
            for g, hyper in zip(opt.param_groups, groups, strict=True):
                g.update(hyper)
        for s, st in zip(t.schedulers, sd["sched"], strict=True):
            s.load_state_dict(st)
        t.step = int(sd["step"])
        t.loader.load_state_dict(sd["data"])


def _pointer_step(run_dir: Any) -> int:
    """The durable pointer's step (0: none, or unreadable: then group 0's restore decides alone)."""
    from dslurm.checkpoint import CheckpointError, read_pointer

    try:
        ptr = read_pointer(run_dir)
    except CheckpointError:
        return 0
    return ptr.step if ptr is not None else 0


def _like(p: torch.nn.Parameter, v: Any) -> Any:
    """An optimizer state value for `p` from a peer's local one: a shard of p's shape becomes a
    DTensor placed as p is; a scalar (AdamW's step) stays a plain tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() > 0:
        return DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
    return v.to(p.device) if isinstance(v, torch.Tensor) else v


def _transport() -> Any:
    """torchft's HTTP transport, recording what a heal received (seconds, bytes, the peer)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Recording(HTTPTransport[dict[str, Any]]):  # type: ignore[misc]  # torchft ships no py.typed
        received: dict[str, Any] | None = None

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            sd = super().recv_checkpoint(src_rank=src_rank, metadata=metadata, step=step, timeout=timeout)
            self.received = {"bytes": _nbytes(sd), "peer": metadata, "src": src_rank}
            return sd

    return Recording(timeout=OP_TIMEOUT, num_chunks=0)


def _nbytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0
