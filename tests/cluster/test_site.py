"""`dslurm site discover` and `dslurm site check` on the real local cluster.

The session cluster has GPUS placeholder GPUs per node and --site-shape partitions of the shipped GPU
sites (conftest). Discover writes the site of its default partition (probing one node); that site
renders the #SBATCH lines of site-configs/local-gpu.yaml, the shipped site of this very cluster, and
`site check` passes every row on it for real: --test-only, the setup lines, the GPUs, scratch, the
shared durable path, the burn-in's 2-node all-reduce, the signal lead and one requeue. A shaped
partition is discovered as its shape; a wrong partition fails before anything is submitted, and an
unwritable scratch path fails on the compute node, each naming its fix.
The pure decisions of every row, the failing ones included, are in tests/unit/test_site_check.py.
"""

from __future__ import annotations

import yaml

from cluster_jobs import GPUS, ROOT
from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.render import RenderRefs, render_sbatch
from testkit import load_scaled


def _sbatch_lines(site) -> list[str]:
    # The job gives the time limit and signal lead: discover marks its own as GUESSes (no Slurm fact).
    job = load_job(data={"name": "same", "nodes": 2, "time": "00:10:00", "requeue": {"signal_lead": 30},
                         "preflight": {"enabled": False}})
    script = render_sbatch(resolve(site, job, base_dir=str(ROOT)), RenderRefs(site="s.yaml", job="j.yaml"))
    return [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]


def test_discovered_site_checks_out_and_bad_sites_are_named_with_fixes(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    out = tmp_path / "site.yaml"
    res = cli("site", "discover", "-o", str(out), env=env, timeout=load_scaled(120))
    assert res.returncode == 0, res.stdout + res.stderr
    site = load_site(out)
    assert (site.slurm.partition, site.node.gpus, site.slurm.gpu_directive) == ("debug", GPUS, "gpus-per-node")
    assert _sbatch_lines(site) == _sbatch_lines(load_site(ROOT / "site-configs/local-gpu.yaml"))
    assert "GUESS" in out.read_text() and site.env.get("GLOO_SOCKET_IFNAME") == "lo"

    shaped = cli("site", "discover", "--partition", "gpu", "--no-probe", env=env, timeout=60)
    assert shaped.returncode == 0, shaped.stderr
    h100 = load_site(ROOT / "site-configs/h100-ib.yaml")
    got = yaml.safe_load(shaped.stdout)["node"]
    assert (got["gpus"], got["cpus"], got["mem_gb"]) == (h100.node.gpus, h100.node.cpus, h100.node.mem_gb)

    res = cli("site", "check", str(out), "--work-dir", str(tmp_path / "check"), "--timeout", "240", env=env,
              timeout=load_scaled(300))
    assert res.returncode == 0, res.stdout + res.stderr
    for promise in ("accepted", "importable", "GPU", "scratch", "shared", "all-reduce", "requeues once"):
        assert any(ln.startswith("OK") and promise in ln for ln in res.stdout.splitlines()), (promise, res.stdout)

    bad = cli("site", "check", str(out), "--site-set", "slurm.partition=nope", "--work-dir",
              str(tmp_path / "bad"), env=env, timeout=60)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "'nope' does not exist" in bad.stdout and "fix: set slurm.partition to one of: debug" in bad.stdout
    assert "nothing was submitted" in bad.stdout and not list((tmp_path / "bad").glob("*.sbatch"))

    # A scratch path no node can write: found by the node job on a compute node, with the fix.
    ro = cli("site", "check", str(out), "--site-set", "storage.scratch=/proc/dslurm-nope/%n", "--work-dir",
             str(tmp_path / "ro"), "--timeout", "240", env=env, timeout=load_scaled(300))
    assert ro.returncode == 1, ro.stdout + ro.stderr
    lines = ro.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("FAIL") and "scratch" in ln)
    assert "is not writable" in lines[at] and "fix: set storage.scratch to a node-local directory" in lines[at + 1]
