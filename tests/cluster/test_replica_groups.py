"""Fault-tolerant replica groups on the real local Slurm (issue 50, `recovery.replicas`), real
torchft (its Lighthouse beside the batch shell, its Manager in every trainer, gloo across the groups).

- Three groups of one node each; kill -9 of one group's training process at step 15: the other
  two train on within 20 s, no requeue, nobody else restarted; the group's step starts again, heals
  from a live peer through torchft's transport, and all three end at the final step with identical
  parameters.
- One job, three faults of three kinds a few steps apart (two groups and a spare): a SIGSTOP hang,
  the node lost (`scontrol update state=down` and its processes killed), kill -9 of group 0 (the
  checkpoints' owner). The run completes, every group at the final step with identical parameters, the ledger's
  participants per step add up, each replica_lost names its cause from the facts.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from cluster_jobs import events, job_spec, logs, submit, wait_for
from dslurm import slurm
from dslurm.cluster.disrupt import signal_pids, step_processes, workers
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from dslurm.run import RunDir

STEPS = 40  # a group back only after the others' last step heals there (train/replicas.py `gather`)


def _group_step(run: Path, group: int) -> int:
    """The last step `group` committed, from its replica_steps windows."""
    wins = [e for e in events(run, "replica_steps") if e["group"] == group]
    return max((w["first"] + len(w["participants"]) - 1 for w in wins), default=0)


def _committed(run: Path) -> dict[int, dict[int, int]]:
    """group -> {step: the participants its commit counted}, from the replica_steps windows."""
    out: dict[int, dict[int, int]] = {}
    for w in events(run, "replica_steps"):
        for i, n in enumerate(w["participants"]):
            out.setdefault(w["group"], {})[w["first"] + i] = n
    return out


def _participants_add_up(run: Path) -> None:
    """Every step's committers agree on how many groups it had, and are that many -- but for a group
    that committed it and was lost before its window reached the ledger (its replica_lost is at or
    after that step: the window dies with the process)."""
    done = _committed(run)
    lost = events(run, "replica_lost")
    for step in sorted({s for c in done.values() for s in c}):
        have = {g: c[step] for g, c in done.items() if step in c}
        assert len(set(have.values())) == 1, (step, have)
        n = next(iter(have.values()))
        missing = n - len(have)
        unflushed = {e["group"] for e in lost if e["group"] not in have and (e["step"] or 0) >= step
                     and max((s for s in done.get(e["group"], {}) if s < step), default=-1) < step}
        assert 0 <= missing <= len(unflushed), (step, have, n, lost)


@pytest.mark.timeout(900)
def test_kill9_of_one_group_the_others_train_on_and_it_heals(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "replicas"
    spec = job_spec(tmp_path, "replicas", steps=STEPS, nodes=3, tp=1, interval=20, sleep=0.4,
                    procs_per_node=1, parallel={"tp": 1, "dp_replicate": 3}, recovery={"replicas": True},
                    train={"global_batch": 6})
    job = submit(cli, env, spec)
    wait_for(lambda: _group_step(run, 0) >= 14, 300, "group 0 at step 14")
    victims = [p.pid for p in workers(job, str(RunDir(run).job_yaml)) if p.node == "node3"]
    assert victims, "no training process of group 2 on node3"
    assert signal_pids(victims, signal.SIGKILL), victims
    killed_t = time.time()
    assert slurm.wait_job(job, timeout=600, env=env) == "COMPLETED", logs(run)

    info = slurm.job_info(job, env=env)
    assert info["restarts"] == 0, info  # no requeue
    # The survivors' next committed step came within 20 s of the kill (group 0 writes a window per step).
    after = [e for e in events(run, "steps") if e["t"] > killed_t]
    assert after and after[0]["t"] - killed_t < 20, (after[:1], killed_t)
    lost = events(run, "replica_lost")
    assert [(e["group"], e["cause"]) for e in lost] == [(2, "crash")], lost
    assert 14 <= lost[0]["step"] <= 17 and lost[0]["next_hosts"] == ["node3"], lost
    healed = events(run, "replica_healed")
    assert [e["group"] for e in healed if e["step"] > 10] == [2], healed  # at a step, or at the end
    h = next(e for e in healed if e["group"] == 2 and e["step"] > 10)
    assert h["bytes"] > 0 and h["peer"].startswith("http://") and h["heal_s"] > 0, h
    assert h["missed_steps"] == h["step"] - lost[0]["step"] and h["missed_samples"] == 2 * h["missed_steps"], h
    # Each survivor committed every step from its first to the last once (no restart, no gap), and
    # the participants say who was out: 2 in each step group 2 missed (none when it was back before
    # the survivors' next quorum: a restart faster than recovery.replica_timeout_s).
    for g in (0, 1):
        wins = sorted((w for w in events(run, "replica_steps") if w["group"] == g), key=lambda w: w["first"])
        steps = [w["first"] + i for w in wins for i in range(len(w["participants"]))]
        assert steps == list(range(steps[0], STEPS + 1)) and steps[0] <= 14, (g, steps)
        parts = dict(zip(steps, (n for w in wins for n in w["participants"])))
        short = {s: n for s, n in parts.items() if s > lost[0]["step"] and n < 3}
        assert len(short) == h["missed_steps"] and set(short.values()) <= {2}, (g, parts, h)
    _participants_add_up(run)
    ends = events(run, "replica_end")
    assert sorted(e["group"] for e in ends if e["step"] == STEPS) == [0, 1, 2], ends
    assert len({e["params_crc"] for e in ends if e["step"] == STEPS}) == 1, ends  # identical parameters
    assert [e["cls"] for e in events(run, "ending")] == ["completed"]
    assert len(events(run, "train_start")) == len(events(run, "job_start")) == 1  # one start: group 0's
    sm = summarize(ev.read(run))
    assert sm.restarts == 0 and sm.completion.complete, sm.completion
    line = next(x for x in sm.replicas if x.startswith("  group 2:"))  # its faults in order (a heal at start first)
    assert line.index("lost at step 1") < line.rindex("healed at step"), sm.replicas


def _resume(env) -> None:
    """node2 back in service (the cluster may have returned it already: its slurmd answers, and
    then Slurm refuses the resume as an invalid state)."""
    slurm.run_cmd(["scontrol", "update", "nodename=node2", "state=resume"], env=env, check=False)
    wait_for(lambda: "down" not in slurm.run_cmd(["sinfo", "-h", "-n", "node2", "-o", "%T"], env=env).stdout, 60,
             "node2 back in service")


@pytest.mark.timeout(900)
def test_hang_node_loss_and_kill_in_one_run(slurm_cluster, cli, tmp_path):
    """Two groups (node1, node2) and a spare (node3), recovery.replica_timeout_s 1: a SIGSTOP of
    group 1 (its sockets stay open: the survivor's all-reduce gives up after the timeout, the
    supervisor ends the frozen step), node2 down (group 1 to the spare), kill -9 of group 0."""
    env = slurm_cluster.env()
    run = tmp_path / "faults"
    steps = 600  # ~0.15-0.4 s a step here: the three faults and their returns take ~60-150 s
    spec = job_spec(tmp_path, "faults", steps=steps, nodes=2, spares=1, tp=1, interval=25, sleep=0.1,
                    procs_per_node=1, parallel={"tp": 1, "dp_replicate": 2},
                    recovery={"replicas": True, "replica_timeout_s": 1.0}, train={"global_batch": 4})
    job = submit(cli, env, spec)
    marker = str(RunDir(run).job_yaml)

    def healed_after(group: int, t: float) -> bool:
        return any(e["group"] == group and e["t"] > t for e in events(run, "replica_healed"))

    def group_step(group: int) -> int:
        return max(_committed(run).get(group, {0: 0}))

    down, frozen = False, []
    try:
        wait_for(lambda: group_step(0) >= 5 and group_step(1) >= 5, 300, "both groups at step 5")
        frozen = [p.pid for p in workers(job, marker) if p.node == "node2"]
        assert signal_pids(frozen, signal.SIGSTOP), frozen
        t_hang = time.time()
        at = group_step(0)
        wait_for(lambda: group_step(0) > at + 2, 60, "group 0 on without the frozen group")
        t_on = time.time()
        wait_for(lambda: healed_after(1, t_hang), 300, "group 1 back after the hang")

        # The node lost: Slurm marks it down (and drops it from the --no-kill allocation) and what ran
        # there dies with it (on this one-machine cluster a node marked down keeps its processes).
        slurm.run_cmd(["scontrol", "update", "nodename=node2", "state=down", "reason=dslurm-test"], env=env)
        down, t_down = True, time.time()
        assert signal_pids([p.pid for p in step_processes(job, "node2")], signal.SIGKILL)
        wait_for(lambda: healed_after(1, t_down), 300, "group 1 back on the spare")
        _resume(env)
        down = False

        lead = [p.pid for p in workers(job, marker) if p.node == "node1"]
        assert signal_pids(lead, signal.SIGKILL), lead
        t_kill = time.time()
        wait_for(lambda: healed_after(0, t_kill), 300, "group 0 back")
        assert group_step(0) < steps, "the run ended before its last fault: raise steps"
    finally:
        signal_pids(frozen, signal.SIGKILL)  # outside its step's process group it outlives the job here
        if down:
            _resume(env)
    assert slurm.wait_job(job, timeout=600, env=env) == "COMPLETED", logs(run)

    # The survivor went on within a few timeouts of the freeze (not torchft's 60 s op timeout).
    assert t_on - t_hang < 20, t_on - t_hang
    lost = events(run, "replica_lost")
    assert [(e["group"], e["cause"]) for e in lost] == [(1, "hang"), (1, "node_failure"), (0, "crash")], lost
    assert lost[0]["next_hosts"] == ["node2"] and lost[1]["next_hosts"] == ["node3"], lost
    assert lost[2]["next_hosts"] == ["node1"], lost
    assert slurm.job_info(job, env=env)["restarts"] == 0  # no requeue
    _participants_add_up(run)
    done = _committed(run)
    # group 1 survived group 0's kill: every step from its last heal to the end, once, in order
    last_heal = max(e["step"] for e in events(run, "replica_healed") if e["group"] == 1)
    assert sorted(s for s in done[1] if s > last_heal) == list(range(last_heal + 1, steps + 1))
    assert any(n == 1 for n in done[1].values())  # it trained alone while group 0 was out
    ends = [e for e in events(run, "replica_end") if e["step"] == steps]
    assert sorted(e["group"] for e in ends) == [0, 1] and len({e["params_crc"] for e in ends}) == 1, ends
    assert [e["cls"] for e in events(run, "ending")] == ["completed"]
