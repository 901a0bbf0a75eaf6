"""Two-tier checkpoints under torchrun: 2 processes, FSDP2 on a CPU gloo mesh, each process its own
"node" (the worker sets SLURMD_NODENAME=node<rank>, so `%n` gives each rank its own scratch and
the per-node dedup, metadata and restore are exercised as on two machines). Three launches:

1. "first": the uninterrupted reference, then a two-tier run that saves at 2 and K and is killed
   (DSLURM_FAULT_CKPT_KILL=1:after_local_commit:3) right after the local commit of its save at K+1,
   before the durable copy: the durable pointer must still name K, nothing half-copied is used.
2. "resume" on the same "nodes": restores K+1 from the local tier, finishes bit-identically.
3. "resume" with node1's scratch wiped (node loss): restores K from durable, bit-identically.

This file is also the torchrun worker: `torchrun --nproc_per_node=2 THIS_FILE MODE RUN_DIR OUT_DIR`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_dist import STEPS, K, build, full_params, train  # noqa: E402

pytestmark = pytest.mark.integration


def worker(mode: str, run_dir: Path, out: Path) -> None:
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["SLURMD_NODENAME"] = f"node{rank}"  # one "node" per rank: its own scratch
    kw = {"layout": {"dp_shard": world}, "scratch": str(run_dir.parent / "scratch" / "%n"), "async_mode": True}
    fresh = lambda: {"sampler": {"index": 5}}  # noqa: E731
    if mode == "first":
        model, opt, sched = build(world)
        record = train(model, opt, sched, fresh(), 0, STEPS)
        params = full_params(model)  # collective
        (out / f"ref-{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save(params, out / "ref-params.pt")
        model, opt, sched = build(world)
        with CheckpointManager(run_dir, **kw) as mgr:
            assert mgr.restore({"train": TrainState(model, opt, sched)}) is None
            train(model, opt, sched, fresh(), 0, K + 1, mgr, saves=(2, K, K + 1))
    elif mode == "resume":
        model, opt, sched = build(world, seed=1)
        extra: dict[str, Any] = {}
        with CheckpointManager(run_dir, **kw) as mgr:
            res = mgr.restore({"train": TrainState(model, opt, sched)}, extra)
            record = train(model, opt, sched, extra, res.step, STEPS)
            mgr.save(STEPS, {"train": TrainState(model, opt, sched)}, extra, blocking=True)
        record["restored"] = [res.step, res.tier, res.tier_reason, res.rng_restored]
        params = full_params(model)  # collective
        (out / f"resume-{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save(params, out / "resume-params.pt")


def torchrun(mode: str, run_dir: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, mode, str(run_dir), str(out)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=180, cwd=ROOT)


def _local(base: Path, node: str) -> Path:
    from dslurm.checkpoint import tiers
    return tiers.local_run_dir(base / "scratch" / node, base / "run")


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("two_tier")
    res = torchrun("first", base / "run", base / "out", env={"DSLURM_FAULT_CKPT_KILL": "1:after_local_commit:3"})
    assert (base / "out" / "ref-1.json").is_file(), res.stderr[-4000:]
    return base, base / "out", res


def test_kill_9_after_local_commit_keeps_the_durable_pointer(first):
    base, _, res = first
    from dslurm import checkpoint as ck
    from dslurm.checkpoint import tiers
    assert res.returncode != 0 and "killing myself at after_local_commit" in res.stderr
    durable = ck.list_generations(base / "run")
    ptr = ck.read_pointer(base / "run")
    assert ptr.step == K and [g.step for g in durable if g.committed] == [2, K]
    assert all(g.step == K + 1 for g in durable if not g.committed)  # at most a partial copy, never used
    for rank, node in enumerate(("node0", "node1")):
        gens = ck.list_generations(_local(base, node))
        newest = gens[-1]
        assert newest.step == K + 1 and tiers.read_record(newest.path, rank) is not None
        assert sorted(p.name for p in newest.path.glob("*.distcp")) == [f"__{rank}_0.distcp"]


def _resume(first, tmp_path: Path, wipe: str | None) -> tuple[list[dict[str, Any]], Path]:
    base, _, _ = first
    new = tmp_path / "base"
    shutil.copytree(base, new, ignore=shutil.ignore_patterns("out"))
    # the local dir's name hashes the run dir's path: carry the scratch over under the new name
    for node in ("node0", "node1"):
        old, moved = _local(base, node), _local(new, node)
        shutil.move(new / "scratch" / node / old.name, moved)
    if wipe:
        shutil.rmtree(new / "scratch" / wipe)
    res = torchrun("resume", new / "run", tmp_path / "out")
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((tmp_path / "out" / f"resume-{r}.json").read_text()) for r in (0, 1)], new


def _same_as_reference(first, tmp_path: Path, got: list[dict[str, Any]], start: int) -> None:
    _, ref_out, _ = first
    for rank in (0, 1):
        ref = json.loads((ref_out / f"ref-{rank}.json").read_text())
        assert got[rank]["losses"] == ref["losses"][start:]
        assert got[rank]["probes"] == ref["probes"][start:]  # per-rank RNG came back
    ref_p = torch.load(ref_out / "ref-params.pt")
    got_p = torch.load(tmp_path / "out" / "resume-params.pt")
    assert ref_p.keys() == got_p.keys() and all(torch.equal(ref_p[k], got_p[k]) for k in ref_p)


def test_same_nodes_resume_from_the_local_tier(first, tmp_path):
    from dslurm import checkpoint as ck
    got, new = _resume(first, tmp_path, wipe=None)
    for rank in (0, 1):
        step, tier, why, rng = got[rank]["restored"]
        assert (step, tier, rng) == (K + 1, "local", True) and "locally committed on all 2 ranks" in why
    _same_as_reference(first, tmp_path, got, K + 1)
    assert ck.read_pointer(new / "run").step == STEPS  # the final save reached durable before exit


def test_node_loss_resumes_from_durable(first, tmp_path):
    got, _ = _resume(first, tmp_path, wipe="node1")
    for rank in (0, 1):
        step, tier, why, _ = got[rank]["restored"]
        assert (step, tier) == (K, "durable") and "no local generation on 1 of 2 ranks" in why
    _same_as_reference(first, tmp_path, got, K)


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    try:
        worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    finally:
        dist.destroy_process_group()
    from dslurm.endings.worker_exit import leave
    leave(0)  # not the interpreter's finalization: it can abort a finished gloo worker (see leave)
