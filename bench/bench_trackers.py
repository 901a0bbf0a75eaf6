"""What a tracker outage costs each training step (goal: at most 1% of the step time).

Three 1-process trainers in this process (same model, batch, data), each step logged to its own
ledger as the loop logs it (log_every 1: `Steps` appended, the trackers fed from it):

- none:    no trackers;
- outage:  MLflow and W&B online (the real clients) at a server on 127.0.0.1 that accepts and
           never answers (tests/outage_servers.py): both are stuck in their open all run long;
- slow:    MLflow at a server that answers every request after 0.2 s (its lane is always busy);
- frozen:  MLflow at a real tracking server (`mlflow server`, sqlite store: tests/mlflow_server.py)
           frozen with SIGSTOP from the second block for `--freeze-s` seconds, then thawed: its lane
           fails, retries, and catches up from the ledger (issue 53). After the measure the server
           must hold every step of that side's ledger, once, in a FINISHED run.

Blocks of steps alternate between them; each block is timed in process CPU seconds (all threads:
the trackers' lanes' work counts, the neighbours' on 2 shared cores does not) and in wall seconds.
The ratios are medians over the blocks, measured side by side in this one run. The phases are
checked in order: the outage's trackers must still be in their open when the measure ends, the
slow one must have delivered points.

    .venv/bin/python bench/bench_trackers.py [--preset small] [--steps 3] [--blocks 8] [--freeze-s 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]


def build(preset: str, name: str, tmp: Path, metrics: dict[str, object] | None):
    import torch

    from dslurm.config import MetricsSpec
    from dslurm.config.resolve import load
    from dslurm.observe.ledger import Ledger
    from dslurm.trackers import attach
    from train.loop import Trainer
    from train_helpers import SITE, write_job

    job = write_job(tmp, name, steps=100_000, grad_clip=1.0)
    resolved = load(SITE, job, ["procs_per_node=1", f"model.preset={preset}", "data.synthetic_tokens=1048576"],
                    ["node.nvlink_domain=8"])
    t = Trainer(resolved, device=torch.device("cpu"), rank=0, world_size=1, fsdp=False, checkpoint=False)
    t.ledger = Ledger(tmp / name)
    t.trackers = attach(t.ledger, tmp / name, MetricsSpec(**metrics), name) if metrics else None  # type: ignore[arg-type]
    t.metrics.start()
    t.listener_s = 0.0  # time the training thread spent inside the trackers' listener (queueing)
    if t.trackers is not None:
        on_event = t.trackers.on_event

        def timed(ev) -> None:
            t0 = time.perf_counter()
            on_event(ev)
            t.listener_s += time.perf_counter() - t0

        t.ledger.listeners[:] = [timed]

    def step() -> None:
        r = t.train_step()
        t.metrics.end_step(r.step, r.loss)
        t._log_window(r)  # the loop's own logging: Steps into the ledger, the trackers fed

    return t, step


def ledger_steps(run: Path) -> list[int]:
    from dslurm.observe import events as ev

    return sorted(e.last + 1 for e in ev.read(run) if isinstance(e, ev.Steps) and e.last is not None)


def real_history(url: str, run: Path) -> tuple[dict[int, int], str]:
    """step -> how many train/loss points the real server holds; the run's status."""
    from mlflow.tracking import MlflowClient

    from dslurm.trackers import read_state

    client = MlflowClient(tracking_uri=url)
    run_id = read_state(run)["mlflow"]["run_id"]
    held: dict[int, int] = {}
    for m in client.get_metric_history(run_id, "train/loss"):
        held[m.step] = held.get(m.step, 0) + 1
    return held, client.get_run(run_id).info.status


