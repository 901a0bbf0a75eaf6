"""examples/own_script/train_safe.py under real torchrun (gloo, 2 processes, no Slurm): stopped
by the stop knob after step 5 it saves and exits 75; restarted it resumes and ends with
parameters bit-identical to an uninterrupted run of the same script, and to the plain script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.observe import events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "own_script"
JOB = """\
name: own-safe
nodes: 1
entry: [train_safe.py, --steps, "12"]
checkpoint:
  interval: {interval}
  async_save: {async_save}
"""


def torchrun(script: str, run_dir: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / script), "--steps", "12", "--out", str(out)]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "DSLURM_RUN_DIR": str(run_dir),
            "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=180)


def frozen_run_dir(tmp: Path, name: str, *, interval: int, async_save: bool) -> Path:
    """A run directory as `dslurm submit` leaves it: the site and job frozen into it."""
    run = tmp / name
    run.mkdir()
    shutil.copy(ROOT / "site-configs" / "local.yaml", run / "site.yaml")
    (run / "job.yaml").write_text(JOB.format(interval=interval, async_save=str(async_save).lower()))
    return run


def params(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """train_safe.py uninterrupted, once for the module (its saves change no number): its parameters."""
    tmp = tmp_path_factory.mktemp("straight")
    out = torchrun("train_safe.py", frozen_run_dir(tmp, "straight", interval=4, async_save=False), tmp / "straight.pt")
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / "straight.pt"


@pytest.mark.parametrize("async_save", [False, True])
def test_stopped_and_resumed_script_ends_bit_identical(tmp_path, async_save, straight):
    import torch

    run = frozen_run_dir(tmp_path, "run", interval=4, async_save=async_save)
    first = torchrun("train_safe.py", run, tmp_path / "never.pt", {"DSLURM_FAULT_STOP": "5:1"})
    assert "exitcode  : 75" in first.stderr, first.stderr[-3000:]
    assert not (tmp_path / "never.pt").exists()
    second = torchrun("train_safe.py", run, tmp_path / "resumed.pt")
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = params(tmp_path / "resumed.pt"), params(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    evs = events.read(run)
    assert [e.step for e in events.of(evs, events.TrainStart)] == [0, 5]
    assert [e.step for e in events.of(evs, events.Signal)] == [5]
    assert [(e.reason, e.step, e.code) for e in events.of(evs, events.Exit)] == [("requeue", 5, 75),
                                                                                 ("completed", 12, 0)]
    saved = [e.step for e in events.of(evs, events.CkptSave)]
    assert saved[:2] == [4, 5] and saved[-1] == 12  # periodic (interval 4), the stop's, the final
    logged = sorted({s for e in events.of(evs, events.Steps) for s in range(e.first, e.last + 1)})
    assert logged == list(range(12))


def test_plain_script_trains_the_same_parameters(tmp_path, straight):
    """The safe script changes nothing about the training itself."""
    import torch

    plain = torchrun("train_plain.py", tmp_path / "unused", tmp_path / "plain.pt")
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = params(tmp_path / "plain.pt"), params(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
