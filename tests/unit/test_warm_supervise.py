"""Which steps `dslurm supervise` offers the warm pools (recovery.warm): never the first (the cold
start), every step after a failure whose nodes' pools all serve, and never the step right after a
failed warm step (a failure during a warm restart falls back to the cold path). Without pools,
nothing changes. The loop is the real one against test_supervise's fake cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_supervise as ts

from dslurm import exitcodes as X
from dslurm.config import load_job, load_site
from dslurm.recover.srun import SrunRunner
from dslurm.recover.supervisor import Step

ROOT = Path(__file__).resolve().parents[2]

make = ts.make  # the fixture: a Supervisor over the fake cluster
crashes, completes = ts.crashes, ts.completes


class FakePools:
    def __init__(self, serving: set[str]) -> None:
        self.serving = serving

        self.ticks: list[bool] = []

    def ready(self, hosts) -> bool:
        return all(h in self.serving for h in hosts)

    def tick(self, step_over: bool) -> None:
        self.ticks.append(step_over)


def test_warm_steps_follow_failures_and_a_failed_warm_step_falls_back_cold(make):
    sup, c, _run = make([crashes, crashes, crashes, completes])
    sup.pools = FakePools({"node1", "node2", "node3"})
    assert sup.loop() == X.OK
    assert [s.warm for s in c.steps] == [False, True, False, True]
    assert sup.pools.ticks == [True] * 4  # once after each step (the fake's steps take no time)


def test_warm_needs_every_training_node_serving(make):
    sup, c, _run = make([crashes, completes])
    sup.pools = FakePools({"node1"})
    assert sup.loop() == X.OK
    assert [s.warm for s in c.steps] == [False, False]


def test_without_pools_every_step_is_cold(make):
    sup, c, _run = make([crashes, completes])
    assert sup.pools is None and sup.loop() == X.OK
    assert [s.warm for s in c.steps] == [False, False]


def test_warm_step_env_tells_the_launchers(make, tmp_path, monkeypatch):
    sup, _c, _run = make([completes])
    seen = []

    class Proc:
        def __init__(self, argv, env, stderr=None):
            seen.append(env["DSLURM_WARM"])
            self.stderr = __import__("io").BytesIO()  # srun said nothing

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr("subprocess.Popen", Proc)
    runner = SrunRunner(sup.r, ["dslurm", "launch"], {})
    for warm in (True, False):
        runner.run(Step(index=1, hosts=("node1",), facts_dir=tmp_path, warm=warm), lambda: False)
    assert seen == ["1", "0"]


def test_warm_pools_start_after_the_first_step_and_run_on_every_allocated_node(make, monkeypatch):
    from dslurm.launch.warm import ready_path
    from dslurm.observe import events as ev
    from dslurm.observe.ledger import Ledger
    from dslurm.recover.warm_pools import WarmPools

    sup, _c, run = make([completes])
    # An earlier start's first step (before a requeue; a resubmission's job id differs too): the
    # ledger holds it before this supervise begins, and it must not start the pools.
    Ledger(run).append(ev.StartPhases(t0=1.0, phases={"imports": 1.0}, total_s=1.0, job_id="4242", restart=0))
    Ledger(run).append(ev.StartPhases(t0=1.0, phases={"imports": 1.0}, total_s=1.0, job_id="4000", restart=0))
    stale = ready_path(run, "4242", "node2")  # a pool of the earlier start, killed -9
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{}")
    cmd = ["python", "-m", "dslurm", "launch", "--", "python", "-m", "train", "--site", "s"]
    pools = WarmPools(sup.r, cmd, {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"}, ["node1", "node2", "node3"])
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda argv, **kw: started.append(argv))
    pools.tick(step_over=False)
    assert started == []  # the cold start has not trained yet: its imports keep the CPUs
    # Appended now, but of another job or another start: still not this cold start's first step.
    Ledger(run).append(ev.StartPhases(t0=1.0, phases={"imports": 1.0}, total_s=1.0, job_id="4000", restart=1))
    Ledger(run).append(ev.StartPhases(t0=1.0, phases={"imports": 1.0}, total_s=1.0, job_id="4242", restart=0))
    pools.tick(step_over=False)
    assert started == []
    Ledger(run).append(ev.StartPhases(t0=1.0, phases={"imports": 1.0}, total_s=1.0, job_id="4242", restart=1))
    pools.tick(step_over=False)
    assert not stale.exists()
    assert [a[a.index("--host") + 1] for a in started] == ["node1", "node2", "node3"]
    assert all(a[:2] == ["srun", "--overlap"] and a[a.index("--module") + 1] == "train" for a in started)
    pools.tick(step_over=True)
    assert len(started) == 3


def test_warm_pool_step_gets_the_training_steps_share_of_its_node(make):
    """Forked workers inherit the pool step's cgroup and affinity: it must hold the node's CPUs the
    training step holds, the node's memory, and no CPU binding."""
    from dslurm.recover.warm_pools import WarmPools, pool_shape_flags
    from dslurm.render import cpus_per_task, tasks_per_node

    sup, _c, _run = make([completes])
    flags = pool_shape_flags(sup.r)
    assert flags == [f"--cpus-per-task={cpus_per_task(sup.r) * tasks_per_node(sup.r)}", "--mem=0", "--cpu-bind=none"]
    assert cpus_per_task(sup.r) * tasks_per_node(sup.r) == max(1, sup.r.site.node.cpus)
    pools = WarmPools(sup.r, ["l", "--", "python", "-m", "train"], {"SLURM_JOB_ID": "1"}, ["node1"])
    argv = pools.argv("node1")
    assert argv[argv.index("--quiet") + 1:argv.index("python")] == flags
    training = SrunRunner(sup.r, ["dslurm", "launch"], {}).argv(Step(index=0, hosts=("node1",), facts_dir=_run))
    assert flags[0] in training or tasks_per_node(sup.r) > 1


