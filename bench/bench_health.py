"""The cost of the in-run health checks (issue 18) against the step time they guard.

Per step the trainer now does, on top of what it did before (train/loop.py, train/watchdog.py):
  - the watchdog: one `beat`, five `collective` notes (forward_backward, grad_norm, step_agree,
    and the occasional stragglers/checkpoint), one fault-knob comparison and the data position;
  - the non-finite verdict: `~isfinite(norm)` as a fourth element of the step's existing
    all-reduce (no new collective) and one more `.item()`;
  - the watchdog thread: wakes every `health.poll_s(floor)` (5 s at the default floor of 120 s)
    to compute one median of <= 64 floats.
The per-step part is timed in process CPU seconds over many repetitions (one torch thread) and
compared with the step time of the demo model (tiny preset, global batch 8: forward, backward,
clip, AdamW), measured here the same way. The thread's share is its work per wake / poll interval.

    PYTHONPATH=. .venv/bin/python bench/bench_health.py [--reps 20000] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def cpu_per_call(fn, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n


def per_step_checks(reps: int) -> tuple[float, float]:
    """(watchdog + knob Python work, extra tensor work) in CPU seconds per step."""
    import torch

    from dslurm import faults
    from train.watchdog import Watchdog

    class Spec:
        hang_k, hang_floor_s, hang_ceiling_s = 10.0, 120.0, 1800.0

    wd = Watchdog(Spec, rank=0, world=1, start_dir=None, run_dir=".", on_hang=lambda v: None)

    def python_side() -> None:
        for name in ("forward_backward", "grad_norm", "step_agree"):
            with wd.collective(name):
                pass
        faults.poisoned(128, 8, None)
        wd.beat(1)

    norm, loss = torch.tensor(0.5), torch.tensor(5.0)
    one, zero = torch.tensor(1.0), torch.tensor(0.0)

    def before() -> None:
        v = torch.stack([loss, one, zero])
        v[1].item(), v[2].item()

    def after() -> None:
        v = torch.stack([loss, one, zero, (~torch.isfinite(norm)).float()])
        v[1].item(), v[2].item(), v[3].item()

    py = statistics.median(cpu_per_call(python_side, reps) for _ in range(5))
    extra = statistics.median(cpu_per_call(after, reps) - cpu_per_call(before, reps) for _ in range(5))
    return py, max(extra, 0.0)


def thread_share(floor_s: float = 120.0) -> float:
    from dslurm import health

    times = [0.05 + 0.001 * i for i in range(64)]
    per_wake = cpu_per_call(lambda: health.hang_bound(times, k=10, floor_s=floor_s, ceiling_s=1800), 20000)
    return per_wake / health.poll_s(floor_s)  # CPU seconds per second of training


def demo_step_s(steps: int) -> float:
    """CPU seconds per optimizer step of the tiny model, global batch 8, one process."""
    import torch

    from dslurm.config.models import PRESETS
    from train.model import build_model, cross_entropy

    shape = PRESETS["tiny"]
    model = build_model(shape, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, shape.vocab_size, (8, shape.seq_len + 1))

    def step() -> None:
        loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    step()  # warm-up
    return statistics.median(cpu_per_call(step, max(1, steps // 4)) for _ in range(4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20000)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    py, extra = per_step_checks(a.reps)
    share = thread_share()
    step = demo_step_s(a.steps)
    total = py + extra + share * step
    print(f"watchdog notes + beat + knob, per step:   {py * 1e6:8.1f} us")
    print(f"non-finite verdict (4th element, .item): {extra * 1e6:8.1f} us")
    print(f"watchdog thread, CPU per step:           {share * step * 1e6:8.1f} us")
    print(f"demo step (tiny, global batch 8, 1 proc): {step * 1e3:8.2f} ms")
    print(f"checks / step time:                      {100 * total / step:8.3f} %  (goal <= 1 %)")


if __name__ == "__main__":
    main()
