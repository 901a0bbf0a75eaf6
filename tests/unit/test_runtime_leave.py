"""dslurm.endings.worker_exit.leave: the exit without finalization still delivers what was printed
and logged (block-buffered into a pipe, as under srun), and the code; finalization's handlers
(where torch's C++ threads can abort a finished process) never run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, logging, sys
atexit.register(lambda: print("finalized"))
logging.basicConfig(stream=sys.stderr, format="%(message)s")
print("buffered line", end="")
logging.getLogger("x").warning("logged line")
from dslurm.endings.worker_exit import leave
leave(75)
"""


def test_leave_flushes_the_buffers_exits_with_the_code_and_skips_finalization():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert res.returncode == 75
    assert res.stdout == "buffered line"  # flushed, and atexit's "finalized" never printed
    assert res.stderr.strip() == "logged line"
