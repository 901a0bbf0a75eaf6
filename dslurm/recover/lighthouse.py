"""`python -m dslurm.recover.lighthouse --heartbeat-timeout-s S`: torchft's Lighthouse for a job with
`recovery.replicas` (docs/recovery.md), run by the batch script beside itself on the job's first
node and stopped by it (TERM) once `dslurm supervise` returned.

The Lighthouse is torchft's own (its Rust server, `torchft.coordination.LighthouseServer`): the
replica groups' managers heartbeat it and ask it for a quorum at every step; we only choose its
port (from the job id and restart count, `dslurm.launch.slurm_env.lighthouse_port`) and how long
a silent group counts as alive (`--heartbeat-timeout-s`, the job's recovery.replica_timeout_s).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

JOIN_TIMEOUT_MS = 60000
"""How long a quorum waits for groups that heartbeat but have not asked yet (torchft's default)."""


def address(host: str, job_id: str, restart_count: int) -> str:
    """The Lighthouse's address as the groups' managers use it (TORCHFT_LIGHTHOUSE). Pure."""
    from dslurm.launch.slurm_env import lighthouse_port

    return f"http://{host}:{lighthouse_port(job_id, restart_count)}"


def main(argv: list[str] | None = None) -> int:
    from dslurm.launch.slurm_env import lighthouse_port

    p = argparse.ArgumentParser(prog="python -m dslurm.recover.lighthouse", description=__doc__.splitlines()[0])
    p.add_argument("--heartbeat-timeout-s", type=float, required=True,
                   help="recovery.replica_timeout_s: a group silent this long is left out of the next quorum (the "
                   "survivors' step after a loss waits about this long; torchft's default is 5 s)")
    args = p.parse_args(argv)
    port = lighthouse_port(os.environ.get("SLURM_JOB_ID", "0"), int(os.environ.get("SLURM_RESTART_COUNT") or 0))
    from torchft.coordination import LighthouseServer

    # A quorum forms with any one group: recovery.replicas_min is the groups' Managers' (no step
    # commits below it) and the supervisor's (it stops the job); a Lighthouse holding the quorum
    # back would leave the survivors inside it, deaf to that stop, until a crash.
    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                              heartbeat_timeout_ms=round(args.heartbeat_timeout_s * 1000))
    print(f"dslurm: torchft Lighthouse at {server.address()} (heartbeat timeout {args.heartbeat_timeout_s} s)",
          flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    while not done.wait(1.0):  # a signal handler runs between waits
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
