"""Bus bandwidth (nccl-tests), per-step collectives per dimension and the MFU conversion,
against hand-computed values."""

import pytest

from dslurm.config.layout import Layout
from dslurm.config.models import PRESETS
from dslurm.errors import UserError
from dslurm.plan.comms import bus_factor, busbw_gbytes_per_s, collective_time_s
from dslurm.plan.layout import Cluster, Workload
from dslurm.plan.mfu import conversion, model_flops_per_token, recompute_flops_per_token
from dslurm.plan.traffic import dim_stride, group_link, step_traffic, traffic_by_dim

GB = 1e9


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 1.75  # 2(n-1)/n
    assert bus_factor("all_gather", 8) == 0.875 == bus_factor("reduce_scatter", 8)  # (n-1)/n
    assert bus_factor("send_recv", 2) == 1.0
    with pytest.raises(UserError, match="op='broadcast'"):
        bus_factor("broadcast", 8)


def test_busbw_from_a_measurement_and_time_from_a_busbw():
    # 8 ranks, 1 GB in 10 ms: algbw 100 GB/s; all-reduce busbw 175, all-gather 87.5.
    assert busbw_gbytes_per_s("all_reduce", 1 * GB, 8, 0.010) == pytest.approx(175.0)
    assert busbw_gbytes_per_s("all_gather", 1 * GB, 8, 0.010) == pytest.approx(87.5)
    # Seed 004: 16 GB of 8B gradients; at 8 ranks 2(7/8) x 16 GB = 28 GB over 900 GB/s = 31.1 ms
    # (the seed's 36 ms is the N -> infinity 2 x 16 GB).
    assert collective_time_s("all_reduce", 16 * GB, 8, 900) == pytest.approx(28 / 900)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        t = collective_time_s(op, 3 * GB, 4, 120)
        assert busbw_gbytes_per_s(op, 3 * GB, 4, t) == pytest.approx(120)  # the inverse
    assert collective_time_s("all_reduce", 16 * GB, 1, 900) == 0.0


H100 = Cluster(nodes=16, gpus_per_node=8, gpu_mem_gb=80, nvlink_domain=8, intra_gbytes_per_s=450,
               inter_gbytes_per_s=400)


def test_group_links_share_the_node_bandwidth():
    assert group_link(H100, 1, 8) == ("nvlink", 450)  # tp=8: one node's NVSwitch
    assert group_link(H100, 8, 4) == ("net 1/8", 50)  # one rank per node: one NIC rail of 8
    assert group_link(H100, 2, 16) == ("net 4/8", 200)  # four ranks per node
    assert group_link(H100, 1, 64) == ("net 8/8", 400)  # whole nodes
    a100 = Cluster(nodes=2, gpus_per_node=4, gpu_mem_gb=40, nvlink_domain=2, intra_gbytes_per_s=300,
                   inter_gbytes_per_s=12.5)
    assert group_link(a100, 1, 4) == ("node", 300)  # inside the node, beyond the NVLink pair
    assert group_link(a100, 4, 2) == ("net 1/4", 3.125)


def test_strides_follow_the_mesh_order():
    lay = Layout(pp=2, dp_replicate=2, dp_shard=4, tp=8, microbatches=8)
    assert [dim_stride(lay, d) for d in ("tp", "dp_shard", "dp_replicate", "pp")] == [1, 8, 32, 64]


def test_70b_example_step_traffic_by_hand():
    # The shipped llama70b-h100 job: tp 8, pp 2 (Interleaved1F1B, v=2), HSDP 2 x 4, 8 microbatches
    # of 8 sequences of 8192, full recomputation, grad_accum 1.
    model = PRESETS["70b"]
    lay = Layout(pp=2, dp_replicate=2, dp_shard=4, tp=8, microbatches=8)
    work = Workload(micro_batch=8, schedule="Interleaved1F1B")
    rows = {(c.dim, c.op): c for c in step_traffic(model, lay, work, H100, "full")}
    local = model.num_params() / 16  # parameters of one (tp, pp) shard
    ag = rows["dp_shard", "all_gather"]  # bf16 weights, once per schedule step under PP
    assert (ag.calls, ag.size_bytes, ag.busbw) == (1, local * 2, 50)
    assert ag.sent_bytes == pytest.approx(local * 2 * 3 / 4) and ag.time_s == pytest.approx(local * 1.5 / 50e9)
    rs = rows["dp_shard", "reduce_scatter"]  # fp32 gradients
    assert (rs.calls, rs.size_bytes) == (1, local * 4) and rs.sent_bytes == pytest.approx(local * 3)
    ar = rows["dp_replicate", "all_reduce"]  # fp32 shard over 2 replicas: 2(1/2) x local x 4 / 4
    assert ar.sent_bytes == pytest.approx(local) and ar.time_s == pytest.approx(local / 50e9)
    act = 8192 * 8 * 8192 * 2  # s x b x h, bf16 = 1.07 GB
    # 8 microbatches x 40 layers x (2 forward + 2 backward + the recomputed forward's 2 gathers, 1 scatter)
    for op, per_layer in (("all_gather", 6), ("reduce_scatter", 5)):
        tp = rows["tp", op]
        assert (tp.calls, tp.size_bytes, tp.busbw) == (8 * 40 * per_layer, act, 450)
        assert tp.sent_bytes == pytest.approx(8 * 40 * per_layer * act * 7 / 8)
    pp = rows["pp", "send_recv"]  # p=2: 2v - 1 = 3 sends per microbatch of s x b x h / tp
    assert (pp.calls, pp.size_bytes) == (24, act / 8)
    assert pp.time_s == pytest.approx(24 * act / 8 / 50e9)
    norms = rows["tp", "all_reduce"]  # the replicated norm weights' grads: 8 x 2 x 40 (the mean pp rank)
    assert (norms.calls, norms.size_bytes) == (8 * 80, 8192 * 2)
    by_dim = traffic_by_dim(list(rows.values()))
    assert by_dim["tp"]["sent_bytes"] == pytest.approx(8 * 40 * 11 * act * 7 / 8 + 8 * 80 * 8192 * 2 * 2 * 7 / 8)


