"""Layout proposal and validation: the resource that does not fit decides (seed 000 table 2.2)."""

import pytest

from dslurm.config.layout import Layout
from dslurm.config.models import PRESETS
from dslurm.errors import UserError
from dslurm.plan.choose import propose_layout, validate_layout
from dslurm.plan.layout import Cluster, Workload, memory_per_gpu
from dslurm.plan.memory import GB


def test_small_model_gets_plain_ddp():
    plan = propose_layout(PRESETS["1b"], Cluster(nodes=2))
    lay = plan.layout
    assert (lay.tp, lay.pp, lay.dp_shard, lay.dp_replicate, plan.recompute) == (1, 1, 1, 16, "none")
    assert "DDP" in plan.reasons["dp"] and plan.fits


def test_8b_on_four_nodes_shards_inside_a_node_and_replicates_across():
    # 128 GB of state does not fit one 80 GB GPU: shard, but over the smallest group that fits.
    plan = propose_layout(PRESETS["8b"], Cluster(nodes=4, gpus_per_node=8, gpu_mem_gb=80))
    lay = plan.layout
    assert (lay.tp, lay.pp, lay.dp_shard, lay.dp_replicate) == (1, 1, 8, 4)
    assert "inside one node" in plan.reasons["dp"]
    assert plan.memory_gb["state"] == pytest.approx(PRESETS["8b"].num_params() * 16 / 8 / GB, abs=0.01)
    assert plan.memory_gb["total"] <= plan.budget_gb == 72.0


def test_70b_needs_tensor_parallelism_inside_the_nvlink_domain():
    plan = propose_layout(PRESETS["70b"], Cluster(nodes=4))
    assert plan.layout.tp == 8 and plan.layout.pp == 1
    assert "NVLink domain of 8" in plan.reasons["tp"] and "tp=4 needs" in plan.reasons["tp"]
    # A 4-GPU NVLink domain caps tp at 4, so it must recompute instead.
    small = propose_layout(PRESETS["70b"], Cluster(nodes=4, nvlink_domain=4))
    assert small.layout.tp <= 4 and small.recompute == "full"


def test_pipeline_only_when_the_layer_stack_does_not_fit_a_shard_group():
    work = Workload(max_shard_gpus=8)  # FSDP confined to one node
    plan = propose_layout(PRESETS["70b"], Cluster(nodes=16), work)
    assert plan.layout.pp > 1 and plan.layout.tp == 8
    assert "layer stack does not fit" in plan.reasons["pp"]
    assert plan.bubble <= 0.10 and plan.layout.microbatches >= plan.layout.pp
    assert propose_layout(PRESETS["70b"], Cluster(nodes=16)).layout.pp == 1  # uncapped: no pipeline


def test_nothing_fits_is_a_user_error_with_the_numbers():
    with pytest.raises(UserError, match=r"no layout fits 70\.6B .* 1 node\(s\) x 8 GPU\(s\) of 80"):
        propose_layout(PRESETS["70b"], Cluster(nodes=1))


def test_global_batch_limits_data_parallelism():
    plan = propose_layout(PRESETS["1b"], Cluster(nodes=4), Workload(global_batch=16))
    assert plan.layout.dp * 1 <= 16 and 16 % plan.layout.dp == 0
    assert plan.layout.tp == 2  # dp=32 cannot split 16 sequences: tensor parallelism halves it


def test_validate_flags_tp_outside_nvlink_memory_and_microbatches():
    model = PRESETS["8b"]
    out = validate_layout(model, Cluster(nodes=4, nvlink_domain=4), Layout(tp=8, dp_shard=4))
    assert out.fits and any("leaves the NVLink domain of 4" in w for w in out.warnings)
    ddp = validate_layout(model, Cluster(nodes=4), Layout(dp_replicate=32))
    assert not ddp.fits and "GB per GPU > 72.0 GB" in ddp.problems[0]
    pipe = validate_layout(model, Cluster(nodes=4), Layout(pp=4, dp_shard=8, microbatches=2))
    assert any("microbatches(2) < pipeline stages(4)" in p for p in pipe.problems)
    assert validate_layout(model, Cluster(nodes=4), Layout(pp=4, dp_shard=8, microbatches=16)).bubble \
        == pytest.approx(3 / 19)


@pytest.mark.parametrize("layout, match", [
    (Layout(tp=2, dp_shard=3), r"=6 != world_size\(32\) \(4 nodes x 8 GPUs\)"),
    (Layout(tp=32), r"tp\(32\) must divide n_heads\(32\) and n_kv_heads\(8\)"),
])
def test_layout_that_does_not_divide_is_a_user_error(layout, match):
    with pytest.raises(UserError, match=match):
        validate_layout(PRESETS["8b"], Cluster(nodes=4), layout)


def test_pipeline_first_stage_holds_pp_microbatches():
    model, work = PRESETS["8b"], Workload()
    one = memory_per_gpu(model, Layout(), work)["activations"]
    four = memory_per_gpu(model, Layout(pp=4, microbatches=8), work)["activations"]
    # 1F1B: 4 in flight × 8 layers = the same 32 layer-activations as no pipeline (less logits).
    assert four == pytest.approx(one - 4 * 8192 * 128256, rel=1e-9)


@pytest.mark.parametrize("kwargs, field", [
    (dict(nodes=0), "nodes=0"), (dict(nodes=1, gpu_mem_gb=-80), "gpu_mem_gb=-80"),
])
def test_invalid_cluster(kwargs, field):
    with pytest.raises(UserError, match=field):
        Cluster(**kwargs)


def test_invalid_workload_and_layout():
    with pytest.raises(UserError, match="micro_batch=0"):
        Workload(micro_batch=0)
    with pytest.raises(UserError, match="tp=0"):
        Layout(tp=0)
    with pytest.raises(UserError, match="recompute='half'"):
        Workload(recompute="half")