def block(fn, n: int) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.monotonic()
    for _ in range(n):
        fn()
    return (time.process_time() - c0) / n, (time.monotonic() - w0) / n


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=3, help="steps per timing block")
    p.add_argument("--blocks", type=int, default=8, help="alternating blocks per side")
    p.add_argument("--freeze-s", type=float, default=12.0, help="how long the real MLflow server is frozen "
                   "(past the frozen side's tracker_timeout_s, 5 s)")
    args = p.parse_args()

    import contextlib
    import io

    import torch
    import torch.distributed as dist

    from mlflow_server import mlflow_server
    from outage_servers import logged_steps, silent_server, slow_mlflow_server

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-trackers-"))
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ[var] = str(tmp / "home" / var.lower())
    os.environ.update(WANDB_SILENT="true", WANDB_API_KEY="x" * 40)
    os.environ.pop("WANDB_MODE", None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with silent_server() as url, slow_mlflow_server(0.2) as slow, mlflow_server(tmp / "mlflow") as real, \
            contextlib.redirect_stdout(io.StringIO()):
        os.environ["WANDB_BASE_URL"] = url
        sides = {
            "none": build(args.preset, "none", tmp, None),
            "outage": build(args.preset, "outage", tmp, {"trackers": ["mlflow", "wandb"], "mlflow_uri": url,
                                                          "wandb_mode": "online", "tracker_timeout_s": 3600}),
            "slow": build(args.preset, "slow", tmp, {"trackers": ["mlflow"], "mlflow_uri": slow.url,
                                                      "tracker_timeout_s": 3600}),
            "frozen": build(args.preset, "frozen", tmp, {"trackers": ["mlflow"], "mlflow_uri": real.url,
                                                          "tracker_timeout_s": 5.0}),
        }
        print("built", file=sys.stderr, flush=True)
        for _, step in sides.values():  # warm-up: allocations, optimizer state, the lanes' imports
            for _ in range(args.steps):
                step()
        time.sleep(5)  # the lanes' package imports (wandb, mlflow) are start-up, not step cost
        for t, _ in sides.values():
            t.listener_s = 0.0
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        wall: dict[str, list[float]] = {k: [] for k in sides}
        frozen_at = thawed_at = None
        for i in range(args.blocks):
            if i == min(1, args.blocks - 1):
                real.freeze()
                frozen_at = time.monotonic()
            if frozen_at is not None and thawed_at is None and time.monotonic() - frozen_at >= args.freeze_s:
                real.thaw()
                thawed_at = time.monotonic()
            for name, (_, step) in sides.items():
                c, w = block(step, args.steps)
                cpu[name].append(c)
                wall[name].append(w)
            print("block", {k: v[-1] for k, v in cpu.items()}, file=sys.stderr, flush=True)
        measured = args.blocks * args.steps
        listener = {k: t.listener_s / measured for k, (t, _) in sides.items()}
        outage_lanes = sides["outage"][0].trackers.lanes
        stuck = {n: lane.doing for n, lane in outage_lanes.items()}
        delivered = logged_steps(slow.calls)
        if thawed_at is None:  # a short measure: the frozen side trains on (untimed) until the freeze is over
            while time.monotonic() - (frozen_at or 0.0) < args.freeze_s:
                sides["frozen"][1]()
            real.thaw()
            thawed_at = time.monotonic()
        frozen_s = thawed_at - (frozen_at or thawed_at)
        heal = sides["frozen"][0].trackers.lanes["mlflow"]
        deadline = time.monotonic() + 120
        while (heal.in_outage or heal.down or heal.outages == 0) and time.monotonic() < deadline:
            time.sleep(0.2)  # the run goes on after the thaw; here: until the lane has caught up
        for name, (t, _) in sides.items():
            if t.trackers is not None:
                t.trackers.spec.tracker_close_s = 2.0 if name != "frozen" else 30.0
                t.trackers.close(ending="completed" if name == "frozen" else None)
        held, status = real_history(real.url, tmp / "frozen")
    dist.destroy_process_group()
    if not all(d.startswith("open") for d in stuck.values()):
        raise SystemExit(f"phase check: the outage's trackers left their open during the measure: {stuck}")
    if not delivered:
        raise SystemExit("phase check: the slow server received no point")
    want = ledger_steps(tmp / "frozen")
    if heal.outages == 0 or held != {s: 1 for s in want} or status != "FINISHED":
        raise SystemExit(f"phase check: the frozen server's run after the thaw: outages {heal.outages}, status "
                         f"{status}, steps missing {sorted(set(want) - set(held))}, twice "
                         f"{sorted(s for s, n in held.items() if n > 1)}")
    med = {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in sides}
    base_c, base_w = med["none"]
    print(f"\n| {args.preset} model, 1 process, {args.blocks} blocks x {args.steps} steps | CPU s/step | "
          "vs none | wall s/step | vs none | training thread in the trackers, s/step (share of the step) |")
    print("|---|---|---|---|---|---|")
    for k, label in (("none", "no trackers"), ("outage", "MLflow + W&B online, server never answers"),
                     ("slow", "MLflow, server answers after 0.2 s"),
                     ("frozen", f"MLflow, real server frozen {frozen_s:.0f} s mid-run, then back")):
        c, w = med[k]
        print(f"| {label} | {c:.4f} | {c / base_c:.3f} | {w:.4f} | {w / base_w:.3f} | "
              f"{listener[k]:.6f} ({listener[k] / w:.3%}) |")
    print(f"\noutage lanes still waiting at the end: {stuck}; slow server got {len(delivered)} step(s) of points; "
          f"the frozen server holds all {len(want)} ledger steps once, run {status}, after {heal.outages} "
          f"outage(s), {heal.backfilled} item(s) sent late")
    sys.stdout.flush()
    # As the trainer leaves (dslurm.endings.worker_exit.leave): W&B's atexit teardown would wait on its
    # service, which still waits on the silent server.
    os._exit(0)


if __name__ == "__main__":
    main()
