"""The config tree: unknown keys, wrong types and impossible layouts are refused with
the file, the field, the value and a fix; the shipped configs all load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dslurm.config import format_time, load_job, load_site, parse_time
from dslurm.config.resolve import load, resolve
from dslurm.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SITES = sorted((ROOT / "site-configs").glob("*.yaml"))
JOBS = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))


def write(tmp_path: Path, name: str, data: dict) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def local_site() -> dict:
    return yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())


def h100_site() -> dict:
    return yaml.safe_load((ROOT / "site-configs" / "h100-ib.yaml").read_text())


@pytest.mark.parametrize("path", SITES, ids=lambda p: p.name)
def test_shipped_sites_load(path):
    site = load_site(path)
    assert site.name and site.slurm.partition
    assert site.procs_per_node >= 1


def test_the_required_sites_are_shipped():
    names = {load_site(p).name for p in SITES}
    assert {"local", "h100-ib", "a100-eth"} <= names
    h100 = load_site(ROOT / "site-configs" / "h100-ib.yaml")
    assert (h100.node.gpus, h100.node.nvlink_domain, h100.network.backend) == (8, 8, "nccl")
    assert h100.node.peak_tflops_bf16 == 989
    local = load_site(ROOT / "site-configs" / "local.yaml")
    assert (local.node.gpus, local.network.backend) == (0, "gloo")


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_shipped_jobs_load(path):
    assert load_job(path).nodes >= 1


def test_unknown_key_lists_valid_keys(tmp_path):
    data = local_site()
    data["node"]["gpu"] = 8  # typo of "gpus"
    p = write(tmp_path, "site.yaml", data)
    with pytest.raises(UserError) as e:
        load_site(p)
    msg = str(e.value)
    assert str(p) in msg and "'node'" in msg and "'gpu'" in msg
    assert "gpus" in msg and "procs_per_node" in msg  # the valid keys are listed


@pytest.mark.parametrize("field,value,expect", [
    ("nodes", "two", "expected an integer"),
    ("nodes", True, "expected an integer"),
    ("nodes", 0, "nodes=0 must be at least 1"),
    ("time", "1:2:3:4", "not a Slurm time"),
    ("launch", "mpirun", "'mpirun' is not allowed"),
])
def test_wrong_values_name_field_and_value(tmp_path, field, value, expect):
    p = write(tmp_path, "job.yaml", {"name": "j", "nodes": 1, field: value})
    with pytest.raises(UserError) as e:
        load_job(p)
    assert expect in str(e.value) and str(p) in str(e.value)


def test_nested_type_error_names_dotted_field(tmp_path):
    p = write(tmp_path, "job.yaml", {"name": "j", "nodes": 1, "train": {"steps": "many"}})
    with pytest.raises(UserError, match=r"field 'train.steps': expected an integer, got 'many'"):
        load_job(p)


@pytest.mark.parametrize("name", ["x$(touch /tmp/owned)", "a b", "x\ny", "'quoted'", "", "-rf"])
def test_unsafe_job_names_are_refused(tmp_path, name):
    p = write(tmp_path, "job.yaml", {"name": name, "nodes": 1})
    with pytest.raises(UserError, match="may only hold letters"):
        load_job(p)


def test_missing_required_field(tmp_path):
    p = write(tmp_path, "job.yaml", {"name": "j"})
    with pytest.raises(UserError, match=r"field 'nodes': is required"):
        load_job(p)


def test_not_yaml_and_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML at line"):
        load_job(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="top level must be a mapping"):
        load_job(lst)
    with pytest.raises(UserError, match="file not found"):
        load_job(tmp_path / "nope.yaml")


def test_overrides_apply_and_are_validated(tmp_path):
    p = write(tmp_path, "job.yaml", {"name": "j", "nodes": 1})
    job = load_job(p, ["train.steps=7", "parallel.tp=2", "data.path=/x y/z.h5"])
    assert (job.train.steps, job.parallel.tp, job.data.path) == (7, 2, "/x y/z.h5")
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_job(p, ["train.steps"])
    with pytest.raises(UserError, match="unknown key"):
        load_job(p, ["train.stepz=3"])


def _resolve(site: dict, job: dict, tmp_path: Path):
    return load(write(tmp_path, "site.yaml", site), write(tmp_path, "job.yaml", job))


def test_product_must_equal_world_size(tmp_path):
    job = {"name": "j", "nodes": 2, "parallel": {"dp_shard": 3, "tp": 2}}
    with pytest.raises(UserError) as e:
        _resolve(h100_site(), job, tmp_path)
    msg = str(e.value)
    assert "pp(1)*dp_replicate(1)*dp_shard(3)*cp(1)*tp(2)=6 != world_size(16)" in msg
    assert "field 'parallel'" in msg and "nodes(2) x processes per node(8)" in msg


def test_dp_shard_rest_is_resolved(tmp_path):
    job = {"name": "j", "nodes": 2, "parallel": {"tp": 4, "pp": 2, "microbatches": 2}, "model": {"preset": "small"}}
    r = _resolve(h100_site(), job, tmp_path)
    assert (r.layout.dp_shard, r.world_size) == (2, 16)
    with pytest.raises(UserError, match="does not divide world_size"):
        _resolve(h100_site(), {"name": "j", "nodes": 1, "parallel": {"tp": 3}}, tmp_path)


def test_tp_outside_nvlink_refused_unless_allowed(tmp_path):
    site = h100_site()
    site["node"]["nvlink_domain"] = 4
    job = {"name": "j", "nodes": 1, "parallel": {"tp": 8},
           "model": {"preset": "small", "n_heads": 8, "n_kv_heads": 8}}
    with pytest.raises(UserError, match=r"tp\(8\) > NVLink domain\(4\)"):
        _resolve(site, job, tmp_path)
    job["parallel"]["allow_tp_outside_nvlink"] = True
    assert _resolve(site, job, tmp_path).layout.tp == 8


def test_microbatches_at_least_stages(tmp_path):
    job = {"name": "j", "nodes": 2, "parallel": {"pp": 4, "microbatches": 2}, "model": {"preset": "small"}}
    with pytest.raises(UserError, match=r"microbatches\(2\) < pipeline stages\(4\)"):
        _resolve(h100_site(), job, tmp_path)


def test_tp_must_divide_heads(tmp_path):
    site = local_site()
    site["node"]["procs_per_node"] = 4
    site["node"]["nvlink_domain"] = 4
    job = {"name": "j", "nodes": 1, "parallel": {"tp": 4}, "model": {"preset": "tiny"}}  # 2 kv heads
    with pytest.raises(UserError, match=r"tp\(4\) must divide n_heads\(4\) and n_kv_heads\(2\)"):
        _resolve(site, job, tmp_path)


def test_context_parallel_runs_on_cpu_and_needs_two_chunks_per_rank(tmp_path):
    assert _resolve(local_site(), {"name": "j", "nodes": 1, "parallel": {"cp": 2}}, tmp_path).layout.cp == 2
    with pytest.raises(UserError, match=r"field 'parallel': 2\*cp\(6\) must divide seq_len\(64\).*Fix: "):
        _resolve(local_site(), {"name": "j", "nodes": 1, "parallel": {"cp": 3},
                                "procs_per_node": 3}, tmp_path)


def test_signal_lead_below_time(tmp_path):
    job = {"name": "j", "nodes": 1, "time": "00:01:00", "requeue": {"signal_lead": 90}}
    with pytest.raises(UserError, match="below the time limit"):
        _resolve(local_site(), job, tmp_path)


@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("30:15", 1815), ("01:02:03", 3723), ("2-03", 2 * 86400 + 3 * 3600),
    ("1-00:30", 86400 + 1800), ("1-00:00:05", 86405),
])
def test_slurm_time_formats(text, seconds):
    assert parse_time(text) == seconds


def test_time_is_rendered_in_whole_minutes():
    assert format_time(3723) == "01:03:00"  # Slurm enforces minutes: round up, never cut short
    assert format_time(86400 + 60) == "1-00:01:00"


def test_resolve_is_the_single_source_of_node_and_process_counts(tmp_path):
    r = _resolve(local_site(), {"name": "j", "nodes": 3, "train": {"global_batch": 12}}, tmp_path)
    assert (r.nnodes, r.procs_per_node, r.world_size) == (3, 2, 6)
    r2 = resolve(r.site, load_job(data={"name": "j", "nodes": 3, "procs_per_node": 1, "train": {"global_batch": 12}}))
    assert r2.world_size == 3


def test_global_batch_must_split_over_data_parallel_ranks(tmp_path):
    with pytest.raises(UserError, match=r"'train.global_batch': 8 is not divisible by dp\(6\)"):
        _resolve(local_site(), {"name": "j", "nodes": 3}, tmp_path)


def test_partner_copies_need_two_tiers(tmp_path):
    p = write(tmp_path, "job.yaml", {"name": "j", "nodes": 2, "checkpoint": {"partner": True}})
    with pytest.raises(UserError) as e:
        load_job(p)
    assert "checkpoint.partner" in str(e.value) and "tiers: two_tier" in str(e.value) and str(p) in str(e.value)
    p = write(tmp_path, "ok.yaml", {"name": "j", "nodes": 2, "checkpoint": {"tiers": "two_tier", "partner": True,
                                                                               "partner_mbps": 500}})
    assert load_job(p).checkpoint.partner is True
    p = write(tmp_path, "neg.yaml", {"name": "j", "nodes": 2, "checkpoint": {"partner_mbps": -1}})
    with pytest.raises(UserError, match="partner_mbps"):
        load_job(p)
