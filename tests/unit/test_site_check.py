"""`dslurm site check`, pure: each row's decision from recorded facts, the failing cases with their fix,
and the scripts of the check's jobs (the site's own #SBATCH lines, the probe steps, the requeue trap).

"Requeue disabled in slurm.conf" is decided here from a `scontrol show config` text with JobRequeue=0,
and on the cluster (tests/cluster/test_site.py) from the local cluster's own slurm.conf, turned off for
a moment; that file runs the other failing rows for real too.
"""

from __future__ import annotations

from pathlib import Path

from dslurm.config import load_site
from dslurm.site import check as C
from dslurm.site.jobs import node_script, requeue_script, resolved
from dslurm.slurm import facts as F

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "site-configs/local.yaml")
PARTS = F.parse_partitions(
    "PartitionName=debug AllowAccounts=ALL Default=YES DefaultTime=NONE MaxTime=UNLIMITED Nodes=node[1-3] State=UP\n"
    "PartitionName=gpu AllowAccounts=ALL Default=NO DefaultTime=NONE MaxTime=UNLIMITED Nodes=gpu-n[1-16] State=UP\n")
NODES = F.parse_nodes("\n".join(
    f"NodeName=node{k} CPUEfctv=4 CPUTot=4 Gres=gpu:2 NodeAddr=127.0.0.1 RealMemory=4096 State=IDLE "
    "Partitions=debug" for k in (1, 2, 3)), "debug")
ASSOC = F.Associations(accounts=("root",), qos=("normal",), default_account="root", available=True)


def site(*overrides: str):
    return load_site(LOCAL, list(overrides))


def probe(node: str, role: str, **extra) -> dict:
    rec = {"node": node, "role": role, "gpus": {"visible": 0, "nvml": None, "env": {}},
           "software": {"python": "3.11.7", "torch": "2.13.0+cpu", "dslurm": "0.1.0", "executable": "python"}}
    rec.update(extra)
    return rec


def test_existing_partition_account_and_shapes_hold():
    s = site()
    assert C.row_partition(s, PARTS).status == "ok"
    assert C.row_account(s, ASSOC, PARTS[0]).status == "ok"
    assert C.row_matches_slurm(s, NODES).status == "ok"
    assert C.row_requeue_config(s, {"JobRequeue": "1"}).status == "ok"


def test_wrong_partition_fails_naming_the_partitions():
    row = C.row_partition(site("slurm.partition=nope"), PARTS)
    assert row.status == "fail" and "'nope' does not exist" in row.detail and "debug, gpu" in row.fix


def test_account_the_user_lacks_fails_with_the_users_accounts():
    row = C.row_account(site("slurm.account=physics"), ASSOC, PARTS[0])
    assert row.status == "fail" and "root" in row.fix
    assert C.row_account(site("slurm.qos=gold"), ASSOC, PARTS[0]).status == "fail"
    assert C.row_account(site("slurm.account=physics"), F.Associations(), PARTS[0]).status == "skip"


def test_site_fields_contradicting_slurm_fail_with_slurms_numbers():
    row = C.row_matches_slurm(site("node.gpus=8", "slurm.gpu_directive=gpus-per-node", "node.cpus=4"), NODES)
    assert row.status == "fail" and "at most 2 GPU(s)" in row.detail and "node.gpus: 2" in row.fix
    row = C.row_matches_slurm(site("node.cpus=64"), NODES)
    assert row.status == "fail" and "node.cpus: 4" in row.fix
    row = C.row_matches_slurm(site("node.gpus=2", "slurm.gpu_directive=gres", "slurm.gres_name=gpu:h100"), NODES)
    assert row.status == "fail" and "gres_name" in row.detail


def test_requeue_disabled_in_slurm_conf_fails_with_the_fix():
    cfg = F.parse_config("Configuration data as of now\nJobRequeue              = 0\n")
    row = C.row_requeue_config(site(), cfg)
    assert row.status == "fail" and "JobRequeue=0" in row.detail
    assert "requeue.enabled: false" in row.fix and "JobRequeue=1" in row.fix
    assert C.row_requeue_config(site("requeue.enabled=false"), cfg).status == "skip"


