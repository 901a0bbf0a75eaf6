"""A warm spare swap against the requeue path after the same node loss, side by side in one run
(issue 29; docs/recovery.md "Warm restarts").

Two jobs on the local Slurm cluster (3 nodes), one after the other, the same but for spares:
2 training nodes x 2 processes (tp 2, tiny model), a checkpoint every 5 steps, and the second
training node (node2; not the batch host) lost for real (its slurmd and every process under it
SIGKILLed, as tests/cluster/test_spares.py does) once step 7 has trained:

  (a) warm swap   `spares: 1`, `recovery.warm: true`: the spare node3's preloaded pool (started
                  after the first step, like every node's) forks the new workers; the bench waits
                  for node3's pool to serve before it kills node2
  (b) requeue     no spares: Slurm requeues the job without node2 and it starts again on
                  node1 + node3 (a new batch script, torchrun, imports)
  (c) cold swap   (`--cold-swap`) `spares: 1` without the pools: the swap of issue 17

Time to training = the kill to the first step done by the next start, by the report's own rule
(`dslurm.observe.endpoints`: never a `steps` event the dying attempt's rank 0 logged after the
kill); the ratio (a)/(b) is issue 29's "spare swap after a node loss: <= 0.15x the requeue path's
recovery". For each, the phases from the kill, from the ledger: the step's ending recorded, the
decision (recovery or requeue), the next start's launcher (job_start), its train_start
(restored), its first step. A rep whose phases are out of order is rejected on stderr, never
counted, and the bench exits non-zero. `--tiny` (the suite's smoke run): the warm swap once.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_warm_spare.py [--reps 1] [--cold-swap] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "cluster"), str(ROOT / "tests")]

from cluster_jobs import kill_node  # noqa: E402
from dslurm import cluster, slurm  # noqa: E402
from dslurm.launch.warm import ready_path  # noqa: E402
from dslurm.observe import endpoints  # noqa: E402
from dslurm.observe import events as ev  # noqa: E402
from dslurm.observe import phases as ph  # noqa: E402

KILL_AFTER = 7  # node2 is lost once this step trained; the save at 5 is the newest then
VARIANTS = {"warm swap": {"spares": 1, "on_spares_exhausted": "requeue", "recovery": {"warm": True}},
            "requeue": {},
            "cold swap": {"spares": 1, "on_spares_exhausted": "requeue"}}


def _wait(what: str, cond: Callable[[], object], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def _trained(run: Path, nth_start: int, step: int) -> bool:
    evs = ev.read(run)
    starts = [i for i, e in enumerate(evs) if isinstance(e, ev.TrainStart)]
    return len(starts) >= nth_start and any(isinstance(e, ev.Steps) and (e.last or 0) >= step
                                            for e in evs[starts[nth_start - 1]:])


def one(tmp: Path, name: str, env: dict[str, str], steps: int = 40
        ) -> tuple[endpoints.Timed, list[ph.StartTable], dict[str, object]]:
    """Run one job to the first step after node2's loss; phase times from the kill, the starts' tables."""
    run = tmp / name.replace(" ", "-")
    job = {"name": "bench-spare", "nodes": 2, "time": "00:10:00", "model": {"preset": "tiny"},
           "parallel": {"tp": 2}, "preflight": {"enabled": False},
           "requeue": {"max_restarts": 4, "no_progress_limit": 0},
           "train": {"steps": steps, "global_batch": 8, "log_every": 1, "step_sleep_s": 0.4},
           "checkpoint": {"run_dir": str(run), "interval": 5}, **VARIANTS[name]}
    spec = tmp / f"{run.name}.yaml"
    spec.write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "dslurm", "submit", "--site", str(ROOT / "site-configs/local.yaml"),
                          "--job", str(spec)], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)  # type: ignore[union-attr]
    try:
        _wait(f"{name}: step {KILL_AFTER}", lambda: _trained(run, 1, KILL_AFTER))
        if name == "warm swap":  # the spare's pool must serve, else the swap would be cold
            _wait("the spare's pool", lambda: ready_path(run, job_id, "node3").exists(), 120)
        # The second training node: never the batch host (the first), whose loss is another path.
        victim = [e for e in ev.read(run) if isinstance(e, ev.JobStart)][0].hosts[1]
        t0 = time.time()
        kill_node(victim)
        _wait(f"{name}: training again", lambda: _trained(run, 2, KILL_AFTER + 1))
    finally:
        slurm.run_cmd(["scancel", job_id], env=env, check=False)
        slurm.wait_job(int(job_id), timeout=120, env=env)
        cluster.up(nodes=3, accounting=True)  # the lost node back
    evs = ev.read(run)
    timed = endpoints.since(evs, t0)  # the report's starts: the endpoint is the next start's own step
    ts = timed.start.first(ev.TrainStart) if timed.start else None
    js = timed.start.first(ev.JobStart) if timed.start else None
    facts: dict[str, object] = {"job": job_id, "mode": js.mode if js else None, "hosts": js.hosts if js else [],
                                "resumed": ts.step if ts else None}
    return timed, ph.tables(evs), facts


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--cold-swap", action="store_true", help="also (c): the swap without warm pools")
    p.add_argument("--tiny", action="store_true",
                   help="the suite's smoke run (tests/cluster/test_cluster_benches.py): the warm swap only, no ratio")
    args = p.parse_args()
    # A TERM (a timeout, a Ctrl-C'd wrapper) unwinds through the `finally`s: the job cancelled, the node back.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = {**os.environ, **cluster.up(nodes=3, accounting=True).env()}
    names = ["warm swap"] if args.tiny else ["warm swap", "requeue", *(["cold swap"] if args.cold_swap else [])]
    rejected = 0
    for i in range(1 if args.tiny else args.reps):
        with tempfile.TemporaryDirectory(prefix="bench-spare-") as d:
            res: dict[str, float] = {}
            for name in names:
                timed, tables, facts = one(Path(d), name, env, steps=KILL_AFTER + 4 if args.tiny else 40)
                print(f"rep {i} {name:>9}: kill -> {endpoints.format_phases(timed)} s; next start {facts['mode']} "
                      f"on {','.join(facts['hosts'])} from step {facts['resumed']}; "  # type: ignore[arg-type]
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                if i == 0:
                    print(ph.format_table(tables), flush=True)
                bad = endpoints.check_order(timed)
                if bad:
                    print(f"REJECTED rep {i} {name}: phases out of order ({'; '.join(bad)}); not counted",
                          file=sys.stderr, flush=True)
                    break
                res[name] = timed.first_step  # type: ignore[assignment]
            if len(res) < len(names):
                rejected += 1
                continue
            if args.tiny:
                print(f"rep {i}: (a) warm swap {res['warm swap']:.2f} s (tiny: no ratio)", flush=True)
                continue
            extra = f", (c)/(b) = {res['cold swap'] / res['requeue']:.2f}" if "cold swap" in res else ""
            print(f"rep {i}: (a) warm swap {res['warm swap']:.2f} s, (b) requeue {res['requeue']:.2f} s: "
                  f"(a)/(b) = {res['warm swap'] / res['requeue']:.2f} (goal <= 0.15){extra}", flush=True)
    if rejected:
        raise SystemExit(f"{rejected} rep(s) rejected: their phases were out of order (see above)")


if __name__ == "__main__":
    main()
