"""Collective traffic of one optimizer step, per parallel dimension, and its time at the site's
bus bandwidth.

What one GPU sends per step, collective by collective, for the schedule this trainer runs:

- **dp_shard (FSDP)**, over dp_shard x cp ranks (the cp ranks join the sharding): weights
  all-gathered in the compute dtype, once per forward/backward pass and, without a pipeline,
  again in backward for all but the last block (resharded after forward; train/parallel/fsdp.py
  keeps the last block's), and once per schedule step with a pipeline (train/parallel/fsdp.py keeps
  them unsharded after forward under PP, and torch's pipelining defers resharding to the last
  microbatch's backward); gradients reduce-scattered in FP32 (`REDUCE_BYTES`: the trainer's
  MixedPrecisionPolicy reduces in float32) once per pass.
- **dp_replicate (HSDP replicas, or DDP)**: an FP32 all-reduce of this GPU's gradient shard
  once per pass. train/loop.py synchronises at every gradient-accumulation pass (it does not
  defer the sync to the last one), so DP traffic scales with grad_accum.
- **tp (tensor + sequence parallel)**: per layer and microbatch, forward 2 all-gathers + 2
  reduce-scatters of the s x b x h activation (BF16), backward the same again (Korthikanti et
  al. 2022, sec. 4.2.2); recomputation re-runs the forward's two all-gathers and its first
  reduce-scatter (checkpoint's early stop skips the last). "selective" counts them too:
  train/parallel/ac.py saves matmul and attention outputs but not collective outputs, so
  rebuilding a matmul's input or a norm's input re-issues them (torchtitan keeps
  reduce_scatter_tensor in its save list for this reason). The embedding's output and the
  output projection's input add one of each per microbatch on their stages; the gradients of
  the norm weights (replicated over tp) are all-reduced, two per layer and the final norm's.
  These counts are what `dslurm plan check` measures (docs/plan.md).
- **cp (context parallel)**: per layer and microbatch, the keys and the values (two calls, each
  s x b x kv_dim/tp, BF16 gathered size) all-gathered in forward (and again when the layer is
  recomputed), their gradients reduce-scattered in backward (train/parallel/cp.py). The TP and PP
  activations above are those of the rank's s/cp tokens.
- **pp**: point-to-point sends of the stage-boundary tensor, sequence-sharded by tp (the blocks
  end in Shard(1)), one forward activation and one backward gradient per boundary and
  microbatch; the busiest rank sends 2v per microbatch (2v - 1 when p = 2).

Links (`group_link`): a group inside the NVLink domain runs at the site's intra-node
bandwidth; a group that crosses nodes shares the node's inter-node bandwidth with the node's
other GPUs (one NIC rail each, all groups of a dimension communicating at once), so a group
with k of its ranks on each node gets k/gpus_per_node of it. Times are bandwidth-bound lower
bounds per collective (no latency) and upper bounds per step (no overlap with compute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dslurm.config.layout import DIM_NAMES, Layout, stages_per_rank
from dslurm.config.models import ModelShape
from dslurm.plan.comms import bus_factor, collective_time_s
from dslurm.plan.layout import Cluster, Workload

REDUCE_BYTES = 4.0
"""Bytes per gradient value in the DP reduction: the trainer reduces in float32
(train/parallel/fsdp.py, `mp_policy`), whatever the compute dtype."""



@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One kind of collective on one parallel dimension, repeated `calls` times per step."""

    dim: str
    """mesh dimension: dp_shard (over dp_shard x cp ranks), dp_replicate, cp, tp or pp"""
    op: str
    """all_gather, reduce_scatter, all_reduce or send_recv (nccl-tests names)"""
    what: str
    """the tensor: weights (bf16), grads fp32, activations (bf16, the s x b x h block input/output),
    boundary / tp (bf16, the pipeline stage's output, sequence-sharded)"""
    ranks: int
    size_bytes: float
    """buffer size of one call, nccl-tests' S (the gathered / unreduced size)"""
    calls: int
    """calls per optimizer step"""
    link: str
    """where the group's ranks sit (`group_link`): "nvlink" (inside the NVLink domain), "node" (inside
    a node, beyond the domain), "net k/g" (across nodes, k of the node's g GPUs' share of its NICs)"""
    busbw: float
    """bus bandwidth of that link, GB/s; 0 = the site does not say"""

    @property
    def sent_bytes(self) -> float:
        """Bytes one GPU sends per step: calls x S x bus factor."""
        return self.calls * self.size_bytes * bus_factor(self.op, self.ranks)

    @property
    def time_s(self) -> float | None:
        """Seconds per step at `busbw` (None when the bandwidth is unknown)."""
        if self.busbw <= 0:
            return None
        return self.calls * collective_time_s(self.op, self.size_bytes, self.ranks, self.busbw)

    def as_dict(self) -> dict[str, object]:
        return {"dim": self.dim, "op": self.op, "what": self.what, "ranks": self.ranks,
                "size_bytes": self.size_bytes, "calls": self.calls, "link": self.link,
                "busbw_gbytes_per_s": self.busbw, "sent_bytes": self.sent_bytes, "time_s": self.time_s}


def dim_stride(layout: Layout, dim: str) -> int:
    """Rank distance between neighbours of a `dim` group: the product of the faster dims."""
    names = list(DIM_NAMES)
    return math.prod(getattr(layout, n) for n in names[names.index(dim) + 1:])


