"""scripts/demo.sh (issue 54): it sets up only what the demo needs (no second torch:
DSLURM_TORCH2=none), sends the set-up's chatter to a log and prints one line per phase, and
shows the log's end when a phase fails. Run here against stub set-up and cluster commands in a
copy of the script's folder layout (bash, milliseconds); the real set-up is the README's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout(tmp: Path, setup_rc: int = 0) -> Path:
    (tmp / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", tmp / "scripts" / "demo.sh")
    (tmp / "scripts" / "setup.sh").write_text(
        'echo "WARNING: pip chatter"; echo "apt: chatter" >&2\n'
        f'echo "torch2=${{DSLURM_TORCH2:-unset}}" > torch2.txt\nexit {setup_rc}\n')
    (tmp / ".venv" / "bin").mkdir(parents=True)
    py = tmp / ".venv" / "bin" / "python"
    py.write_text('#!/bin/sh\ncase "$*" in\n  *"cluster up"*) echo "munge: started";;\n'
                  '  *"cluster status"*) echo "node1 idle";;\n  *preempt_demo.py*) echo "DEMO $*";;\nesac\n')
    py.chmod(0o755)
    return tmp


def test_the_demo_prints_a_line_per_phase_and_keeps_the_chatter_in_its_log(tmp_path):
    root = layout(tmp_path)
    res = subprocess.run(["bash", str(root / "scripts" / "demo.sh"), "--fast"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "demo: set-up output goes to checkpoints/demo-setup.log"
    assert [ln.split(" ... ")[0].strip() for ln in lines[1:3]] == ["setup", "cluster"]
    assert all(" ... ok (" in ln for ln in lines[1:3]) and lines[3] == "DEMO examples/preempt_demo.py --fast"
    assert "chatter" not in res.stdout + res.stderr and "munge" not in res.stdout
    log = (root / "checkpoints" / "demo-setup.log").read_text()
    assert "WARNING: pip chatter" in log and "apt: chatter" in log and "munge: started" in log
    assert (root / "torch2.txt").read_text() == "torch2=none\n"  # the second torch is the tests' only


def test_a_failed_phase_shows_the_end_of_the_log_and_its_code(tmp_path):
    root = layout(tmp_path, setup_rc=3)
    res = subprocess.run(["bash", str(root / "scripts" / "demo.sh")], capture_output=True, text=True, timeout=30)
    assert res.returncode == 3
    assert "setup    ... FAILED (exit 3); the end of checkpoints/demo-setup.log:" in res.stdout
    assert "  WARNING: pip chatter" in res.stdout and "DEMO" not in res.stdout
