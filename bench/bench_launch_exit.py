"""Two start/exit costs on a recovery's path, side by side in one run (docs/recovery.md, cuts 2-3):

  torchrun exit   a worker fails -> the launcher process is gone: `-m torch.distributed.run`
                  against `-m dslurm.launch.torchrun` (which leaves without finalization)
  store connect   a TCPStore client started 50 ms before its server listens: torch's own
                  connect (it backs off) against `await_store` first, then the client

    .venv/bin/python bench/bench_launch_exit.py [--reps 3]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from dslurm.health.process_group import await_store  # noqa: E402

WORKER = ("import os, sys, time\nif os.environ['RANK'] == '1':\n    print(time.time(), flush=True)\n    sys.exit(1)\n"
          "time.sleep(60)\n")


def torchrun_exit(module: str, script: Path) -> float:
    """Seconds from the worker's failure to the launcher process gone."""
    out = subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2", "--max-restarts=0",
                          str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    gone = time.time()
    return gone - float(out.stdout.split()[0])


def store_connect(port: int, wait: bool) -> float:
    """Seconds until a client is connected to a server that starts listening 50 ms after it (a
    thread of this process: torch's connect releases the GIL while it waits)."""
    import torch.distributed as dist

    servers: list[object] = []
    timer = threading.Timer(0.05, lambda: servers.append(dist.TCPStore("127.0.0.1", port, 2, True,
                                                                       wait_for_workers=False)))
    t = time.monotonic()
    timer.start()
    if wait:
        await_store({"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, timeout_s=10)
    dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
    dt = time.monotonic() - t
    timer.join()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {k: [] for k in ("torch.distributed.run", "dslurm.launch.torchrun",
                                                    "client alone", "await_store + client")}
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "worker.py"
        script.write_text(WORKER)
        for i in range(args.reps):  # alternated, so that drift hits both sides alike
            rows["torch.distributed.run"].append(torchrun_exit("torch.distributed.run", script))
            rows["dslurm.launch.torchrun"].append(torchrun_exit("dslurm.launch.torchrun", script))
            rows["client alone"].append(store_connect(29870 + 2 * i, False))
            rows["await_store + client"].append(store_connect(29871 + 2 * i, True))
    for name, v in rows.items():
        print(f"{name:24} median {statistics.median(v):.3f} s  ({', '.join(f'{x:.3f}' for x in v)})")
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"torchrun exit: {med['dslurm.launch.torchrun'] / med['torch.distributed.run']:.2f}x; "
          f"store connect, server 50 ms late: {med['await_store + client'] / med['client alone']:.2f}x")


if __name__ == "__main__":
    main()
