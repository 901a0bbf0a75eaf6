"""dslurm.integrations without Slurm: a kill -9 in the middle of the HF Trainer's save leaves the
previous generation as the one resumed (the killed save's folder is in no committed generation,
and a half-written `.incoming` folder is cleared), and `dslurm.runtime.Checkpoint` takes an
accelerate Accelerator's prepared objects as they are. The bit-identical requeue of HF and
Lightning jobs is tests/cluster/test_integrations.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm import checkpoint as ck
from dslurm.observe.ledger import read_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
JOB = "name: hf\nnodes: 1\nentry: [hf_train.py]\ncheckpoint:\n  interval: 4\n"


def run_hf(run: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """examples/integrations/hf_train.py as one process (a world of one, no torchrun)."""
    cmd = [sys.executable, str(ROOT / "examples" / "integrations" / "hf_train.py"), "--steps", "12",
           "--out", str(out), "--output-dir", str(run.parent / "hf-out")]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "DSLURM_RUN_DIR": str(run), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=240)


def test_hf_kill9_during_its_save_resumes_the_previous_generation(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "site-configs" / "local.yaml", run / "site.yaml")
    (run / "job.yaml").write_text(JOB)
    # the second save (step 8): killed once HF's folder is inside the generation, before its manifest
    first = run_hf(run, tmp_path / "never.pt", {"DSLURM_FAULT_CKPT_KILL": "0:before_write:2"})
    assert first.returncode == -9, first.stderr[-3000:]
    assert ck.read_pointer(run).step == 4
    killed = [g for g in ck.list_generations(run) if g.step == 8]
    assert len(killed) == 1 and not killed[0].committed and (killed[0].path / ck.FILES / "model.safetensors").exists()
    half = ck.generations_dir(run) / ck.INCOMING / "checkpoint-12"  # a kill while HF itself was writing
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"half")

    second = run_hf(run, tmp_path / "final.pt")
    assert second.returncode == 0, second.stderr[-3000:]
    starts = [e for e in read_events(run) if e["event"] == "train_start"]
    assert [e["step"] for e in starts] == [0, 4]  # resumed from the committed generation
    assert [e["step"] for e in read_events(run) if e["event"] == "ckpt_save"] == [4, 8, 12]
    assert not half.exists()
    gens = ck.list_generations(run)
    assert all(g.committed for g in gens) and gens[-1].step == ck.read_pointer(run).step == 12
    assert ck.verify_generation(gens[-1].path, full=True) == []  # HF's files are in the manifest, crc32 and all
    manifest = json.loads((gens[-1].path / ck.MANIFEST).read_text())
    assert {f"{ck.FILES}/model.safetensors", f"{ck.FILES}/trainer_state.json"} <= set(manifest["files"])


def test_accelerate_prepared_objects_are_taken_as_they_are(tmp_path):
    script = ROOT / "tests" / "integration" / "accelerate_script.py"
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["start"] == 5
    assert out["shared"] == ["model", "optim", "sched"] and out["per_rank"] == ["data"]  # the scheduler: shared
    assert out["equal"] == {"model": True, "optim": True, "sched": True, "data": True}