def group_link(cluster: Cluster, stride: int, ranks: int) -> tuple[str, float]:
    """(where a group of `ranks` ranks `stride` apart sits, its bus bandwidth in GB/s)."""
    gpn = cluster.gpus_per_node
    span = stride * ranks
    domain = cluster.nvlink_domain or gpn
    if span <= domain:
        return "nvlink", cluster.intra_gbytes_per_s
    if span <= gpn:
        return "node", cluster.intra_gbytes_per_s  # beyond the NVLink domain: PCIe may be slower
    per_node = min(ranks, max(1, gpn // stride))
    bw = cluster.inter_gbytes_per_s * per_node / gpn
    if cluster.intra_gbytes_per_s > 0:
        bw = min(bw, cluster.intra_gbytes_per_s)
    return f"net {per_node}/{gpn}", bw


def step_traffic(model: ModelShape, layout: Layout, work: Workload, cluster: Cluster,
                 recompute: str = "none", *, local_params: float | None = None,
                 layers: int | None = None, ends: tuple[bool, bool] | None = None) -> list[Collective]:
    """Every collective one GPU takes part in per optimizer step (module docstring). `local_params`
    (its parameters, unsharded by FSDP), `layers` (the blocks it runs) and `ends` (it holds the first
    stage, the last stage) default to the mean pipeline rank's (both ends without a pipeline, neither
    with one); `dslurm.plan.rank` passes one rank's own."""
    out: list[Collective] = []
    passes = work.grad_accum
    if local_params is None:
        local_params = model.num_params() / (layout.tp * layout.pp)

    def add(dim: str, op: str, what: str, size: float, calls: int) -> None:
        # FSDP's group is (dp_shard, cp) flattened: cp is the faster dim, so its stride is cp's
        ranks = layout.fsdp_shard if dim == "dp_shard" else getattr(layout, dim)
        stride = dim_stride(layout, "cp" if dim == "dp_shard" else dim)
        if ranks > 1 and calls > 0:
            link, bw = group_link(cluster, stride, ranks)
            out.append(Collective(dim=dim, op=op, what=what, ranks=ranks, size_bytes=size, calls=calls,
                                  link=link, busbw=bw))

    wb = work.bytes.gathered
    if layers is None:
        layers = math.ceil(model.n_layers / layout.pp)
    weights = "weights" if wb == 2 else f"weights {wb:g}B"
    add("dp_shard", "all_gather", weights, local_params * wb, passes)
    if layout.pp == 1 and layers > 1:
        # Backward gathers everything again (the root too: embedding, final norm, output) but the
        # last block, which train/parallel/fsdp.py keeps after forward.
        block = model.layer_params() / layout.tp
        add("dp_shard", "all_gather", f"{weights} again (backward)", (local_params - block) * wb, passes)
    add("dp_shard", "reduce_scatter", "grads fp32", local_params * REDUCE_BYTES, passes)
    add("dp_replicate", "all_reduce", "grad shard fp32", local_params * REDUCE_BYTES / layout.fsdp_shard,
        passes)
    seq = (work.seq_len or model.seq_len) // layout.cp
    act = seq * work.micro_batch * model.dim * wb  # activations travel in the compute dtype
    # forward 2 + backward 2 of each; recomputation re-runs the forward's two all-gathers but only
    # the first reduce-scatter: torch.utils.checkpoint stops recomputing once backward has what
    # it needs, and the block's last op (the FFN output's reduce-scatter) feeds no saved tensor.
    redo = 1 if recompute in ("selective", "full") else 0
    micro = passes * layout.microbatches
    first, last = (layout.pp == 1, layout.pp == 1) if ends is None else ends
    # the embedding's output is reduce-scattered (gathered in backward), the output projection's
    # input gathered (reduce-scattered in backward): once per microbatch on the stage that holds them
    add("tp", "all_gather", "activations", act, micro * (layers * (4 + 2 * redo) + first + last))
    add("tp", "reduce_scatter", "activations", act, micro * (layers * (4 + redo) + first + last))
    # the RMSNorm weights are replicated over tp; their gradients are summed over it (compute dtype)
    add("tp", "all_reduce", "norm grads", model.dim * wb, micro * (2 * layers + last))
    kv = seq * layout.cp * work.micro_batch * model.n_kv_heads * model.head_dim * wb / layout.tp
    add("cp", "all_gather", "keys, values", kv, micro * layers * 2 * (1 + redo))
    add("cp", "reduce_scatter", "key, value grads", kv, micro * layers * 2)
    if layout.pp > 1:
        v = stages_per_rank(work.schedule)
        sends = 2 * v - (1 if layout.pp == 2 else 0)
        add("pp", "send_recv", "boundary / tp", act / layout.tp, micro * sends)
    return out


def traffic_by_dim(collectives: list[Collective]) -> dict[str, dict[str, float | None]]:
    """Per dimension: bytes one GPU sends per step and their time (None if any time is unknown)."""
    out: dict[str, dict[str, float | None]] = {}
    for c in collectives:
        row = out.setdefault(c.dim, {"sent_bytes": 0.0, "time_s": 0.0})
        row["sent_bytes"] = (row["sent_bytes"] or 0.0) + c.sent_bytes
        t = c.time_s
        row["time_s"] = None if t is None or row["time_s"] is None else row["time_s"] + t
    return out
