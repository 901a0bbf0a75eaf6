"""GPU-style jobs on the real local Slurm with placeholder GPU gres (dslurm/cluster/conf.py).

The session cluster declares conftest.GPUS GPUs per node. A 2-node probe job asks for them the two
ways sites do (--gpus-per-node, --gres=gpu:N), launched by torchrun and by one srun task per GPU;
slurmctld schedules it, Slurm sets the GPU environment, `dslurm launch` starts one CPU process per
declared GPU, and each records its ranks, host and the GPU variables it inherited.

Then every shipped GPU example, rendered for its site, goes through `sbatch --test-only` against
that site's shape (a never-started partition of the session cluster): slurmctld checks its nodes,
GPUs, CPUs per task, memory and partition exactly as it would at the site.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from cluster_jobs import GPUS, ROOT, logs, probe_job, session_shapes
from dslurm import slurm
from dslurm.launch.slurm_env import gpus_on_node
from dslurm.slurm.hosts import expand_hosts

SITE = "site-configs/local-gpu.yaml"
DIRECTIVE = {"gpus-per-node": f"#SBATCH --gpus-per-node={GPUS}", "gres": f"#SBATCH --gres=gpu:{GPUS}"}
SLOTS = ",".join(str(i) for i in range(GPUS))  # Slurm numbers a node's GPUs from 0


@pytest.mark.parametrize("directive", sorted(DIRECTIVE))
@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_gpu_job_runs_one_process_per_declared_gpu(slurm_cluster, cli, tmp_path, mode, directive):
    env = slurm_cluster.env()
    res = cli("submit", "--site", SITE, "--site-set", f"slurm.gpu_directive={directive}",
              "--job", probe_job(tmp_path, mode), env=env)
    assert res.returncode == 0, res.stderr
    job_id = int(re.search(r"submitted job (\d+)", res.stdout).group(1))
    run = tmp_path / "run"
    assert DIRECTIVE[directive] in (run / "job.sbatch").read_text()
    state = slurm.wait_job(job_id, timeout=240, env=env)
    assert state == "COMPLETED", logs(run)
    # slurmctld allocated the GPUs, not only accepted the flag.
    shown = slurm.run_cmd(["scontrol", "-o", "show", "job", str(job_id)], env=env).stdout
    assert f"gres/gpu={2 * GPUS}" in shown, shown

    recs = [json.loads(p.read_text()) for p in sorted((run / "probe").glob("rank-*.json"))]
    assert sorted(r["rank"] for r in recs) == list(range(2 * GPUS)), logs(run)
    assert all(r["world_size"] == 2 * GPUS for r in recs)
    assert all(r["allreduce_sum"] == sum(range(2 * GPUS)) for r in recs)
    hosts = sorted({r["hostname"] for r in recs})
    assert len(hosts) == 2 and set(hosts) <= set(slurm_cluster.node_names), hosts
    for node_rank, host in enumerate(hosts):  # node ranks follow the host list; GPUS local ranks each
        mine = [r for r in recs if r["hostname"] == host]
        assert {r["node_rank"] for r in mine} == {node_rank}
        assert sorted(r["local_rank"] for r in mine) == list(range(GPUS))
        assert sorted(r["rank"] for r in mine) == [node_rank * GPUS + i for i in range(GPUS)]
    for r in recs:
        gpu = r["gpu_env"]
        assert gpu["SLURM_GPUS_ON_NODE"] == str(GPUS), gpu
        assert gpu["SLURM_JOB_GPUS"] == SLOTS and gpu["CUDA_VISIBLE_DEVICES"] == SLOTS, gpu
        # --gpus-per-node is repeated to the steps; --gres=gpu:N is not a gpus-per-node request.
        assert gpu["SLURM_GPUS_PER_NODE"] == (str(GPUS) if directive == "gpus-per-node" else None), gpu
        assert r["device"] == "cpu"  # CPU processes: the visible placeholder GPUs select no device


def test_cpu_job_on_gpu_nodes_sees_no_gpus_in_its_steps(slurm_cluster, tmp_path):
    """The CPU tests share these nodes: an exclusive job that asks for no GPUs is given the node's
    gres (SLURM_JOB_GPUS) but its steps get no GPU count, so `dslurm launch` derives none."""
    out = tmp_path / "env.txt"
    script = tmp_path / "cpu.sh"
    script.write_text("#!/bin/bash\nsrun env\n")
    job = slurm.sbatch(script, extra_args=["--nodes=1", "--exclusive", f"--output={out}"],
                       cwd=tmp_path, env=slurm_cluster.env())
    assert slurm.wait_job(job, timeout=60, env=slurm_cluster.env()) == "COMPLETED"
    seen = dict(ln.split("=", 1) for ln in out.read_text().splitlines() if "=" in ln)
    assert "SLURM_GPUS_ON_NODE" not in seen and "CUDA_VISIBLE_DEVICES" not in seen
    assert gpus_on_node(seen) is None


def _gpu_examples() -> list[tuple[str, str]]:
    """Every shipped example rendered for a GPU site (the golden list, dslurm/cli/render.py)."""
    from dslurm.cli.render import EXAMPLES
    from dslurm.config import load_site

    return [(s, j) for s, j in EXAMPLES if load_site(ROOT / s).node.gpus]


def _placeable(examples: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(the examples a shaped partition can place, those asking for more nodes than it declares).
    The session cluster declares DEFAULT_SHAPE_NODES never-started nodes per shaped partition; the
    405B example asks for 2,048 whole nodes. Its script is checked as a golden (tests/unit/test_sbatch.py)
    and its layout built at full size by `dslurm plan check` (docs/plan.md), not placed here."""
    from dslurm.cluster.shapes import DEFAULT_SHAPE_NODES
    from dslurm.config import load_job

    fits = [(s, j) for s, j in examples if load_job(ROOT / j).nodes <= DEFAULT_SHAPE_NODES]
    return fits, [x for x in examples if x not in fits]


