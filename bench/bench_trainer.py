"""Trainer overhead and per-layout throughput on this machine.

1. Step time of the 1-process trainer with FSDP2 applied (world of one) against a plain
   PyTorch loop (forward, loss, backward, clip, AdamW) on the same model and batch size.
   Blocks of steps alternate between them, one torch thread, timed in process CPU seconds
   (wall time on 2 shared cores mostly measures the neighbours); the ratio of medians is
   reported (goal <= 1.05).
2. tokens/s of each parity layout under torchrun (gloo, CPU), read from the run's ledger
   (best `steps` window of 4 steps after the first, which holds warm-up).

    .venv/bin/python bench/bench_trainer.py [--preset small] [--steps 2] [--blocks 8] [--layout-steps 16] [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]  # testkit, train_helpers

LAYOUTS = {
    "1 process": (None, []),
    "FSDP x4": (4, []),
    "FSDP x TP 2x2": (4, ["parallel.tp=2"]),
    "PP x2 (1F1B)": (2, ["parallel.pp=2", "parallel.microbatches=2"]),
    "PP x FSDP x TP 2x2x2": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"]),
}


def _time_block(fn, n: int) -> float:
    """CPU seconds of this process per call: with one torch thread this is the work done,
    and unlike wall time it does not count time other processes took on the shared cores."""
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n


def overhead(preset: str, steps: int, blocks: int) -> tuple[float, float, float]:
    """(plain, trainer without FSDP, trainer with FSDP) s/step, medians over alternating blocks."""
    import torch
    import torch.distributed as dist

    from dslurm.config.resolve import load
    from train.loop import Trainer
    from train.model import build_model, cross_entropy
    from train_helpers import SITE, write_job

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    job = write_job(tmp, "overhead", steps=10_000, grad_clip=1.0)
    resolved = load(SITE, job, ["procs_per_node=1", f"model.preset={preset}",
                                "data.synthetic_tokens=1048576"], ["node.nvlink_domain=8"])
    shape, b = resolved.shape, resolved.job.train.global_batch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(resolved, device=torch.device("cpu"), rank=0, world_size=1, fsdp=True, checkpoint=False)
    bare = Trainer(resolved, device=torch.device("cpu"), rank=0, world_size=1, fsdp=False, checkpoint=False)
    model = build_model(shape, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    data = torch.randint(0, shape.vocab_size, (b, shape.seq_len + 1))

    def plain_step() -> None:
        loss = cross_entropy(model(data[:, :-1]), data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer logs the loss every step: same sync

    plain_step(), trainer.train_step(), bare.train_step()  # warm-up (allocations, optimizer state)
    plain, ours, nofsdp = [], [], []
    for _ in range(blocks):
        plain.append(_time_block(plain_step, steps))
        ours.append(_time_block(trainer.train_step, steps))
        nofsdp.append(_time_block(bare.train_step, steps))
    dist.destroy_process_group()
    return statistics.median(plain), statistics.median(nofsdp), statistics.median(ours)


def layout_throughput(steps: int, names: list[str] | None = None) -> dict[str, float]:
    """tokens/s per layout (tiny model): the best ledger window after the first (warm-up).
    Best, not mean: on shared cores a window is slowed by neighbours, never sped up."""
    from train_helpers import run_train, step_records, write_job

    out = {}
    for name, (nproc, sets) in LAYOUTS.items():
        if names is not None and name not in names:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="bench-layout-"))
        job = write_job(tmp, "layout", steps=steps)
        proc = run_train(nproc, job, *sets, f"train.log_every={min(4, max(1, steps // 2))}", timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        windows = step_records(tmp / "layout")[1:]
        out[name] = max(w["tokens_per_s"] for w in windows)
    return out


def print_overhead(args: argparse.Namespace) -> None:
    plain, bare, ours = overhead(args.preset, args.steps, args.blocks)
    print(f"\n| {args.preset} model, global batch 8, 1 process | CPU s/step | ratio |")
    print("|---|---|---|")
    print(f"| plain PyTorch loop | {plain:.4f} | 1.000 |")
    print(f"| trainer, no FSDP | {bare:.4f} | {bare / plain:.3f} |")
    print(f"| trainer (FSDP2 on a 1-process mesh) | {ours:.4f} | {ours / plain:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="model preset for the overhead comparison")
    p.add_argument("--steps", type=int, default=2, help="steps per timing block")
    p.add_argument("--blocks", type=int, default=8, help="alternating blocks per side")
    p.add_argument("--layout-steps", type=int, default=16, help="steps per layout run (tiny model)")
    p.add_argument("--skip-layouts", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--tiny", action="store_true",
                   help="the suite's smoke run (tests/integration/test_benches.py): tiny model, 1 block, "
                        "the 1-process layout for 4 steps; not a measurement")
    args = p.parse_args()
    if args.tiny:
        args.preset, args.steps, args.blocks, args.layout_steps = "tiny", 1, 1, 4
    if not args.skip_overhead:
        print_overhead(args)
    if not args.skip_layouts:
        print("\n| layout (tiny model, global batch 8, gloo CPU) | processes | tokens/s |")
        print("|---|---|---|")
        names = ["1 process"] if args.tiny else None
        for name, tps in layout_throughput(args.layout_steps, names).items():
            print(f"| {name} | {LAYOUTS[name][0] or 1} | {tps:,.0f} |")


if __name__ == "__main__":
    main()