def test_test_only_refusal_names_the_field():
    row = C.row_test_only(2, 1, "sbatch: error: invalid partition specified: nope\n")
    assert row.status == "fail" and "slurm.partition" in row.fix
    row = C.row_test_only(2, 1, "sbatch: error: Invalid account or account/partition combination specified")
    assert "slurm.account" in row.fix
    assert C.row_test_only(2, 0, "sbatch: Job 7 to start at now using 4 processors on nodes node[1-2]").holds


def test_setup_lines_that_do_not_make_torch_importable_fail():
    s = site()
    bad = probe("node1", "write", software={"python": "3.11", "torch": None, "executable": "/usr/bin/python3",
                                            "torch_error": "ModuleNotFoundError: No module named 'torch'"})
    row = C.row_setup(s, [bad], ["0"], "job 1 COMPLETED")
    assert row.status == "fail" and "No module named 'torch'" in row.detail
    assert 'setup line 1 `source "$SLURM_SUBMIT_DIR/.venv/bin/activate"` failed' in row.detail, row.detail
    assert "setup" in row.fix
    row = C.row_setup(s, [], ["0", "7"], "job 1 COMPLETED")  # 7: no such line (a stray marker): its number
    assert row.status == "fail" and "dslurm is not importable" in row.detail and "failed" in row.detail
    assert "`, 7 failed" in row.detail, row.detail
    assert C.row_setup(s, [probe("node1", "write")], [], "").status == "ok"


def test_unwritable_scratch_fails_and_shared_scratch_is_not_node_local():
    s = site()
    first = probe("node1", "write", scratch={"path": "/proc/x/node1", "writable": False, "error": "PermissionError"})
    row = C.row_scratch(s, first, None)
    assert row.status == "fail" and "not writable" in row.detail and "storage.scratch" in row.fix
    good = probe("node1", "write", scratch={"path": "/tmp/s/node1", "writable": True, "fs": "ext4", "free_gb": 9})
    assert C.row_scratch(s, good, None).status == "ok"  # %n: one directory per node
    flat = site("storage.scratch=/scratch/shared")
    seen = probe("node2", "read", scratch={"peer_marker_seen": True})
    row = C.row_scratch(flat, {**good, "scratch": {**good["scratch"], "path": "/scratch/shared"}}, seen)
    assert row.status == "fail" and "shared between nodes" in row.detail
    assert C.row_scratch(flat, {**good, "scratch": {**good["scratch"], "fs": "lustre"}}, None).status == "fail"


def test_node_local_durable_path_fails():
    s = site()
    first = probe("node1", "write", durable={"path": "/local/runs", "written": True, "fs": "xfs"})
    second = probe("node2", "read", durable={"path": "/local/runs", "seen_from": None})
    row = C.row_durable(s, first, second)
    assert row.status == "fail" and "node-local" in row.detail and "every node mounts" in row.fix
    second["durable"]["seen_from"] = "node1"
    assert C.row_durable(s, first, second).status == "ok"
    assert C.row_durable(s, first, None).status == "skip"  # one node: nothing to compare


def test_gpu_rows_follow_visible_devices():
    s = site("node.gpus=2", "slurm.gpu_directive=gpus-per-node", "node.procs_per_node=2")
    rec = probe("node1", "write", gpus={"visible": 2, "nvml": None, "env": {"CUDA_VISIBLE_DEVICES": "0,1"}})
    assert C.row_gpus(s, [rec]).status == "ok"
    rec["gpus"] = {"visible": 1, "nvml": None, "env": {"CUDA_VISIBLE_DEVICES": "0"}}
    row = C.row_gpus(s, [rec])
    assert row.status == "fail" and "node.gpus: 1" in row.fix
    assert C.row_gpus(site(), [rec]).status == "skip"  # the CPU site asks for none


