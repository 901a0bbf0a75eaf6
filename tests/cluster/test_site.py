"""`dslurm site discover` and `dslurm site check` on the real local cluster.

The session cluster has GPUS placeholder GPUs per node and --site-shape partitions of the shipped GPU
sites (conftest). Discover writes the site of its default partition (probing one node); that site
renders the #SBATCH lines of site-configs/local-gpu.yaml, the shipped site of this very cluster, and
`site check` passes every row on it for real: --test-only, the setup lines, the GPUs, scratch, the
shared durable path, the burn-in's 2-node all-reduce, the signal lead and one requeue. A shaped
partition is discovered as its shape. Broken sites fail their rows, each naming its fix: a wrong
partition before anything is submitted; one site broken three ways at once (setup lines that leave
the system Python, without torch; a scratch path no node can write; a node-local durable path), found
by the node job on the compute nodes; and JobRequeue=0 in the cluster's own slurm.conf, for a moment.
The pure decisions of every row, the failing ones included, are in tests/unit/test_site_check.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

import yaml

from cluster_jobs import GPUS, ROOT, SITE
from dslurm import slurm
from dslurm.cluster import daemons
from dslurm.cluster.state import load
from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.render import RenderRefs, render_sbatch
from dslurm.site import check as C
from dslurm.slurm.facts import parse_config
from testkit import load_scaled


def _sbatch_lines(site) -> list[str]:
    # The job gives the time limit and signal lead: discover marks its own as GUESSes (no Slurm fact).
    job = load_job(data={"name": "same", "nodes": 2, "time": "00:10:00", "requeue": {"signal_lead": 30},
                         "preflight": {"enabled": False}})
    script = render_sbatch(resolve(site, job, base_dir=str(ROOT)), RenderRefs(site="s.yaml", job="j.yaml"))
    return [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]


def _rows(stdout: str) -> dict[str, tuple[str, str, str]]:
    """`site check`'s table: promise -> (status, detail, fix)."""
    rows: dict[str, tuple[str, str, str]] = {}
    lines = stdout.splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r"(OK|FAIL|SKIP) +(.*)", ln)
        promise = next((p for p in C.PROMISES if m and m[2].startswith(p)), None)
        if m and promise:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            fix = nxt.split("fix: ", 1)[1] if nxt.startswith(" ") and "fix: " in nxt else ""
            rows[promise] = (m[1], m[2][len(promise):].strip(), fix)
    assert set(rows) == set(C.PROMISES), stdout
    return rows


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

    # The placeholder GPUs are not at NVIDIA's /dev/nvidiaK: the site names its device files, as
    # site-configs/local-gpu.yaml does, for the warm row to compare what the workers open.
    found = yaml.safe_load(out.read_text())
    found.setdefault("env", {})["DSLURM_GPU_DEVICES"] = f"{slurm_cluster.state_dir}/dev/$SLURMD_NODENAME/gpu*"
    # Its durable path is the checkout's checkpoints/, where the suite's own injected faults are on
    # record against node1..node3 (the site's node memory): as the shipped local sites, record but
    # never exclude, or the check's 2-node jobs find no nodes left.
    found["nodes"] = {"exclude_after": 0}
    out.write_text(yaml.safe_dump(found))
    res = cli("site", "check", str(out), "--work-dir", str(tmp_path / "check"), "--timeout", "240", env=env,
              timeout=load_scaled(300))
    assert res.returncode == 0, res.stdout + res.stderr
    for promise in ("accepted", "importable", "GPU", "scratch", "shared", "all-reduce", "requeues once",
                    "warm restart"):
        assert any(ln.startswith("OK") and promise in ln for ln in res.stdout.splitlines()), (promise, res.stdout)
    # the warm row proved a warm restart under the device constraint, with the node's 2 GPU device files,
    # and recorded it beside the site file: `recovery.warm: auto` (the discovered site's) now chooses warm
    assert f"{GPUS} GPU device(s)" in _rows(res.stdout)[C.P_WARM][1], res.stdout
    from dslurm.submission.warm_proof import choice_for

    spares = load_job(data={"name": "w", "nodes": 1, "spares": 1})
    assert load_site(out).recovery.warm == "auto" and choice_for(spares, load_site(out), str(out)).warm, res.stdout

    bad = cli("site", "check", str(out), "--site-set", "slurm.partition=nope", "--work-dir",
              str(tmp_path / "bad"), env=env, timeout=60)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "'nope' does not exist" in bad.stdout and "fix: set slurm.partition to one of: debug" in bad.stdout
    assert "nothing was submitted" in bad.stdout and not list((tmp_path / "bad").glob("*.sbatch"))

    # One site broken three ways, one node job: the setup lines leave the system Python (a venv path that
    # does not exist, then PATH without it; dslurm from the checkout, torch nowhere), scratch no node can
    # write, and a durable path each node has its own copy of. The local nodes share one filesystem, so a
    # node-local directory there is a per-node one (%n, as site-configs/local.yaml's scratch): written on
    # the first node, absent on the last, as /local or /tmp at a site. Requeue off: no 2-minute job.
    assert subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode != 0, \
        "this test needs a system python3 without torch: it stands for setup lines that miss the venv"
    broken = yaml.safe_load(out.read_text())
    broken.update(python="python3", setup=["source /opt/no-such-venv/bin/activate",
                                           'export PATH=/usr/bin:/bin PYTHONPATH="$SLURM_SUBMIT_DIR"'])
    broken["storage"] = {"scratch": "/proc/dslurm-nope/%n", "durable": str(tmp_path / "node-local" / "%n")}
    broken["requeue"]["enabled"] = False
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    res = cli("site", "check", str(tmp_path / "broken.yaml"), "--work-dir", str(tmp_path / "broken"),
              "--timeout", "240", env=env, timeout=load_scaled(300))
    assert res.returncode == 1, res.stdout + res.stderr
    rows = _rows(res.stdout)
    failed = {p for p, (status, _, _) in rows.items() if status == "FAIL"}
    assert failed == {C.P_SETUP, C.P_SCRATCH, C.P_DURABLE}, res.stdout
    status, detail, fix = rows[C.P_SETUP]
    assert "import torch failed" in detail and "No module named 'torch'" in detail and "/usr/bin/python3" in detail
    assert "setup line 1 `source /opt/no-such-venv/bin/activate` failed" in detail, detail
    assert fix.startswith("add the lines that make torch importable on a compute node to `setup`"), fix
    status, detail, fix = rows[C.P_SCRATCH]
    assert "is not writable" in detail and fix.startswith("set storage.scratch to a node-local directory"), detail
    status, detail, fix = rows[C.P_DURABLE]
    assert "it is node-local" in detail and fix.startswith("set storage.durable to a filesystem every node mounts")
    # Held meanwhile: Slurm's rows and the GPUs (the probe ran, torch or not); the burn-in needs torch, so
    # the all-reduce is not judged (its fix would name the interface); requeue is off in this site.
    assert all(rows[p][0] == "OK" for p in (C.P_PARTITION, C.P_MATCH, C.P_TEST_ONLY, C.P_GPUS)), res.stdout
    assert rows[C.P_ALLREDUCE][0] == "SKIP" and "fix the setup row first" in rows[C.P_ALLREDUCE][1]
    assert rows[C.P_REQUEUE_CONF][0] == rows[C.P_REQUEUE][0] == "SKIP"


