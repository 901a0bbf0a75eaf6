"""sbatch's refusals said as a field and its fix (dslurm/slurm/refusals.py; the shell in dslurm/cli/submit.py).

The sbatch and scontrol texts are recorded from Slurm 22.05 (the local cluster, and the words
22.05's slurmctld sends back for account, QOS and limit refusals). Pure; a fake sbatch for
what submit leaves behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslurm.config.resolve import load
from dslurm.errors import SlurmError, UserError
from dslurm.slurm import facts as F
from dslurm.slurm.refusals import ClusterFacts, Origin, explain, parse_assoc_rows, sbatch_said

ROOT = Path(__file__).resolve().parents[2]
SITE = "site-configs/local.yaml"
JOB = "examples/jobs/tiny-2node.yaml"

PARTITIONS = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 Nodes=node[1-3] State=UP TotalCPUs=12 "
    "TotalNodes=3 TRES=cpu=12,mem=12G,node=3,billing=12,gres/gpu=6\n"
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A "
    "DefaultTime=NONE MaxNodes=UNLIMITED MaxTime=2-00:00:00 MinNodes=0 Nodes=gpu-n[1-16] State=UP TotalCPUs=1536 "
    "TotalNodes=16 TRES=cpu=1536,mem=32T,node=16,billing=1536,gres/gpu=128\n"
)
NODE = ("NodeName=node{i} Arch=x86_64 CoresPerSocket=4 CPUAlloc=0 CPUEfctv=4 CPUTot=4 AvailableFeatures={f} "
        "ActiveFeatures={f} Gres=gpu:2 NodeAddr=127.0.0.1 NodeHostName=node{i} RealMemory=4096 State=IDLE "
        "Partitions=debug\n")
NODES = "".join(NODE.format(i=i, f="(null)" if i == 3 else "ib,fast") for i in (1, 2, 3))

# sbatch's stderr as recorded
BAD_PARTITION = ("sbatch: error: invalid partition specified: nosuchpart\n"
                 "sbatch: error: Batch job submission failed: Invalid partition name specified\n")
BAD_NODE_CONFIG = "sbatch: error: Batch job submission failed: Requested node configuration is not available\n"
BAD_ACCOUNT = ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination "
               "specified\n")
BAD_QOS = "sbatch: error: Batch job submission failed: Invalid qos specification\n"
BAD_TIME = ("sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds "
            "some limit)\n")
BAD_FEATURE = "sbatch: error: Batch job submission failed: Invalid feature specification\n"
BAD_GRES = "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification\n"
BAD_POLICY = ("sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, "
              "user's size and/or time limits)\n")
ASSOC = "proj-a|debug|normal,high\nproj-b||normal\n"


def _facts(partition: str = "debug") -> ClusterFacts:
    return ClusterFacts(partitions=tuple(F.parse_partitions(PARTITIONS)),
                        nodes=tuple(F.parse_nodes(NODES, partition)) or None,
                        assoc=tuple(parse_assoc_rows(ASSOC)), user="me")


def _r(site_sets: list[str] | None = None, sets: list[str] | None = None):
    return load(ROOT / SITE, ROOT / JOB, sets, site_sets)


FILE = Origin(site_file="sites/mine.yaml", job_file="jobs/j.yaml")


def test_sbatch_said_keeps_sbatchs_words_once():
    assert sbatch_said(BAD_PARTITION) == ("invalid partition specified: nosuchpart; Batch job submission failed: "
                                          "Invalid partition name specified")


def test_unknown_partition_names_file_field_value_and_the_partitions():
    msg = explain(BAD_PARTITION, _r(["slurm.partition=nosuchpart"]), FILE, _facts())
    assert msg is not None
    assert msg.startswith("sites/mine.yaml: field 'slurm.partition': partition 'nosuchpart' does not exist")
    assert "nothing was submitted" in msg and "debug (default), gpu" in msg
    assert "Fix: set slurm.partition: debug in sites/mine.yaml" in msg


def test_a_field_given_with_site_set_is_named_as_typed():
    typed = Origin(site_file="sites/mine.yaml", job_file="j.yaml", site_sets=("slurm.partition=nosuchpart",))
    msg = explain(BAD_PARTITION, _r(["slurm.partition=nosuchpart"]), typed, _facts())
    assert msg is not None and msg.startswith("--site-set slurm.partition=nosuchpart: partition")
    assert "Fix: give --site-set slurm.partition=debug" in msg


def test_without_the_clusters_answers_the_fix_says_where_to_look():
    msg = explain(BAD_PARTITION, _r(["slurm.partition=x"]), FILE, ClusterFacts())
    assert msg is not None and "sinfo -s" in msg


def test_account_partition_combination_lists_the_users_accounts():
    msg = explain(BAD_ACCOUNT, _r(["slurm.account=theirs"]), FILE, _facts())
    assert msg is not None and msg.startswith("sites/mine.yaml: field 'slurm.account': account theirs with partition")
    assert "proj-a (debug)" in msg and "proj-b (any partition)" in msg
    assert "Fix: set slurm.account: proj-a in sites/mine.yaml" in msg


def test_invalid_qos_lists_the_qos_of_the_users_associations():
    msg = explain(BAD_QOS, _r(["slurm.qos=gold"]), FILE, _facts())
    assert msg is not None and "field 'slurm.qos': QOS 'gold'" in msg and "Your QOS: high, normal" in msg
    assert "or remove it" in msg


def test_node_configuration_names_the_node_fields_and_what_the_nodes_have():
    r = _r(["node.gpus=9", "slurm.gpu_directive=gres", "node.gpu_mem_gb=80", "node.procs_per_node=2",
            "node.cpus=64"])
    msg = explain(BAD_NODE_CONFIG, r, FILE, _facts())
    assert msg is not None and msg.startswith("sites/mine.yaml: the job asks partition 'debug' for 2 node(s)")
    assert "64 CPUs each (node.cpus=64 (sites/mine.yaml))" in msg and "9 GPU(s) each (node.gpus=9" in msg
    assert "Its nodes: 3 x 4 CPUs, 4 GB, 2 GPU(s) (gres gpu)" in msg
    assert "set node.cpus: 4 in sites/mine.yaml; set node.gpus: 2 in sites/mine.yaml" in msg
    assert "dslurm site discover --partition debug" in msg and "dslurm site check" in msg


def test_node_configuration_with_too_few_nodes_having_the_feature():
    msg = explain(BAD_NODE_CONFIG, _r(["slurm.constraint=ib"], ["nodes=3", "train.global_batch=12"]), FILE, _facts())
    assert msg is not None and "2 of its 3 node(s) have that" in msg and "set nodes: 2 in jobs/j.yaml" in msg


def test_time_over_the_partitions_max_time_names_the_job_field_and_the_limit():
    msg = explain(BAD_TIME, _r(["slurm.partition=gpu"], ["time=3-00:00:00"]), FILE, _facts("gpu"))
    assert msg is not None and msg.startswith("jobs/j.yaml: field 'time': time limit 3-00:00:00")
    assert "allows at most 2-00:00:00" in msg and "set time: '2-00:00:00' in jobs/j.yaml" in msg
    r = _r(["slurm.partition=gpu", "slurm.default_time=5-00:00:00"], ["time=null"])
    msg = explain(BAD_TIME, r, FILE, _facts("gpu"))
    assert msg is not None and "field 'slurm.default_time'" in msg  # the job gives none: the site's default


def test_feature_gres_and_policy_refusals_name_their_fields():
    msg = explain(BAD_FEATURE, _r(["slurm.constraint=nvme"]), FILE, _facts())
    assert msg is not None and "field 'slurm.constraint': constraint 'nvme'" in msg and "have: fast, ib" in msg
    msg = explain(BAD_GRES, _r(["node.gpus=2", "slurm.gpu_directive=gres", "slurm.gres_name=gpu:h100",
                                "node.gpu_mem_gb=80", "node.procs_per_node=2"]), FILE, _facts())
    assert msg is not None and "node.gpus=2" in msg and "gpu:h100" in msg and "slurm.gres_name" in msg
    msg = explain(BAD_POLICY, _r(), FILE, _facts())
    assert msg is not None and "2 node(s)" in msg and "slurm.qos" in msg and "sacctmgr show qos" in msg


def test_an_unknown_refusal_is_left_to_the_caller():
    assert explain("sbatch: error: Batch job submission failed: Socket timed out", _r(), FILE, _facts()) is None


# ------------------------------------------------ submit: a refusal leaves nothing submitted


@pytest.fixture
def refusing_sbatch(monkeypatch):
    """sbatch refuses the partition (its recorded words); scontrol/sacctmgr answer as recorded."""
    from dslurm import slurm
    from dslurm.slurm import refusals as sbatch_errors

    def sbatch(script, extra, **kw):
        raise SlurmError(slurm.failure_message(["sbatch", "--parsable", str(script)], 1, BAD_PARTITION))

    monkeypatch.setattr(slurm, "sbatch", sbatch)
    monkeypatch.setattr(sbatch_errors, "cluster_facts", lambda partition, env=None: _facts())
    from dslurm.cli import submit as submit_mod

    monkeypatch.setattr(submit_mod, "active_jobs_of_run", lambda run_dir, env=None: [])


def _submit_cli(*argv: str) -> int:
    from dslurm.cli import build_parser

    args = build_parser(["submit"]).parse_args(["submit", *argv])
    return int(args.func(args))


def test_a_refused_submit_leaves_no_frozen_run_and_no_submit_event(tmp_path, refusing_sbatch):
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"--site-set slurm.partition=nosuchpart: partition 'nosuchpart'"):
        _submit_cli("--site", str(ROOT / SITE), "--job", str(ROOT / JOB), "--site-set", "slurm.partition=nosuchpart",
                    "--set", f"checkpoint.run_dir={run}")
    assert not [p.name for p in run.iterdir() if p.name != "logs"]  # no site.yaml/job.yaml/job.sbatch/ledger
    with pytest.raises(UserError, match="missing; --run-dir needs"):  # nothing for --run-dir to mistake for a run
        _submit_cli("--run-dir", str(run))


def test_a_refused_resubmit_keeps_the_runs_frozen_config(tmp_path, refusing_sbatch, monkeypatch):
    from dslurm import slurm
    from dslurm.observe import events

    run = tmp_path / "run"
    refusing = slurm.sbatch
    monkeypatch.setattr(slurm, "sbatch", lambda script, extra, **kw: 4242)
    assert _submit_cli("--site", str(ROOT / SITE), "--job", str(ROOT / JOB), "--set", f"checkpoint.run_dir={run}") == 0
    frozen = {n: (run / n).read_bytes() for n in ("site.yaml", "job.yaml", "job.sbatch")}
    monkeypatch.setattr(slurm, "sbatch", refusing)
    with pytest.raises(UserError, match="--site-set slurm.partition=nosuchpart: partition 'nosuchpart'"):
        _submit_cli("--run-dir", str(run), "--site-set", "slurm.partition=nosuchpart")
    assert {n: (run / n).read_bytes() for n in frozen} == frozen  # what a requeued job reads is unchanged
    assert [e.job_ids for e in events.of(events.read(run), events.Submit)] == [[4242]]
    (run / "site.yaml").write_text((run / "site.yaml").read_text().replace("debug", "nosuchpart"))
    with pytest.raises(UserError, match=f"{run}/site.yaml: field 'slurm.partition'"):  # the frozen file, edited
        _submit_cli("--run-dir", str(run))


def test_a_chain_refused_halfway_cancels_its_first_link(tmp_path, monkeypatch):
    from dslurm import slurm
    from dslurm.cli import submit as submit_mod
    from dslurm.slurm import refusals as sbatch_errors

    calls: list[int] = []

    def sbatch(script, extra, **kw):
        if calls:
            raise SlurmError(slurm.failure_message(["sbatch"], 1, BAD_POLICY))
        calls.append(1)
        return 77

    cancelled: list[int] = []
    monkeypatch.setattr(slurm, "sbatch", sbatch)
    monkeypatch.setattr(slurm, "cancel", lambda i, env=None: cancelled.append(int(i)))
    monkeypatch.setattr(sbatch_errors, "cluster_facts", lambda partition, env=None: _facts())
    r = load(ROOT / SITE, ROOT / JOB, [f"checkpoint.run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match="accounting/QOS policy"):
        submit_mod.submit(r, chain=2)
    assert cancelled == [77] and not (tmp_path / "run" / "ledger.jsonl").exists()


def test_the_origin_file_names_the_laptops_site_file(tmp_path):
    from argparse import Namespace

    from dslurm.cli.submit import origin_of

    o = tmp_path / "origin.json"
    o.write_text(json.dumps({"site": "laptop/site.yaml", "job": "laptop/job.yaml", "site_sets": ["slurm.qos=x"]}))
    got = origin_of(Namespace(origin=str(o), overrides=[], site_overrides=[]), "/tmp/x/site.yaml", "/tmp/x/job.yaml")
    assert got == Origin(site_file="laptop/site.yaml", job_file="laptop/job.yaml", site_sets=("slurm.qos=x",))
    plain = origin_of(Namespace(origin=None, overrides=["a=1"], site_overrides=[]), "s.yaml", "j.yaml")
    assert plain == Origin(site_file="s.yaml", job_file="j.yaml", sets=("a=1",))
