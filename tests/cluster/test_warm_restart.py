"""Warm restarts inside the allocation on the real local Slurm (dslurm/launch/warm.py): a 1+1 job
with `recovery.warm: true` and four failures within one allocation. Step 0 starts cold and rank 1
freezes (DSLURM_FAULT_FREEZE: TERM ignored, SIGSTOPped: neither its watchdog nor a TERM can end
it); rank 0's hang watchdog catches it, and the launcher's teardown has to SIGKILL it: step 1,
warm, starts only once that process is gone (watched from outside through /proc). Then three
crashes in a row: rank 1 is killed -9 in the warm step 1, step 2 falls back to the cold path
(torchrun) and rank 1 raises there, step 3 is warm again and rank 1 is killed -9, step 4 (cold)
completes: one job, no requeue. Every loss the job logged (the redone steps' too) equals, bit for
bit, an uninterrupted run's of the same job and layout (torchrun on this machine, no faults). The
failure -> first step of the warm attempts is printed beside the cold start's job start -> first
step."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster_jobs import ROOT, SITE, events, job_spec, logs, submit
from dslurm import slurm
from dslurm.observe import events as ev
from dslurm.observe.phases import tables
from dslurm.observe.report import summarize

# The goal, warm restart <= 0.35x a cold start, is a ratio for bench/bench_warm_restart.py
# (docs/recovery.md). Timed bounds in a test flake (CI runs it on 2 busy cores), so the test holds
# what does not move: the warm attempts imported nothing; it prints the times. The first fault waits
# (DSLURM_FAULT_AWAIT, bounded below the hang bound's ceiling) until both nodes' pools serve, so
# step 1 is warm however slowly the pools preloaded; they stay up, so step 3 finds them serving too.
STEPS = 18
SIGTERM_BIT = 1 << 14  # SIGTERM (15) in /proc/PID/status's SigIgn mask


def _losses(run) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in events(run, "steps"):
        assert e["first"] == e["last"], e  # log_every 1: one step per window, its own loss
        out.setdefault(e["last"], []).append(e["loss"])
    return out


class FrozenWatch(threading.Thread):
    """Finds the trainer process of `marker` (its job file on the command line) that is stopped
    (state T), notes its TERM disposition, then when it was last seen alive and first seen gone
    (wall clock): it died in between."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.done = marker.encode(), threading.Event()
        self.pid: int | None = None
        self.ignores_term = False
        self.alive_t: float | None = None
        self.gone_t: float | None = None

    def _frozen(self) -> int | None:
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and self.marker in (d / "cmdline").read_bytes() and \
                        (d / "stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"T":
                    return int(d.name)
            except (OSError, IndexError):
                continue
        return None

    def run(self) -> None:
        while not self.done.is_set() and self.gone_t is None:
            if self.pid is None:  # frozen for torchrun's 30 s grace: a slow scan finds it
                self.pid = self._frozen()
                if self.pid is not None:
                    status = Path(f"/proc/{self.pid}/status").read_text()
                    ign = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigIgn:"))
                    self.ignores_term = bool(int(ign, 16) & SIGTERM_BIT)
                time.sleep(0.25)
                continue
            now = time.time()
            if Path(f"/proc/{self.pid}").exists():
                self.alive_t = now
            else:
                self.gone_t = now
            time.sleep(0.02)


@pytest.mark.timeout(600)
def test_a_frozen_rank_then_three_crashes_in_a_row_end_bit_identical(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "warm"
    spec = job_spec(tmp_path, "warm", steps=STEPS, nodes=1, interval=2, sleep=0.2, spares=1,
                    recovery={"warm": True}, requeue={"max_restarts": 5, "no_progress_limit": 0},
                    health={"hang_k": 3, "hang_floor_s": 8, "hang_ceiling_s": 100},
                    env={"DSLURM_FAULT_FREEZE": "9:1@0.0", "DSLURM_FAULT_KILL9": "11:1@0.1;15:1@0.3",
                         "DSLURM_FAULT_CRASH": "13:1@0.2", "DSLURM_FAULT_AWAIT": f"{run}/warm/*.ready:2:90"})
    watch = FrozenWatch(str(run / "job.yaml"))  # the trainer's --job: submit's copy in the run dir
    watch.start()
    try:
        job = submit(cli, env, spec)
        assert slurm.wait_job(job, timeout=450, env=env) == "COMPLETED", logs(run)
    finally:
        watch.done.set()
    assert slurm.job_info(job, env=env)["restarts"] == 0
    ends = events(run, "ending")
    assert [e["cls"] for e in ends] == ["crash", "crash", "crash", "crash", "completed"], logs(run)
    # rank 0's watchdog caught it (the frozen rank left no note: rank 0 reports the crash, naming it)
    assert "hang" in ends[0]["reason"] and "suspect rank(s) [1]" in ends[0]["reason"], ends[0]
    (hang,) = events(run, "hang")
    assert hang["suspects"] == [1] and hang["step"] == 8, hang
    starts = events(run, "job_start")
    assert [e["mode"] for e in starts] == ["torchrun", "warm", "torchrun", "warm", "torchrun"], logs(run)
    assert [e["mode"] for e in events(run, "recovery")] == ["same_nodes"] * 4
    assert [s["step"] for s in events(run, "train_start")] == [0, 8, 10, 12, 14]
    # The frozen rank: stopped, deaf to TERM, killed (only SIGKILL ends it), and gone before the
    # warm attempt's launcher asked the pool for workers.
    assert watch.pid is not None and watch.ignores_term, "the frozen rank was not seen stopped with TERM ignored"
    assert watch.alive_t is not None and watch.gone_t is not None, (watch.alive_t, watch.gone_t)
    # It died in (alive_t, gone_t]: seen alive only before the launch, and seen gone no later than
    # one poll (and a loaded machine's scheduling delay) after it.
    assert watch.alive_t < starts[1]["t"] and watch.gone_t <= starts[1]["t"] + 0.25, (watch.alive_t, watch.gone_t,
                                                                                     starts[1]["t"])
    evs = ev.read(run)
    cold, warm, again, warm2, last = tables(evs)
    assert warm.warm and warm2.warm and not cold.warm and not again.warm and not last.warm
    assert (warm.seconds("imports") or 0) < 0.2 < (cold.seconds("imports") or 0), (cold.rows, warm.rows)
    to_training = [r.resumed_s or 0.0 for r in summarize(evs).recoveries]
    print(f"cold job start -> first step {cold.startup_s():.1f} s; failure -> first step: after the freeze "
          f"(warm) {to_training[0]:.1f} s, warm -> cold {to_training[1]:.1f} s, cold -> warm {to_training[2]:.1f} s "
          f"({to_training[2] / cold.startup_s():.2f}x), warm -> cold {to_training[3]:.1f} s; the frozen rank "
          f"was last seen alive {starts[1]['t'] - watch.alive_t:.2f} s before the warm launch")

    # The reference: the same job and layout (1 node x 2 processes, tp 2), uninterrupted, no faults,
    # no step sleep (a sleep only), through torchrun on this machine after the job ended.
    ref = tmp_path / "ref"
    ref_spec = job_spec(tmp_path, "ref", steps=STEPS, nodes=1, interval=2, sleep=0.0)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "train", "--site", SITE, "--job", ref_spec], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    want = {step: losses[0] for step, losses in _losses(ref).items()}
    assert sorted(want) == list(range(STEPS))
    got = _losses(run)
    assert sorted(got) == list(range(STEPS))
    # Every step's loss, each time it was logged, bit for bit.
    assert {step: set(losses) for step, losses in got.items()} == {step: {want[step]} for step in want}, got