def test_fsdp_without_pipeline_gathers_blocks_again_in_backward_and_scales_with_grad_accum():
    lay = Layout(dp_shard=16, tp=2)
    c = Cluster(nodes=4, gpus_per_node=8, gpu_mem_gb=80)  # bandwidth unknown: times are None
    got = step_traffic(PRESETS["8b"], lay, Workload(grad_accum=16), c, "selective")
    rows = {(r.dim, r.op): r for r in got}
    fwd, again = [r for r in got if (r.dim, r.op) == ("dp_shard", "all_gather")]
    assert (fwd.calls, fwd.size_bytes) == (16, PRESETS["8b"].num_params() / 2 * 2)
    # backward: all again but the last block (kept after forward)
    assert (again.calls, again.size_bytes) == (16, (PRESETS["8b"].num_params() - PRESETS["8b"].layer_params()) / 2 * 2)
    assert rows["dp_shard", "reduce_scatter"].calls == 16
    assert rows["tp", "all_gather"].calls == 16 * (32 * 6 + 2)  # selective re-issues the forward's gathers too
    assert rows["dp_shard", "all_gather"].time_s is None
    assert traffic_by_dim(list(rows.values()))["dp_shard"]["time_s"] is None
    ddp = step_traffic(PRESETS["1b"], Layout(dp_replicate=8), Workload(), Cluster(nodes=1), "none")
    grads = PRESETS["1b"].num_params() * 4  # fp32 reduce
    assert [(r.dim, r.op, r.size_bytes) for r in ddp] == [("dp_replicate", "all_reduce", grads)]


def test_recomputation_flops_by_hand():
    shape = dict(params=1e9, layers=2, heads=4, head_dim=8, seq_len=16)
    model = model_flops_per_token(**shape)
    assert model == 6e9 + 12 * 2 * 4 * 8 * 16
    # Full: one more forward, 2N + 4LHQT = a third of the model FLOPs.
    assert recompute_flops_per_token(recompute="full", **shape) == pytest.approx(2e9 + 4 * 2 * 4 * 8 * 16)
    assert recompute_flops_per_token(recompute="selective", **shape) == 0.0  # op-level: no matmul re-run
    assert recompute_flops_per_token(recompute="none", **shape) == 0.0
    with pytest.raises(UserError, match="recompute='some'"):
        recompute_flops_per_token(recompute="some", **shape)


def test_mfu_conversion_by_hand():
    # Seed 000's example: 20,000 tokens/s x 120 GFLOP on 8 x 1,000 TFLOP/s = 30%.
    out = conversion(model_flops=120e9, extra_flops=40e9, gpus=8, peak_tflops=1000, bubble=0.1,
                     tokens_per_step=1e6, tokens_per_s=20_000)
    assert out["peak_flops"] == 8e15 and out["executed_flops_per_token"] == 160e9
    assert out["mfu_per_1000_tokens_per_s"] == pytest.approx(0.015)
    at30 = out["at"][0]
    assert at30["mfu"] == 0.3 and at30["tokens_per_s"] == pytest.approx(20_000) and at30["step_s"] == pytest.approx(50)
    assert out["mfu_ceiling"] == pytest.approx(0.9 * 120 / 160)
    assert out["measured"] == pytest.approx({"tokens_per_s": 20_000, "mfu": 0.3, "hfu": 0.4})


def test_context_parallel_shards_state_tokens_and_adds_its_kv_collectives():
    """cp 2 (train/parallel/cp.py): FSDP shards over dp_shard x cp, each rank's TP traffic is of its
    seq/cp tokens, and each layer gathers K and V (s x kv_dim / tp, bf16) and reduce-scatters their grads."""
    from dslurm.plan.layout import memory_per_gpu

    model, work = PRESETS["8b"], Workload(micro_batch=1, grad_accum=1)
    one, two = Layout(tp=2, dp_shard=64), Layout(tp=2, dp_shard=32, cp=2)
    assert memory_per_gpu(model, two, work)["state"] == pytest.approx(memory_per_gpu(model, one, work)["state"])
    assert memory_per_gpu(model, two, work)["activations"] < 0.6 * memory_per_gpu(model, one, work)["activations"]
    rows = {(c.dim, c.op): c for c in step_traffic(model, two, work, H100)}
    assert rows[("dp_shard", "all_gather")].ranks == 64  # dp_shard 32 x cp 2, tp-strided
    kv = 8192 * 8 * 128 * 2 / 2  # full sequence x kv_dim x bf16 / tp
    assert rows[("cp", "all_gather")].size_bytes == kv and rows[("cp", "all_gather")].calls == 32 * 2
    assert rows[("cp", "reduce_scatter")].calls == 32 * 2 and rows[("cp", "all_gather")].link == "nvlink"
    assert rows[("tp", "all_gather")].size_bytes == 8192 // 2 * 4096 * 2  # this rank's tokens
