"""Silent data corruption across HSDP replicas, and the periodic NVML poll (the rules: dslurm/health/__init__.py).

Fingerprint. Per parameter, the integer sum of the words of this rank's local shard (int32 words
for fp32, int16 for bf16), summed as int64 on the device. Integer addition is exact and
associative, so replicas holding the same bits get the same number whatever the reduction order
or thread count (a float sum would not); one flipped bit b changes the sum by +-2^b, never 0
mod 2^64, so a single bit flip is always seen. Only the fingerprint vector (8 bytes a parameter)
moves: one all-gather over the mesh's dp_replicate dim, then one 1-element all-reduce over the
world so every rank (every shard group) acts together. Names and hosts are gathered only on a
mismatch.

Not covered: what is not replicated (dp_replicate = 1: FSDP shards, TP/PP slices each live on one
rank) and the optimizer state (it shows up in the parameters at a later check).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dslurm import health

if TYPE_CHECKING:
    from dslurm.config.resolve import Resolved
    from dslurm.preflight.thresholds import Thresholds
    from dslurm.run import RunDir
    from train.parallel.dims import ParallelDims

log = logging.getLogger(__name__)
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def fingerprint(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per parameter: the exact sum of its local shard's words (module doc)."""
    with torch.no_grad():
        sums = [_local(p).detach().view(_WORDS[p.element_size()]).sum(dtype=torch.int64) for p in params]
        return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def flip_bit(params: Sequence[torch.Tensor], bit: int = 16) -> str:
    """DSLURM_FAULT_BITFLIP: flip one mantissa bit of the first element of the first non-empty local
    shard (a relative change of ~2^-7 for fp32: no NaN, the loss barely moves). Returns its name."""
    with torch.no_grad():
        for i, p in enumerate(params):
            local = _local(p)
            if local.numel():
                words = local.view(_WORDS[p.element_size()]).reshape(-1)
                words[0:1].bitwise_xor_(1 << min(bit, 8 * p.element_size() - 2))
                return f"param #{i}"
    return "nothing (no local shard)"


