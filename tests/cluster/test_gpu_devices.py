"""Warm steps get the job's devices, under the session cluster's device constraint (task/cgroup,
ConstrainDevices=yes: dslurm/cluster/conf.py): a step's processes open only the GPUs Slurm gave it,
EPERM for the others, as on a GPU site. The placeholder devices carry /dev/nvidiaK's numbers and
no driver, so an open the cgroup lets through fails with ENXIO instead (dslurm/launch/devices.py).

1. One job's steps, each srun built by dslurm's own code: the training step of `dslurm supervise`
   and the warm pool's step (the same GPU request, `render.step_gpu_flags`) open both of the node's
   GPUs; a step given one GPU opens one; a pool step as before this change would be on a site
   whose steps get no GRES by default (`--gres=none`) opens none: the check can tell.
2. A supervised job (1 node + 1 spare, `recovery.warm: true`) whose probe crashes in its cold step
   once both pools serve: the warm attempt's workers, forked by the pool (its own devices cgroup,
   not their step's), open exactly the devices the cold attempt's opened, with the same
   CUDA_VISIBLE_DEVICES, and the job completes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cluster_jobs import GPUS, ROOT, events, logs
from dslurm import slurm
from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve

SITE = "site-configs/local-gpu.yaml"
VIEW = "import json; from dslurm.launch.devices import device_view; print('VIEW', json.dumps(device_view()))"


def _gpu_files(slurm_cluster, host: str) -> list[str]:
    return [str(slurm_cluster.state_dir / "dev" / host / f"gpu{i}") for i in range(GPUS)]


def _resolved(tmp_path: Path):
    job = load_job(data={"name": "dev", "nodes": 1, "spares": 1, "entry": "dslurm.launch.probe",
                         "preflight": {"enabled": False}, "checkpoint": {"run_dir": str(tmp_path / "run")}})
    return resolve(load_site(ROOT / SITE), job, site_path=SITE, job_path="dev", base_dir=str(tmp_path))


def test_the_pool_step_opens_exactly_the_training_steps_gpus(slurm_cluster, tmp_path):
    from dslurm.recover.srun import SrunRunner
    from dslurm.recover.supervisor import Step
    from dslurm.recover.warm_pools import WarmPools
    from dslurm.render import q, words

    assert slurm_cluster.constrain_devices, "the session cluster runs without its device constraint"
    r = _resolved(tmp_path)
    py = str(ROOT / ".venv" / "bin" / "python")
    host = "HOSTPLACEHOLDER"  # the batch shell's node, filled in by bash
    training = SrunRunner(r, [py, "-c", VIEW], {}).argv(Step(index=0, hosts=(host,), facts_dir=tmp_path))
    pool = WarmPools(r, ["launch", "--", py, "-m", "dslurm.launch.probe"], {"SLURM_JOB_ID": "1"}, [host]).argv(host)
    pool = [*pool[:pool.index(py) + 1], "-c", VIEW]  # the pool step's srun, running the view instead
    one = ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--gpus-per-node=1", py, "-c", VIEW]
    # The pool step as a site whose steps get no GRES unless they ask would run the old one (no GPU
    # request): --gres=none, and no --gpus-per-node from the batch shell's environment either.
    gpu_flag = f"--gpus-per-node={GPUS}"
    assert gpu_flag in pool and gpu_flag in training
    none = ["env", "-u", "SLURM_GPUS_PER_NODE", *(("--gres=none" if w == gpu_flag else w) for w in pool)]
    lines = ["#!/bin/bash", "set -u", f"export DSLURM_GPU_DEVICES={q(r.site.env['DSLURM_GPU_DEVICES'])}"]
    for name, argv in (("training", training), ("pool", pool), ("one", one), ("none", none)):
        lines.append(f"echo STEP {name}; " + words(argv).replace(host, '"$SLURMD_NODENAME"'))
    script = tmp_path / "devices.sh"
    script.write_text("\n".join(lines) + "\n")
    out = tmp_path / "devices.out"
    env = slurm_cluster.env()
    job = slurm.sbatch(script, extra_args=["--nodes=1", "--exclusive", f"--gpus-per-node={GPUS}", f"--output={out}"],
                       cwd=ROOT, env=env)
    assert slurm.wait_job(job, timeout=120, env=env) == "COMPLETED", out.read_text()
    text = out.read_text()
    views = dict(zip(re.findall(r"^STEP (\w+)", text, re.M),
                     (json.loads(m) for m in re.findall(r"^VIEW (.*)$", text, re.M)), strict=True))
    assert set(views) == {"training", "pool", "one", "none"}, text
    node = Path(views["training"]["reachable"][0]).parent.name
    files = _gpu_files(slurm_cluster, node)
    assert views["training"]["reachable"] == files and views["pool"]["reachable"] == files, views
    assert views["pool"]["gpu_env"]["CUDA_VISIBLE_DEVICES"] == views["training"]["gpu_env"]["CUDA_VISIBLE_DEVICES"]
    assert views["one"]["reachable"] == files[:1] and views["one"]["files"][files[1]] == "denied", views["one"]
    assert views["none"]["reachable"] == [] and set(views["none"]["files"].values()) == {"denied"}, views["none"]
    assert "/step_" in (views["pool"]["cgroup"] or ""), views["pool"]  # each step its own devices cgroup


@pytest.mark.timeout(300)
def test_a_warm_attempt_after_a_crash_opens_the_cold_attempts_devices(slurm_cluster, cli, tmp_path):
    run = tmp_path / "run"
    job = {"name": "warm-devices", "nodes": 1, "spares": 1, "time": "00:05:00", "launch": "torchrun",
           # no recovery.warm: `auto`, and the site says warm (site-configs/local-gpu.yaml)
           "entry": "dslurm.launch.probe", "preflight": {"enabled": False},
           "checkpoint": {"run_dir": str(run)},
           # rank 0 crashes in the cold step, once both nodes' pools serve (the probe waits for them)
           "env": {"DSLURM_FAULT_CRASH": "1:0@0.0", "DSLURM_FAULT_AWAIT": f"{run}/warm/*.ready:2:120"}}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job))
    env = slurm_cluster.env()
    res = cli("submit", "--site", SITE, "--job", str(spec), env=env)
    assert res.returncode == 0, res.stderr
    job_id = int(re.search(r"submitted job (\d+)", res.stdout).group(1))
    assert slurm.wait_job(job_id, timeout=240, env=env) == "COMPLETED", logs(run)
    assert [e["cls"] for e in events(run, "ending")] == ["crash", "completed"], logs(run)
    assert [e["mode"] for e in events(run, "job_start")] == ["torchrun", "warm"], logs(run)
    recs = {p.name: json.loads(p.read_text()) for p in (run / "probe").glob("step-*.json")}
    assert sorted(recs) == [f"step-0.{s}-rank-{r}.json" for s in (0, 1) for r in range(GPUS)], sorted(recs)
    for rank in range(GPUS):
        cold, warm = recs[f"step-0.0-rank-{rank}.json"], recs[f"step-0.1-rank-{rank}.json"]
        assert not cold["warm"] and warm["warm"], (cold, warm)
        assert cold["hostname"] == warm["hostname"]  # a crash: the same node again
        files = _gpu_files(slurm_cluster, cold["hostname"])
        assert cold["devices"]["reachable"] == files == warm["devices"]["reachable"], (cold, warm)
        assert cold["devices"]["gpu_env"]["CUDA_VISIBLE_DEVICES"] == warm["devices"]["gpu_env"]["CUDA_VISIBLE_DEVICES"]
        # the cold worker lives in its own step's devices cgroup; the warm one in the pool step's
        assert f"/step_{cold['slurm_step_id']}/" in cold["devices"]["cgroup"], cold
        assert f"/step_{warm['slurm_step_id']}/" not in warm["devices"]["cgroup"], warm
