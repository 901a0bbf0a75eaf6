"""`dslurm selftest --gpu --dry-run`: the whole check on CPU with tiny sizes, as a user runs it
(the CLI, its in-job process, the real trainer, DCP on disk). Checks the report's structure,
that every part ran, and the numbers against each other: the compiled trainer's losses equal
the eager one's (same seed, same batches: eager is the single-process reference), the restore
brings the saved values back, the checkpoint holds at least the sized state."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.selftest.report import PARTS, SCHEMA

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_dry_run_runs_every_part_and_reports_them(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "dslurm", "selftest", "--gpu", "--dry-run", "--out", str(out),
                           "--dir", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == rep  # one report: printed and written
    assert rep["schema"] == SCHEMA and rep["mode"] == "dry-run" and rep["failures"] == []
    assert rep["process"] == {"exit_code": 0, "timed_out": False}
    assert rep["chip"].startswith("cpu") and rep["notes"] and rep["site"]["name"] == "local"
    for name in PARTS:
        part = rep["parts"][name]
        assert part["status"] == "ok", (name, part.get("error"))
        assert part["chip"] == rep["chip"] and part["wall_s"] > 0
    # no peak on a CPU site: the goals are there, unjudged
    assert {g["pass"] for g in rep["goals"].values()} == {None}
    assert rep["parts"]["gemm"]["result"]["tflops"] > 0

    eager, compiled = rep["parts"]["trainer_eager"]["result"], rep["parts"]["trainer_compiled"]["result"]
    assert (eager["compile"], compiled["compile"]) == (False, True)
    for t in (eager, compiled):
        assert t["activation_checkpoint"] == "selective" and t["dtype"] == "fp32" and t["meta_init"] is False
        assert t["tokens_per_s"] > 0 and t["mfu"] is None and t["mfu_label"] == "cpu: no peak"
        assert t["micro_batch"] == rep["sizing"]["micro_batch"] and t["oom_retries"] == []
        assert len(t["losses"]) == t["warmup_steps"] + t["steps"] and all(map(math.isfinite, t["losses"]))
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)

    ck = rep["parts"]["checkpoint"]["result"]
    assert ck["restore_matches"] is True
    assert ck["bytes"] >= rep["sizing"]["saved_bytes"]
    for key in ("raw_write_s", "sync_save_s", "restore_s", "async_stall_s", "async_first_stall_s"):
        assert ck[key] > 0, key
    assert ck["sync_vs_raw"] == pytest.approx(ck["raw_write_s"] / ck["sync_save_s"])
    assert not (tmp_path / "work" / "work").exists()  # checkpoints and run dirs are removed