def test_requeue_row_needs_the_signal_and_one_restart():
    s = site()
    out = "DSLURM-SITE-START 0\nDSLURM-SITE-SIGNAL USR2 1\nDSLURM-SITE-REQUEUE rc=0\nDSLURM-SITE-RESTARTED 1\n"
    assert C.row_requeue(s, "COMPLETED", 1, out, 40).status == "ok"
    row = C.row_requeue(s, "TIMEOUT", 0, "DSLURM-SITE-START 0\n", 40)
    assert row.status == "fail" and "no USR2" in row.detail
    row = C.row_requeue(s, "FAILED", 0, "DSLURM-SITE-SIGNAL USR2 1\nDSLURM-SITE-REQUEUE rc=1\n", 40)
    assert row.status == "fail" and "did not start again" in row.detail


def test_allreduce_row_reads_the_burn_ins_communication_findings():
    report = {"backend": "gloo", "inter": {"busbw_gbps": 0.9, "ranks": 4},
              "verdict": {"ok": False, "problems": [], "bad_nodes": {
                  "node1": ["0 GPUs visible, expected 2", "intra-node busbw 0.1 GB/s is 4.0x below node2"]}}}
    row = C.row_allreduce(2, report, "job 5 COMPLETED")
    assert row.status == "ok" and "4 ranks over gloo" in row.detail and "0 GPUs visible" in row.detail
    report["verdict"]["problems"] = ["inter-node busbw 0.90 GB/s < 100 GB/s and no node localized"]
    row = C.row_allreduce(2, report, "")
    assert row.status == "fail" and "SOCKET_IFNAME" in row.fix
    report["verdict"]["problems"] = []
    report["verdict"]["bad_nodes"] = {"node1": ["slow link to node2"], "node2": ["slow link to node1"]}
    assert C.row_allreduce(2, report, "").status == "fail"
    assert C.row_allreduce(2, None, "job 5 FAILED").status == "fail"
    assert C.row_allreduce(2, {"inter": {}, "verdict": {}}, "").status == "fail"
    assert C.row_allreduce(1, None, "").status == "skip"
    # Setup lines without torch: the burn-in cannot run, so the interface is not judged (nor blamed).
    row = C.row_allreduce(2, None, "job 5 cancelled", setup_holds=False)
    assert row.status == "skip" and "fix the setup row first" in row.detail and not row.fix


def test_verdict_and_table():
    rows = [C.ok("a", "fine"), C.skip("b", "none"), C.fail("c", "broken", "do this")]
    assert C.verdict(rows) == 1 and C.verdict(rows[:2]) == 0
    assert "fix: do this" in C.table(rows)
    assert all(r.status == "skip" for r in C.not_run(C.LIVE, "x"))


def test_check_scripts_carry_the_sites_sbatch_lines_and_probe_steps(tmp_path):
    s = site()
    r = resolved(s, LOCAL, 2, "site-check-nodes")
    text = node_script(r, str(tmp_path), "abc")
    assert "#SBATCH --partition=debug" in text and "#SBATCH --exclusive" in text and "#SBATCH --nodes=2" in text
    assert "#SBATCH --no-requeue" in text
    assert 'source "$SLURM_SUBMIT_DIR/.venv/bin/activate"' in text
    assert "--role write" in text and "--role read" in text and "/tmp/dslurm-cluster/scratch/%n" in text
    rq = requeue_script(resolved(s, LOCAL, 1, "site-check-requeue", time="00:01:00",
                                 requeue={"enabled": True, "signal_lead": 40}), str(tmp_path))
    assert "#SBATCH --signal=B:USR2@40" in rq and "#SBATCH --requeue" in rq and "#SBATCH --time=00:01:00" in rq
    assert 'scontrol requeue "$SLURM_JOB_ID"' in rq and "trap 'got=1' USR2" in rq


# ------------------------------------------------------------------ the warm row, and what auto does with it

GPU_SITE = str(ROOT / "site-configs/local-gpu.yaml")


def _view(files: dict[str, str], cvd: str | None = "0,1") -> dict:
    return {"files": files, "reachable": [p for p, v in files.items() if v == "reachable"],
            "cgroup": "/slurm_node1/uid_0/job_1/step_0/task_0", "gpu_env": {"CUDA_VISIBLE_DEVICES": cvd}}


BOTH = {"/d/node1/gpu0": "reachable", "/d/node1/gpu1": "reachable"}


