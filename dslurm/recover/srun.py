"""The real `Runner` of the supervisor (dslurm/recover/supervisor.py): job steps through srun on an
explicit node list, Slurm's view through dslurm.slurm, a silent node probed by its slurmd's port
and an `srun true` beside the step."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import tempfile
import threading
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
        from dslurm.endings.facts import ENV
        from dslurm.launch.slurm_env import PENDING_STOP_ENV, STEP_INDEX_ENV
        from dslurm.launch.warm import WARM_ENV

        env = {**self.env, ENV: str(step.facts_dir), STEP_INDEX_ENV: str(step.index),
               WARM_ENV: "1" if step.warm else "0", **({PENDING_STOP_ENV: step.stop} if step.stop else {})}
        # srun's stderr passes through to the job's log line by line; a refusal is recorded as it
        # is said (facts.write_refusal): the supervisor starts a refused step again instead of reading
        # the silence of nodes that were never asked as their loss.
        self.proc = proc = subprocess.Popen(self.argv(step), env=env, stderr=subprocess.PIPE)
        relay = threading.Thread(target=_relay, args=(proc, step.facts_dir), daemon=True)
        relay.start()
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
            relay.join(timeout=5.0)  # srun's last words (a refusal) are in before the step is read
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
        Then the hosts whose slurmd listens run `true` through `srun -v` in parallel: a step that
        was created (srun says it launches it) and fails or does not answer within `timeout_s`
        is a slurmd that cannot start a task, gone too; one Slurm refused for the node (down,
        drained) likewise. A step slurmctld did not create asked no node: refused for a reason
        that says nothing about it (`refusal`) it is asked again until the deadline, and still
        uncreated then (pending, or refused: seen for ~5-15 s after a slurmctld restart) the node
        is not counted lost: its slurmd listens."""
        from dslurm import slurm

        addrs = slurm.node_addresses(hosts, env=self.env)
        silent_port = [h for h in hosts if h in addrs and not _listens(*addrs[h], timeout_s=min(2.0, timeout_s))]
        env = {k: v for k, v in self.env.items() if not k.startswith("SLURM_STEP")}
        deadline = time.monotonic() + timeout_s
        dead = list(silent_port)
        ask = [h for h in hosts if h not in silent_port]
        while ask:
            # stderr to a file, not a pipe: a killed srun's child may hold a pipe open past the deadline
            errs = {h: tempfile.TemporaryFile() for h in ask}
            procs = {h: subprocess.Popen([*PROBE_ARGV[:-1], f"--nodelist={h}", PROBE_ARGV[-1]], env=env,
                                         stdout=subprocess.DEVNULL, stderr=errs[h]) for h in ask}
            ask = []
            for h, p in procs.items():
                rc = _finish(p, deadline)
                errs[h].seek(0)
                err = errs[h].read().decode(errors="replace")
                errs[h].close()
                if rc == 0:
                    continue
                why = refusal(err)
                if LAUNCHED.search(err) or (rc is not None and why is None):
                    dead.append(h)  # created and failed or silent, or refused for the node itself
                elif why is not None and time.monotonic() + 1.0 < deadline:
                    ask.append(h)  # slurmctld could not create it yet: the node was never asked
                else:
                    log.warning("dslurm supervise: slurmctld did not create a probe step on %s within %.0f s "
                                "(%s); its slurmd listens: not counted lost", h, timeout_s,
                                why or "the step pended")
            if ask:
                time.sleep(1.0)
        return tuple(h for h in hosts if h in dead)


def _finish(p: subprocess.Popen[bytes], deadline: float) -> int | None:
    """A probe's code by the deadline; killed past it: None."""
    try:
        return p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


# `srun -v` says this once slurmctld created the step and it goes to the node (22.05: "launching
# StepId=J.S on host ...", 23.02+: "Step created for StepId=J.S").
LAUNCHED = re.compile(r"launching (StepId=)?\d+|Step created for StepId=")


# srun's words when slurmctld will not create a step for a reason that says nothing about the
# nodes: it restarted and the nodes have not registered again (their memory unknown to it: chaos
# seed 4444, "Memory required by task is not available" for ~15 s after a restart), or it is not
# answering. A refusal naming the nodes (down, drained, "Requested node configuration is not
# available") is not among them: that one is about the node.
TRANSIENT_REFUSALS = ("Memory required by task is not available", "Unable to confirm allocation",
                      "Unable to contact slurm controller", "Socket timed out", "Zero Bytes were transmitted",
                      "Slurm backup controller in standby mode", "Job/step already completing")


def refusal(text: str) -> str | None:
    """The first line of srun's stderr that says slurmctld would not create the step for a
    reason that says nothing about the nodes (TRANSIENT_REFUSALS), or None. Pure."""
    for line in text.splitlines():
        if any(r in line for r in TRANSIENT_REFUSALS) and ("step" in line or "allocation" in line
                                                           or "controller" in line):
            return line.strip()[:300]
    return None


def _relay(proc: subprocess.Popen[bytes], facts_dir: Path) -> None:
    """Copy srun's stderr to ours line by line; the first refusal goes to the facts dir."""
    import sys

    from dslurm.endings.facts import write_refusal

    assert proc.stderr is not None
    said = False
    for raw in iter(proc.stderr.readline, b""):
        try:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
        except (OSError, ValueError):
            pass  # a full disk under the job's log: the relay goes on reading, srun never blocks
        if not said and (why := refusal(raw.decode(errors="replace"))):
            said = write_refusal(facts_dir, why)
    proc.stderr.close()


def _listens(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at addr:port within timeout_s."""
    import socket

    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:  # refused, unreachable, timed out
        return False


PROBE_ARGV = ("srun", "-v", "--overlap", "--nodes=1", "--ntasks=1", "true")
