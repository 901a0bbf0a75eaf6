"""Two processes as two "nodes" under torchrun: the scaffolding the two-tier and partner-copy
checkpoint tests share (tests/integration/test_two_tier_dist.py, test_partner_dist.py). The worker
sets SLURMD_NODENAME=node<rank>, so `%n` gives each rank its own scratch and the per-node dedup,
metadata, partner copies and restore run as on two machines. The training itself is
test_checkpoint_dist's (FSDP2 on a CPU gloo mesh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from test_checkpoint_dist import STEPS, K, build, full_params, train

from train_helpers import ROOT, run_procs, worker_main  # noqa: F401 - the workers' __main__


def scratch_kw(run_dir: Path, world: int, **more: Any) -> dict[str, Any]:
    """The CheckpointManager arguments of a two-tier run whose ranks are nodes (call in the worker)."""
    os.environ["SLURMD_NODENAME"] = f"node{dist.get_rank()}"  # one "node" per rank: its own scratch
    return {"layout": {"dp_shard": world}, "scratch": str(run_dir.parent / "scratch" / "%n"), "async_mode": True,
            **more}


def fresh() -> dict[str, Any]:
    return {"sampler": {"index": 5}}


def first_run(run_dir: Path, out: Path, kw: dict[str, Any], saves: tuple[int, ...]) -> None:
    """The uninterrupted reference (its losses, probes and final parameters into `out`), then the
    run under test from scratch: it trains to K+1 with saves at `saves` (a fault env kills it)."""
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build(world)
    record = train(model, opt, sched, fresh(), 0, STEPS)
    params = full_params(model)  # collective
    (out / f"ref-{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(params, out / "ref-params.pt")
    model, opt, sched = build(world)
    with CheckpointManager(run_dir, **kw) as mgr:
        assert mgr.restore({"train": TrainState(model, opt, sched)}) is None
        train(model, opt, sched, fresh(), 0, K + 1, mgr, saves=saves)


def resumed(run_dir: Path, out: Path, kw: dict[str, Any], after_restore: Callable[[Any], dict[str, Any]]
            = lambda mgr: {}) -> None:
    """The next start: restore (from another seed), train to STEPS, a final blocking save; its
    record (+ `restored`, + what `after_restore(mgr)` returned) and final parameters into `out`."""
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build(world, seed=1)
    extra: dict[str, Any] = {}
    with CheckpointManager(run_dir, **kw) as mgr:
        res = mgr.restore({"train": TrainState(model, opt, sched)}, extra)
        seen = after_restore(mgr)
        record = train(model, opt, sched, extra, res.step, STEPS)
        mgr.save(STEPS, {"train": TrainState(model, opt, sched)}, extra, blocking=True)
    record.update(seen, restored=[res.step, res.tier, res.tier_reason, res.rng_restored])
    params = full_params(model)  # collective
    (out / f"resume-{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(params, out / "resume-params.pt")


def torchrun(worker: str, mode: str, run_dir: Path, out: Path, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 WORKER MODE RUN_DIR OUT` under a deadline that follows the load."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           worker, mode, str(run_dir), str(out)]
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # the worker imports this module (testkit)
    return run_procs(cmd, 2, 180, {"PYTHONPATH": path, **(env or {})})


def node_local(base: Path, node: str) -> Path:
    """The run's local tier on `node` (the run under `base/run`, scratch under `base/scratch`)."""
    from dslurm.checkpoint import tiers
    return tiers.local_run_dir(base / "scratch" / node, base / "run")


def copy_base(base: Path, new: Path) -> None:
    """A copy of a first run's durable and node-local state for one test to change and resume."""
    shutil.copytree(base, new, ignore=shutil.ignore_patterns("out"))
    for node in ("node0", "node1"):  # the local dir's name hashes the run dir's path
        shutil.move(new / "scratch" / node / node_local(base, node).name, node_local(new, node))


def resume_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"resume-{r}.json").read_text()) for r in (0, 1)]


def same_as_reference(ref_out: Path, out: Path, got: list[dict[str, Any]], start: int) -> None:
    """Every loss and per-rank RNG probe from `start` on, and the final parameters, bit-identical."""
    for rank in (0, 1):
        ref = json.loads((ref_out / f"ref-{rank}.json").read_text())
        assert got[rank]["losses"] == ref["losses"][start:]
        assert got[rank]["probes"] == ref["probes"][start:]  # per-rank RNG came back
    ref_p = torch.load(ref_out / "ref-params.pt")
    got_p = torch.load(out / "resume-params.pt")
    assert ref_p.keys() == got_p.keys() and all(torch.equal(ref_p[k], got_p[k]) for k in ref_p)
