"""The same fault under replica groups, spare recovery and requeue, side by side in one run (issue 50;
docs/recovery.md "Replica groups").

Four jobs on the local Slurm cluster (3 nodes), one after the other, the same tiny model (tp 1, one
process per node, global batch 6, a checkpoint every 5 steps), and the same fault: kill -9 (or, for
(b), SIGSTOP) of the training process on the last training node once step 7 has trained:

  (a) replicas       3 nodes, `recovery.replicas: true`, dp_replicate 3: the two other groups train
                     on (torchft leaves the lost one out of the next quorum after
                     recovery.replica_timeout_s); the lost group's step starts again and heals from a
                     live peer
  (b) replicas-hang  as (a) with SIGSTOP: the frozen group keeps its sockets open, so the survivors'
                     all-reduce gives up on it after replica_timeout_s (gloo's per-wait timeout); the
                     supervisor ends the frozen step later (its stall bound), and it heals
  (c) in-alloc       2 nodes + 1 spare (`dslurm supervise`): every rank stops, the step starts again
                     on the same nodes (no node at fault) and resumes from the checkpoint pointer
  (d) requeue        3 nodes, no spare: every rank stops, Slurm requeues the job, it resumes from the
                     pointer

Printed per variant: the step time before the fault (median of the 5 step intervals before it); the
survivors' next step done after the fault (for (a)/(b) the next `steps` event of group 0, which was
never stopped; for (c)/(d) the next start's first step, by the report's rule,
`dslurm.observe.endpoints`); the lost time: for (c)/(d) how much later that step came than it
would have without the fault (the last step before the fault + one step time; the steps retrained
from the checkpoint are not counted, in their favour), for (a)/(b) how much later the survivors'
3rd step after the lost group healed came than that many steps at the step time (a fault that
lands after the group's part of a step's all-reduce shows in the step after; the heal's serving
is counted too); and that as steps; for (a)/(b) the heal: its
seconds and bytes and when the group was back in the quorum (fault -> `replica_healed`). Goal of the
issue: the survivors lose at most one step's time per fault. Each variant's events are checked to
be in order (steps before the fault, the fault's replica_lost/ending after it, the next step, the
heal last) before anything is printed.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_replicas.py          # 60 steps (replicas), 30 (the others)
    PYTHONPATH=$PWD .venv/bin/python bench/bench_replicas.py --tiny   # the suite's run: 12 steps each
    PYTHONPATH=$PWD .venv/bin/python bench/bench_replicas.py --only replicas replicas-hang --replica-timeout-s 0.5
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "cluster"), str(ROOT / "tests")]

from dslurm import cluster, slurm  # noqa: E402
from dslurm.cluster.disrupt import signal_pids, workers  # noqa: E402
from dslurm.observe import endpoints  # noqa: E402
from dslurm.observe import events as ev  # noqa: E402
from dslurm.run import RunDir  # noqa: E402

KILL_AFTER = 7
REPLICAS = {"nodes": 3, "parallel": {"tp": 1, "dp_replicate": 3}, "recovery": {"replicas": True}}
VARIANTS: dict[str, dict[str, object]] = {
    "replicas": REPLICAS,
    "replicas-hang": REPLICAS,
    "in-alloc": {"nodes": 2, "spares": 1, "parallel": {"tp": 1}},
    "requeue": {"nodes": 3, "parallel": {"tp": 1}},
}


def _wait(what: str, cond: Callable[[], object], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def _steps(run: Path) -> list[ev.Steps]:
    return [e for e in ev.read(run) if isinstance(e, ev.Steps)]


def in_order(name: str, phases: list[tuple[str, float | None]]) -> None:
    """The variant's events happened in the order its measurement assumes, or the bench stops."""
    missing = [what for what, t in phases if t is None]
    if missing:
        raise SystemExit(f"{name}: no {', '.join(missing)}: nothing measured")
    for (a, ta), (b, tb) in zip(phases, phases[1:]):
        if ta is None or tb is None or ta > tb:
            raise SystemExit(f"{name}: {a} ({ta}) is after {b} ({tb}): the phases are out of order")


