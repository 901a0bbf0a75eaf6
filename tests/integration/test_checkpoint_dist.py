"""Checkpoints under torchrun (2 processes, FSDP2 on a CPU gloo mesh): kill -9 of one rank in the
middle of a save, then bit-identical resume from the previous generation, and resharding to one
process. Two torchrun launches in all (each costs seconds on 2 cores):

1. "first": the uninterrupted reference run, then a run that saves (async) at steps 2 and K and is
   killed in its save at step K+1: DSLURM_FAULT_CKPT_KILL=1:after_write:3 (see `ckpt_kill` in dslurm/faults.py;
   dslurm/checkpoint/dcp.py) makes rank 1 SIGKILL itself once its shards are on disk, before rank 0
   can write the manifest or move the pointer. That makes "the middle of a save" deterministic.
2. "resume": the next start, which must come back at step K and match the reference bit for bit.

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
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
STEPS, K = 6, 3  # uninterrupted run length; the interrupted run saves at K and stops

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------ the worker


def build(world: int, seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train(model: nn.Module, opt: Any, sched: Any, extra: dict[str, Any], start: int, stop: int,
          mgr: Any = None, saves: tuple[int, ...] = ()) -> dict[str, list[float]]:
    """Global batch 8 from the sampler position, split across ranks; loss averaged over ranks.
    `probe` draws from each rank's torch RNG: equal only if per-rank RNG state came back."""
    from dslurm.checkpoint.dcp import TrainState
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    state = {"train": TrainState(model, opt, sched)}
    losses, probes = [], []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(extra["sampler"]["index"])
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        n = 8 // world
        extra["sampler"]["index"] += 3
        loss = nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        probes.append(torch.rand(()).item())
        if mgr is not None and step + 1 in saves:
            mgr.save(step + 1, state, extra)
    return {"losses": losses, "probes": probes}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def worker(mode: str, run_dir: Path, out: Path) -> None:
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = {"dp_shard": world}
    fresh = lambda: {"sampler": {"index": 5}}  # noqa: E731
    if mode == "first":  # the uninterrupted reference, then the run that saves at K and stops
        model, opt, sched = build(world)
        record = train(model, opt, sched, fresh(), 0, STEPS)
        params = full_params(model)
        (out / f"ref-{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save(params, out / "ref-params.pt")
        model, opt, sched = build(world)
        with CheckpointManager(run_dir, async_mode=True, layout=layout) as mgr:
            assert mgr.restore({"train": TrainState(model, opt, sched)}) is None
            train(model, opt, sched, fresh(), 0, K + 1, mgr, saves=(2, K, K + 1))
    elif mode == "resume":
        from testkit import ReadCounter
        model, opt, sched = build(world, seed=1)
        extra: dict[str, Any] = {}
        with CheckpointManager(run_dir, layout=layout) as mgr:
            with ReadCounter(run_dir / "generations") as reads:
                res = mgr.restore({"train": TrainState(model, opt, sched)}, extra)
            record = train(model, opt, sched, extra, res.step, STEPS, mgr, saves=(STEPS,))
        record["restored"] = [res.step, res.fell_back, res.rng_restored]
        record["reads"] = {n: [reads.opens[n], reads.bytes[n]] for n in reads.opens if n.endswith(".distcp")}
        params = full_params(model)
        (out / f"resume-{rank}.json").write_text(json.dumps(record))
        if rank == 0:
            torch.save(params, out / "resume-params.pt")


def torchrun(mode: str, run_dir: Path, out: Path, env: dict[str, str] | None = None,
             nproc: int = 2) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, mode, str(run_dir), str(out)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=180, cwd=ROOT)


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("ckpt_dist")
    res = torchrun("first", base / "run", base / "out", env={"DSLURM_FAULT_CKPT_KILL": "1:after_write:3"})
    assert (base / "out" / "ref-1.json").is_file(), res.stderr[-4000:]
    return base / "run", base / "out", res


