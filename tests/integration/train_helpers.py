"""Helpers for the trainer's integration tests: a small job file, torchrun in its own
process group (killed whole on timeout, so no worker outlives a failed test), and the
per-step numbers read back from the run's ledger."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dslurm.observe.ledger import read_events
from testkit import LoadDeadline

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site-configs" / "local.yaml"

JOB = """\
name: {name}
nodes: 1
model:
  preset: tiny
train:
  steps: {steps}
  global_batch: 8
  log_every: 1
  warmup_steps: 2
  grad_clip: {grad_clip}
data:
  synthetic_tokens: 16384
checkpoint:
  interval: 100
  run_dir: {run_dir}
preflight:
  enabled: false
"""


def write_job(tmp: Path, name: str, *, steps: int = 4, grad_clip: float = 0.3) -> Path:
    """A tiny-model job whose run directory is under `tmp`; grad_clip 0.3 is below the
    tiny model's initial gradient norm (~0.57), so clipping is active in every step."""
    path = tmp / f"{name}.yaml"
    path.write_text(JOB.format(name=name, steps=steps, grad_clip=grad_clip, run_dir=tmp / name))
    return path


def run_train(nproc: int | None, job: Path, *sets: str, env: dict[str, str] | None = None,
              timeout: float = 90, entry: tuple[str, ...] = ("-m", "train")) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m train` (or a plain process when nproc is None); `entry`
    replaces `-m train` (a script that runs it, e.g. to look at the worker's modules).

    `timeout` is the bound on an idle machine; it stretches with the machine's load while the
    run goes on (testkit.LoadDeadline): every process imports torch (~5-10 CPU-s), so 8 of them
    on 2 busy cores take minutes, not a fixed 90 s, and are not hung."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(nproc)] if nproc else [sys.executable])
    cmd = [*launcher, *entry, "--site", str(SITE), "--job", str(job),
           "--site-set", "node.nvlink_domain=8"]
    for s in sets:
        cmd += ["--set", s]
    return run_procs(cmd, nproc or 1, timeout, env)


def run_procs(cmd: list[str], procs: int, timeout: float, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    """Run `cmd` (e.g. a torchrun of `procs` workers) from the repository root under a deadline that
    follows the machine's load (see `run_train`); the whole process group is stopped on expiry."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    deadline = LoadDeadline(timeout, procs=procs)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                if deadline.expired():
                    out, err = _stop(proc)
                    raise AssertionError(f"timed out after {deadline.describe()}: {' '.join(cmd)}\n{out}\n{err}"
                                         ) from None
    finally:  # also when pytest-timeout interrupts us
        if proc.poll() is None:
            _stop(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM first: torchrun forwards it to its workers, which live in sessions of their
    own (a killpg of torchrun's group would orphan them); then SIGKILL what is left."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def step_records(run_dir: Path) -> list[dict]:
    """The `steps` events (log_every=1: one per optimizer step), in order."""
    return [e for e in read_events(run_dir) if e["event"] == "steps"]


def worker_main(worker: Callable[[str, Path, Path], None]) -> None:
    """A torchrun worker file's `__main__`: MODE RUN_DIR OUT from argv, in a gloo process group
    (test_checkpoint_dist.py and the two-node tests of node_pair.py)."""
    import logging

    import torch.distributed as dist  # here: most users of this module never start a worker
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    try:
        worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    finally:
        dist.destroy_process_group()
    from dslurm.endings.worker_exit import leave
    leave(0)  # not the interpreter's finalization: it can abort a finished gloo worker (see leave)
