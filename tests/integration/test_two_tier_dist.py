"""Two-tier checkpoints under torchrun: 2 processes, FSDP2 on a CPU gloo mesh, each process its own
"node" (the worker sets SLURMD_NODENAME=node<rank>, so `%n` gives each rank its own scratch and
the per-node dedup, metadata and restore are exercised as on two machines). Three launches:

1. "first": the uninterrupted reference, then a two-tier run that saves at 2 and K and is killed
   (DSLURM_FAULT_CKPT_KILL=1:after_local_commit:3) right after the local commit of its save at K+1,
   before the durable copy: the durable pointer must still name K, nothing half-copied is used.
2. "resume" on the same "nodes": restores K+1 from the local tier, finishes bit-identically.
3. "resume" with node1's scratch wiped (node loss): restores K from durable, bit-identically.

The worker scaffolding (two processes as two nodes) is node_pair.py's, shared with test_partner_dist.py.
This file is also the torchrun worker: `torchrun --nproc_per_node=2 THIS_FILE MODE RUN_DIR OUT_DIR`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_pair import (  # noqa: E402
    STEPS,
    K,
    copy_base,
    first_run,
    node_local,
    resume_records,
    resumed,
    same_as_reference,
    scratch_kw,
    worker_main,
)
from node_pair import torchrun as _torchrun  # noqa: E402

pytestmark = pytest.mark.integration


def worker(mode: str, run_dir: Path, out: Path) -> None:
    kw = scratch_kw(run_dir, dist.get_world_size())
    if mode == "first":
        first_run(run_dir, out, kw, saves=(2, K, K + 1))
    elif mode == "resume":
        resumed(run_dir, out, kw)


def torchrun(mode: str, run_dir: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _torchrun(__file__, mode, run_dir, out, env)


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
        gens = ck.list_generations(node_local(base, node))
        newest = gens[-1]
        assert newest.step == K + 1 and tiers.read_record(newest.path, rank) is not None
        assert sorted(p.name for p in newest.path.glob("*.distcp")) == [f"__{rank}_0.distcp"]


def _resume(first, tmp_path: Path, wipe: str | None) -> tuple[list[dict[str, Any]], Path]:
    base, _, _ = first
    new = tmp_path / "base"
    copy_base(base, new)
    if wipe:
        shutil.rmtree(new / "scratch" / wipe)
    res = torchrun("resume", new / "run", tmp_path / "out")
    assert res.returncode == 0, res.stderr[-4000:]
    return resume_records(tmp_path / "out"), new


def _same_as_reference(first, tmp_path: Path, got: list[dict[str, Any]], start: int) -> None:
    same_as_reference(first[1], tmp_path / "out", got, start)


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
    worker_main(worker)
