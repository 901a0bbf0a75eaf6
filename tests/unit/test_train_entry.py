"""`python -m train`: bad layouts fail before any process-group work, exit 2, with the
numbers and no traceback; the world comes from torchrun's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site-configs" / "local.yaml"
JOB = ROOT / "examples" / "jobs" / "tiny-2node.yaml"


def run_entry(world: int, *sets: str) -> subprocess.CompletedProcess:
    """The entry with torchrun's variables but no torchrun: a layout error must exit before
    anything would try to reach a rendezvous (there is none, so reaching it would hang)."""
    env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "RANK": "0",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    args = [sys.executable, "-m", "train", "--site", str(SITE), "--job", str(JOB)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("world, sets, expect", [
    (4, ["parallel.dp_shard=3"], "pp(1)*dp_replicate(1)*dp_shard(3)*cp(1)*tp(2)=6 != world_size(4)"),
    (3, [], "pp(1)*dp_replicate(1)*cp(1)*tp(2)=2 does not divide world_size(3)"),
    (4, ["parallel.tp=1", "parallel.pp=2", "parallel.microbatches=1"],
     "microbatches(1) < pipeline stages(2)"),
    (2, ["model.n_heads=2", "model.n_kv_heads=1", "parallel.dp_shard=1"],
     "tp(2) must divide n_heads(2) and n_kv_heads(1)"),
])
def test_bad_layout_exits_2_with_the_numbers_and_no_traceback(world, sets, expect):
    proc = run_entry(world, *sets)
    assert proc.returncode == 2, proc.stderr
    assert expect in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")


def test_resolution_takes_the_world_from_the_launcher(monkeypatch):
    from train.__main__ import parse_args, resolve_for_world

    args = parse_args(["--site", str(SITE), "--job", str(JOB)])
    r = resolve_for_world(args, 4, 4)  # the job file says 2 nodes x 2; torchrun started 1 x 4
    assert (r.nnodes, r.procs_per_node, r.layout.dp_shard, r.layout.tp) == (1, 4, 2, 2)


def test_trainer_entry_imports_no_torch_before_the_layout_is_checked():
    code = ("import sys; from train.__main__ import main; rc = main(['--site', %r, '--job', %r, '--set', "
            "'parallel.dp_shard=5']); print(rc, 'torch' in sys.modules)" % (str(SITE), str(JOB)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert proc.stdout.split() == ["2", "False"], proc.stderr


def test_a_signal_after_a_rank_failed_of_its_own_is_not_recorded_as_its_cause():
    """Both orders: TERM then failure = a victim of the teardown (signal kept, classified
    killed_by_teardown); failure (e.g. the hang watchdog's verdict) then TERM from torchrun
    tearing the step down = its own failure (signal dropped, the report stays a crash)."""
    from types import SimpleNamespace

    from dslurm.endings.facts import victim_kind
    from dslurm.endings.worker_exit import signal_before_failure

    term_first = SimpleNamespace(signame="SIGTERM", times={"SIGTERM": 100.0})  # a StopRequest's fields
    assert signal_before_failure(term_first, 101.0) == "SIGTERM"
    assert victim_kind("crash", "hang", signal_before_failure(term_first, 101.0)) == "killed_by_teardown"
    assert signal_before_failure(term_first, 99.0) is None
    assert victim_kind("crash", "hang", signal_before_failure(term_first, 99.0)) == "crash"
    assert signal_before_failure(term_first, None) == "SIGTERM"  # a stop without a failure: kept
    assert signal_before_failure(SimpleNamespace(signame=None, times={}), 5.0) is None
    assert signal_before_failure(None, 5.0) is None
