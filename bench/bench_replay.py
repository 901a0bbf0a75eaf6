"""What `checkpoint.verify_resume: replay` adds to a save and to a restore, side by side, in one process.

    .venv/bin/python bench/bench_replay.py [--dir /tmp/dslurm-bench-replay] [--preset small] [--batch 8] [--reps 5]
        [--threads 1] [--interval 50]

The trainer's model (train/model.py, a preset shape) with AdamW state after one step, one process.
Each repetition measures every row once, the two of a pair back to back in alternating order:
  save           CheckpointManager sync save (blocking=True, as a stop's): the fingerprint only
  save_replay    the probe (a forward of the state on one batch, eval mode, no gradients: what
                 train/recovery.py's probe_loss does) plus the same save, recording the probe
  restore        CheckpointManager.restore, verify_resume: fingerprint (crc32s, fingerprints)
  restore_replay the same with verify_resume: replay: the probe recomputed and compared
  step           one training step on that batch (forward, backward, AdamW): the probe's scale
  fingerprint    the fingerprint check's share of a restore (RestoreResult.phases["fingerprint"]: the
                 crc32 of every floating tensor held, compared); a save computes the same on its
                 helper thread, beside DCP's write
A restore's generation is the newest save's: with or without a recorded probe, the replay restore
runs the same forward (only the comparison differs). Ratios per repetition, then the median.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dslurm.checkpoint.dcp import CheckpointManager, TrainState  # noqa: E402
from dslurm.config.models import PRESETS  # noqa: E402
from train.model import build_model, cross_entropy  # noqa: E402


def probe_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Callable[[Any], float]:
    def probe(_extra: Any = None) -> float:
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                return float(cross_entropy(model(inputs), targets).item())
        finally:
            model.train(was)
    return probe


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dslurm-bench-replay"), help="scratch directory")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model shape")
    ap.add_argument("--batch", type=int, default=8, help="sequences in the probe's (and the step's) batch")
    ap.add_argument("--reps", type=int, default=5, help="repetitions")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1, as torchrun gives each worker: more threads than free "
                         "cores spin against the save's own threads and time the machine, not the save)")
    ap.add_argument("--interval", type=int, default=50, help="steps between saves, for the share printed last")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    shape = PRESETS[args.preset]
    shutil.rmtree(args.dir, ignore_errors=True)
    torch.manual_seed(0)
    model = build_model(shape, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, shape.vocab_size, (args.batch, shape.seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        cross_entropy(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = {"train": TrainState(model, opt)}
    probe = probe_of(model, inputs, targets)
    mb = sum(t.numel() * t.element_size() for t in model.parameters()) * 3 / 1e6
    print(f"preset {args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"~{mb:.0f} MB with AdamW state; batch {args.batch}x{shape.seq_len}; {args.reps} reps; "
          f"{args.threads} thread(s)")
    run = args.dir / "run"
    rows: dict[str, list[float]] = {k: [] for k in ("save", "save_replay", "restore", "restore_replay", "step",
                                                    "fingerprint")}
    n = 0
    with CheckpointManager(run, keep=2) as mgr:
        def save(replay: bool) -> None:
            nonlocal n
            n += 1
            p = probe() if replay else None
            assert mgr.save(n, state, {}, blocking=True, probe=p)

        for rep in range(args.reps):
            for replay in ((False, True) if rep % 2 == 0 else (True, False)):
                rows["save_replay" if replay else "save"].append(timed(lambda: save(replay)))  # noqa: B023
    fresh = build_model(shape, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)

    def restore(replay: bool) -> None:
        with CheckpointManager(run, verify_resume="replay" if replay else "fingerprint") as m:
            res = m.restore({"train": TrainState(fresh, fresh_opt)},
                            probe=probe_of(fresh, inputs, targets) if replay else None)
        assert res is not None and not res.fell_back, res
        if not replay:
            rows["fingerprint"].append(res.phases["fingerprint"])

    for rep in range(args.reps):
        for replay in ((False, True) if rep % 2 == 0 else (True, False)):
            rows["restore_replay" if replay else "restore"].append(timed(lambda: restore(replay)))  # noqa: B023
        rows["step"].append(timed(step))
    med = {k: statistics.median(v) for k, v in rows.items()}
    for k, v in med.items():
        print(f"  {k:<15} {v:8.3f} s   (reps: {', '.join(f'{x:.3f}' for x in rows[k])})")
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(rows[a], rows[b]))  # noqa: E731
    print(f"save_replay / save       = {ratio('save_replay', 'save'):.2f}x  "
          f"(+{med['save_replay'] - med['save']:.3f} s)")
    print(f"restore_replay / restore = {ratio('restore_replay', 'restore'):.2f}x  "
          f"(+{med['restore_replay'] - med['restore']:.3f} s)")
    print(f"fingerprint / restore    = {ratio('fingerprint', 'restore'):.2f}")
    per_step = statistics.median(timed(probe) for _ in range(args.reps)) / med["step"]
    print(f"probe forward / step     = {per_step:.2f}  (a save every {args.interval} steps: "
          f"+{100 * per_step / args.interval:.2f}% of the training time)")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