class ReplicaCheck:
    """The fingerprint comparison of one rank (collective: every rank calls `check` together)."""

    def __init__(self, params: Sequence[torch.Tensor], names: list[str], group: dist.ProcessGroup, device: torch.device,
                 host: str, rank: int) -> None:
        self.params, self.names, self.group, self.device = params, names, group, device
        self.host, self.rank = host, rank
        self.replicas = dist.get_world_size(group)

    def compare(self) -> tuple[health.SdcVerdict, list[str], int]:
        """My shard group's verdict, the differing parameter names, my replica index."""
        mine = fingerprint(self.params).to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.replicas)]
        dist.all_gather(out, mine, group=self.group)
        table = [tuple(int(x) for x in t.tolist()) for t in out]  # one device->host copy per replica
        verdict = health.sdc_verdict(table)
        me = dist.get_rank(self.group)
        params: list[str] = []
        if not verdict.ok:
            ref = next((i for i in range(self.replicas) if i not in verdict.odd), 0 if me else 1)
            params = health.mismatched_params(table[me], table[ref], self.names)
        return verdict, params, me

    def check(self) -> health.SdcSummary | None:
        """None when every shard group's replicas agree, else the run's verdict (on every rank)."""
        verdict, params, me = self.compare()
        flag = torch.tensor([0.0 if verdict.ok else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every shard group acts together
        if not flag.item():
            return None
        mine = {"rank": self.rank, "host": self.host, "suspect": me in verdict.odd, "named": verdict.named,
                "why": "" if verdict.ok else verdict.why, "params": params}
        reports: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
        return health.sdc_summary(cast(list[dict[str, Any]], reports))  # each filled with a rank's `mine`


# ------------------------------------------------------------------ the NVML poll

class DevicePoll:
    """Temperature, hardware throttling, new uncorrected ECC and Xid events of this node's GPUs,
    polled by local rank 0. Without NVML (CPU nodes) it says so once and does nothing."""

    def __init__(self, thresholds: Thresholds) -> None:
        from dslurm.preflight.nvml import _load_nvml

        self.th = thresholds
        self.nv: Any = _load_nvml()  # the pynvml module (untyped), None without NVML
        self.handles: list[Any] = []
        self.events: Any = None
        self.baseline: dict[int, int | None] = {}
        self._last: set[str] = set()
        if self.nv is None:
            log.info("device health poll off: no NVML on this node (CPU run or no driver)")
            return
        nv = self.nv
        try:
            self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            self.baseline = {i: self._ecc(h) for i, h in enumerate(self.handles)}
            self.events = nv.nvmlEventSetCreate()
            for h in self.handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self.events)
        except nv.NVMLError as exc:  # NotSupported in some containers: Xids not watched
            log.info("device health poll: Xid events not available: %s", exc)
            self.events = None

    @property
    def on(self) -> bool:
        return self.nv is not None and bool(self.handles)

    def _q(self, fn: Any, *args: Any) -> Any:
        """Any NVML error is 'not read' here (unlike the burn-in's `_query`): a poll must never
        end the training it watches; a GPU that stops answering shows up as a hang or a crash."""
        try:
            return fn(*args)
        except self.nv.NVMLError:  # not supported, no permission: not checked
            return None

    def _ecc(self, h: Any) -> int | None:
        nv = self.nv
        v = self._q(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        return None if v is None else int(v)

    def _xids(self) -> dict[int, list[int]]:
        seen: dict[int, list[int]] = {}
        if self.events is None:
            return seen
        nv = self.nv
        try:
            while True:
                data = nv.nvmlEventSetWait_v2(self.events, 0)
                seen.setdefault(int(nv.nvmlDeviceGetIndex(data.device)), []).append(int(data.eventData))
        except nv.NVMLError:  # Timeout: nothing more queued
            return seen

    def readings(self) -> list[health.GpuReading]:
        from dslurm.preflight.nvml import hard_throttle, throttle_reasons_fn

        nv = self.nv
        fn = throttle_reasons_fn(nv)
        xids = self._xids()
        out = []
        for i, h in enumerate(self.handles):
            reasons = self._q(fn, h) or 0
            out.append(health.GpuReading(i, temp_c=self._q(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                                         throttle=hard_throttle(nv, reasons),
                                         ecc_uncorrected=self._ecc(h), xids=xids.get(i, [])))
        return out

    def poll(self) -> list[str]:
        """The findings of this poll ([] when healthy or off)."""
        if not self.on:
            return []
        from dslurm.preflight.nvml import HARDWARE_XIDS

        now = self.readings()
        found = health.device_findings(now, self.baseline, max_temp_c=self.th.max_temp_c,
                                       hardware_xids=HARDWARE_XIDS)
        self.baseline.update({g.index: g.ecc_uncorrected for g in now if g.ecc_uncorrected is not None})
        new = [f for f in found if f not in self._last]  # a hot GPU is reported once, not every poll
        self._last = set(found)
        return new

    def close(self) -> None:
        if self.nv is not None:
            try:
                if self.events is not None:
                    self.nv.nvmlEventSetFree(self.events)
                self.nv.nvmlShutdown()
            except self.nv.NVMLError:
                pass
            self.nv = None


# ------------------------------------------------------------------ what the loop holds

class RunChecks:
    """The health checks of one rank: the replica check (None where nothing is replicated or
    health.sdc_every is 0) and the device poll (None unless local rank 0 and polling is on)."""

    def __init__(self, resolved: Resolved, dims: ParallelDims, parts: list[torch.nn.Module], device: torch.device,
                 rank: int) -> None:
        from dslurm import faults
        from dslurm.checkpoint.tiers import node_name

        spec, lay = resolved.job.health, dims.layout
        self.spec, self.host, self.rank = spec, node_name(), rank
        self._flip_at = faults.step_fault("DSLURM_FAULT_BITFLIP")
        self.replicas: ReplicaCheck | None = None
        if spec.sdc_every and lay.dp_replicate_enabled:
            named = [(n, p) for part in parts for n, p in part.named_parameters()]
            self.replicas = ReplicaCheck([p for _, p in named], [n for n, _ in named],
                                         dims.get_mesh("dp_replicate").get_group(), device, self.host, rank)
        elif spec.sdc_every and rank == 0:
            log.info("silent data corruption not checked: nothing is replicated (parallel.dp_replicate = 1); "
                     "see docs/health.md")
        self.poll: DevicePoll | None = None
        if spec.device_poll_every and rank % resolved.procs_per_node == 0:
            from dslurm.preflight.thresholds import Thresholds

            self.poll = DevicePoll(Thresholds.from_site(resolved.site))

    def replicas_due(self, step: int, saving: bool) -> bool:
        """Before every save (no unchecked generation is ever committed) and every sdc_every steps."""
        return self.replicas is not None and (saving or health.due(step, self.spec.sdc_every))

    def poll_devices(self, step: int, run: RunDir) -> None:
        """The NVML poll when due; what is new goes to the log and the ledger (`device_health`)."""
        if self.poll is None or not self.poll.on or not health.due(step, self.spec.device_poll_every):
            return
        found = self.poll.poll()
        if found:
            from dslurm.observe import events
            from dslurm.observe.ledger import Ledger

            log.warning("[rank %d] device health after step %d: %s", self.rank, step, "; ".join(found))
            Ledger(run.path).append(events.DeviceHealth(step=step, findings=found))

    def maybe_flip(self, step: int, params: Sequence[torch.Tensor]) -> None:
        """DSLURM_FAULT_BITFLIP (dslurm/faults.py): once per process, after optimizer step STEP."""
        if self._flip_at == step:
            self._flip_at = None  # a replay after the rollback must not flip again
            log.warning("[rank %d] DSLURM_FAULT_BITFLIP: flipped a bit of %s after step %d", self.rank,
                        flip_bit(params), step)

    def close(self) -> None:
        if self.poll is not None:
            self.poll.close()