@pytest.mark.parametrize("directive", ["gpus-per-node", "gres"])
def test_on_a_gpu_site_the_pool_step_asks_for_the_training_steps_gpus(tmp_path, directive):
    """Under ConstrainDevices a forked worker opens only the pool step's GPUs: the pool step asks
    for exactly what the training step asks for, the job's own request (tests/cluster/test_gpu_devices.py
    shows the devices on the local cluster)."""
    from dslurm.config.resolve import resolve
    from dslurm.recover.warm_pools import WarmPools, pool_shape_flags
    from dslurm.render import directives, step_gpu_flags

    site = load_site(ROOT / "site-configs" / "h100-ib.yaml", [f"slurm.gpu_directive={directive}"])
    job = load_job(data={"name": "w", "nodes": 2, "spares": 1, "recovery": {"warm": True},
                         "train": {"global_batch": 64}, "checkpoint": {"run_dir": str(tmp_path)}})
    r = resolve(site, job, site_path="s", job_path="j", base_dir=str(tmp_path))
    want = {"gpus-per-node": ["--gpus-per-node=8"], "gres": ["--gres=gpu:8"]}[directive]
    assert step_gpu_flags(r) == want
    assert (want[0][2:].split("=")[0], want[0].split("=")[1]) in directives(r, "logs")  # = the #SBATCH line
    assert pool_shape_flags(r)[-1:] == want
    training = SrunRunner(r, ["dslurm", "launch"], {}).argv(Step(index=1, hosts=("n1", "n2"), facts_dir=tmp_path))
    pool = WarmPools(r, ["l", "--", "python", "-m", "train"], {"SLURM_JOB_ID": "1"}, ["n1"]).argv("n1")
    assert [w for w in training if w in want] == [w for w in pool if w in want] == want
    cpu = resolve(load_site(ROOT / "site-configs" / "local.yaml"), job, site_path="s", job_path="j",
                  base_dir=str(tmp_path))
    assert step_gpu_flags(cpu) == [] and not any("gpu" in w or "gres" in w for w in pool_shape_flags(cpu))
