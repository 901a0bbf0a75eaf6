"""Submit-to-COMPLETED turnaround of a trivial job on the local real Slurm, as a ratio.

    .venv/bin/python bench/bench_submit.py [--jobs 10] [--nodes 1]

Brings the local cluster up if it is not (left running), then times `sbatch --wrap true`
until the controller reports COMPLETED, polling like `dslurm.slurm.wait_job`. The ratio
is turnaround / cost of one `squeue` call, i.e. how many client round trips a job costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from dslurm import cluster, slurm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=1)
    args = ap.parse_args()
    if not cluster.is_up():
        t0 = time.monotonic()
        cluster.up(nodes=max(3, args.nodes), accounting=True)
        print(f"cluster up: {time.monotonic() - t0:.2f} s")
    t0 = time.monotonic()
    for _ in range(5):
        slurm.squeue()
    rtt = (time.monotonic() - t0) / 5
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.jobs):
            t0 = time.monotonic()
            job = slurm.sbatch(None, extra_args=["--wrap", "true", f"--nodes={args.nodes}",
                                                        "--output=/dev/null"], cwd=tmp)
            state = slurm.wait_job(job, timeout=60, poll=0.05)
            times.append(time.monotonic() - t0)
            assert state == "COMPLETED", (job, state)
    med = statistics.median(times)
    print(json.dumps({"jobs": args.jobs, "nodes": args.nodes, "median_s": round(med, 3),
                      "max_s": round(max(times), 3), "squeue_rtt_s": round(rtt, 4),
                      "ratio_turnaround_to_rtt": round(med / rtt, 1)}))


if __name__ == "__main__":
    main()