def one(tmp: Path, name: str, env: dict[str, str], steps: int,
        timeout_s: float | None) -> dict[str, float | int | None]:
    run = tmp / name
    variant = dict(VARIANTS[name])
    if timeout_s is not None and name.startswith("replicas"):
        variant["recovery"] = {"replicas": True, "replica_timeout_s": timeout_s}
    job = {"name": f"bench-{name}", "time": "00:10:00", "model": {"preset": "tiny"}, "procs_per_node": 1,
           "preflight": {"enabled": False}, "requeue": {"max_restarts": 4, "no_progress_limit": 0},
           "train": {"steps": steps, "global_batch": 6, "log_every": 1, "step_sleep_s": 0.4},
           "checkpoint": {"run_dir": str(run), "interval": 5}, **variant}
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "dslurm", "submit", "--site", str(ROOT / "site-configs/local.yaml"),
                          "--job", str(spec)], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)  # type: ignore[union-attr]
    victim_node = "node3" if name != "in-alloc" else "node2"  # the last training node, never the batch host
    victims: list[int] = []
    try:
        _wait(f"{name}: step {KILL_AFTER}", lambda: any((e.last or 0) >= KILL_AFTER for e in _steps(run)))
        victims = [p.pid for p in workers(job_id, str(RunDir(run).job_yaml)) if p.node == victim_node]
        t0 = time.time()
        if not signal_pids(victims, signal.SIGSTOP if name == "replicas-hang" else signal.SIGKILL):
            raise SystemExit(f"{name}: no training process on {victim_node}")
        if name.startswith("replicas"):
            _wait("the lost group healed", lambda: any(isinstance(e, ev.ReplicaHealed) and e.t > t0
                                                       for e in ev.read(run)))
        else:
            _wait(f"{name}: training again", lambda: endpoints.since(ev.read(run), t0).first_step is not None)
    finally:
        slurm.run_cmd(["scancel", job_id], env=env, check=False)
        if name == "replicas-hang":  # a stopped trainer outside its step's process group outlives
            signal_pids(victims, signal.SIGKILL)  # the job on this cluster (proctrack/pgid)
        slurm.wait_job(int(job_id), timeout=120, env=env)
    evs = ev.read(run)
    before = [e for e in evs if isinstance(e, ev.Steps) and e.t < t0]
    if len(before) < 6:
        raise SystemExit(f"{name}: {len(before)} step window(s) before the fault, 6 needed")
    step_s = statistics.median(b.t - a.t for a, b in zip(before[-6:], before[-5:]))
    heal: dict[str, float | int | None] = {}
    if name.startswith("replicas"):
        nxt = next((e.t for e in evs if isinstance(e, ev.Steps) and e.t > t0), None)  # group 0 never stopped
        lost = next((e.t for e in evs if isinstance(e, ev.ReplicaLost) and e.t > t0), None)
        back = next((e for e in evs if isinstance(e, ev.ReplicaHealed) and e.t > t0), None)
        # the survivors' next step comes before the lost group's step has even ended (a kill: ended
        # at once, but recorded after srun's exit; a hang: ended by the supervisor's stall bound)
        in_order(name, [("last step before the fault", before[-1].t), ("fault", t0), ("survivors' next step", nxt),
                        ("healed", back.t if back else None)])
        in_order(name, [("fault", t0), ("replica_lost", lost), ("healed", back.t if back else None)])
        assert nxt is not None and back is not None
        # The fault may land after the stopped group's part of the step's all-reduce: then the next
        # step commits on time and the loss shows in the one after (the quorum's wait). So the
        # survivors' loss is read at their 3rd step after the lost group healed (its heal served
        # too): how much later that step came than n steps at the step time.
        after = [e for e in evs if isinstance(e, ev.Steps) and e.t > t0]
        k = next((i for i, e in enumerate(after) if e.t > back.t), len(after) - 1)
        k = min(k + 2, len(after) - 1)
        late = after[k].t - (before[-1].t + (k + 1) * step_s)
        heal = {"heal_s": back.heal_s, "heal_bytes": back.bytes, "back_s": round(back.t - t0, 2),
                "missed": back.missed_steps}
    else:
        first = endpoints.since(evs, t0).first_step
        ending = next((e.t for e in evs if isinstance(e, ev.Ending) and e.t > t0), None)
        nxt = t0 + first if first is not None else None
        in_order(name, [("last step before the fault", before[-1].t), ("fault", t0), ("the fault's ending", ending),
                        ("the next start's first step", nxt)])
        assert nxt is not None
        late = nxt - (before[-1].t + step_s)  # how much later the next step came than without the fault
    return {"job": int(job_id), "step_s": round(step_s, 3), "to_step_s": round(nxt - t0, 2),
            "lost_s": round(late, 2), "lost_steps": round(late / step_s, 2), **heal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--tiny", action="store_true",
                    help="12 steps per variant, no hang variant (the suite's run: the script works, its numbers are "
                    "not kept)")
    ap.add_argument("--replica-timeout-s", type=float, default=None,
                    help="recovery.replica_timeout_s for the replica variants (default: the job's default)")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="these variants")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = {**os.environ, **cluster.up(nodes=3, accounting=True).env()}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as d:
        # --tiny leaves the hang out: 12 steps end before its group is back, and its ~40 s more (the
        # stall bound, a restart, the final gather) buy the suite nothing the kill does not show.
        for name in [n for n in args.only if not (args.tiny and n == "replicas-hang")]:
            r = one(Path(d), name, env, steps=12 if args.tiny else 60 if name.startswith("replicas") else 30,
                    timeout_s=args.replica_timeout_s)
            extra = (f"; heal {r['heal_s']:.2f} s, {int(r['heal_bytes'] or 0) / 1e6:.1f} MB, the group back in "
                     f"the quorum {r['back_s']:.1f} s after the fault ({r['missed']} step(s) missed)"
                     if name.startswith("replicas") else "")
            print(f"{name:>13} (job {r['job']}): step {r['step_s']:.2f} s; fault -> the survivors' next step "
                  f"{r['to_step_s']:.2f} s, lost {r['lost_s']:.2f} s = {r['lost_steps']:.2f} step(s){extra}; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
