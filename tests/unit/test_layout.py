"""The one layout type (`dslurm.config.layout.Layout`): degrees in one order, the product, "cp needs
a GPU", the model-shape and schedule rules, and the one batch rule, which `resolve` and the
planner used to apply differently under pp > 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from dslurm.config.layout import DIM_NAMES, Layout
from dslurm.config.models import PRESETS
from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.plan.choose import validate_layout
from dslurm.plan.inputs import from_resolved
from dslurm.plan.layout import Cluster, Workload

ROOT = Path(__file__).resolve().parents[2]


def resolve_job(tmp_path: Path, **job) -> object:
    """A job on one 8-GPU H100 node (world 8)."""
    site = tmp_path / "site.yaml"
    site.write_text((ROOT / "site-configs" / "h100-ib.yaml").read_text())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "j", "nodes": 1, "model": {"preset": "small"}, **job}))
    return load(site, path)


# ----------------------------------------------------------------------------- degrees

def test_ranks_form_a_grid_in_dim_order_with_tp_fastest():
    lay = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert [n for n, _ in lay.dims()] == list(DIM_NAMES) and lay.world_size == 16 and lay.dp == 4
    assert lay.coords(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert all(lay.rank_of(**lay.coords(r)) == r for r in range(16))
    assert lay.degrees() == {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}


def test_enabled_flags_and_fsdp_rule():
    lay = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2, microbatches=2)
    assert (lay.pp_enabled, lay.dp_replicate_enabled, lay.dp_shard_enabled, lay.tp_enabled) == (True,) * 4
    assert lay.fsdp_enabled and lay.loss_parallel_enabled and not lay.cp_enabled
    tp_only = Layout(tp=2)
    assert not tp_only.fsdp_enabled and tp_only.loss_parallel_enabled


def test_dp_shard_rest_and_the_product_with_the_numbers():
    assert Layout.for_world(16, pp=2, tp=2).dp_shard == 4
    with pytest.raises(UserError, match=r"pp\(1\)\*dp_replicate\(1\)\*cp\(1\)\*tp\(3\)=3 does not divide "
                                        r"world_size\(8\)"):
        Layout.for_world(8, tp=3)
    with pytest.raises(UserError, match=r"pp\(2\)\*dp_replicate\(1\)\*dp_shard\(3\)\*cp\(1\)\*tp\(1\)=6 != "
                                        r"world_size\(8\)\. Fix: "):
        Layout.for_world(8, pp=2, dp_shard=3)


def test_degrees_below_one_and_microbatches_without_a_pipeline_are_refused():
    with pytest.raises(UserError, match=r"parallel\.tp=0"):
        Layout(tp=0)
    with pytest.raises(UserError, match=r"parallel\.microbatches=4 without a pipeline"):
        Layout(microbatches=4)
    # From a config, microbatches without a pipeline are ignored, as the trainer ignores them.
    assert Layout.for_world(4, microbatches=4).microbatches == 1


def test_context_parallel_needs_two_chunks_per_rank_and_a_local_sequence_tp_divides():
    tiny, small = PRESETS["tiny"], PRESETS["small"]  # seq_len 64; small: 8 heads, 4 kv heads
    assert Layout(cp=4).shape_problems(tiny) == []
    assert Layout(cp=3).shape_problems(tiny) == [
        "2*cp(6) must divide seq_len(64): context parallel gives each cp rank two equal chunks of the sequence "
        "(load-balanced causal split)"]
    short = dataclasses.replace(small, seq_len=12)  # cp 2: 6 tokens per rank, not a multiple of tp 4
    assert Layout(cp=2, tp=4).shape_problems(short) == ["tp(4) must divide seq_len/cp(6) for sequence parallel"]
    assert Layout(tp=4).shape_problems(short) == []
    assert Layout(cp=2, dp_shard=3).fsdp_enabled and Layout(cp=2).fsdp_shard == 2  # cp joins FSDP's sharding


def test_shape_and_schedule_rules_count_virtual_stages():
    small = PRESETS["small"]  # 8 layers, 8 heads, 4 kv heads
    assert Layout(tp=8).shape_problems(small) == ["tp(8) must divide n_heads(8) and n_kv_heads(4)"]
    assert Layout(pp=8, microbatches=8).shape_problems(small) == []
    assert Layout(pp=8, microbatches=16).shape_problems(small, stages_per_rank=2) == [
        "n_layers(8) < pipeline stages(16)"]
    assert Layout(pp=4, microbatches=4).schedule_problem() is None
    assert "microbatches(4) < pipeline stages(8)" in str(Layout(pp=4, microbatches=4).schedule_problem(2))


# ----------------------------------------------------------------------------- the batch rule

def test_batch_rule_without_a_pipeline():
    lay = Layout(dp_shard=4)
    assert lay.micro_batch(32, grad_accum=2) == 4
    with pytest.raises(UserError, match=r"12 is not divisible by dp\(4\) x grad_accum\(2\) = 8"):
        lay.micro_batch(12, grad_accum=2)


def test_batch_rule_under_a_pipeline_counts_grad_accum_and_microbatches():
    lay = Layout(pp=2, dp_shard=4, microbatches=4)
    assert lay.micro_batch(64, grad_accum=2) == 2  # 64 = dp 4 x grad_accum 2 x microbatches 4 x 2
    with pytest.raises(UserError, match=r"16 is not divisible by dp\(4\) x grad_accum\(2\) x microbatches\(4\) "
                                        r"= 32.*Fix: use a multiple of 32, or change train.grad_accum or "
                                        r"parallel.microbatches"):
        lay.micro_batch(16, grad_accum=2)


def test_resolve_and_the_planner_apply_the_same_batch_rule_under_pp(tmp_path):
    par = {"pp": 2, "microbatches": 4}  # world 8: dp 4
    # 16 = dp 4 x microbatches 4: the planner used to accept it (leaving grad_accum out) while
    # resolve refused it; now both refuse, with the field and every factor.
    bad = {"parallel": par, "train": {"global_batch": 16, "grad_accum": 2}}
    with pytest.raises(UserError, match=r"job.yaml: field 'train.global_batch': 16 is not divisible by dp\(4\) x "
                                        r"grad_accum\(2\) x microbatches\(4\) = 32"):
        resolve_job(tmp_path, **bad)
    lay = Layout(pp=2, dp_shard=4, microbatches=4)
    plan = validate_layout(PRESETS["small"], Cluster(nodes=1), lay,
                           Workload(global_batch=16, grad_accum=2, micro_batch=1))
    assert any("16 is not divisible by dp(4) x grad_accum(2) x microbatches(4)" in p for p in plan.problems)
    # Accepted by both, with the same micro-batch: 64 / (4 x 2 x 4) = 2, not 64 / (4 x 4) = 4.
    r = resolve_job(tmp_path, parallel=par, train={"global_batch": 64, "grad_accum": 2})
    inputs = from_resolved(r)
    assert inputs.layout is r.layout and r.layout.microbatches == 4
    assert (inputs.work.micro_batch, inputs.work.grad_accum) == (2, 2)
    checked = validate_layout(inputs.model, inputs.cluster, inputs.layout, inputs.work)
    assert checked.as_dict()["layout"]["grad_accum"] == 2 and not any("divisible" in p for p in checked.problems)


def test_resolve_builds_the_layout_with_the_config_path_messages(tmp_path):
    r = resolve_job(tmp_path, parallel={"tp": 2, "pp": 2, "microbatches": 2}, train={"global_batch": 8})
    assert r.layout == Layout(pp=2, dp_shard=2, tp=2, microbatches=2)
    r1 = resolve_job(tmp_path, parallel={"microbatches": 4})
    assert r1.layout.microbatches == 1  # no pipeline: grad_accum splits the batch
    with pytest.raises(UserError, match=r"job.yaml: field 'parallel': microbatches\(2\) < pipeline stages\(4\); "
                                        r"set parallel.microbatches >= 4"):
        resolve_job(tmp_path, parallel={"pp": 2, "microbatches": 2, "pp_schedule": "Interleaved1F1B"})
