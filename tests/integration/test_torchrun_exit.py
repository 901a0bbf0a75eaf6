"""`python -m dslurm.launch.torchrun`: torchrun, left without its interpreter's finalization. A
worker's failure still comes out as torchrun's code 1 with its error summary, after the workers
are gone (the peer that would sleep on was stopped). Real torchrun, two processes."""

from __future__ import annotations

import subprocess
import sys
import time

from train_helpers import ROOT

WORKER = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(60)
"""


def test_a_failed_worker_is_torchruns_code_1_with_its_summary_and_no_worker_outlives_it(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dslurm.launch.torchrun", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts=0", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "ChildFailedError" in out.stderr and "exitcode  : 3" in out.stderr, out.stderr[-3000:]
    assert time.monotonic() - t < 50  # the sleeping peer was stopped, not waited for
    args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(script) not in args  # no worker left behind
