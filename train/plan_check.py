"""`python -m train.plan_check --site S --job J --rank R`: one rank of the job's real layout, built
at its full world size without a GPU or real memory, and what it allocates and sends.

The process joins a fake process group (torch's `fake` backend: every collective returns at once,
no peer exists) as rank R of the job's world, and builds its model parts with the trainer's own
`train.parallel.build.build_parts` on the meta device, with the GPU's mixed precision; the parts
are then materialised as fake tensors (`FakeTensorMode`: shapes, dtypes and devices, no storage).
Measured, and printed as one JSON line for `dslurm plan check` (dslurm/plan/check.py):

- params / grads / optimizer: bytes of the local shards (`DTensor.to_local`) of the parameters, of
  the gradients one micro-batch's backward leaves, and of AdamW's state after one `step()`;
- activations: the peak of one micro-batch's forward and backward on each of the rank's stages,
  from torch's memory tracker (`torch.distributed._tools.mem_tracker.MemTracker`), less the
  parameters, gradients and optimizer state present before it (what the micro-batch adds);
- collectives: calls and bytes of each collective kind per mesh dimension in that forward and
  backward, seen at the dispatcher (the c10d ops DTensor, FSDP2 and context parallel issue; the
  pipeline's point-to-point sends are not run: the stages are called directly). Bytes are
  nccl-tests' buffer size S of the call: the gathered size of an all-gather, the unreduced size of
  a reduce-scatter or all-reduce.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dslurm.errors import UserError

OPS = {  # dispatcher op name -> (kind, index of the tensor whose size is S, group argument index)
    "_allgather_base_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "allreduce_": ("all_reduce", 0, 1),
    "all_gather_into_tensor": ("all_gather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "all_reduce": ("all_reduce", 0, 2),
}


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class Collectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Calls and bytes per (mesh dimension, collective kind) of what runs under it."""

    def __init__(self, dim_of: dict[str, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dim_of = dim_of
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def _group(self, arg: Any) -> str:
        if isinstance(arg, str):
            return self.dim_of.get(arg, arg)
        pg = dist.ProcessGroup.unbox(arg) if isinstance(arg, torch.ScriptObject) else arg
        return self.dim_of.get(pg.group_name, pg.group_name)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns in ("c10d", "c10d_functional", "_c10d_functional") and name in OPS:
            kind, t_idx, g_idx = OPS[name]
            size = _nbytes(args[t_idx])
            if ns != "c10d" and kind == "all_gather":
                size *= int(args[1])  # funcol's input is this rank's part: S is the gathered size
            row = self.rows[(self._group(args[g_idx]), kind)]
            row[0] += 1
            row[1] += size
        return out


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    return sum(_nbytes(t.to_local() if isinstance(t, DTensor) else t) for t in tensors)


def group_dims(dims: Any) -> dict[str, str]:
    """Process-group name -> the planner's dimension name (FSDP's shard group is dp_shard's)."""
    lay = dims.layout
    out = {dims.get_mesh(d).get_group().group_name: d for d, n in lay.dims() if n > 1}
    if lay.fsdp_enabled:
        mesh = dims.fsdp_mesh()
        out[mesh.get_group(mesh.ndim - 1).group_name] = "dp_shard"
        if mesh.ndim == 2:
            out[mesh.get_group(0).group_name] = "dp_replicate"
    return out


def _inputs(part: Any, first: bool, mb: int, seq: int, lay: Any, dim: int) -> torch.Tensor:
    if first:
        return torch.zeros((mb, seq), dtype=torch.long)
    return torch.zeros((mb, seq // lay.tp if lay.tp > 1 else seq, dim))  # a stage boundary is sequence-sharded by tp


def _fwd_bwd(parts: list[nn.Module], ids: list[int], n_stages: int, shape: Any, lay: Any, mb: int) -> None:
    from train.model import cross_entropy

    seq = shape.seq_len // lay.cp
    for part, sid in zip(parts, ids, strict=True):
        out = part(_inputs(part, sid == 0, mb, seq, lay, shape.dim))
        if sid == n_stages - 1:
            ctx: Any
            if lay.loss_parallel_enabled:
                from torch.distributed.tensor.parallel import loss_parallel

                ctx = loss_parallel()
            else:
                ctx = torch.enable_grad()
            with ctx:
                cross_entropy(out, torch.zeros((mb, seq), dtype=torch.long)).backward()
        else:
            out.backward(torch.ones_like(out))


def local_shapes(parts: list[nn.Module]) -> dict[str, list[int]]:
    """Parameter name -> the shape of this rank's shard (a pipeline rank's two stages never share a name)."""
    from torch.distributed.tensor import DTensor

    return {n: list((p.to_local() if isinstance(p, DTensor) else p).shape)
            for part in parts for n, p in part.named_parameters()}


def run_micro_batch(parts: list[nn.Module], dims: Any, shape: Any, ids: list[int], n_stages: int,
                    mb: int) -> Collectives:
    """One micro-batch's forward and backward on every stage of the rank; the collectives it issued."""
    comm = Collectives(group_dims(dims))
    with comm:
        _fwd_bwd(parts, ids, n_stages, shape, dims.layout, mb)
    return comm


def rows(comm: Collectives) -> list[dict[str, Any]]:
    return [{"dim": d, "op": op, "calls": int(c), "bytes": b} for (d, op), (c, b) in sorted(comm.rows.items())]


def measure(site: str, job: str, rank: int, overrides: list[str], site_overrides: list[str]) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dslurm.config.layout import stage_ids, stages_per_rank
    from dslurm.config.resolve import load
    from train.model import cross_entropy
    from train.optim import build_optimizers
    from train.parallel.build import build_parts
    from train.parallel.dims import ParallelDims

    res = load(site, job, overrides, site_overrides)
    lay, shape, jspec = res.layout, res.shape, res.job
    if not 0 <= rank < lay.world_size:
        raise UserError(f"--rank {rank} is outside the job's world of {lay.world_size}. Fix: 0..{lay.world_size - 1}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
    try:
        dims = ParallelDims(layout=lay, device_type="cpu")
        gpu = "cuda" if res.site.node.gpus > 0 else "cpu"
        built = build_parts(shape, jspec, dims, torch.device("meta"), loss_fn=cross_entropy, precision=gpu)
        pp_rank = lay.coords(rank)["pp"]
        ids = stage_ids(pp_rank, lay.pp, jspec.parallel.pp_schedule) if lay.pp_enabled else [0]
        n_stages = lay.pp * stages_per_rank(jspec.parallel.pp_schedule) if lay.pp_enabled else 1
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            for part in built.parts:
                part.to_empty(device="cpu")
        params = [p for part in built.parts for p in part.parameters()]
        state = _local_bytes(params)
        tracker = MemTracker()
        tracker.track_external(*built.parts)
        mb = lay.micro_batch(jspec.train.global_batch, jspec.train.grad_accum)
        with fake, tracker:
            comm = run_micro_batch(built.parts, dims, shape, ids, n_stages, mb)
        peak = tracker.get_tracker_snapshot("peak")
        dev = next(iter(peak))
        kinds = {str(k).split(".")[-1].lower(): float(v) for k, v in peak[dev].items()}
        grads = _local_bytes([p.grad for p in params if p.grad is not None])
        with fake:
            opts, _ = build_optimizers(built.parts, jspec.train)
            for opt in opts:
                opt.step()
        opt_bytes = sum(_local_bytes([v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0])
                        for opt in opts for st in opt.state.values())
        return {"rank": rank, "coords": lay.coords(rank), "stages": ids, "params": state, "grads": grads,
                "optimizer": opt_bytes, "activations": kinds.get("act", 0.0) + kinds.get("temp", 0.0),
                "peak_by_kind": kinds, "micro_batch": mb, "collectives": rows(comm),
                "shapes": local_shapes(built.parts)}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plan_check", description=__doc__.split("\n")[0])
    p.add_argument("--site", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--site-set", dest="site_overrides", action="append", default=[])
    a = p.parse_args(argv)
    try:
        out = measure(a.site, a.job, a.rank, a.overrides, a.site_overrides)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