def test_requeue_off_in_slurm_conf_fails_the_check_before_anything_is_submitted(slurm_cluster, cli, tmp_path):
    """JobRequeue=0 in the cluster's slurm.conf (rendered by its own generator, reconfigured, and rendered
    back in `finally`: the function `dslurm cluster up` runs when a killed test left it so). Tests run one
    at a time, and dslurm's own jobs (any session's) say --requeue or --no-requeue: the second it is off
    changes only a bare sbatch submitted in it, which takes the default."""
    sdir = slurm_cluster.state_dir
    rec = load(sdir)
    assert rec is not None
    daemons.write_conf(dataclasses.replace(daemons.running_spec(sdir, rec), job_requeue=False))
    try:
        res = cli("site", "check", SITE, "--work-dir", str(tmp_path), env=slurm_cluster.env(), timeout=60)
    finally:
        restored = daemons.restore_conf(sdir, rec)
    config = parse_config(slurm.run_cmd(["scontrol", "show", "config"], env=slurm_cluster.env()).stdout)
    assert restored and config["JobRequeue"] == "1", config.get("JobRequeue")
    assert not daemons.restore_conf(sdir, rec)  # as rendered: nothing left to put back
    assert res.returncode == 1, res.stdout + res.stderr
    rows = _rows(res.stdout)
    status, detail, fix = rows[C.P_REQUEUE_CONF]
    assert status == "FAIL" and "JobRequeue=0" in detail and "does not requeue" in detail, res.stdout
    assert fix == ("ask the admins for JobRequeue=1, or set requeue.enabled: false in the site (a run then ends "
                   "at its time limit; resubmit it to continue)"), fix
    assert [p for p, (status, _, _) in rows.items() if status == "FAIL"] == [C.P_REQUEUE_CONF], res.stdout
    assert all("not run" in rows[p][1] for p in C.LIVE) and not (tmp_path / "nodes.sbatch").exists()
