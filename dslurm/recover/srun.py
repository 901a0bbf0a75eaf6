"""The real `Runner` of the supervisor (dslurm/recover/supervisor.py): job steps through srun on an
explicit node list, Slurm's view through dslurm.slurm, a silent node probed by its slurmd's port
and an `srun true` beside the step."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dslurm import endings as E
from dslurm.config.resolve import Resolved
from dslurm.recover.supervisor import Step
from dslurm.requeue import Decision

log = logging.getLogger(__name__)


class SrunRunner:
    """Job steps through srun on an explicit node list; Slurm's view through dslurm.slurm."""

    # How often a running step's `abandon` (and the warm pools' tick) is asked: a lost node's
    # step is abandoned within this of its probe's answer.
    POLL_S = 0.25
    # Slurm's job state (`_job_state`) is read once per step's end: a view asked again within
    # this (the spares' down nodes for a swap) reuses it.
    STATE_TTL_S = 5.0

    def __init__(self, r: Resolved, cmd: Sequence[str], env: Mapping[str, str]) -> None:
        self.r, self.cmd, self.env = r, list(cmd), dict(env)
        self.cwd = os.getcwd()  # the batch shell's: the submit dir a pyxis container works in
        self.proc: subprocess.Popen[bytes] | None = None
        self._state: tuple[float, str | None] | None = None  # (monotonic time, sacct's state)

    def argv(self, step: Step) -> list[str]:
        """`srun ... --nodelist=HOSTS CMD [--set train.grad_accum=N]`. Pure."""
        from dslurm.render import cpus_per_task, step_gpu_flags, tasks_per_node
        from dslurm.render.container import srun_container_flags, with_cwd

        extra = ["--set", f"train.grad_accum={step.grad_accum}"] if step.grad_accum is not None else []
        per_node = tasks_per_node(self.r)
        # --ntasks explicitly: srun otherwise takes SLURM_NTASKS of the whole allocation (training
        # nodes + spares) and packs the extra launcher onto a training node. --overlap: a step that
        # spanned a lost node is never cleaned up on it, and Slurm keeps its CPUs on the healthy
        # nodes "busy" (seen: step creation disabled for minutes); its processes are gone.
        return ["srun", "--kill-on-bad-exit=1", "--overlap", f"--nodes={len(step.hosts)}",
                f"--nodelist={','.join(step.hosts)}", f"--ntasks={len(step.hosts) * per_node}",
                f"--ntasks-per-node={per_node}",
                f"--cpus-per-task={cpus_per_task(self.r)}",
                *step_gpu_flags(self.r),  # the node's GPUs, as the job asked: the warm pools' too
                *with_cwd(srun_container_flags(self.r), self.cwd),  # pyxis: on the step's srun, as rendered
                *self.cmd, *extra]

    def run(self, step: Step, abandon: Callable[[], bool]) -> int:
        from dslurm.facts import ENV
        from dslurm.launch.slurm_env import PENDING_STOP_ENV, STEP_INDEX_ENV
        from dslurm.launch.warm import WARM_ENV

        env = {**self.env, ENV: str(step.facts_dir), STEP_INDEX_ENV: str(step.index),
               WARM_ENV: "1" if step.warm else "0", **({PENDING_STOP_ENV: step.stop} if step.stop else {})}
        self.proc = proc = subprocess.Popen(self.argv(step), env=env)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=self.POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if abandon():
                        # Its other tasks ended (their launcher reported); what is left runs on
                        # nodes that are gone, which Slurm cleans up when it marks them down.
                        proc.kill()
                        rc = proc.wait()
                        break
        finally:
            self.proc = None
            self._state = None  # the step's end: Slurm's state is read afresh
        return 128 - rc if rc < 0 else rc

    def signal(self, signum: int) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def view(self, hosts: Sequence[str]) -> E.SlurmView:
        from dslurm import slurm

        now = time.monotonic()
        if self._state is None or now - self._state[0] > self.STATE_TTL_S:
            self._state = (now, self._job_state())
        down = slurm.down_nodes(hosts, env=self.env) if hosts else {}
        return E.SlurmView(state=self._state[1], down_nodes=tuple(down),
                           node_states=tuple(f"{k}: {v}" for k, v in down.items()))

    def _job_state(self) -> str | None:
        """This incarnation's state. slurmctld's answer when it says RUNNING (scontrol, ~10 ms: the
        state of every recovery inside the allocation, on its path): accounting only lags behind it
        (slurmctld hands it its records through a queue), so it could say nothing newer. Anything
        else (a stop under way: COMPLETING hides TIMEOUT or PREEMPTED there) is accounting's word
        (sacct, ~0.4 s here, its slurmdbd behind MySQL), as everywhere else."""
        from dslurm import slurm

        job = self.env.get("SLURM_JOB_ID", "")
        if slurm.ctld_job_state(job, env=self.env) == "RUNNING":
            return "RUNNING"
        incs = slurm.incarnations(job, env=self.env)
        return str(incs[-1]["state"]) if incs else None

    def act(self, dec: Decision, ending: E.Ending, env: Mapping[str, str], run_dir: Path, chain: list[int]) -> None:
        from dslurm.requeue import act_on

        act_on(dec, ending, env, run_dir, chain)

    def drain(self, hosts: Sequence[str], reason: str) -> None:
        from dslurm import slurm

        for host in hosts:
            res = slurm.run_cmd(["scontrol", "update", f"NodeName={host}", "State=DRAIN", f"Reason={reason}"],
                                check=False, env=self.env)
            if res.returncode:
                log.error("could not drain %s: %s", host, res.stderr.strip())

    def probe(self, hosts: Sequence[str], timeout_s: float) -> tuple[str, ...]:
        """The hosts that are gone. First their slurmd's port (from `scontrol show node`): a
        refused or unanswered connection settles it at once (a killed slurmd, a frozen machine).
        Then the hosts whose slurmd listens run `true` through srun in parallel: failing, or not
        answering within `timeout_s`, they are gone too (a slurmd that listens but cannot start a
        task is no use either)."""
        from dslurm import slurm

        addrs = slurm.node_addresses(hosts, env=self.env)
        silent_port = [h for h in hosts if h in addrs and not _listens(*addrs[h], timeout_s=min(2.0, timeout_s))]
        rest = [h for h in hosts if h not in silent_port]
        env = {k: v for k, v in self.env.items() if not k.startswith("SLURM_STEP")}
        procs = {h: subprocess.Popen([*PROBE_ARGV[:-1], f"--nodelist={h}", PROBE_ARGV[-1]], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for h in rest}
        deadline = time.monotonic() + timeout_s
        dead = list(silent_port)
        for h, p in procs.items():
            try:
                rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = None
            if rc != 0:
                dead.append(h)
        return tuple(h for h in hosts if h in dead)


def _listens(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at addr:port within timeout_s."""
    import socket

    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:  # refused, unreachable, timed out
        return False


PROBE_ARGV = ("srun", "--overlap", "--nodes=1", "--ntasks=1", "--quiet", "true")
