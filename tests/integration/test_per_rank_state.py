"""Per-rank state under dslurm.runtime (issue: a per-rank stream came back as one rank's).
3 ranks under real torchrun (gloo): a StatefulDataLoader over a DistributedSampler and a
per-rank torch.Generator, handed to Checkpoint as they are, with dropout, stopped after step 6
and again after step 9 (the stop knob, as USR2 would), resumed: parameters bit-identical to an
uninterrupted run (issue 38: the loader's iterator, made after the restore, drew its seed from
the restored RNG and shifted every later dropout mask). Resumed
with 2 ranks instead: the loader is resharded (the epoch's remaining samples, none twice),
the generator is refused by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.observe import events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("per_rank_script.py")
JOB = """\
name: per-rank
nodes: 1
entry: [per_rank_script.py]
checkpoint:
  interval: 4
  async_save: true
"""


def torchrun(run: Path, nproc: int, out: Path, *args: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    reads = run.parent / f"reads-{run.name}"
    reads.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), "--out", str(out), "--reads", str(reads), *args]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "DSLURM_RUN_DIR": str(run), "PYTHONPATH": str(ROOT),
            **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)


def run_dir(tmp: Path, name: str) -> Path:
    run = tmp / name
    run.mkdir()
    shutil.copy(ROOT / "site-configs" / "local.yaml", run / "site.yaml")
    (run / "job.yaml").write_text(JOB)
    return run


def reads_of(run: Path) -> list[list[int]]:
    """Sample indices read, one list per (rank, process)."""
    return [[int(i) for i in f.read_text().split()] for f in sorted((run.parent / f"reads-{run.name}").iterdir())]


def test_per_rank_state_resumes_bit_identical_and_reshards_what_it_can(tmp_path):
    import torch

    run = run_dir(tmp_path, "run")
    first = torchrun(run, 3, tmp_path / "never.pt", env={"DSLURM_FAULT_STOP": "6"})
    assert "exitcode  : 75" in first.stderr, first.stderr[-3000:]
    shutil.copytree(run, tmp_path / "wide")  # the same stopped run, to resume with 2 ranks below
    shutil.copytree(tmp_path / "reads-run", tmp_path / "reads-wide")
    second = torchrun(run, 3, tmp_path / "never.pt", env={"DSLURM_FAULT_STOP": "9"})
    assert "exitcode  : 75" in second.stderr, second.stderr[-3000:]
    third = torchrun(run, 3, tmp_path / "resumed.pt")
    assert third.returncode == 0, third.stderr[-3000:]
    straight = torchrun(run_dir(tmp_path, "straight"), 3, tmp_path / "straight.pt")
    assert straight.returncode == 0, straight.stderr[-3000:]

    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "straight.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert sorted(sum(reads_of(run), [])) == sorted(sum(reads_of(tmp_path / "straight"), []))
    evs = events.read(run)
    assert [e.step for e in events.of(evs, events.TrainStart)] == [0, 6, 9]
    # The loop's last periodic save is its final step: saved once, not twice.
    assert [e.step for e in events.of(evs, events.CkptSave)] == [4, 6, 8, 9, 12]

    # 3 -> 2 ranks: the generator's per-rank streams cannot map: refused by name.
    wide = tmp_path / "wide"
    refused = torchrun(wide, 2, tmp_path / "refused.pt")
    assert refused.returncode != 0
    assert ("checkpoint entry 'noise' is per-rank state saved by 3 ranks, and it cannot be mapped onto 2 ranks"
            in refused.stderr)
    assert f'File "{ROOT / "dslurm"}' not in refused.stderr  # one line, no traceback of ours (torchrun has its own)
    # Without it, the loader reshards: the 2 ranks read the epoch's next samples, none seen before.
    done = torchrun(wide, 2, tmp_path / "two.pt", "--parts", "loader")
    assert done.returncode == 0, done.stderr[-3000:]
    # The ranks' RNG streams cannot map onto 2 ranks: not restored, and the ledger says so (doctor names it).
    rest = list(events.of(events.read(wide), events.CkptRestore))[-1]
    assert (rest.rng_restored, rest.saved_world_size) == (False, 3), rest
    seen = sum(reads_of(wide), [])
    assert len(seen) == 6 * 3 * 4 + 6 * 2 * 4 and len(set(seen)) == len(seen)
