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

Every `health.sdc_every` steps (and before each save) the replica check: the fingerprint of every
local parameter shard, one all-gather over dp_replicate, one 1-element all-reduce (train/sdc.py).
Timed in wall seconds with 2 gloo processes that each hold the whole tiny model (dp_replicate 2,
dp_shard 1: the largest shards the demo model can have), against the demo step's wall time in the
same process. Every `health.device_poll_every` steps the NVML poll, with pynvml mocked (this
machine has no GPU: this times our Python around NVML, not the driver calls).

    PYTHONPATH=. .venv/bin/python bench/bench_health.py [--reps 20000] [--steps 20] [--checks 200]
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


def demo_step_s(steps: int, timer=cpu_per_call) -> float:
    """CPU (or, with timer=wall_per_call, wall) seconds per optimizer step of the tiny model,
    global batch 8, one process."""
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
    return statistics.median(timer(step, max(1, steps // 4)) for _ in range(4))


def _sdc_worker(rank: int, port: int, checks: int, steps: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from dslurm.config.models import PRESETS
    from train.model import build_model
    from train.sdc import ReplicaCheck

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = build_model(PRESETS["tiny"], seed=0)
    named = list(model.named_parameters())
    chk = ReplicaCheck([p for _, p in named], [n for n, _ in named], dist.group.WORLD, torch.device("cpu"),
                       "localhost", rank)
    assert chk.check() is None  # identical replicas
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(checks):
        chk.check()
    per_check = (time.perf_counter() - t0) / checks
    if rank == 0:
        Path(out).write_text(f"{per_check}")
    dist.destroy_process_group()


def sdc_check_s(checks: int, steps: int) -> float:
    """Wall seconds of one replica check of the tiny model over 2 gloo processes."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "per_check")
        mp.spawn(_sdc_worker, args=(port, checks, steps, out), nprocs=2)
        return float(Path(out).read_text())


def fingerprint_cpu_s(reps: int) -> float:
    """CPU seconds of the fingerprint alone (no peer to wait on): the load-independent part."""
    from dslurm.config.models import PRESETS
    from train.model import build_model
    from train.sdc import fingerprint

    params = list(build_model(PRESETS["tiny"], seed=0).parameters())
    return statistics.median(cpu_per_call(lambda: fingerprint(params), reps) for _ in range(3))


def nvml_poll_s(reps: int) -> float:
    """CPU seconds of one DevicePoll.poll of an 8-GPU node, pynvml mocked (no GPU here)."""
    from unittest import mock

    import pynvml

    from dslurm.preflight.thresholds import Thresholds
    from train.sdc import DevicePoll

    timeout = pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def wait(*a: object) -> None:
        raise timeout

    fakes = dict(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 8,
                 nvmlDeviceGetHandleByIndex=lambda i: i, nvmlEventSetCreate=lambda: "set",
                 nvmlDeviceRegisterEvents=lambda *a: None, nvmlEventSetFree=lambda *a: None,
                 nvmlEventSetWait_v2=wait, nvmlDeviceGetTemperature=lambda *a: 60,
                 nvmlDeviceGetTotalEccErrors=lambda *a: 0, nvmlDeviceGetCurrentClocksEventReasons=lambda *a: 0)
    with mock.patch.multiple(pynvml, **fakes):
        poll = DevicePoll(Thresholds())
        assert poll.on and poll.poll() == []
        return cpu_per_call(poll.poll, reps)


def wall_per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checks", type=int, default=200)
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
    from dslurm.config import HealthSpec

    h = HealthSpec()
    wall_step = demo_step_s(a.steps, wall_per_call)
    sdc = sdc_check_s(a.checks, a.steps)
    poll = nvml_poll_s(max(1, a.reps // 20))
    periodic = sdc / h.sdc_every + poll / h.device_poll_every
    print(f"replica check (fingerprint + all-gather + all-reduce, 2 gloo procs, whole tiny model): "
          f"{sdc * 1e3:.2f} ms = {100 * sdc / wall_step:.1f} % of one step, every {h.sdc_every} steps")
    fp = fingerprint_cpu_s(max(1, a.checks // 2))
    print(f"  of which the fingerprint alone, CPU:   {fp * 1e3:8.2f} ms = {100 * fp / step:.1f} % of one step "
          f"(CPU time), {100 * fp / step / h.sdc_every:.3f} % every {h.sdc_every} steps")
    print(f"NVML poll (8 GPUs, pynvml mocked):       {poll * 1e6:8.1f} us, every {h.device_poll_every} steps")
    print(f"demo step, wall (same as above):         {wall_step * 1e3:8.2f} ms")
    print(f"periodic checks / step time:             {100 * periodic / wall_step:8.3f} %  (at the defaults)")
    print(f"all checks / step time:                  {100 * (total / step + periodic / wall_step):8.3f} %  "
          "(goal <= 1 %)")


if __name__ == "__main__":
    main()
