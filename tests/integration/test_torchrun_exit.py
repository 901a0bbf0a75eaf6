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


def test_a_term_to_torchrun_stops_the_workers_and_exits_1(tmp_path):
    """The launcher forwards Slurm's TERM to torchrun: torchrun turns it into an exception, stops
    its workers, and this module exits 1 as `python -m torch.distributed.run` would."""
    import signal

    script = tmp_path / "sleeper.py"
    script.write_text(f"import os, time\nopen('{tmp_path}/up-' + os.environ['RANK'], 'w').close()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "dslurm.launch.torchrun", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts=0", str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("up-*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-3000:]
    assert "SignalException" in err, err[-3000:]
    args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(script) not in args