def _warm_records(warm_view: dict, warm: bool = True) -> dict:
    out = {}
    for rank in (0, 1):
        out[f"step-0.0-rank-{rank}.json"] = {"rank": rank, "hostname": "node1", "warm": False, "devices": _view(BOTH)}
        out[f"step-0.1-rank-{rank}.json"] = {"rank": rank, "hostname": "node1", "warm": warm, "devices": warm_view}
    return out


def test_warm_row_holds_when_the_warm_attempt_opened_the_cold_attempts_devices():
    s = load_site(GPU_SITE)
    row = C.row_warm(s, 2, ["crash", "completed"], ["torchrun", "warm"], _warm_records(_view(BOTH)), "job 7")
    assert row.status == "ok" and "2 rank(s)" in row.detail and "2 GPU device(s)" in row.detail, row


def test_warm_row_fails_on_a_pool_without_the_gpus_or_no_warm_attempt():
    s = load_site(GPU_SITE)
    denied = _view({"/d/node1/gpu0": "denied", "/d/node1/gpu1": "denied"})
    row = C.row_warm(s, 2, ["crash", "completed"], ["torchrun", "warm"], _warm_records(denied), "job 7")
    assert row.status == "fail" and "the warm one []" in row.detail and "gpu_directive" in row.fix, row
    # under ConstrainDevices such a worker usually crashes: the attempt does not complete
    row = C.row_warm(s, 2, ["crash", "crash"], ["torchrun", "warm"], {}, "job 7")
    assert row.status == "fail" and "did not complete" in row.detail and "ConstrainDevices" in row.fix
    row = C.row_warm(s, 2, ["crash", "completed"], ["torchrun", "torchrun"], {}, "job 7")
    assert row.status == "fail" and "started torchrun" in row.detail
    row = C.row_warm(s, 2, ["crash", "completed"], ["torchrun", "warm"], _warm_records(_view(BOTH), warm=False), "j")
    assert row.status == "fail" and "not forked by a pool" in row.detail
    none = _warm_records(_view({}, cvd="0,1"))
    for k in none:
        none[k]["devices"] = _view({})
    row = C.row_warm(s, 2, ["crash", "completed"], ["torchrun", "warm"], none, "j")
    assert row.status == "fail" and "DSLURM_GPU_DEVICES" in row.fix  # a GPU site whose device files were not found


def test_warm_row_skips_what_it_cannot_judge():
    assert C.row_warm(site(), 1, [], [], {}, "").status == "skip"  # no spare
    assert C.row_warm(site(), 2, [], [], {}, "", setup_holds=False).status == "skip"
    assert C.P_WARM in C.LIVE


def test_auto_is_warm_only_where_the_site_or_its_record_says_so(tmp_path):
    from dslurm.config import load_job
    from dslurm.submission.warm_proof import choose, read_record, record_path, write_record

    auto = load_job(data={"name": "j", "nodes": 1, "spares": 1})
    s = site("recovery.warm=auto")
    path = tmp_path / "mysite.yaml"
    assert record_path(path) == tmp_path / "mysite.warm-check.json"
    assert choose(auto, s, None).warm is False  # nothing proven: cold, and the reason names the check
    assert "dslurm site check" in choose(auto, s, None).reason
    write_record(path, s, "ok", "proven", "42")
    assert choose(auto, s, read_record(path), str(path)).warm is True
    assert "job 42" in choose(auto, s, read_record(path), str(path)).reason
    other = site("recovery.warm=auto", "node.cpus=3")  # the site file changed since its check
    assert choose(auto, other, read_record(path), str(path)).warm is False
    assert choose(auto, site("recovery.warm=auto", "recovery.warm=false"), read_record(path)).warm is False
    write_record(path, s, "fail", "the warm one []", "43")
    assert choose(auto, s, read_record(path), str(path)).warm is False
    assert choose(auto, site("recovery.warm=true"), None).warm is True  # the site says so
    assert choose(load_job(data={"name": "j", "nodes": 1, "spares": 1, "recovery": {"warm": True}}), s, None).warm
    assert not choose(load_job(data={"name": "j", "nodes": 1}), site("recovery.warm=true"), None).warm  # no spares
    assert auto.recovery.warm == "auto" and site().recovery.warm is False  # local.yaml says cold
