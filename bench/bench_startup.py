"""Trainer start-up against the floor, phase by phase; a restart against a cold start.

One repetition runs, one after the other on the same machine (alternating, so the
neighbours' load hits every side alike):
  floor   torchrun --nproc-per-node N: `import torch, torch.distributed` + init_process_group
          (gloo) + one barrier, in every process;
  cold    the demo job (examples/jobs/tiny-2node.yaml: FSDP x TP 2x2, tiny model) under the
          same torchrun, in a fresh run directory, 1 step (then its final save);
  restart the same run directory again, 2 steps: restores step 1, trains step 2.
Times are each process's own, from its birth (/proc) to the end of its first step (the
floor: to its barrier), read from the ledger's `start_phases` (rank 0) and the floor's
report; the slowest rank of the floor is compared with rank 0 of the trainer (rank 0's first
step ends with an all-reduce, so it waits for the slowest rank too). Ratios are taken per
repetition and their median reported (goal: cold <= 1.5x floor, restart <= 1.2x cold).
The burn-in phase is 0 here: plain torchrun does not ask for one (`dslurm launch --preflight` does).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_startup.py [--reps 5] [--nproc 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from dslurm.observe import events as ev  # noqa: E402
from dslurm.observe import phases as ph  # noqa: E402

SITE = ROOT / "site-configs" / "local.yaml"
JOB = ROOT / "examples" / "jobs" / "tiny-2node.yaml"

FLOOR = """\
import time
t_entry = time.time()
import torch, torch.distributed as dist
t_imports = time.time()
dist.init_process_group("gloo")
dist.barrier()
t_done = time.time()
import json, os, sys
sys.path.insert(0, os.environ["BENCH_ROOT"])
from train.startup import process_start_time  # after the clock stopped: not part of the floor
born = min(process_start_time() or t_entry, t_entry)
with open(os.environ["BENCH_OUT"] % os.environ["RANK"], "w") as fh:
    json.dump({"interpreter": t_entry - born, "imports": t_imports - t_entry,
               "rendezvous": t_done - t_imports, "total": t_done - born}, fh)
dist.destroy_process_group()
"""


def torchrun(nproc: int, *cmd: str, env: dict[str, str] | None = None, timeout: float = 600) -> float:
    """Run one torchrun; its wall seconds."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def floor(tmp: Path, nproc: int) -> tuple[dict[str, float], float]:
    """The slowest rank's floor phases, and torchrun's wall seconds."""
    script = tmp / "floor.py"
    script.write_text(FLOOR)
    out = str(tmp / "floor-%s.json")
    wall = torchrun(nproc, str(script), env={"BENCH_OUT": out, "BENCH_ROOT": str(ROOT)})
    ranks = [json.loads(Path(out % r).read_text()) for r in range(nproc)]
    return max(ranks, key=lambda d: d["total"]), wall


def trainer(run_dir: Path, nproc: int, steps: int) -> tuple[ph.StartTable, float]:
    """This start's phase table (rank 0) and torchrun's wall seconds."""
    wall = torchrun(nproc, "-m", "train", "--site", str(SITE), "--job", str(JOB),
                    "--set", f"checkpoint.run_dir={run_dir}", "--set", f"train.steps={steps}",
                    "--set", "checkpoint.async_save=false")
    return ph.tables(ev.read(run_dir))[-1], wall


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=4, help="processes (the demo: 2 nodes x 2)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    rows: list[tuple[dict[str, float], ph.StartTable, ph.StartTable, tuple[float, float, float]]] = []
    for rep in range(args.reps):
        run_dir = tmp / f"run-{rep}"
        f, fw = floor(tmp, args.nproc)
        cold, cw = trainer(run_dir, args.nproc, 1)
        restart, rw = trainer(run_dir, args.nproc, 2)
        assert cold.cold and not restart.cold, "the second start must restore the first one's save"
        rows.append((f, cold, restart, (fw, cw, rw)))
        print(f"rep {rep}: floor {f['total']:.2f} s  cold {cold.startup_s(spawn=False):.2f} s  "
              f"restart {restart.startup_s(spawn=False):.2f} s  (torchrun wall {fw:.1f} / {cw:.1f} / {rw:.1f} s)",
              flush=True)

    print(f"\nper phase, median of {args.reps} (s; rank 0 of the trainer, slowest rank of the floor)")
    names = [n for n in ph.ORDER if any(t.seconds(n) is not None for _, c, r, _ in rows for t in (c, r))]
    print(f"{'phase':<17}{'floor':>10}{'cold':>10}{'restart':>10}")
    floor_names = {"interpreter": "interpreter", "imports": "imports", "rendezvous": "rendezvous"}
    for n in names:
        fl = med([f[floor_names[n]] for f, *_ in rows]) if n in floor_names else None
        c = med([t.seconds(n) or 0.0 for _, t, _, _ in rows])
        r = med([t.seconds(n) or 0.0 for _, _, t, _ in rows])
        print(f"{n:<17}{'-' if fl is None else f'{fl:.3f}':>10}{c:>10.3f}{r:>10.3f}")
    fl_t = med([f["total"] for f, *_ in rows])
    c_t = med([c.startup_s(spawn=False) for _, c, _, _ in rows])
    r_t = med([r.startup_s(spawn=False) for _, _, r, _ in rows])
    print(f"{'total':<17}{fl_t:>10.3f}{c_t:>10.3f}{r_t:>10.3f}")
    cold_ratio = med([c.startup_s(spawn=False) / f["total"] for f, c, _, _ in rows])
    restart_ratio = med([r.startup_s(spawn=False) / c.startup_s(spawn=False) for _, c, r, _ in rows])
    fw, cw, rw = (med([w[i] for *_, w in rows]) for i in range(3))
    print(f"\ntorchrun wall, median: floor {fw:.2f} s, cold {cw:.2f} s, restart {rw:.2f} s "
          "(includes torchrun's own start, the exit and the saves)")
    print(f"cold start / floor   : {cold_ratio:.2f}x  (median of per-repetition ratios; goal <= 1.5)")
    print(f"restart / cold start : {restart_ratio:.2f}x  (goal <= 1.2)")


if __name__ == "__main__":
    main()
