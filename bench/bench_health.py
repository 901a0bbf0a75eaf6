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

Issue 37 adds the always-on recording: PyTorch's Flight Recorder on every process group (one
ring-buffer entry per c10d collective, in C++), the wall-clock phase spans of each step (two
`time.time_ns()` per phase), and every `train.straggler_every` steps the straggler split (the
ring read back as a pickle without stack traces, the step's arrivals picked out, the pure split;
the payload rides in the all-gather the check already made). The recorder's cost is measured as
the CPU time of a 1-element gloo all-reduce in a world of one, with the recorder off
(TORCH_FR_BUFFER_SIZE=0) and on (`health.FR_ENTRIES`), in alternating child processes (the size is
read once per process), and multiplied by the c10d collectives of one demo step, counted from
the recorder of 2 gloo processes running the tiny model under FSDP2.

    PYTHONPATH=. .venv/bin/python bench/bench_health.py [--reps 20000] [--steps 20] [--checks 200]
                                                        [--recording-only]
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
    from dslurm.run import RunDir
    from train.watchdog import Watchdog

    class Spec:
        hang_k, hang_floor_s, hang_ceiling_s = 10.0, 120.0, 1800.0

    wd = Watchdog(Spec, rank=0, world=1, start_dir=None, run=RunDir("."), on_hang=lambda v: None)

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


def _fr_child(reps: int) -> None:
    """One process, world of one: CPU seconds per all-reduce, and (recorder on) per straggler split."""
    import json
    import os

    import torch
    import torch.distributed as dist

    from dslurm.observe import slowrank
    from dslurm.runtime import flight

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(1)
    for _ in range(200):
        dist.all_reduce(x)
    per_op = statistics.median(cpu_per_call(lambda: dist.all_reduce(x), reps // 5) for _ in range(5))
    split = 0.0
    if os.environ.get("TORCH_FR_BUFFER_SIZE") != "0":  # the ring is full: read it back as a check does
        now = time.time_ns()
        spans = [("data", now - 4_000_000, now - 3_000_000), ("compute", now - 3_000_000, now - 1_000_000),
                 ("optimizer", now - 1_000_000, now)]

        def check() -> None:
            arr = flight.arrivals(now - 10**9, now)
            steps = [slowrank.RankStep(rank=r, host="h", step_s=0.004, spans=spans, arrivals=arr[-18:])
                     for r in range(2)]
            slowrank.causes(steps)

        split = statistics.median(cpu_per_call(check, 20) for _ in range(3))
    dist.destroy_process_group()
    print(json.dumps({"per_op": per_op, "split": split}))


FR_ENTRIES = 500  # health.FR_ENTRIES (checked in main: the bench measures the shipped size)


def fr_costs(reps: int, rounds: int = 3) -> tuple[float, float, float]:
    """(CPU s per collective with the recorder off, on; CPU s per straggler split), alternating
    children so that both see the same machine load."""
    import json
    import os
    import subprocess

    off, on, split = [], [], []
    for _ in range(rounds):
        for size, into in (("0", off), (str(FR_ENTRIES), on)):
            out = subprocess.run([sys.executable, __file__, "--fr-child", str(reps)], check=True, text=True,
                                 capture_output=True, env={**os.environ, "TORCH_FR_BUFFER_SIZE": size})
            got = json.loads(out.stdout.strip().splitlines()[-1])
            into.append(got["per_op"])
            if size != "0":
                split.append(got["split"])
    return statistics.median(off), statistics.median(on), statistics.median(split)


def _count_worker(rank: int, port: int, steps: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dslurm import health
    from dslurm.config.models import PRESETS
    from dslurm.runtime import flight
    from train.model import build_model, cross_entropy

    torch.set_num_threads(1)
    health.enable_flight_recorder(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shape = PRESETS["tiny"]
    model = build_model(shape, seed=0)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, shape.vocab_size, (4, shape.seq_len + 1))
    t = [time.time_ns()]
    for _ in range(steps):
        cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(time.time_ns())
    per_step = [len(flight.arrivals(a, b)) for a, b in zip(t[1:], t[2:])]  # the first step: lazy init
    if rank == 0:
        Path(out).write_text(f"{statistics.median(per_step)}")
    dist.destroy_process_group()


def collectives_per_step(steps: int = 4) -> float:
    """c10d collectives of one tiny-model step under FSDP2 on 2 gloo processes (from the recorder)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "count")
        mp.spawn(_count_worker, args=(port, steps, out), nprocs=2)
        return float(Path(out).read_text())


def spans_cpu_s(reps: int) -> float:
    """CPU seconds of the four phase contexts of a step (their spans included) and the step's end."""
    from train.metrics import Peak, StepMetrics

    m = StepMetrics(tokens_per_step=1, flops_per_token=1.0, peak=Peak(0.0, "x"), n_devices=1)
    m.start()

    def step() -> None:
        for name in ("data", "compute", "optimizer", "checkpoint"):
            with m.phase(name):
                pass
        m.end_step(0, 0.0)
        m._steps.clear()  # keep the window from growing over the repetitions

    return cpu_per_call(step, reps)


def wall_per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checks", type=int, default=200)
    p.add_argument("--fr-child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--recording-only", action="store_true", help="only issue 37's always-on recording")
    a = p.parse_args()
    if a.fr_child:
        _fr_child(a.fr_child)
        return
    import torch

    torch.set_num_threads(1)
    from dslurm import health

    assert health.FR_ENTRIES == FR_ENTRIES, (health.FR_ENTRIES, FR_ENTRIES)
    if a.recording_only:
        recording(a.reps, demo_step_s(a.steps))
        return
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
    recording(a.reps, step)


def recording(reps: int, step: float) -> None:
    """Issue 37: the always-on recording against the demo step (CPU time)."""
    from dslurm.config import TrainSpec

    off, on, split = fr_costs(reps)
    n = collectives_per_step()
    spans = spans_cpu_s(reps)
    every = TrainSpec().straggler_every
    rec = max(0.0, on - off) * n + spans + split / every
    print(f"demo step (tiny, global batch 8, 1 proc): {step * 1e3:8.2f} ms")
    print(f"c10d all-reduce, recorder off / on, CPU: {off * 1e6:8.1f} / {on * 1e6:.1f} us "
          f"(+{(on - off) * 1e6:.1f} us per collective; {FR_ENTRIES} entries)")
    print(f"c10d collectives per demo step (FSDP2, 2 gloo procs): {n:.0f}")
    print(f"phase spans (4 phases + step end), CPU:  {spans * 1e6:8.1f} us per step")
    print(f"straggler split (ring read + split), CPU: {split * 1e3:7.2f} ms per check, every {every} steps")
    print(f"recording / step time:                   {100 * rec / step:8.3f} %  (goal <= 1 %; "
          f"{rec * 1e6:.1f} us of {step * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
