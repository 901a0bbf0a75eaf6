"""Partner copies (issue 52): restore from the partner copy vs the local and durable tiers, and the
step time with partner copies on vs off, side by side in one run.

    .venv/bin/python bench/bench_partner.py [--dir /tmp/dslurm-bench-partner] [--mb 67] [--reps 3]
                                            [--mbps 200] [--batch 16] [--steps 12]

Two processes on one machine, a gloo group, each its own "node" (SLURMD_NODENAME=node<rank>: its
own scratch, as tests/integration/test_partner_dist.py), one model (fp32 Linear layers, replicated:
each node holds all of it, so each rank sends --mb MB to its partner). Each repetition, after
os.sync():
  step_off / step_on   one two-tier async save after the first of --steps steps, partner copies
                       off / on (alternating order); the mean time of the steps after it (forward,
                       backward, SGD step, a barrier), run while the save's local write, partner
                       copy and durable copy go on in the background
  partner              the save's partner phase: local commit to partner commit (rank 0's view)
  restore_local        CheckpointManager.restore, both ranks from their own local copy
  restore_partner      node1's scratch gone: rank 1 pulls its files from the partner copy on node0
                       over gloo (checked as they arrive) while its checked load reads them as
                       they land
  restore_durable      both scratches gone: the durable tier, reads capped at --mbps per rank
                       (DSLURM_FAULT_DURABLE_MBPS: a loaded shared file system)
Checks every rep's save and restore phases in order first (a rep out of order fails the run),
then prints medians and best reps, the restores' phases (the slowest rank's), and the ratios of
issue 52: restore partner / local (goal <= 1.5), partner / durable, and step time partner on / off
(goal <= 1.02).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import make_model, nbytes, settle  # noqa: E402

from dslurm.checkpoint.dcp import CheckpointManager  # noqa: E402


def manager(base: Path, partner: bool) -> CheckpointManager:
    return CheckpointManager(base / "run", scratch=str(base / "scratch" / "%n"), async_mode=True,
                             partner=partner, on_lag="wait")


SAVE_ORDER = ("dcp", "local_commit", "partner", "manifest", "verify", "pointer")  # job.phases, from the save's start


def save_phase_problems(phases: dict[str, float], partner: bool) -> list[str]:
    """A save's phases must come in the order the two-tier save runs them (local write, local
    commit, partner copy, durable copy), with the partner copy exactly when it is on. Pure."""
    bad = [] if ("partner" in phases) == partner else [f"partner phase {'missing' if partner else 'present'}"]
    seen = [(k, phases[k]) for k in SAVE_ORDER if k in phases]
    missing = [k for k in SAVE_ORDER if k not in phases and k != "partner"]
    bad += [f"{k} missing" for k in missing]
    bad += [f"{a} {ta:.3f} s after {b} {tb:.3f} s" for (a, ta), (b, tb) in zip(seen, seen[1:]) if ta > tb]
    return bad


def restore_phase_problems(phases: dict[str, float], tier: str) -> list[str]:
    """A restore's phases: the pull only when restoring from the partner copy, and no part longer
    than the whole (the pull overlaps the load, so parts may sum to more). Pure."""
    bad = [] if ("partner_pull" in phases) == (tier == "partner") else [f"partner_pull with tier {tier}"]
    bad += [f"{k} {v:.3f} s > total {phases['total']:.3f} s" for k, v in phases.items() if v > phases["total"]]
    return bad + [f"{k} missing" for k in ("load", "total") if k not in phases]


def steps(model: torch.nn.Module, base: Path, partner: bool, n: int, batch: int) -> tuple[float, dict[str, float]]:
    """One save after the first step, then n - 1 steps while it runs (local write, partner copy,
    durable copy); -> (mean step time of those, the save's phases)."""
    for d in ("run", "scratch"):
        shutil.rmtree(base / d, ignore_errors=True)
    dist.barrier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    x = torch.randn(batch, model[0].in_features)
    times = []
    with manager(base, partner) as mgr:
        for i in range(n):
            t = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()  # waits for the host copy of the save (the fence)
            opt.zero_grad(set_to_none=True)
            if i == 0:
                mgr.save(1, {"model": model}, {})
            dist.barrier()  # a step of data parallelism ends when both ranks' does
            times.append(time.perf_counter() - t)
        mgr.wait()
        out = mgr.last_outcome
        assert out is not None and out.ok, out
    return statistics.mean(times[1:]), dict(out.phases)


def restore(model: torch.nn.Module, base: Path, tier: str, mbps: float) -> tuple[float, dict[str, float]]:
    """-> (the slowest rank's restore time, that rank's phases)."""
    rank = dist.get_rank()
    away = []
    if rank == 0:
        if tier in ("partner", "durable"):
            away.append(base / "scratch" / "node1")
        if tier == "durable":
            away.append(base / "scratch" / "node0")
        for p in away:
            shutil.move(p, p.with_name(p.name + ".away"))
    if tier == "durable":
        os.environ["DSLURM_FAULT_DURABLE_MBPS"] = str(mbps)
    dist.barrier()
    try:
        with manager(base, True) as mgr:
            t = time.perf_counter()
            res = mgr.restore({"model": model})
            dt = time.perf_counter() - t
            assert res is not None and res.tier == tier, (res.tier, res.tier_reason) if res else None
            dt, phases = max(dist_gather((dt, res.phases)), key=lambda x: x[0])  # the slowest rank's end
    finally:
        os.environ.pop("DSLURM_FAULT_DURABLE_MBPS", None)
        dist.barrier()
        if rank == 0:
            for p in away:
                shutil.rmtree(p, ignore_errors=True)
                shutil.move(p.with_name(p.name + ".away"), p)
        dist.barrier()
    return dt, phases


def dist_gather(x: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def worker(rank: int, args: argparse.Namespace, store: str) -> None:
    os.environ["SLURMD_NODENAME"] = f"node{rank}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    base = Path(args.dir)
    torch.manual_seed(0)  # replicated state is the same on every rank (the restore's fingerprint checks it)
    model = make_model(args.mb)
    rows = []
    for rep in range(args.reps):
        row: dict[str, Any] = {"bad": [], "phases": {}}
        for on in ([False, True] if rep % 2 == 0 else [True, False]):
            settle()
            step_s, save = steps(model, base, on, args.steps, args.batch)
            row["step_on" if on else "step_off"] = step_s
            row["bad"] += [f"save (partner {'on' if on else 'off'}): {b}" for b in save_phase_problems(save, on)]
            if not on:
                continue
            row["partner"] = save.get("partner", 0.0) - save.get("local_commit", 0.0)
            tiers = ["local", "partner", "durable"]  # from the generation the partner-on run saved
            for tier in (tiers if rep % 2 == 0 else tiers[::-1]):
                settle()
                row[f"restore_{tier}"], row["phases"][tier] = restore(model, base, tier, args.mbps)
                row["bad"] += [f"restore {tier}: {b}" for b in restore_phase_problems(row["phases"][tier], tier)]
        rows.append(row)
    if rank == 0:
        (base / "rows.json").write_text(json.dumps({"rows": rows, "bytes": nbytes(model)}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/dslurm-bench-partner")
    ap.add_argument("--mb", type=int, default=67)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mbps", type=float, default=200.0, help="durable read cap per rank (a loaded shared FS)")
    ap.add_argument("--batch", type=int, default=16, help="rows per training step (sets the step time)")
    ap.add_argument("--steps", type=int, default=12, help="steps per measurement (a save after the first)")
    args = ap.parse_args()
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    store = tempfile.mktemp(prefix="dslurm-bench-partner-store-")
    mp.spawn(worker, args=(args, store), nprocs=2, join=True)
    data = json.loads((base / "rows.json").read_text())
    rows = data["rows"]
    for i, r in enumerate(rows):  # checked before anything is reported
        if r["bad"]:
            print(f"REJECTED rep {i}: phases out of order ({' | '.join(r['bad'])})")
    if any(r["bad"] for r in rows):
        raise SystemExit(f"{sum(bool(r['bad']) for r in rows)} rep(s) rejected: phases out of order (see above)")
    keys = ["step_off", "step_on", "partner", "restore_local", "restore_partner", "restore_durable"]
    print(f"{data['bytes'] / 1e6:.0f} MB per node, 2 ranks (one per 'node'), {args.reps} reps, durable reads "
          f"capped at {args.mbps:g} MB/s per rank, load average {os.getloadavg()[0]:.1f}")
    for k in keys:
        print(f"  {k:16s} median {statistics.median(r[k] for r in rows):7.3f} s   "
              f"best {min(r[k] for r in rows):7.3f} s")
    for tier in ("local", "partner"):  # where the restores' time goes (the slowest rank's phases)
        parts = sorted({k for r in rows for k in r["phases"][tier]} - {"total"})
        print(f"  restore_{tier} phases (median s): " + ", ".join(
            f"{k} {statistics.median(r['phases'][tier].get(k, 0.0) for r in rows):.3f}" for k in parts))
    ratio = lambda a, b: statistics.median(r[a] / r[b] for r in rows)  # noqa: E731
    print(f"restore partner / local:                 {ratio('restore_partner', 'restore_local'):.3f}  (goal <= 1.5)")
    print(f"restore partner / durable at {args.mbps:g} MB/s: {ratio('restore_partner', 'restore_durable'):.3f}")
    print(f"step time, partner copies on / off:      {ratio('step_on', 'step_off'):.3f}  (goal <= 1.02)")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
