"""The warm pools of a supervised job (recovery.warm): one background pool step per allocated node
(dslurm/launch/warm.py is the pool itself), started once the cold start has trained, asked by the
supervisor whether every training node's pool serves."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from dslurm.config.resolve import Resolved
from dslurm.observe import events as ev
from dslurm.observe.ledger import FILENAME as LEDGER_FILE

log = logging.getLogger(__name__)


def pool_shape_flags(r: Resolved) -> list[str]:
    """The pool step's resources on its node: the training step's whole per-node share. The
    workers it forks inherit its cgroups and CPU affinity, so with task/cgroup or task/affinity a
    one-CPU pool step would pack every rank onto that CPU (and a default memory limit), and under
    ConstrainDevices a pool step without the GPUs forks workers that cannot open one (every warm
    attempt would crash and spend a restart). So: all the CPUs the training step's tasks get on a
    node, the node's memory (--mem=0, as the job has it), no binding, and the very GPU request
    of the training step (`render.step_gpu_flags`). Pure."""
    from dslurm.render import cpus_per_task, step_gpu_flags, tasks_per_node

    return [f"--cpus-per-task={cpus_per_task(r) * tasks_per_node(r)}", "--mem=0", "--cpu-bind=none",
            *step_gpu_flags(r)]


class WarmPools:
    """One warm pool per allocated node (training nodes and spares), each a background job step
    (`srun --overlap -N1 -w HOST python -m dslurm.launch.warm`) for the rest of the job. A pool
    counts as serving while its srun runs and its ready file exists (it writes it once it listens).

    The pools start once the first job step has trained its first step (rank 0's start_phases
    event of this job and start, appended after this supervise began: an earlier start's, before a
    requeue or a resubmission, does not count), or when that step ends: their imports (~5 CPU-s
    each) would otherwise compete with the cold start's own (seen here: the cold start 6.3 s ->
    9.3 s with two pools importing beside it)."""

    def __init__(self, r: Resolved, cmd: Sequence[str], env: Mapping[str, str], alloc: Sequence[str]) -> None:
        from dslurm.launch.warm import entry_module

        self.r, self.env, self.alloc = r, dict(env), list(alloc)
        self.job_id = self.env.get("SLURM_JOB_ID", "")
        self.train_cmd = list(cmd)[len(cmd) - list(reversed(cmd)).index("--"):] if "--" in cmd else []
        self.module = entry_module(self.train_cmd)
        self.restart = int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started = False
        self.ledger = Path(r.run_dir) / LEDGER_FILE
        try:  # only what is appended from now on can be this start's
            self.offset = self.ledger.stat().st_size
        except OSError:
            self.offset = 0

    def tick(self, step_over: bool) -> None:
        if self.started:
            return
        if step_over or self._trained():
            self.start()

    def _trained(self) -> bool:
        """A start_phases event of this job and start among the lines appended since the last
        look (the ledger's tail only: this runs 4x a second)."""
        import json

        try:
            with open(self.ledger, "rb") as fh:
                fh.seek(self.offset)
                tail = fh.read()
        except OSError:
            return False
        complete = tail[:tail.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a torn line
                continue
            if (isinstance(rec, dict) and rec.get("event") == ev.StartPhases.NAME
                    and str(rec.get("job_id")) == self.job_id and int(rec.get("restart") or 0) == self.restart):
                return True
        return False

    def argv(self, host: str) -> list[str]:
        """The pool step on `host`. Pure."""
        from dslurm.launch.warm import ready_path

        return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--quiet",
                *pool_shape_flags(self.r), self.train_cmd[0], "-m", "dslurm.launch.warm", "--job", self.job_id,
                "--host", host,
                "--module", str(self.module), "--ready", str(ready_path(self.r.run_dir, self.job_id, host))]

    def start(self) -> None:
        from dslurm.render.container import srun_container_flags

        self.started = True
        if self.module is None:
            log.error("dslurm supervise: recovery.warm needs a `python -m MODULE` entry (got %s); every step "
                      "starts cold", self.train_cmd[:3])
            return
        if srun_container_flags(self.r):  # each step its own container: the socket may not be shared
            log.error("dslurm supervise: recovery.warm is not supported with a container runtime yet; every "
                      "step starts cold")
            return
        from dslurm.launch.warm import ready_path

        env = {k: v for k, v in self.env.items() if not k.startswith("SLURM_STEP")}
        for host in self.alloc:
            # A pool of an earlier start killed -9 left its ready file: it must not count as serving.
            ready_path(self.r.run_dir, self.job_id, host).unlink(missing_ok=True)
            self.procs[host] = subprocess.Popen(self.argv(host), env=env, stdin=subprocess.DEVNULL)

    def ready(self, hosts: Sequence[str]) -> bool:
        from dslurm.launch.warm import ready_path

        missing = [h for h in hosts if h not in self.procs or self.procs[h].poll() is not None
                   or not ready_path(self.r.run_dir, self.job_id, h).exists()]
        if missing:
            log.warning("dslurm supervise: no warm pool serving on %s: this step starts cold", ",".join(missing))
        return not missing

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