# Every shipped GPU example job with the site it is written for (container sites included: the
# script's resources are what `--test-only` checks, the runtime is never started).
GPU_EXAMPLES, TOO_BIG_TO_PLACE = _placeable(_gpu_examples())


def test_every_shipped_gpu_site_has_an_example_and_a_shape():
    from dslurm.cluster import parse_site_shape
    from dslurm.config import load_site

    gpu_sites = {str(p.relative_to(ROOT)) for p in (ROOT / "site-configs").glob("*.yaml")
                 if load_site(p).node.gpus and p.name != "local-gpu.yaml"}
    assert gpu_sites == {s for s, _ in GPU_EXAMPLES}
    # only the 405B example is left out of the placement check below, by name, never silently
    assert TOO_BIG_TO_PLACE == [("site-configs/h100-ib.yaml", "examples/jobs/llama405b-h100.yaml")]
    assert len(GPU_EXAMPLES) >= 5
    # each site's shape is one the session cluster declares (a container site shares its base's)
    shapes = {(x.partition, x.gpus, x.gpu_type, x.cpus, x.memory_mb) for x in session_shapes()}
    for site in gpu_sites:
        x = parse_site_shape(str(ROOT / site))
        assert (x.partition, x.gpus, x.gpu_type, x.cpus, x.memory_mb) in shapes, site


def _test_only(cli, tmp_path, env, site: str, job: str, *extra: str) -> subprocess.CompletedProcess[str]:
    res = cli("render", "--site", str(ROOT / site), "--job", str(ROOT / job), env=env)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(res.stdout)
    return subprocess.run(["sbatch", "--test-only", *extra, str(script)], cwd=tmp_path, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("site", "job"), GPU_EXAMPLES, ids=[f"{Path(j).stem}@{Path(s).stem}" for s, j in GPU_EXAMPLES])
def test_shipped_gpu_example_is_accepted_by_a_cluster_shaped_like_its_site(slurm_cluster, cli, tmp_path, site, job):
    from dslurm.config import load_job, load_site

    env = slurm_cluster.env()
    proc = _test_only(cli, tmp_path, env, site, job)
    part, nodes = load_site(ROOT / site).slurm.partition, load_job(ROOT / job).nodes
    # "Job N to start at T using P processors on nodes gpu-n[1-4] in partition gpu"
    assert proc.returncode == 0 and f"in partition {part}" in proc.stderr, proc.stderr
    names = re.search(r"on nodes (\S+)", proc.stderr).group(1)
    assert len(expand_hosts(names)) == nodes
    # The same check fails when the job does not fit the site: it can tell.
    bad = _test_only(cli, tmp_path, env, site, job, f"--nodes={nodes + 16}")
    assert bad.returncode != 0 and "not available" in bad.stderr, bad.stderr