def _copy(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


def test_kill_9_of_one_rank_mid_save_keeps_previous_pointer(first):
    run_dir, _, res = first
    from dslurm import checkpoint as ck
    assert res.returncode != 0 and "DSLURM_FAULT_CKPT_KILL: killing myself at after_write" in res.stderr
    gens = ck.list_generations(run_dir)
    assert [(g.step, g.committed) for g in gens] == [(2, True), (K, True), (K + 1, False)]
    assert (gens[2].path / "__1_0.distcp").is_file()  # rank 1 had written its shard: truly mid-save
    assert ck.read_pointer(run_dir).generation == gens[1].name


def test_fsdp2_resume_is_bit_identical(first, tmp_path):
    run_dir, ref_out, _ = first
    from dslurm import checkpoint as ck
    run = _copy(run_dir, tmp_path / "run")
    res = torchrun("resume", run, tmp_path / "out")
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 1):
        ref = json.loads((ref_out / f"ref-{rank}.json").read_text())
        got = json.loads((tmp_path / "out" / f"resume-{rank}.json").read_text())
        assert got["restored"] == [K, False, True]
        assert got["losses"] == ref["losses"][K:]
        assert got["probes"] == ref["probes"][K:]  # this rank's RNG stream came back
        for name, (opens, nbytes) in got["reads"].items():  # each file at most once per rank
            assert opens == 1 and nbytes <= (run / "generations" / name).stat().st_size, name
    assert [g.step for g in ck.list_generations(run)] == [K, STEPS]  # the orphan was collected
    ref_p = torch.load(ref_out / "ref-params.pt")
    got_p = torch.load(tmp_path / "out" / "resume-params.pt")
    assert ref_p.keys() == got_p.keys() and all(torch.equal(ref_p[k], got_p[k]) for k in ref_p)


def test_altered_shard_of_the_other_rank_falls_back_on_both(first, tmp_path):
    """The pointer's generation has a flipped byte in rank 1's own shard of a parameter, which
    rank 0 never reads (it reads only the replicated items rank 1's file also holds). Each rank
    checks only what it reads, so only rank 1 can notice; the verdict is agreed, both ranks
    reject the generation, load the previous one (step 2) and continue bit-identically."""
    run_dir, ref_out, _ = first
    from torch.distributed.checkpoint import FileSystemReader

    from dslurm import checkpoint as ck
    run = _copy(run_dir, tmp_path / "run")
    target = ck.read_pointer(run).generation
    shard = ck.generations_dir(run) / target / "__1_0.distcp"
    md = FileSystemReader(shard.parent).read_metadata()
    # rank 1's half of a sharded tensor: chunk offset not at the origin
    info = next(v for k, v in md.storage_data.items()
                if v.relative_path == shard.name and k.offset is not None and any(k.offset))
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 4] ^= 0x10  # inside the tensor's bytes
    shard.write_bytes(bytes(data))
    res = torchrun("resume", run, tmp_path / "out")
    assert res.returncode == 0, res.stderr[-4000:]
    got = [json.loads((tmp_path / "out" / f"resume-{r}.json").read_text()) for r in (0, 1)]
    opens, nbytes = got[0]["reads"][f"{target}/{shard.name}"]
    assert opens == 1 and nbytes < len(data)  # rank 0 read only its part of rank 1's file
    for rank in (0, 1):
        assert f"[rank {rank}] CHECKPOINT FALLBACK" in res.stderr
        assert got[rank]["restored"] == [2, True, True]
        assert got[rank]["losses"] == json.loads((ref_out / f"ref-{rank}.json").read_text())["losses"][2:]
    assert f"{shard}: crc32" in res.stderr
    # marked REJECTED, so the save at the end collected it instead of the step-2 generation
    assert [g.step for g in ck.list_generations(run)] == [2, STEPS]


def test_reshard_fsdp2x2_to_one_process(first, tmp_path, caplog):
    run_dir, ref_out, _ = first
    from dslurm.checkpoint.dcp import CheckpointManager, TrainState
    model, opt, sched = build(1, seed=1)
    extra: dict[str, Any] = {}
    with caplog.at_level("INFO"):
        with CheckpointManager(_copy(run_dir, tmp_path / "run"), layout={"dp_shard": 1}) as mgr:
            res = mgr.restore({"train": TrainState(model, opt, sched)}, extra)
    assert res.step == K and res.saved_world_size == 2 and not res.rng_restored
    assert res.saved_layout == {"dp_shard": 2} and "resharding" in caplog.text
    assert extra == {"sampler": {"index": 5 + 3 * K}}
    got = train(model, opt, sched, extra, K, STEPS)["losses"]
    ref = json.loads((ref_out / "ref-0.json").read_text())["losses"][K:]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5 and len(got) == STEPS - K


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))  # testkit
    from train_helpers import worker_main
    worker_main(worker)
