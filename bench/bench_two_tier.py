"""Two-tier checkpoints vs durable-only, in one process, one model (fp32), one run of ratios.

    .venv/bin/python bench/bench_two_tier.py [--dir /tmp/dslurm-bench-2t] [--mb 134] [--reps 5] [--mbps 200]
                                             [--batch 64]

Each repetition runs, in alternating order, after os.sync():
  sync          durable-only sync save (CheckpointManager, async_mode=False): the save a stop makes today
  stall_staged  two-tier save with the host copy on the training thread (overlap_staging=False, the
                path before): time until save() returns, i.e. one host copy of the whole state
  stall         two-tier save with the host copy overlapped with the next step (the default): time
                until save() returns plus the time the next optimizer step waited for the copy
                (SaveOutcome.stall_s adds both)
  step_plain, step_staged, step  one training step (forward, backward, SGD step on a --batch of
                random rows) with no save in flight, and right after each kind of save
  local_commit  two-tier: save start to local commit (restorable on the same nodes)
  durable       two-tier: save start to the durable pointer move, the durable writer capped at --mbps
                (DSLURM_FAULT_DURABLE_MBPS), and lag = durable - local commit
  restore_local    CheckpointManager.restore from the local tier (full crc32 checks)
  restore_durable  the same generation from the durable tier, reads capped at --mbps
Every save is the second of its manager (steady state: the stager's host buffers exist). Prints
medians and best reps, then the ratios of issue 16: stall / sync for both stagings (goal <= 0.02),
the step time with a save in flight over a plain step, restore local / durable at the cap (goal
<= 0.5), and the durable lag.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import make_model, nbytes, settle  # noqa: E402

from dslurm.checkpoint.dcp import CheckpointManager  # noqa: E402


def durable_sync(model: nn.Module, base: Path) -> float:
    with CheckpointManager(base / "sync") as mgr:
        mgr.save(1, {"model": model}, {})
        t = time.perf_counter()
        mgr.save(2, {"model": model}, {})
        dt = time.perf_counter() - t
    shutil.rmtree(base / "sync")
    return dt


class Steps:
    """One training step on the benchmark model: forward, backward, SGD step (the fence's hook)."""

    def __init__(self, model: nn.Module, batch: int) -> None:
        self.model, self.opt = model, torch.optim.SGD(model.parameters(), lr=1e-6)
        self.x = torch.randn(batch, model[0].in_features)

    def __call__(self) -> float:
        t = time.perf_counter()
        self.model(self.x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t


def two_tier(model: nn.Module, base: Path, mbps: float, row: dict[str, float], step: Steps,
             overlap: bool) -> None:
    tag = "" if overlap else "_staged"
    for d in ("tt", "scratch"):  # the previous run's; the last one stays for the restores
        shutil.rmtree(base / d, ignore_errors=True)
    os.environ["DSLURM_FAULT_DURABLE_MBPS"] = str(mbps)
    try:
        with CheckpointManager(base / "tt", scratch=str(base / "scratch" / "%n"), async_mode=True,
                               overlap_staging=overlap) as mgr:
            mgr.save(1, {"model": model}, {})
            mgr.wait()
            mgr.save(2, {"model": model}, {})
            row[f"step{tag}"] = step()  # the step that overlaps the copy (and the local write)
            mgr.wait()
            out = mgr.last_outcome
            assert out is not None and out.ok and out.local_s is not None and out.lag_s is not None, out
            row[f"stall{tag}"] = out.stall_s  # save() until it returned + the optimizer step's wait
            if overlap:
                row["local_commit"], row["durable"], row["lag"] = out.local_s, out.total_s, out.lag_s
    finally:
        del os.environ["DSLURM_FAULT_DURABLE_MBPS"]


def restore(model: nn.Module, base: Path, mbps: float, tier: str) -> float:
    scratch = str(base / "scratch" / "%n")
    if tier == "durable":  # a node loss: the scratch is gone
        shutil.move(base / "scratch", base / "scratch.away")
        os.environ["DSLURM_FAULT_DURABLE_MBPS"] = str(mbps)
    try:
        with CheckpointManager(base / "tt", scratch=scratch) as mgr:
            t = time.perf_counter()
            res = mgr.restore({"model": model})
            dt = time.perf_counter() - t
            assert res is not None and res.tier == tier, res
    finally:
        os.environ.pop("DSLURM_FAULT_DURABLE_MBPS", None)
        if tier == "durable":
            shutil.rmtree(base / "scratch", ignore_errors=True)
            shutil.move(base / "scratch.away", base / "scratch")
    return dt


def one_rep(model: nn.Module, base: Path, mbps: float, flip: bool, step: Steps) -> dict[str, float]:
    row: dict[str, float] = {"step_plain": statistics.median(step() for _ in range(3))}
    order = ["sync", "staged", "overlap"] if not flip else ["overlap", "staged", "sync"]
    for what in order:
        settle()
        if what == "sync":
            row["sync"] = durable_sync(model, base)
        else:
            two_tier(model, base, mbps, row, step, overlap=what == "overlap")
    for tier in (["local", "durable"] if not flip else ["durable", "local"]):
        settle()
        row[f"restore_{tier}"] = restore(model, base, mbps, tier)
    shutil.rmtree(base / "tt")
    shutil.rmtree(base / "scratch")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/dslurm-bench-2t")
    ap.add_argument("--mb", type=int, default=134)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mbps", type=float, default=200.0, help="durable cap per rank (a loaded shared FS)")
    ap.add_argument("--batch", type=int, default=64, help="rows per training step (sets the step time)")
    args = ap.parse_args()
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    model = make_model(args.mb)
    size = nbytes(model)
    step = Steps(model, args.batch)
    rows = [one_rep(model, base, args.mbps, bool(i % 2), step) for i in range(args.reps)]
    keys = ["sync", "stall_staged", "stall", "step_plain", "step_staged", "step", "local_commit", "durable",
            "lag", "restore_local", "restore_durable"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"{size / 1e6:.0f} MB, {args.reps} reps, durable capped at {args.mbps:g} MB/s per rank, "
          f"load average {os.getloadavg()[0]:.1f}")
    for k in keys:
        print(f"  {k:16s} median {med[k]:7.3f} s   best {min(r[k] for r in rows):7.3f} s")
    ratio = lambda a, b: statistics.median(r[a] / r[b] for r in rows)  # noqa: E731
    print(f"two-tier stall / sync durable save, copy on the training thread: {ratio('stall_staged', 'sync'):.4f}")
    print(f"two-tier stall / sync durable save, copy overlapped:            {ratio('stall', 'sync'):.4f}"
          "  (goal <= 0.02)")
    print(f"step with the save in flight / plain step, copy on the training thread: "
          f"{ratio('step_staged', 'step_plain'):.3f}")
    print(f"step with the save in flight / plain step, copy overlapped:            "
          f"{ratio('step', 'step_plain'):.3f}")
    print(f"local commit / sync durable save:          {ratio('local_commit', 'sync'):.3f}")
    print(f"restore local / durable at {args.mbps:g} MB/s:     {ratio('restore_local', 'restore_durable'):.3f}"
          "  (goal <= 0.5)")
    print(f"durable lag (local commit -> pointer):     {med['lag']:.3f} s median")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
