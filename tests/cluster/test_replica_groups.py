"""Fault-tolerant replica groups on the real local Slurm (issue 50, `recovery.replicas`): three
groups of one node each, real torchft (its Lighthouse beside the batch shell, its Manager in every
trainer, gloo across the groups). kill -9 of one group's training process at step 15: the other
two train on within 20 s, no requeue, nobody else restarted; the group's step starts again, heals
from a live peer through torchft's transport, and all three end at the final step with identical
parameters."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from cluster_jobs import events, job_spec, logs, submit, wait_for
from dslurm import slurm
from dslurm.cluster.disrupt import signal_pids, workers
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from dslurm.run import RunDir

STEPS = 40  # a group back only after the others' last step heals there (train/replicas.py `gather`)


def _group_step(run: Path, group: int) -> int:
    """The last step `group` committed, from its replica_steps windows."""
    wins = [e for e in events(run, "replica_steps") if e["group"] == group]
    return max((w["first"] + len(w["participants"]) - 1 for w in wins), default=0)


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
    # the survivors' next quorum: a restart faster than torchft's 5 s heartbeat timeout).
    for g in (0, 1):
        wins = sorted((w for w in events(run, "replica_steps") if w["group"] == g), key=lambda w: w["first"])
        steps = [w["first"] + i for w in wins for i in range(len(w["participants"]))]
        assert steps == list(range(steps[0], STEPS + 1)) and steps[0] <= 14, (g, steps)
        parts = dict(zip(steps, (n for w in wins for n in w["participants"])))
        short = {s: n for s, n in parts.items() if s > lost[0]["step"] and n < 3}
        assert len(short) == h["missed_steps"] and set(short.values()) <= {2}, (g, parts, h)
    ends = events(run, "replica_end")
    assert sorted(e["group"] for e in ends if e["step"] == STEPS) == [0, 1, 2], ends
    assert len({e["params_crc"] for e in ends if e["step"] == STEPS}) == 1, ends  # identical parameters
    assert [e["cls"] for e in events(run, "ending")] == ["completed"]
    assert len(events(run, "train_start")) == len(events(run, "job_start")) == 1  # one start: group 0's
    sm = summarize(ev.read(run))
    assert sm.restarts == 0 and sm.completion.complete, sm.completion
    line = next(x for x in sm.replicas if x.startswith("  group 2:"))  # its faults in order (a heal at start first)
    assert line.index("lost at step 1") < line.rindex("healed at step"), sm.replicas
