"""The data loader's tokens/s against the trainer's consumption in the demo job (goal >= 20x).

The demo is examples/jobs/tiny-2node.yaml (tiny model, global batch 8). Consumption: the
1-process trainer on that model (FSDP2 on a world of one; the fastest consumer on this
machine -- the demo's 4 processes on the same cores consume less), tokens per second of
wall time over `--steps` steps after one warm-up step. Loader: one data-parallel rank
reading the WHOLE global batch (dp 1, the most a rank ever reads per step) through
`make_loader`, for three data sections: the synthetic file, a 4-shard manifest (windows
across shard boundaries), and a mixture of the manifest and a file with val_fraction 0.01.
Times are wall and process CPU; the ratio uses wall time of both.

    .venv/bin/python bench/bench_loader.py [--steps 20] [--loader-steps 400]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
SITE = ROOT / "site-configs" / "local.yaml"
DEMO = ROOT / "examples" / "jobs" / "tiny-2node.yaml"
TOKENS = 1 << 22


def _resolved(tmp: Path, *sets: str):
    from dslurm.config.resolve import load

    return load(SITE, DEMO, ["nodes=1", "procs_per_node=1", "parallel.tp=1", f"checkpoint.run_dir={tmp / 'run'}",
                             f"data.synthetic_tokens={TOKENS}", *sets], ["node.nvlink_domain=8"])


def _corpus(tmp: Path, vocab: int) -> tuple[Path, Path]:
    """A 4-shard manifest and a single file, synthetic tokens."""
    from dslurm.data import tokenize as tk

    toks = tk.synthetic_tokens(TOKENS, vocab, seed=1)
    folder = tmp / "shards"
    folder.mkdir()
    q, shards = TOKENS // 4, []
    for i in range(4):
        tk._write_atomic(folder / f"shard-{i}.h5", [toks[i * q:(i + 1) * q]], vocab_size=vocab, seq_len=0,
                         source="bench")
        shards.append({"path": f"shard-{i}.h5", "n_tokens": q})
    (folder / "manifest.json").write_text(json.dumps({
        "format": "dslurm-manifest", "version": 1, "vocab_size": vocab, "dtype": "uint16",
        "n_tokens": 4 * q, "shards": shards}))
    single = tk.write_synthetic(tmp / "single.h5", TOKENS, vocab, seed=2)
    return folder / "manifest.json", single


def consumption(tmp: Path, steps: int) -> float:
    """Trainer tokens/s (wall) on the demo's model and batch, 1 process."""
    import torch
    import torch.distributed as dist

    from train.loop import Trainer

    torch.set_num_threads(1)
    resolved = _resolved(tmp)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(resolved, device=torch.device("cpu"), rank=0, world_size=1, fsdp=True, checkpoint=False)
        trainer.train_step()  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        wall = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    return steps * resolved.job.train.global_batch * resolved.shape.seq_len / wall


def loader_rate(resolved, steps: int) -> tuple[float, float]:
    """(tokens/s wall, tokens/s CPU) of `next_batch` on one rank reading the whole global batch."""
    from train.data import make_loader

    loader = make_loader(resolved, 0, 1, rank=0)
    loader.next_batch()  # open the files
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loader.next_batch()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = steps * loader.local_batch * loader.seq_len
    return tokens / wall, tokens / cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="trainer steps timed")
    p.add_argument("--loader-steps", type=int, default=400, help="loader batches timed per data section")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    base = _resolved(tmp)
    manifest, single = _corpus(tmp, base.shape.vocab_size)
    sections = {
        "synthetic file": (),
        "4-shard manifest": (f"data.path={manifest}",),
        "mixture 1:3 (manifest, file), val_fraction 0.01": (
            f"data.sources=[{{path: {manifest}, weight: 1}}, {{path: {single}, weight: 3}}]",
            "data.val_fraction=0.01"),
    }
    rates = {name: loader_rate(_resolved(tmp, *sets), args.loader_steps) for name, sets in sections.items()}
    need = consumption(tmp, args.steps)
    print(f"demo job {DEMO.name}: model {base.job.model.preset}, seq_len {base.shape.seq_len}, "
          f"global batch {base.job.train.global_batch}")
    print(f"trainer consumption (1 process, wall): {need:,.0f} tokens/s")
    print("| data section | loader tokens/s (wall) | loader tokens/s (CPU) | x consumption |")
    print("|---|---|---|---|")
    for name, (wall, cpu) in rates.items():
        print(f"| {name} | {wall:,.0f} | {cpu:,.0f} | **{wall / need:.0f}x** |")
    worst = min(w for w, _ in rates.values()) / need
    print(f"goal >= 20x: {'met' if worst >= 20 else 'NOT met'} (worst {worst:.0f}x)")


if __name__ == "__main__":
    main()
